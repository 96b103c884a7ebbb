"""`with_policy`: a policy applied as a function transform over Flax linen modules.

Flax linen modules take `dtype` (computation) and `param_dtype` (storage)
attributes. `with_policy` sets them on every module as it is called, through
a linen method interceptor, so a model written without precision in mind
runs under any policy, as its own hand-written half-precision config would:
Flax's layers cast what they compute with, values moving between modules
keep their dtypes (`jmp_policy.integrations.casting` decides, for linen and
NNX alike), and the carries of lifted loops (`nn.scan`, `nn.RNN`,
`nn.while_loop`) keep theirs. Every product's dtype is decided by the
op-level rewrite of the call (`product_rules`), the fields being only the usual
route: a product whose operands are wider than its module's compute dtype
takes it, and under a matmul dtype every product takes that; a module whose
rule changes either marks its products with a name scope (`product_scope`).
The values between products follow `autocast`'s rule under bfloat16, so a
layer no field reaches (an NNX layer behind `ToLinen`) stays in half too.

The package, one concern a module (read `entry_points` first):

* `entry_points`: `with_policy` itself, and linen's `apply`, `init`,
  `init_with_output` (their results, state, collections);
* `call`: the record of one wrapped call and the context it runs in;
* `interceptor`: the method interceptor, each module's policy and fields;
* `arguments`: which arguments `keep_inputs` names, a partial's own;
* `plain_function`: a function that is not a linen entry point;
* `parameters`: the dtypes parameters are made in, and `init`'s own draws;
* `remat_norms`: half-precision norms recomputed in the backward pass;
* `loop_carries`: the carries of lifted loops keep their dtypes.

Every Flax private API read or patched, and every guess about a Flax model,
is in `jmp_policy.integrations.flax_internals`.
"""

from jmp_policy.integrations.linen.entry_points import (
    apply_keeping_variables,
    collections_as_given,
    state_in_result,
    with_policy,
)

__all__ = ["apply_keeping_variables", "collections_as_given", "state_in_result", "with_policy"]
