"""The folder this package keeps what it builds or fetches in: `$MTP_JAX_CACHE`, or `~/.cache/mtp_jax`."""

from __future__ import annotations

import os

CACHE_ENV = "MTP_JAX_CACHE"


def cache_dir() -> str:
    """`$MTP_JAX_CACHE`, or `~/.cache/mtp_jax`."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "mtp_jax")
