"""Errors that point at the user's spec, not at ssmc's insides.

A `SpecError` carries the `Loc` (file, line, source text) of the spec line that caused it and
formats as one line: ``path:line: message — in `source``` .
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
import sysconfig
from dataclasses import dataclass

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Loc:
    """A line of user code: where a spec, a node or a declaration was written."""

    path: str
    line: int

    @property
    def code(self) -> str:
        return linecache.getline(self.path, self.line).strip()

    def __str__(self) -> str:
        return f"{_short_path(self.path)}:{self.line}"


class SpecError(Exception):
    """A spec that ssmc cannot accept, raised when the spec is defined (or compiled).

    `str(err)` is a single line naming the user's file and line and quoting the offending code.
    """

    def __init__(self, message: str, loc: Loc | None = None):
        self.message = one_line(message)
        self.loc = loc
        super().__init__(self._format())

    def _format(self) -> str:
        if self.loc is None:
            return self.message
        code = self.loc.code
        return f"{self.loc}: {self.message}" + (f" — in `{code}`" if code else "")


def one_line(text: str) -> str:
    """`text` with its line breaks (say, from a user's multi-line exception message) folded into spaces."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _short_path(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def _is_internal(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_PACKAGE_DIR + os.sep)


def _is_library(filename: str) -> bool:
    """Whether `filename` is Python's own library or a package the step may call into (NumPy's
    ``np.sum(x)`` raising on a tensor): the user's line is the one that called it."""
    path = os.path.abspath(filename)
    return any(path.startswith(d) for d in _library_dirs())


@functools.cache
def _stdlib() -> str:
    return sysconfig.get_paths()["stdlib"]


def _library_dirs() -> tuple[str, ...]:
    dirs = [_stdlib()]
    for name in ("numpy", "torch", "sympy"):
        module = sys.modules.get(name)
        if getattr(module, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(module.__file__)))
    return tuple(os.path.join(d, "") for d in dirs)


def _pick(frames) -> Loc | None:
    """The first of `frames` ((file, line), innermost first) in the user's own code: not in ssmc, nor
    in a library (`_is_library`) unless every frame outside ssmc is."""
    fallback = None
    for name, line in frames:
        if _is_internal(name) or name.startswith("<frozen"):
            continue
        if not _is_library(name):
            return Loc(name, line)
        fallback = fallback or Loc(name, line)
    return fallback


def user_loc(skip: int = 1) -> Loc | None:
    """The innermost frame on the current stack in the user's code (`_pick`)."""
    def frames(frame):
        while frame is not None:
            yield frame.f_code.co_filename, frame.f_lineno
            frame = frame.f_back
    return _pick(frames(sys._getframe(skip)))


def loc_from_traceback(tb) -> Loc | None:
    """The innermost traceback entry in the user's code (where a user's exception surfaced, `_pick`)."""
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    return _pick(frames[::-1])
