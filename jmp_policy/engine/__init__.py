"""The engine: the one place each operation's dtype is decided.

Every front end (`autocast`, linen's `with_policy`, `jmp_policy.nnx`, Equinox)
hands it a traced program and the policy that applies where; it runs the
program again equation by equation, choosing each operation's precision the
way `torch.autocast` does:

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

Modules: `decision` (the rules: primitive sets, compute and matmul dtypes),
`interpreter` (the rewrite), `data_flow` (what a program returns from its
arguments: state keeps its dtype), `residuals` (what products save for the
backward pass), `stack_room` (a whole model's trace starts at a fresh
CPython frame-stack chunk), `products/` (how a product is made: `half` with
float32 accumulation in both passes, `cpu_form` for XLA:CPU, `fp8` per tensor
and per row, `block_scaling` for MXFP8 and NVFP4, `matmul_dtype`'s public
`dot_general`s).

References: PyTorch's `torch.autocast` (its float32 and "promote to widest
input" op lists); Micikevicius et al., "Mixed Precision Training" (ICLR 2018);
JAX's "Writing custom Jaxpr interpreters" tutorial.
"""
