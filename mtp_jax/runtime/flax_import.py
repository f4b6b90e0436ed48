"""Imports flax without importing IPython.

flax.nnx asks, at import time, whether it runs under IPython (to colour its reprs) and imports IPython to ask: a
noticeable part of every command-line start where IPython is installed (it is, for the notebooks; measured:
docs/benchmarks-log.md#cpu-decode-where-a-steps-time-goes-under-xlacpu-and-the-startup-imports-cpu). Outside IPython
the answer is "no" either way, so here it comes from a failed import instead; IPython stays importable afterwards.
Inside IPython (already imported) flax is imported as usual.
"""

import sys

if "IPython" not in sys.modules:
    sys.modules["IPython"] = None  # type: ignore[assignment]  # `import IPython` raises ImportError meanwhile
    try:
        import flax.nnx  # noqa: F401
    finally:
        del sys.modules["IPython"]
