"""The author's precision, read from the traced program.

A policy moves a model's learned computation to half precision; it must not
move what the author computed in float32 on purpose. Three kinds of product
say so in the program itself, and run as written under every front end:

* `precision=HIGHEST` (`matmul_dtype.asks_full_precision`).
* A product one of whose operands is a *table*: float arithmetic on
  integers (positions, `iota`/`arange`, integer inputs), literals and NumPy
  constants, with no floating value given to the program in its ancestry.
  Rotary angles `einsum(positions, inv_freq)` (`inv_freq` is one), a
  sinusoidal embedding `einsum(t, freqs)`, however the product is written
  (`@`, `jnp.dot`, `einsum`). In bfloat16 a position near 8000 is off by up
  to 32. Integers alone are no table (a head mask `einsum(weights, mask)`
  takes the policy, as in the model's own half config), nor is a value
  made from booleans (a mask, a one-hot: exact in any precision) or from
  random bits.
* A product an operand of which the program widens from a narrower float
  just before it (`h.astype(float32)` of a bfloat16 activation, through
  reshapes and transposes): DeepSeek-V3's router, Mixtral's expert combine,
  written in float32 by a model whose own half config computes the rest in
  bfloat16. In a float32 model such a cast is a no-op and invisible: there,
  `as_written` or a rule says it.

Each value of a program gets a `Mark` from its inputs' (`marks_of`); nested
programs (calls, loops, branches, custom rules) are read with the marks of
what they are given, a loop's carry to a fixed point.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jmp_policy.core import jax_internals as ji
from jmp_policy.engine.data_flow import MOVES_DATA


class Origin(enum.IntEnum):
    """What a value is made from; the join of several is the largest."""

    CONSTANT = 0  # Literals, booleans, random bits: nothing the author's precision hangs on.
    INTEGER = 1  # Integers (positions, iota, integer inputs), as floats too.
    TABLE = 2  # Float arithmetic on integers and constants: frequencies, angles.
    DATA = 3  # A floating value given to the program: parameters, activations, timesteps.


class Mark(NamedTuple):
    origin: Origin
    # The program widened it from a narrower float it computed (not a
    # narrower argument's elements: a half cache read by a float32 program).
    widened: bool = False
    # The elements of an argument, moved or written into (`data_flow`'s buffers).
    buffer: bool = False


_CONSTANT = Mark(Origin.CONSTANT)
# Random bits are no table, whatever integers their key is made of.
_RANDOM = frozenset(
    {"random_bits", "random_seed", "random_wrap", "random_unwrap", "random_fold_in",
     "random_split", "threefry2x32"}
)  # fmt: skip
# A buffer written into or grown stays the buffer (`data_flow`).
_BUFFER_OPS = frozenset({"dynamic_update_slice", "scatter", "concatenate", "pad", "select_n"})


def given(dtype: Any, *, numpy_constant: bool = False) -> Mark:
    """The mark of a value given to the program, of `dtype`.

    A floating argument is data; so is a JAX array the program closes over
    (an Equinox module's parameter may be one). A NumPy array it closes over
    (`numpy_constant`) is the author's constant: a frequency table computed
    in NumPy.
    """
    if jnp.issubdtype(dtype, jnp.inexact):
        return Mark(Origin.TABLE) if numpy_constant else Mark(Origin.DATA, buffer=True)
    return Mark(Origin.INTEGER) if jnp.issubdtype(dtype, jnp.integer) else _CONSTANT


def given_constant(value: Any) -> Mark:
    """The mark of a constant a program closes over."""
    dtype = getattr(value, "dtype", None) or np.asarray(value).dtype
    return given(dtype, numpy_constant=isinstance(value, (np.ndarray, np.generic)))


def _join(marks: Sequence[Mark], floating: bool) -> Mark:
    """A value computed from `marks`: float arithmetic on integers makes a table."""
    origin = max((m.origin for m in marks), default=Origin.CONSTANT)
    if floating and origin is Origin.INTEGER:
        origin = Origin.TABLE
    return Mark(origin)


# Frameworks' own code that widens a layer's input to infer its dtype (a
# Flax layer whose `dtype` is None promotes a half input against a float32
# kernel): a widening that the model's own half config, setting the field,
# would not have. `predicate(origin)` on where the conversion was written
# (`jax_internals.origin`); a framework's front end registers its own.
_DTYPE_INFERENCE: list[Callable[[str], bool]] = []


def register_dtype_inference(predicate: Callable[[str], bool]) -> None:
    """Says which conversions a framework writes to infer a layer's dtype."""
    if predicate not in _DTYPE_INFERENCE:
        _DTYPE_INFERENCE.append(predicate)


def _convert(eqn: ji.JaxprEqn, mark: Mark) -> Mark:
    source, target = ji.shaped(eqn.invars[0]).dtype, ji.new_dtype(eqn)
    if mark.origin is not Origin.DATA and source == np.bool_:
        return _CONSTANT  # A mask made a float: 0 and 1 are exact in any precision.
    floats = jnp.issubdtype(source, jnp.floating) and jnp.issubdtype(target, jnp.floating)
    widens = floats and np.dtype(source).itemsize < np.dtype(target).itemsize
    if widens and not mark.buffer and _DTYPE_INFERENCE:
        where = ji.origin(eqn)
        widens = not any(infers(where) for infers in _DTYPE_INFERENCE)
    widened = (widens and not mark.buffer) or (mark.widened and source == target)
    return Mark(mark.origin, widened, mark.buffer)


class Marks:
    """The marks of one program's values, for the marks of its inputs."""

    def __init__(self, jaxpr: ji.Jaxpr, inputs: Sequence[Mark], consts: Sequence[Mark]):
        self.env: dict[Any, Mark] = {}
        self.env.update(zip(jaxpr.constvars, consts))
        self.env.update(zip(jaxpr.invars, inputs))
        self.carries: dict[ji.JaxprEqn, list[Mark]] = {}
        for eqn in jaxpr.eqns:
            outs = self._outputs(eqn, [self[v] for v in eqn.invars])
            self.env.update((v, m) for v, m in zip(eqn.outvars, outs))
        self.outputs = [self[v] for v in jaxpr.outvars]

    def __getitem__(self, v: Any) -> Mark:
        return _CONSTANT if isinstance(v, ji.Literal) else self.env.get(v, _CONSTANT)

    def _outputs(self, eqn: ji.JaxprEqn, ins: list[Mark]) -> list[Mark]:
        name, n = eqn.primitive.name, len(eqn.outvars)
        if name == "iota":
            return [Mark(Origin.INTEGER)] * n
        if name in _RANDOM:
            data = any(m.origin is Origin.DATA for m in ins)
            return [Mark(Origin.DATA) if data else _CONSTANT] * n
        if eqn.primitive is ji.convert_element_type_p:
            return [_convert(eqn, ins[0])]
        if name in MOVES_DATA and ins:
            return [ins[0]] * n
        nested = self._nested(eqn, ins)
        if nested is not None:
            return nested
        dtypes = [ji.shaped(v).dtype for v in eqn.outvars]
        out = _join(ins, any(jnp.issubdtype(d, jnp.floating) for d in dtypes))
        if out.origin is not Origin.DATA and all(d == np.bool_ for d in dtypes):
            out = _CONSTANT  # A mask (a causal one from iota): exact in any precision.
        if name in _BUFFER_OPS and ins and ins[-1 if name == "select_n" else 0].buffer:
            out = out._replace(buffer=True)
        return [out] * n

    def _nested(self, eqn: ji.JaxprEqn, ins: list[Mark]) -> list[Mark] | None:
        inputs = program_inputs(eqn, ins, self)
        if inputs is None:
            return None
        body = ji.inlined_body(eqn)
        if body is not None:
            return marks_of(body, inputs["body"]).outputs
        loop = ji.loop_parts(eqn)
        if loop is not None:
            outs = marks_of(loop.body, inputs["body"]).outputs
            return self.carries[eqn] + [Mark(m.origin) for m in outs[len(loop.carry) :]]
        per_branch = [marks_of(b, inputs["body"]).outputs for b in ji.branches(eqn) or []]
        return [Mark(max(m.origin for m in outs)) for outs in zip(*per_branch)]


def program_inputs(
    eqn: ji.JaxprEqn, ins: Sequence[Mark], marks: Marks | None = None
) -> dict[str, list[Mark]] | None:
    """The marks of the inputs of the programs nested in `eqn`, given its
    inputs' `ins`: `"body"` (a call's, a loop body's, each branch's) and
    `"cond"` (a while loop's condition); None for an equation with none."""
    ins = list(ins)
    if ji.inlined_body(eqn) is not None:
        return {"body": ins}
    loop = ji.loop_parts(eqn)
    if loop is not None:
        carries = _carry_fixed_point(eqn, loop, ins, marks)
        consts, xs = [ins[i] for i in loop.consts], [ins[i] for i in loop.xs]
        cond = ins[: loop.consts.start] + carries
        return {"body": consts + carries + xs, "cond": cond}
    if ji.branches(eqn) is not None:
        return {"body": ins[1:]}
    return None


def _carry_fixed_point(
    eqn: ji.JaxprEqn, loop: ji.LoopParts, ins: list[Mark], marks: Marks | None
) -> list[Mark]:
    """A carry is what it starts as joined with what the body makes of it."""
    if marks is not None and eqn in marks.carries:
        return marks.carries[eqn]
    consts, xs = [ins[i] for i in loop.consts], [ins[i] for i in loop.xs]
    carries = [Mark(ins[i].origin) for i in loop.carry]
    while True:
        outs = marks_of(loop.body, consts + carries + xs).outputs
        grown = [Mark(max(c.origin, o.origin)) for c, o in zip(carries, outs)]
        if grown == carries:
            break
        carries = grown
    if marks is not None:
        marks.carries[eqn] = carries
    return carries


# Per program (held weakly), per marks of its inputs.
_MARKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def marks_of(jaxpr: ji.Jaxpr, inputs: Sequence[Mark], consts: Sequence[Mark] = ()) -> Marks:
    """The `Marks` of `jaxpr`'s values (its constants: `consts`, else as given)."""
    consts = tuple(consts) or tuple(given(ji.shaped(v).dtype) for v in jaxpr.constvars)
    key = (tuple(inputs), consts)
    known = _MARKS.setdefault(jaxpr, {})
    if key not in known:
        known[key] = Marks(jaxpr, list(inputs), list(consts))
    return known[key]


def keeps_authors_precision(
    eqn: ji.JaxprEqn, marks: Marks, *, widened_by_config: bool = False
) -> bool:
    """Whether a product's operands say the author computed it as written: one
    a table, or one the program widened from a narrower float it computed
    (unless the user said the program's widenings are its config's dtype,
    `widened_by_config`). Integers alone are no table: a head mask
    (`einsum(weights, mask)`) takes the policy; positions times frequencies
    (a table) do not."""
    operands = [marks[v] for v in eqn.invars[:2]]
    return any(m.origin is Origin.TABLE or (m.widened and not widened_by_config) for m in operands)


# Per program (held weakly): whether it, or a program nested in it, widens a float.
_WIDENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _widens(jaxpr: ji.Jaxpr) -> bool:
    if jaxpr not in _WIDENS:
        _WIDENS[jaxpr] = any(
            (eqn.primitive is ji.convert_element_type_p
             and jnp.issubdtype(ji.shaped(eqn.invars[0]).dtype, jnp.floating)
             and jnp.issubdtype(ji.new_dtype(eqn), jnp.floating))
            or any(_widens(sub) for sub in ji.sub_jaxprs(eqn))
            for eqn in jaxpr.eqns
        )  # fmt: skip
    return _WIDENS[jaxpr]


def key(jaxpr: ji.Jaxpr, inputs: Sequence[Mark]) -> tuple:
    """What of its inputs' marks a rewrite of `jaxpr` depends on: whether an
    input is an argument's elements matters only where the program widens a
    float (a deep model's first layer, given the model's argument, and the
    others, given its activations, share one rewrite)."""
    if _widens(jaxpr):
        return tuple(inputs)
    return tuple(m._replace(buffer=False) for m in inputs)
