"""Named axes: parsing axis strings and placing the implicit time axis.

An axis string names a tensor's axes in order, separated by spaces: ``"b d n"``. An axis may
carry a static size, ``"g=4"``, which `unbind` needs. The name ``t`` is reserved for time.
"""

from __future__ import annotations

import re
from functools import lru_cache

TIME = "t"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_axes(text: str) -> tuple[tuple[str, ...], dict[str, int]]:
    """``"b g=4 k"`` -> (("b", "g", "k"), {"g": 4}). Raises ValueError with a readable reason."""
    if not isinstance(text, str):
        raise ValueError(f"axes must be a string like 'b d n', got {text!r}")
    names: list[str] = []
    sizes: dict[str, int] = {}
    for token in text.split():
        name, _, size = token.partition("=")
        if not _NAME.match(name):
            raise ValueError(f"axis name {name!r} is not an identifier")
        if name == TIME:
            raise ValueError("axis name 't' is reserved for the implicit time axis")
        if name in names:
            raise ValueError(f"axis {name!r} appears twice in {text!r}")
        if size:
            if not size.isdigit() or int(size) < 1:
                raise ValueError(f"axis size in {token!r} must be a positive integer")
            sizes[name] = int(size)
        names.append(name)
    return tuple(names), sizes


def format_axes(axes: tuple[str, ...]) -> str:
    return "[" + " ".join(axes) + "]"


@lru_cache(maxsize=1024)  # asked for every array of every call
def resolve_layout(template: str, axes: tuple[str, ...]) -> tuple[str, ...]:
    """Order of an array's axes, time included, from a layout template.

    The template names axes and ``t`` (time); ``...`` stands for the array's other axes in
    declared order. Without ``...``, the template's names that the array lacks are placeholders
    and the array's other axes fill the first one; failing that, they go at the end.

        resolve_layout("t ...", ("b", "d"))   -> ("t", "b", "d")
        resolve_layout("b t d", ("b", "n"))   -> ("b", "t", "n")
        resolve_layout("b d t", ("b", "n"))   -> ("b", "n", "t")
    """
    tokens = template.split()
    if tokens.count(TIME) != 1:
        raise ValueError(f"layout {template!r} must name the time axis 't' exactly once")
    if tokens.count("...") > 1:
        raise ValueError(f"layout {template!r} has more than one '...'")
    rest = [a for a in axes if a not in tokens]
    out: list[str] = []
    filled = False
    for tok in tokens:
        if tok == TIME:
            out.append(TIME)
        elif tok in axes:
            out.append(tok)
        elif (tok == "..." or "..." not in tokens) and not filled:
            out.extend(rest)
            filled = True
    if not filled:
        out.extend(rest)
    return tuple(out)
