"""Decoding on a `jax.sharding` mesh: the mesh from a spec, the logical-axis rules, placing parameters and pinning
activations (`sharding`)."""
