"""Environment overrides of ssmc's settings (SSMC_CUDA_..., backends/cuda/settings.py) for the bench
scripts: set for a block, then restored.

    with overriding(SSMC_CUDA_LANES_BACKWARD="1"):   # None leaves a variable as it is
        ...
"""

from __future__ import annotations

import os
from contextlib import contextmanager


@contextmanager
def overriding(**settings: str | None):
    """The environment variables `settings` set (those given None left as they are) while the block
    runs; afterwards each as it was (unset where it was unset)."""
    given = {k: v for k, v in settings.items() if v is not None}
    old = {k: os.environ.get(k) for k in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
