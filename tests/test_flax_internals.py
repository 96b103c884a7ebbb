"""Every Flax private API and guess the front ends read, checked against the installed Flax.

`jmp_policy/integrations/flax_internals.py` is the one module that touches
what Flax does not promise to keep, or guesses about a Flax model (as
`core/jax_internals.py` is for JAX); each of its reads has a probe here. A
Flax release that moves one fails here, before a feature quietly does
without it.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys
from typing import Any

import flax.linen as nn
import flax.linen.module
import flax.linen.transforms
import jax
import jax.numpy as jnp

from jmp_policy.integrations import flax_internals as fi
from jmp_policy.integrations.linen import call

_PATCHED_WHEN = """
import flax.linen as nn, jax.numpy as jnp, jmp_policy as jmp
proxy = nn.transforms._HashableProxy
patched = lambda: getattr(proxy.from_module, "_jmp_policy", False)
jmp.autocast(lambda x: x * 2, "mixed_bfloat16")(jnp.ones(3))
print(patched())
model = nn.Dense(2)
params = model.init(jax.random.key(0), jnp.ones((1, 2)))
jmp.with_policy(model.apply, "mixed_bfloat16")(params, jnp.ones((1, 2)))
print(patched())
"""


def test_nn_jit_is_keyed_only_once_a_linen_front_end_is_called():
    # A process that only uses `autocast` keeps Flax as it was; the first
    # linen `with_policy` call makes `nn.jit` key its traces on the call too.
    code = "import jax\n" + _PATCHED_WHEN
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True"], proc.stdout


def test_nn_jit_keys_its_traces_on_hashable_proxy_from_module():
    call._nn_jit_keyed_on_the_call()  # As a linen front end's first call does.
    proxy = flax.linen.transforms._HashableProxy
    assert getattr(proxy.from_module, "_jmp_policy", False)
    key = proxy.from_module(nn.Dense(2))
    assert dataclasses.is_dataclass(key) and hash(key) == key.hash_key
    assert dataclasses.replace(key, hash_key=1) == dataclasses.replace(key, hash_key=1)


def test_interceptors_are_set_aside_from_the_global_stack_and_put_back():
    seen = []

    def interceptor(next_fun, args, kwargs, context):
        seen.append(context.method_name)
        return next_fun(*args, **kwargs)

    model, x = nn.Dense(2), jnp.ones((1, 3))
    with nn.intercept_methods(interceptor):
        with fi.interceptors_set_aside():
            assert len(flax.linen.module._global_interceptor_stack) == 0
            model.init(jax.random.key(0), x)
        assert seen == []
        assert len(flax.linen.module._global_interceptor_stack) == 1
        model.init(jax.random.key(0), x)
    assert seen


def test_a_lifted_loops_body_scope_names_its_loop():
    # The debug path of a lifted loop's body scope names the transforms that
    # made it ("remat(scan(blocks))"); its children's scopes have a parent.
    found = []

    class Body(nn.Module):
        @nn.compact
        def __call__(self, carry, x):
            dense = nn.Dense(2)
            out = carry + dense(x)
            found.append((fi.lifted_loop(self.scope), fi.lifted_loop(dense.scope)))
            return out, x

    class Model(nn.Module):
        lift: Any

        @nn.compact
        def __call__(self, carry, xs):
            scan = nn.scan(
                self.lift(Body), variable_broadcast="params", split_rngs={"params": False}
            )
            return scan(name="blocks")(carry, xs)

    for lift in (lambda m: m, nn.remat):
        found.clear()
        Model(lift).init(jax.random.key(0), jnp.ones((2,)), jnp.ones((4, 2)))
        assert found and set(found) == {("scan", None)}, found

    class Step(nn.Module):
        @nn.compact
        def __call__(self, carry):
            found.append(fi.lifted_loop(self.scope))
            return carry

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            step = Step(name="step")
            return nn.while_loop(lambda m, c: c[0] < 0, lambda m, c: m(c), step, x)

    found.clear()
    Outer().init(jax.random.key(0), jnp.ones(2))
    assert found and set(found) == {"while_loop"}, found
    assert nn.Dense(2).scope is None and fi.lifted_loop(None) is None


def test_flax_layers_are_told_by_their_package():
    from flax import nnx

    class Mine(nn.Module):
        dtype: Any = jnp.float32

        @nn.compact
        def __call__(self, x):
            return x

    class MyDense(nn.Dense):
        pass

    assert fi.is_flax_layer(nn.Dense(2)) and fi.is_flax_module(nn.Dense(2))
    assert fi.is_flax_layer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    assert fi.is_flax_layer(MyDense(2)) and not fi.is_flax_module(MyDense(2))
    assert not fi.is_flax_layer(Mine()) and not fi.is_flax_module(Mine())
    # A lifted class (`nn.scan(Block)`) is its block's: a third party's here.
    lifted = nn.scan(Mine, variable_broadcast="params", split_rngs={"params": False})()
    assert type(lifted).__module__ == "flax.linen.transforms" and not fi.is_flax_layer(lifted)
    # A model's own dtype config: a floating `dtype` field (Hugging Face's).
    assert fi.configures_dtypes(Mine()) and not fi.configures_dtypes(nn.Dense(2))
    assert not fi.configures_dtypes(Mine(dtype="not a dtype"))


def test_linen_entry_points_and_variables_are_told_by_name():
    model, x = nn.Dense(2), jnp.ones((1, 3))
    entries = [fi.linen_entry(f) for f in (model.apply, model.init, model.init_with_output)]
    assert entries == ["apply", "init", "init_with_output"]
    assert fi.linen_entry(model.__call__) is None and fi.linen_entry(jnp.sin) is None
    variables = model.init(jax.random.key(0), x)
    assert fi.looks_like_variables(variables) and fi.looks_like_variables(dict(variables))
    assert not fi.looks_like_variables(variables["params"]) and not fi.looks_like_variables(x)


def test_nnx_methods_run_in_a_context_on_a_merged_copy_only():
    import contextlib

    from flax import nnx

    entered = []

    @contextlib.contextmanager
    def context():
        entered.append(1)
        yield

    model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    fi.run_methods_in(copy.layers[0], context, ())
    copy(jnp.ones((1, 2)))
    assert entered == [1]
    assert isinstance(copy.layers[0], nnx.Linear) and type(model.layers[0]) is nnx.Linear
    assert nnx.state(copy) == nnx.state(model)  # Its state, paths and all, are the class's.
    other = nnx.merge(graphdef, state)
    fi.run_methods_in(other.layers[0], context, ())
    assert type(other.layers[0]) is type(copy.layers[0])  # One subclass per class and context.


def test_no_module_but_the_seam_reads_flax_internals():
    package = pathlib.Path(fi.__file__).resolve().parents[1]
    private = re.compile(
        r"_HashableProxy|_global_interceptor_stack|debug_path|dtypes\\.py|__class__ = "
    )
    found = [
        f"{path.relative_to(package)}: {match.group()}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "flax_internals.py"
        for match in private.finditer(path.read_text())
    ]
    assert found == []


@jax.numpy_dtype_promotion("standard")  # `dtype=None`: a half input meets a float32 kernel.
def test_a_layer_inferring_its_dtype_is_told_from_an_authors_widening():
    # `infers_a_layers_dtype` reads where a conversion was written:
    # Flax's `promote_dtype` (linen's and NNX's), for a layer with `dtype=None`.
    from flax import nnx

    from jmp_policy.core import jax_internals as ji

    infers_a_layers_dtype = fi.infers_a_layers_dtype

    def widenings(fn, *args):
        found = []

        def walk(jaxpr):
            for eqn in jaxpr.eqns:
                if eqn.primitive is ji.convert_element_type_p and ji.new_dtype(eqn) == jnp.float32:
                    found.append(infers_a_layers_dtype(ji.origin(eqn)))
                for sub in ji.sub_jaxprs(eqn):
                    walk(sub)

        walk(jax.make_jaxpr(fn)(*args).jaxpr)
        return found

    x = jnp.ones((2, 3), jnp.bfloat16)
    dense = nn.Dense(4)
    variables = dense.init(jax.random.key(0), x)
    linear = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    assert widenings(dense.apply, variables, x) == [True]
    assert widenings(lambda x: linear(x), x) == [True]
    assert widenings(lambda x: x.astype(jnp.float32) @ jnp.ones((3, 4)), x) == [False]
