"""How a mixture of experts' routing weights reach its experts: each row's picks spread over the local experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def routing_mix(weights: jax.Array, ids: jax.Array, local: int) -> jax.Array:
    """[M, E] float32: what each row's picks (weights, local ids [M, O]) give each local expert (zero: not picked)."""
    return jnp.einsum("MO,MOE->ME", weights, jax.nn.one_hot(ids, local, dtype=jnp.float32))
