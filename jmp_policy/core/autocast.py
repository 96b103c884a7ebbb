"""Op-level mixed precision: `autocast`, a transform over the traced program.

`autocast(fn, policy)` traces `fn` to a jaxpr and runs it again equation by
equation, choosing each operation's precision the way `torch.autocast` does:

* `HALF_PRIMITIVES` (matmuls and convolutions) take `policy.compute_dtype`
  operands and accumulate in float32 (`preferred_element_type=float32`), in the
  forward *and* the backward pass (see `half_dot_general`), unless the author
  asked for `precision=HIGHEST` (`asks_full_precision`): those run as written.
  Their result keeps the dtype the traced program gave it, so a float32 program stays float32
  between matmuls. Where the policy has a `matmul_dtype`, every `dot_general`
  takes that instead: half operands (`half_dot_general`) or FP8
  (`fp8_dot_general`); convolutions stay in the compute dtype.
* `FLOAT32_PRIMITIVES` (exp, log, pow, sqrt, sums, products, ...) run in
  float32 (or wider); so do the softmax, logsumexp, norm, variance and loss
  patterns built from them. Their result stays float32.
* `PROMOTE_PRIMITIVES` (elementwise arithmetic, comparisons, reshapes, max
  reductions, ...) run in the widest floating dtype of their inputs.
* Anything else runs as written: its floating inputs are cast back to the
  dtypes the traced program had, so it always type-checks. Writes into a
  buffer (`dynamic_update_slice`, scatters, `.at[].set`) keep the buffer's
  dtype and write the value in it, so a decode cache of any dtype stays in it
  (a float32 program writing into a half cache included).

Integers, booleans and PRNG keys are never touched, and explicit casts in the
program are kept (so `jnp.mean` of a bf16 array, which sums in float32 and
casts back, still returns bf16). Nested programs are rewritten too: `jit` and
`checkpoint` as if inlined; `custom_jvp` functions (`jax.nn.relu`,
`jax.nn.softmax`, ...) and their JVP rules, on inputs of the dtypes the rule
was written for; a user's `custom_vjp` forward and backward rule (the
products jmp_policy itself makes are left as decided); `scan`, `while_loop`
and `cond` with the input and output dtypes of the original, so loop
carries and branches stay type-correct; `shard_map` (and so `jax.pmap`)
bodies inside a new `shard_map` over the same mesh and specs, their inputs
and results in the original dtypes.

Matmuls and convolutions run through `jmp_policy.core.matmul`, whose custom VJP
keeps the backward products half x half with float32 accumulation too.

References: PyTorch's `torch.autocast` (its float32 and "promote to widest
input" op lists); Micikevicius et al., "Mixed Precision Training" (ICLR 2018);
JAX's "Writing custom Jaxpr interpreters" tutorial.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from jmp_policy.core import jax_internals as ji
from jmp_policy.core.dtypes import F32 as _F32
from jmp_policy.core.interpreter import Rules, flow_recording_runner, may_scale, trace_and_eval
from jmp_policy.core.matmul import clear_shared_products
from jmp_policy.core.policy import Policy, get_policy
from jmp_policy.core.residuals import residual_form, traced_for
from jmp_policy.core.state import ReturnsState, cast_results

# Matmuls and convolutions: half operands, float32 accumulation.
HALF_PRIMITIVES: frozenset[str] = frozenset({"dot_general", "conv_general_dilated"})

# Run in float32 (or wider): exponentials and logarithms overflow or lose
# everything in half precision, sums and products accumulate rounding error,
# squares and powers overflow float16. torch.autocast keeps the same in float32.
FLOAT32_PRIMITIVES: frozenset[str] = frozenset(
    {
        "exp", "exp2", "log", "log1p", "expm1", "pow", "integer_pow", "square",
        "sqrt", "rsqrt", "cbrt", "logistic", "erf", "erfc", "erf_inv", "lgamma",
        "digamma", "polygamma", "igamma", "igammac", "igamma_grad_a", "zeta",
        "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta", "tan", "asin",
        "acos", "asinh", "acosh", "atanh", "sinh", "cosh",
        "reduce_sum", "reduce_prod", "reduce_window_sum", "cumsum", "cumprod",
        "cumlogsumexp",
    }
)  # fmt: skip

# Run in the widest floating dtype of their inputs: exact or well conditioned
# in any precision (max, min, argmax and comparisons are exact; tanh, sin and
# cos are bounded), or only moving data around.
PROMOTE_PRIMITIVES: frozenset[str] = frozenset(
    {
        "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "neg", "abs",
        "sign", "floor", "ceil", "round", "nextafter", "atan2", "sin", "cos",
        "tanh", "atan", "is_finite", "eq", "ne", "lt", "le", "gt", "ge",
        "select_n", "clamp", "stop_gradient", "reduce_precision", "copy",
        "broadcast_in_dim", "reshape", "squeeze", "transpose", "rev", "slice",
        "dynamic_slice", "concatenate", "pad", "gather",
        "split", "tile", "reduce_max", "reduce_min", "argmax", "argmin", "cummax",
        "cummin", "reduce_window_max", "reduce_window_min", "sharding_constraint",
    }
)  # fmt: skip


def _known_primitive_names() -> frozenset[str]:
    return ji.primitive_names() | HALF_PRIMITIVES | FLOAT32_PRIMITIVES | PROMOTE_PRIMITIVES


# Handlers for arguments holding state that `fn` updates in place (Flax NNX
# modules): `handler(run, fn, args, kwargs)` returns `fn`'s result, running a
# pure function of that state through `run(pure_fn, args, kwargs)` and writing
# the new state back, or `NotImplemented` if the call holds no such state.
# The core knows no framework: the package registers the Flax NNX handler.
StateHandler = Callable[[Callable, Callable, tuple, dict], Any]
_STATE_HANDLERS: list[StateHandler] = []


def register_state_handler(handler: StateHandler) -> None:
    """Lets `autocast` thread a framework's mutable state through the traced program."""
    if handler not in _STATE_HANDLERS:
        _STATE_HANDLERS.append(handler)


# Readers of what a framework's API says is state in a call's result (linen's
# `apply(..., mutable=...)` returns the updated collections, Equinox keeps it
# in `eqx.nn.State`): `reader(fn, kwargs, result)` returns a `returns_state`
# prefix of the result, or None.
StateReader = Callable[[Callable, dict, Any], Any]
_STATE_READERS: list[StateReader] = []


def register_state_reader(reader: StateReader) -> None:
    """Lets `autocast` know which parts of a framework call's result are state."""
    if reader not in _STATE_READERS:
        _STATE_READERS.append(reader)


def _framework_state(fn: Callable, kwargs: dict, result: Any) -> ReturnsState:
    for reader in _STATE_READERS:
        said = reader(fn, kwargs, result)
        if said is not None:
            return said
    return None


def _primitive_names(ops: Iterable[Any], arg: str) -> frozenset[str]:
    if isinstance(ops, str):
        ops = [ops]
    try:
        ops = list(ops)
    except TypeError:
        raise TypeError(
            f"autocast({arg}=...) takes an iterable of primitive names or primitives, got {ops!r}."
        ) from None
    names = set()
    known = None
    for op in ops:
        name = op if isinstance(op, str) else getattr(op, "name", None)
        if not isinstance(name, str):
            raise TypeError(
                f"autocast({arg}=...) takes primitive names or primitives "
                f"(e.g. 'exp' or jax.extend.core.primitives.exp_p), got {op!r}."
            )
        if isinstance(op, str):
            # A misspelt name would match no operation and change nothing.
            known = _known_primitive_names() if known is None else known
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), 3)
                hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
                raise ValueError(
                    f"autocast({arg}=...): unknown primitive name {name!r}{hint}. Accepted "
                    "are the names of jax.extend.core.primitives (e.g. 'exp', 'tanh', "
                    "'dot_general'); pass a primitive object for one defined elsewhere."
                )
        names.add(name)
    return frozenset(names)


def matmul_rules(
    matmul_dtype: Any,
    fp8_scaling: str = "tensor",
    *,
    scoped: bool = False,
    scaled_scopes: bool = False,
    compute_dtype: Any = _F32,
) -> Rules:
    """The `Rules` of `matmuls_in`: every `dot_general` takes `matmul_dtype`'s
    product; without one, a product whose operands are wider than
    `compute_dtype` takes them in it (float32 accumulation), the others run
    as written."""
    return Rules(
        compute_dtype=np.dtype(compute_dtype),
        half=frozenset({"dot_general", "conv_general_dilated"}),
        float32=frozenset(),
        promote=frozenset(),
        matmul_dtype=None if matmul_dtype is None else np.dtype(matmul_dtype),
        fp8_scaling=fp8_scaling,
        scoped=scoped,
        scaled_scopes=scaled_scopes,
    )


def policy_products(policy: Policy) -> tuple[np.dtype, np.dtype | None, str]:
    """What decides a product under `policy`: its compute dtype, matmul dtype and FP8 scaling."""
    m = None if policy.matmul_dtype is None else np.dtype(policy.matmul_dtype)
    return np.dtype(policy.compute_dtype), m, policy.fp8_scaling


def product_rules(policy: Policy, *, scaled_scopes: bool) -> Rules:
    """A front end's op-level rewrite under `policy`: every product takes its
    compute dtype (where its operands are wider) or its matmul dtype, except
    inside a `product_scope` (a module a rule gives other ones; with
    `scaled_scopes`, one may name an FP8 or FP4 matmul dtype)."""
    c, m, scaling = policy_products(policy)
    return matmul_rules(m, scaling, scoped=True, scaled_scopes=scaled_scopes, compute_dtype=c)


def matmuls_in(
    fn: Callable,
    matmul_dtype: Any,
    fp8_scaling: str = "tensor",
    *,
    scoped: bool = False,
    shared: bool = False,
) -> Callable:
    """`fn` with every `dot_general` taking `matmul_dtype`'s product; all else as written.

    For code with no `dot_general` hook (`jnp.einsum` and `@` in model code,
    attention): half operands with float32 accumulation, or FP8
    (`fp8_dot_general`, with `fp8_scaling`), forward and backward. Each
    product keeps the result dtype of the traced program. With `scoped`, a
    product traced inside `product_scope(c, m)` takes those instead, the
    innermost scope winning; `matmul_dtype` may then be None.
    Array arguments are traced, anything else is static. With `shared` (not
    with `scoped`), for an `fn` called often with the same shapes (the
    attention of every layer): calls whose other arguments are plain values
    (numbers, strings, dtypes, enums, None) share one traced rewrite per
    signature, an inlined `jax.jit`; their results must be arrays. The caller
    vouches that `fn` reads nothing but its arguments: what it read otherwise
    (an array, a variable, a module's attribute) would stay as first traced.
    jmp_policy shares only Flax's own `dot_product_attention`.
    """
    rules = matmul_rules(matmul_dtype, fp8_scaling, scoped=scoped, scaled_scopes=scoped)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if shared and not scoped:
            out = _shared_rewrite(fn, rules, args, kwargs)
            if out is not NotImplemented:
                return out
        return trace_and_eval(lambda a, k: fn(*a, **k), (args, kwargs), rules)

    return wrapped


# `matmuls_in(shared=True)`: per function (held weakly), per signature, the
# inlined `jax.jit` of its rewrite.
_SHARED_REWRITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _shared_rewrite(fn: Callable, rules: Rules, args: tuple, kwargs: dict) -> Any:
    """`fn(*args, **kwargs)` rewritten through its shared trace; NotImplemented if none can be."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    is_array = tuple(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)
    static = tuple((type(x), x) for x, a in zip(leaves, is_array) if not a)
    if not all(ji.is_plain(x) for _, x in static):
        return NotImplemented  # A module or a function: not kept alive in a cache.
    try:
        per_signature = _SHARED_REWRITES.setdefault(fn, {})
    except TypeError:  # No weak reference to `fn`.
        return NotImplemented
    arrays = [x for x, a in zip(leaves, is_array) if a]
    scaled = may_scale(rules)
    with traced_for(arrays) if scaled else contextlib.nullcontext():
        # What FP8 products save (`fp8_residuals`' setting, the operands under
        # second-order differentiation of `arrays`) is read as they trace: a key.
        key = (rules, treedef, is_array, static, residual_form(None) if scaled else None)
        if key not in per_signature:
            ref = weakref.ref(fn)
            values = [None if a else x for x, a in zip(leaves, is_array)]  # Plain values only.

            def rewritten(*arrays):
                it = iter(arrays)
                full = [next(it) if a else v for v, a in zip(values, is_array)]
                f = ref()
                assert f is not None  # The caller holds `fn` while this runs.
                given = jax.tree.unflatten(treedef, full)  # (args, kwargs)
                return trace_and_eval(lambda a, k: f(*a, **k), given, rules)

            per_signature[key] = ji.inlined_jit(rewritten)
        return per_signature[key](*arrays)


def clear_shared_traces() -> None:
    """Forgets the traces `matmuls_in(shared=True)` and the half products share."""
    _SHARED_REWRITES.clear()
    clear_shared_products()


def autocast(
    fn: Callable,
    policy: Policy | str,
    *,
    half_primitives: Iterable[Any] = HALF_PRIMITIVES,
    float32_primitives: Iterable[Any] = FLOAT32_PRIMITIVES,
    promote_primitives: Iterable[Any] = PROMOTE_PRIMITIVES,
    returns_state: ReturnsState = None,
) -> Callable:
    """Runs `fn` with matmuls in half precision and sensitive ops in float32.

    A transform over the traced program of any JAX function (plain `jnp`, Flax
    linen or NNX, Equinox), in the spirit of `torch.autocast`: see the module
    docstring for the rules. Arrays keep the dtypes they are given (storage is
    `Policy.cast_to_param`'s job); only the operations are rewritten, and the
    floating results are cast to `policy.output_dtype`, except state, read
    from the traced program: a cache written or grown, a value passed
    through, a loop's carry (and `fn`'s carry where JAX traces it as a loop
    body), an Equinox `State`, linen's `mutable` collections come back in
    the dtypes they went in, by the rule linen's `with_policy` and
    `jmp_policy.nnx` use too (`jmp_policy.core.state`). Non-array results (an
    Equinox module's activation) come back as returned. `param_dtype` is not
    used. Array arguments are traced, anything else is static. Each call traces
    `fn` again, so call it under `jax.jit`.

    Composes with `jax.jit`, `jax.grad`, `jax.vmap`, `lax.scan` and
    `jax.checkpoint` on either side; the bodies of `jax.shard_map` and
    `jax.pmap` (which JAX 0.10 runs as a `shard_map`) are rewritten too. Autocast of
    an autocast function: the inner one decides for the operations inside it.
    Flax NNX modules that update their state (BatchNorm statistics, `Rngs`)
    work as `fn` (`autocast(model, policy)(x)`), as a bound method, or as
    arguments (`autocast(step, policy)(model, x)`), eagerly and under
    `nnx.jit`: their state is threaded through the traced program and written
    back; a module `fn` merely closes over gets a `TypeError` saying so. Not
    supported: forward-mode differentiation (`jax.jvp`, `jax.jacfwd`) through
    the half matmuls, which carry a `jax.custom_vjp`. A user's `custom_vjp`
    is rewritten too: its forward, and its backward rule from the inputs as
    residuals (the rule recomputes the forward, as under `jax.checkpoint`).

    Args:
      fn: the function to transform.
      policy: a `Policy` or a spec for `get_policy` (e.g. "mixed_bfloat16").
      half_primitives: names of primitives that run on `compute_dtype`
        operands with float32 accumulation (bilinear ones only).
      float32_primitives: names of primitives that run in float32.
      promote_primitives: names of primitives that run in the widest floating
        dtype of their inputs. Extend a list with e.g.
        `float32_primitives=FLOAT32_PRIMITIVES | {"tanh"}`. A name in several
        lists takes the first of half, float32, promote.
      returns_state: a pytree prefix of `fn`'s result, `True` for a part
        that is state (in the dtype of the argument it is built from, else
        as made: a cache `fn` makes), `False` for a result (the output
        dtype); None (the default) lets the state rule decide.

    Returns:
      The transformed function, with `fn`'s signature.

    Raises:
      TypeError: if `fn` is not callable, or a primitive list holds something
        other than names or primitives.
      ValueError: if a primitive list holds a name that is no JAX primitive's
        (the message lists close matches).

    >>> import jax, jax.numpy as jnp
    >>> import jmp_policy as jmp
    >>> from jmp_policy import autocast
    >>> def f(x, w):
    ...   return jax.nn.softmax(x @ w)
    >>> g = autocast(f, "mixed_bfloat16")
    >>> x, w = jnp.linspace(-1, 1, 6).reshape(2, 3), jnp.ones((3, 4))
    >>> g(x, w).dtype
    dtype('float32')
    >>> bool(jnp.allclose(jax.jit(g)(x, w), f(x, w), atol=1e-2))
    True
    """
    if not callable(fn):
        raise TypeError(f"autocast expects a function as its first argument, got {fn!r}.")
    policy = get_policy(policy)
    rules = Rules(
        compute_dtype=np.dtype(policy.compute_dtype),
        half=_primitive_names(half_primitives, "half_primitives"),
        float32=_primitive_names(float32_primitives, "float32_primitives"),
        promote=_primitive_names(promote_primitives, "promote_primitives"),
        matmul_dtype=None if policy.matmul_dtype is None else np.dtype(policy.matmul_dtype),
        fp8_scaling=policy.fp8_scaling,
    )

    # Not `functools.wraps`: it would copy `fn.__dict__`, and with it the
    # `lower` of a `jax.pmap` or `jax.jit` function, which lowers the
    # original program.
    @functools.wraps(fn, updated=())
    def wrapped(*args, **kwargs):
        run, flows = flow_recording_runner(rules)
        for handler in _STATE_HANDLERS:
            outs = handler(run, fn, args, kwargs)
            if outs is not NotImplemented:
                break
        else:
            outs = run(fn, args, kwargs)
        # What the program returns from an argument keeps its dtype; results
        # take the output dtype.
        flow = flows[-1].called_with(args)
        said = _framework_state(fn, kwargs, outs) if returns_state is None else returns_state
        return cast_results(outs, flow, policy.cast_to_output, returns_state=said)

    return wrapped
