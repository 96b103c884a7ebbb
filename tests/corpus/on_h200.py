"""A model's gradient compiled for an H200 without a GPU, for its temporary memory.

The CUDA plugin built for the installed jaxlib compiles for a topology of
GPUs no process owns (benchmarks/gpu_compile.py, on the path). The model is
made abstract on a mesh of those GPUs; the state it reads but does not train
(random keys and counts) is made on the CPU and given to the program as
data, since an abstract one cannot be read while tracing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def devices(count: int = 1) -> list[Any]:
    import gpu_compile  # benchmarks/: reads the GPU targets, needs the CUDA plugin.

    return gpu_compile.cuda_devices(gpu_compile.target_configs()["h200_sxm"], count)


def temp_bytes(loss_of_params: Callable[[Any], jax.Array], params: Any, mesh: Any) -> int:
    """The temporary memory of `jax.grad(loss_of_params)`, `params` abstract
    and replicated over `mesh`."""
    on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_mesh), params)
    compiled = jax.jit(jax.grad(loss_of_params)).lower(specs).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


class Portable(NamedTuple):
    """An array as numpy data, made again inside the program compiled for the GPU."""

    data: np.ndarray
    key: bool


def portable(tree: Any) -> Any:
    def one(x: jax.Array) -> Portable:
        key = jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
        return Portable(np.asarray(jax.random.key_data(x) if key else x), key)

    return jax.tree.map(one, tree)


def made_again(tree: Any) -> Any:
    """`tree` with its `Portable` leaves made into arrays (traced: constants)."""

    def one(x: Any) -> Any:
        if not isinstance(x, Portable):
            return x
        return jax.random.wrap_key_data(x.data) if x.key else jnp.asarray(x.data)

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, Portable))
