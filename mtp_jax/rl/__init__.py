"""Rollouts and head refreshes for JAX RL libraries (tunix): an optional extra, `pip install mtp_jax[rl]`."""
