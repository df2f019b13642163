"""A module's CUDA source: the kernels' template contexts rendered into ``module.cu.j2`` with the
math header, and NVRTC's options for it."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

import jinja2

from ...ir.ops import LEAVES, Op
from ...version import __version__
from .hardware import (
    WARP,
)
from .kernels import environment
from .printer import (
    BLOCK,
    ArraySpec,
)


def _template() -> jinja2.Template:
    return environment().get_template("module.cu.j2")


@cache
def math_header(elementary: bool = False) -> str:
    """ssmc_math.cuh; its elementary functions (sin_, atan2_, ...: the section between the
    SSMC_ELEMENTARY markers) only with `elementary`, so that modules calling none of them keep the
    source they had before those functions existed."""
    text = resources.files("ssmc").joinpath("templates", "ssmc_math.cuh").read_text()
    begin, end = text.index("// SSMC_ELEMENTARY_BEGIN"), text.index("// SSMC_ELEMENTARY_END")
    end = text.index("\n", end) + 1
    return text if elementary else text[:begin] + text[end:]


@cache
def mma_header() -> str:
    """ssmc_mma.cuh: the tensor-core tile product (mma.sync m16n8k16, emulated off the GPU) and the
    16-bit conversions, for kernels that multiply tiles (the chunked and the attention kernels)."""
    return resources.files("ssmc").joinpath("templates", "ssmc_mma.cuh").read_text()


_ELEMENTARY_CALL = re.compile(r"\b(?:sin_|cos_|tan_|log1p_|expm1_|sign_|atan2_)\(")


def render(program_name: str, strategy: str, ctype: str, contexts: list[dict], half: bool,
           exact: bool = False) -> str:
    """The CUDA module of the kernels' template `contexts`: the math header, the helpers they use (row
    combines, the lanes kernel's reduce-scatter), one kernel per context; `half` where an array is
    fp16 / bf16 (their headers); `exact` where it must be built without FMA contraction
    (`exact_products`, `compile_options`)."""
    def module(elementary: bool) -> str:
        return _template().render(version=__version__, program_name=program_name, strategy=strategy,
                                  ctype=ctype, math_header=math_header(elementary), block=BLOCK, kernels=contexts,
                                  half=half, warp=WARP, exact=exact,
                                  rows=any(c.get("row") or c.get("row_recurrence") for c in contexts),
                                  lanes=any(c.get("lanes") or c.get("lanes_backward") for c in contexts))
    source = module(False)
    return module(True) if _ELEMENTARY_CALL.search(source) else source


def exact_products(program) -> bool:
    """Whether `program` takes a max over an axis or compares computed values for equality: a max's
    gradient asks which values equal it (`x == max(x)`, ties by construction), each recomputed in
    whichever kernel needs it. nvcc contracts a * b + c into one FMA (one rounding) where the code
    lets it, which differs from kernel to kernel: a value recomputed one way missed its max computed
    the other, and its gradient was lost (a random spec's float64 gradients off by 0.2-0.4). Such
    programs' kernels are built without contraction (`compile_options`), every
    product rounded as the interpreter rounds it; the comparisons of iotas and constants (a select's
    gradient) are exact either way."""
    nodes = getattr(program, "nodes", None)
    return nodes is not None and any(
        n.op is Op.REDUCE_MAX or (n.op in (Op.EQ, Op.NE) and not all(a.op in LEAVES for a in n.args))
        for n in nodes())


def compile_options(source: str) -> tuple[str, ...]:
    """NVRTC's options for a generated module beyond the architecture, the same for the GPU's build
    (runner) and the CPU's (report, the CI's spill checks): C++17; subnormal floats flushed to zero,
    because CuPy's `RawModule` appends ``-ftz=true`` to whatever it is given (NVRTC takes the last),
    so a CPU build without it compiled other code than the GPU ran (exp2f one instruction, not four;
    other registers, and spills in the lanes backward that the CPU build did not show); no FMA
    contraction where `render` marked the module exact."""
    exact = ("--fmad=false",) if "#define SSMC_NO_CONTRACTION" in source else ()
    return ("--std=c++17", "-ftz=true", *exact)


def has_half(arrays: dict[str, ArraySpec]) -> bool:
    """Whether any of the arrays is fp16 or bf16."""
    return any(spec.dtype in ("float16", "bfloat16") for spec in arrays.values())
