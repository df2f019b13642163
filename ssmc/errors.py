"""Errors that point at the user's spec, not at ssmc's insides.

A `SpecError` carries the `Loc` (file, line, source text) of the spec line that caused it and
formats as one line: ``path:line: message — in `source``` .
"""

from __future__ import annotations

import linecache
import os
import sys
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


def user_loc(skip: int = 1) -> Loc | None:
    """The innermost frame on the current stack that is not inside the ssmc package."""
    frame = sys._getframe(skip)
    while frame is not None:
        name = frame.f_code.co_filename
        if not _is_internal(name) and not name.startswith("<frozen"):
            return Loc(name, frame.f_lineno)
        frame = frame.f_back
    return None


def loc_from_traceback(tb) -> Loc | None:
    """The innermost traceback entry in user code (where a user's exception surfaced)."""
    found = None
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not _is_internal(name) and not name.startswith("<frozen"):
            found = Loc(name, tb.tb_lineno)
        tb = tb.tb_next
    return found
