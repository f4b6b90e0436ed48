"""Every command's argument parsing and output (`python -m mtp_jax.<command>` runs a thin shim that calls `main`)."""
