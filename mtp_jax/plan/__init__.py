"""Compiling the decode loop for a device topology without running on it (`planning`, `topology`, `shapes`) and reading
what the program holds and moves (`hlo_text`, `hlo_traffic`, `hlo_collectives`, `routed_floor`).
`python -m mtp_jax.plan` runs the command in cli/plan.py."""
