"""Every Flax private API the linen integration reads, checked against the installed Flax.

`jmp_policy/integrations/linen/flax_internals.py` is the one module that
touches what Flax does not promise to keep (as `core/jax_internals.py` is for
JAX); each of its reads has a probe here. A Flax release that moves one fails
here, before a feature quietly does without it.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys

import flax.linen as nn
import flax.linen.module
import flax.linen.transforms
import jax
import jax.numpy as jnp

from jmp_policy.integrations.linen import call
from jmp_policy.integrations.linen import flax_internals as fi


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


def test_a_scan_body_scope_names_scan_in_its_debug_path():
    paths = []

    class Body(nn.Module):
        @nn.compact
        def __call__(self, carry, x):
            paths.append(fi.debug_path(self.scope))
            return carry + nn.Dense(2)(x), x

    scan = nn.scan(Body, variable_broadcast="params", split_rngs={"params": False})
    scan().init(jax.random.key(0), jnp.ones((2,)), jnp.ones((4, 2)))
    assert any(p and "scan(" in p[-1] for p in paths), paths


def test_no_module_but_the_seam_reads_flax_internals():
    package = pathlib.Path(fi.__file__).resolve().parents[2]
    private = re.compile(
        r"_HashableProxy|_global_interceptor_stack|(?<!flax_internals)\.debug_path|['\"]debug_path"
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
    # `casting.infers_a_layers_dtype` reads where a conversion was written:
    # Flax's `promote_dtype` (linen's and NNX's), for a layer with `dtype=None`.
    from flax import nnx

    from jmp_policy.core import jax_internals as ji
    from jmp_policy.integrations.casting import infers_a_layers_dtype

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
