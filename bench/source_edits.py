"""Text edits of generated CUDA sources, for the scripts that time a kernel against variants of itself
(bench/lanes_variants.py, bench/backward_variants.py).

    install()                       # CudaRunner.function passes each source through the active edit
    with editing(edit, only="_fused_backward("):   # sources containing `only`, for the block's duration
        ...                         # build (fresh runners) and time
"""

from __future__ import annotations

from contextlib import contextmanager

from ssmc.backends.cuda import runner

# float exp2 as the one-instruction `ex2.approx.ftz` (exp2f is 4 SASS instructions: the scaling around
# subnormal results)
FTZ = ('__device__ __forceinline__ float ex2_ftz(float x) { float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) '
       ': "f"(x)); return r; }\n')

_active: dict = {"edit": None, "only": None}
_function = runner.CudaRunner.function


def both(*edits):
    """An edit applying `edits` in order."""
    def edit(source: str) -> str:
        for e in edits:
            source = e(source)
        return source
    return edit


def _edited_function(self, source: str, name: str):
    edit, only = _active["edit"], _active["only"]
    if edit is not None and (only is None or only in source):
        source = edit(source)
    return _function(self, source, name)


def install() -> None:
    """Route every kernel source the CUDA runners compile through the active edit (`editing`)."""
    runner.CudaRunner.function = _edited_function


@contextmanager
def editing(edit, only: str | None = None):
    """`edit` active (None: the generated sources) for the sources containing `only` (all: None)."""
    _active.update(edit=edit, only=only)
    try:
        yield
    finally:
        _active.update(edit=None, only=None)
