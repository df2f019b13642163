"""The compiler pipeline as a list of named stages, each a function of the program.

`ssmc show --stage NAME` prints the output of one stage; later stages join the list as they are
built. A stage takes the traced program and returns something printable.
"""

from __future__ import annotations

from collections.abc import Callable

from .ir.printer import format_program

# name -> (description, function from program to printable text)
STAGES: dict[str, tuple[str, Callable[[object], str]]] = {
    "ir": ("the traced IR, one line per node", format_program),
}


def show(program, stage: str = "ir") -> str:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    return STAGES[stage][1](program)
