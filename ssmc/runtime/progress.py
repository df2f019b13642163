"""A note on stderr when something (a compile) takes more than a moment."""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager


@contextmanager
def progress(what: str, after: float = 1.0):
    """Say `what` is under way if it is still running after `after` seconds, and when it ends."""
    start = time.perf_counter()
    shown = threading.Event()

    def show():
        shown.set()
        print(f"ssmc: {what} ...", file=sys.stderr, flush=True)

    timer = threading.Timer(after, show)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if shown.is_set():
            print(f"ssmc: {what}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
