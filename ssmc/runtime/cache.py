"""The on-disk cache of generated sources: one file per content hash, written atomically.

The directory is ``$SSMC_CACHE_DIR`` or ``~/.cache/ssmc``. Files are named by the hash of their
content, so a file that exists is always the right one and is never rewritten (its timestamp, which
Numba's own cache checks, stays put).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path


def cache_dir(kind: str) -> Path:
    root = os.environ.get("SSMC_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ssmc")
    path = Path(root) / kind
    path.mkdir(parents=True, exist_ok=True)
    return path


def content_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def store(kind: str, text: str, suffix: str) -> Path:
    """The path of a file holding `text`, written now unless it exists already."""
    path = cache_dir(kind) / f"k_{content_key(text)}{suffix}"
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    return path
