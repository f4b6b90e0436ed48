"""transformers imported on first use only (it takes seconds), without its advice about PyTorch."""

from __future__ import annotations

import os
import sys

QUIET_ADVICE = "TRANSFORMERS_NO_ADVISORY_WARNINGS"


def import_transformers():
    """The transformers module (heavy to import: seconds), imported without its advice that PyTorch is missing and
    its models unavailable: this package uses its tokenizers only."""
    if "transformers" not in sys.modules:
        previous = os.environ.get(QUIET_ADVICE)
        os.environ[QUIET_ADVICE] = "1"
        try:
            import transformers  # noqa: F401
        finally:
            if previous is None:
                os.environ.pop(QUIET_ADVICE, None)
            else:
                os.environ[QUIET_ADVICE] = previous
    return sys.modules["transformers"]
