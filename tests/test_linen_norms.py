"""`with_policy` on linen models: half-precision norms are rematerialised,
recomputed rather than saved for the backward pass, without changing what
they compute.
Strict dtype promotion, as in `test_linen.py`.
"""

from __future__ import annotations

import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from linen_models import (
    BATCH,
    F32,
    FEATURES,
    SEQ,
    RematLM,
    ScanLM,
    _dtypes,
    _tokens,
    materialize,
)

from jmp_policy import with_policy
from jmp_policy.core.diagnostics import saved_residuals

# --------------------------------------------------------------------------
# Half-precision norms are rematerialised: recomputed, not saved, for backward.


class Norms(nn.Module):
    """The three parameter-only Flax norms, each after a Dense."""

    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(nn.Dense(FEATURES)(x))
        x = nn.RMSNorm()(nn.Dense(FEATURES)(x))
        x = nn.GroupNorm(num_groups=4)(nn.Dense(FEATURES)(x))
        return nn.Dense(4)(x)


NORMS_X = np.random.default_rng(3).standard_normal((BATCH, SEQ, FEATURES)).astype(np.float32)


def norms_loss(policy, **kwargs):
    apply = with_policy(Norms().apply, policy, **kwargs)
    return lambda params: jnp.mean(jnp.square(apply({"params": params}, NORMS_X)))


def norms_params():
    shapes = jax.eval_shape(Norms().init, jax.random.key(0), NORMS_X)
    return materialize(shapes["params"], seed=4)


def saved(loss, params) -> list[tuple[Any, str]]:
    return saved_residuals(loss, params)


def checkpoints(loss, params) -> int:
    """The `jax.checkpoint` equations of the forward program (named remat2 or checkpoint)."""
    return len(re.findall(r"= (?:remat2|checkpoint)\[", str(jax.make_jaxpr(loss)(params))))


def from_norms(residuals, dtype) -> list:
    return [a for a, where in residuals if a.dtype == dtype and "normalization.py" in where]


def test_half_norms_save_no_float32_intermediates():
    params = norms_params()
    plain = saved(norms_loss("mixed_bfloat16", remat_norms=False), params)
    remat = saved(norms_loss("mixed_bfloat16"), params)
    # Without remat, each norm saves float32 copies of its [2, 8, 16] input.
    assert len([a for a in from_norms(plain, F32) if a.shape == NORMS_X.shape]) >= 3
    assert from_norms(remat, F32) == []
    nbytes = lambda res: sum(a.size * a.dtype.itemsize for a, _ in res)
    assert nbytes(remat) < nbytes(plain)
    assert checkpoints(norms_loss("mixed_bfloat16"), params) == 3


def test_rematerialised_norms_give_the_same_values_and_grads():
    params = norms_params()
    value_and_grad = lambda loss: jax.value_and_grad(loss)(params)
    remat, plain = jax.jit(
        lambda: (
            value_and_grad(norms_loss("mixed_bfloat16")),
            value_and_grad(norms_loss("mixed_bfloat16", remat_norms=False)),
        )
    )()
    for a, b in zip(jax.tree.leaves(remat), jax.tree.leaves(plain)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


class DeepNorms(nn.Module):
    """Four LayerNorms of one shape, one with another epsilon, between Dense layers."""

    @nn.compact
    def __call__(self, x):
        for i in range(4):
            x = nn.LayerNorm(epsilon=1e-3 if i == 2 else 1e-6)(nn.Dense(FEATURES)(x))
        return nn.Dense(4)(x)


def test_norms_of_one_program_share_one_rematerialised_trace():
    params = materialize(jax.eval_shape(DeepNorms().init, jax.random.key(0), NORMS_X)["params"])

    def loss(remat_norms):
        apply = with_policy(DeepNorms().apply, "mixed_bfloat16", remat_norms=remat_norms)
        return lambda p: jnp.mean(jnp.square(apply({"params": p}, NORMS_X)))

    eqns = jax.make_jaxpr(loss(True))(params).eqns
    bodies = [e.params["jaxpr"] for e in eqns if e.primitive.name in ("remat2", "checkpoint")]
    # Each norm is its own checkpoint, with its own parameters; the three with
    # the same epsilon run one program, the fourth its own.
    assert len(bodies) == 4
    assert len({id(b) for b in bodies}) == 2
    assert bodies[0] is bodies[1] is bodies[3]
    # Compiled apart, the same bits. (In one jit, XLA 0.12 merges and fuses
    # the two programs' common work, so they differ in bf16 rounding.)
    shared, plain = (jax.jit(jax.value_and_grad(loss(r)))(params) for r in (True, False))
    for a, b in zip(jax.tree.leaves(shared), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(a, b)
    # Every norm's parameters get their own gradient.
    grads = shared[1]
    scales = [grads[f"LayerNorm_{i}"]["scale"] for i in range(4)]
    assert all(not np.allclose(scales[i], scales[j]) for i in range(4) for j in range(i))


def _scaled_tangent(scale):
    """The identity, whose derivative is `scale`: a rule the printed program does not show."""

    @jax.custom_jvp
    def f(x):
        return x

    f.defjvp(lambda primals, tangents: (primals[0], tangents[0] * scale))
    return f


def _scaled_by_callback(scale):
    """Times `scale`, through a host callback: its function prints like any other."""
    return lambda y: jax.pure_callback(
        lambda v: (v * scale).astype(v.dtype), jax.ShapeDtypeStruct(y.shape, y.dtype), y
    )


class NormsUnderRules(nn.Module):
    """Two LayerNorms whose outputs an inner interceptor passes through a
    different function each, made by `wrap(a number)`."""

    wrap: Any

    @nn.compact
    def __call__(self, x):
        def rule(next_fun, args, kwargs, context):
            return self.wrap(float(len(context.module.name)))(next_fun(*args, **kwargs))

        with nn.intercept_methods(rule):
            a = nn.LayerNorm(name="n")(x)
            b = nn.LayerNorm(name="norm")(x)
        return jnp.sum(a) + jnp.sum(b * b)


@pytest.mark.parametrize(
    ("wrap", "transform"),
    [(_scaled_tangent, jax.value_and_grad), (_scaled_by_callback, lambda f: f)],
    ids=["jvp-rule", "callback"],  # A callback has no derivative: values only.
)
def test_norms_whose_programs_print_alike_keep_their_own(wrap, transform):
    model = NormsUnderRules(wrap)
    params = materialize(jax.eval_shape(model.init, jax.random.key(0), NORMS_X)["params"])
    results = [
        jax.jit(transform(lambda p: with_policy(
            model.apply, "mixed_bfloat16", remat_norms=r)({"params": p}, NORMS_X)))(params)
        for r in (True, False)
    ]  # fmt: skip
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


class TaggedNorms(nn.Module):
    @nn.compact
    def __call__(self, x):
        from jax.experimental.xla_metadata import set_xla_metadata

        with set_xla_metadata(tagged="yes"):
            a = nn.LayerNorm(name="tagged")(x)
        return a, nn.LayerNorm(name="plain")(x)


def test_norms_in_another_context_keep_it():
    # An equation's context (XLA metadata, compute_on) is not in its text.
    params = TaggedNorms().init(jax.random.key(0), NORMS_X)
    for remat in (True, False):
        apply = with_policy(TaggedNorms().apply, "mixed_bfloat16", remat_norms=remat)
        lines = jax.jit(apply).lower(params, NORMS_X).as_text().splitlines()
        rsqrt = [line for line in lines if "stablehlo.rsqrt" in line]
        assert len(rsqrt) == 2 and sum('tagged = "yes"' in line for line in rsqrt) == 1, remat


def test_norms_with_parameters_as_literals_keep_their_own(monkeypatch):
    # Under jax_use_simplified_jaxpr_constants, concrete parameters (closed
    # over by a jit) are array literals of the program, printed without
    # their values: same-shaped norms must not share them.
    model = DeepNorms()
    params = jax.tree.map(np.asarray, model.init(jax.random.key(0), NORMS_X))["params"]
    params["LayerNorm_1"] = jax.tree.map(lambda v: v * 3 + 1, params["LayerNorm_1"])
    flag = "jax_use_simplified_jaxpr_constants"
    saved = getattr(jax.config, flag)
    jax.config.update(flag, True)
    try:
        outs = [
            jax.jit(lambda x: with_policy(model.apply, "mixed_bfloat16", remat_norms=r)(
                {"params": params}, x))(NORMS_X)
            for r in (True, False)
        ]  # fmt: skip
    finally:
        jax.config.update(flag, saved)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("policy", "kwargs"),
    [
        ("f32", {}),  # float32 norms: the program is the user's own
        ("mixed_bfloat16", {"remat_norms": False}),
        (
            "mixed_bfloat16",
            {"rules": {nn.LayerNorm: "f32", nn.RMSNorm: "f32", nn.GroupNorm: "f32"}},
        ),
    ],
    ids=["float32", "off", "float32-rule"],
)
def test_norms_not_rematerialised(policy, kwargs):
    assert checkpoints(norms_loss(policy, **kwargs), norms_params()) == 0


def test_rematerialised_norms_inside_scan_and_remat():
    # LayerNorm, LayerNorm in the scanned Block, the final LayerNorm.
    for model, expected in ((ScanLM(), 3), (RematLM(), 3)):
        tokens = _tokens()
        init = with_policy(model.init, "mixed_bfloat16")
        params = materialize(jax.eval_shape(init, jax.random.key(0), tokens)["params"])
        apply = with_policy(model.apply, "mixed_bfloat16")
        loss = lambda p: apply({"params": p}, tokens, rngs={"dropout": jax.random.key(1)}).sum()
        assert checkpoints(loss, params) >= expected
        grads = jax.jit(jax.grad(loss))(params)
        assert _dtypes(grads) == {F32}
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_user_interceptors_see_each_norm_once():
    # The norm runs once, through the whole interceptor chain, under remat.
    seen = []

    def log_and_shift(next_fun, args, kwargs, context):
        seen.append((type(context.module).__name__, context.module.path))
        out = next_fun(*args, **kwargs)
        return out + 1 if isinstance(context.module, nn.LayerNorm) else out

    params = norms_params()
    apply = with_policy(Norms().apply, "mixed_bfloat16")
    with nn.intercept_methods(log_and_shift):
        shifted = jax.jit(lambda p: apply({"params": p}, NORMS_X))(params)
    assert [name for name, _ in seen].count("LayerNorm") == 1
    assert ("LayerNorm", ("LayerNorm_0",)) in seen
    plain = jax.jit(lambda p: apply({"params": p}, NORMS_X))(params)
    assert not np.allclose(shifted, plain)


def test_apply_that_creates_parameters_is_not_rematerialised():
    # Flax cannot create variables inside a JAX transform: an apply with
    # mutable params (as init) runs the norms as they are.
    apply = with_policy(Norms().apply, "mixed_bfloat16")
    rngs = {"params": jax.random.key(0)}
    _, created = jax.eval_shape(lambda: apply({}, NORMS_X, rngs=rngs, mutable=True))
    assert set(created["params"]) == set(norms_params())
    # A tree that gains a norm: the existing ones are read, the new one created.
    existing = {k: v for k, v in norms_params().items() if k != "GroupNorm_0"}
    _, grown = apply({"params": existing}, NORMS_X, rngs=rngs, mutable=["params"])
    assert _dtypes(grown["params"]["GroupNorm_0"]) == {F32}


def test_remat_norms_must_be_a_bool():
    with pytest.raises(TypeError, match="remat_norms must be True or False"):
        with_policy(Norms().apply, "mixed_bfloat16", remat_norms="yes")
