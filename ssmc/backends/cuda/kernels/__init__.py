"""The CUDA backend's kernel strategies: one module (its analysis, template context, launch shape)
and one template (``<name>.cu.j2``) per way of mapping a program onto threads.

A context (the dict a strategy's module builds for one kernel) names its template under
``"template"``; `template` loads it. The module template (``../module.cu.j2``) renders each
kernel by including its context's template, so a strategy adds a kernel shape without editing it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import jinja2

HERE = Path(__file__).parent


@cache
def environment() -> jinja2.Environment:
    """The Jinja environment every CUDA template is loaded in (strict: a missing context key fails)."""
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(HERE.parent)), keep_trailing_newline=True,
                              undefined=jinja2.StrictUndefined)


@cache
def template(path: str | Path) -> jinja2.Template:
    """The template at `path`: a strategy's ``<name>.cu.j2`` (a relative path is under this package)."""
    path = HERE / path
    return environment().from_string(path.read_text())

