"""What the fused backward of Mamba-1 spends its time on (GPU): the generated kernel timed against
variants of its own source, edited as text before it compiles, and against other steps per lane.

Each variant runs a training step of Mamba-1 (`ssmc.grad`: the lanes forward saving its rounds, then
the fused backward) at B8 D1536 L2048 N16 (and, with --small, B32 D512 L180), fp32, layout "b d t",
and reports the fused backward kernel's own time (torch.profiler). Some variants keep the results
(a loop unrolled, another exp instruction, other steps per lane); the others drop work the kernel
needs (marked "drops": their gradients are wrong and say how wrong) to measure what that work costs,
together with whatever the compiler then finds dead. Every variant's gradients are compared with the
unedited kernel's; a variant that keeps the results and changes them makes the script exit non-zero.

    python3 bench/backward_variants.py [--small] [--shape BxDxL ...] [--only NAME ...] [--repeat K]

Results and what they say: bench/results/2026-11-26-h200-fused-backward-time.md.
"""

from __future__ import annotations

import argparse
import os
import re

import numpy as np
import torch
from lanes_backward_probe import kernel_times  # bench/ is the script's folder, on sys.path
from source_edits import FTZ, both, editing, install

import ssmc
from ssmc.backends.cuda import fused_backward, runner
from ssmc.examples import mamba1

KERNEL = "_fused_backward("  # the kernel whose source the edits apply to


class NotInSource(ValueError):
    """An edit's pattern is not in the generated kernel (its generator changed, or the piece it edits
    is not generated at this shape: the blocks spread over b where there is one b, say)."""


def _sub(pattern: str, new: str):
    """An edit replacing every match of `pattern` (a regex) by `new`; it must match."""
    def edit(source: str) -> str:
        out, n = re.subn(pattern, new, source)
        if not n:
            raise NotInSource(f"the edit's pattern is not in the generated source: {pattern!r}")
        return out
    return edit


_N_LOOP = r"#pragma unroll 1(\s*for \(int (\w+) = 0; \2 < n_n; \+\+\2\) \{  // one state value at a time)"
_SCAN = r"off < 32; off <<= 1\) \{(  //[^\n]*)?(\s*const F Hb = __shfl_DIRECTION_sync)"
_NO_FORWARD_SCAN = _sub(_SCAN.replace("DIRECTION", "up"), r"off < 1; off <<= 1) {\1\2")
_NO_ADJOINT_SCAN = _sub(_SCAN.replace("DIRECTION", "down"), r"off < 1; off <<= 1) {\1\2")


def _bounds(blocks: int):
    """`__launch_bounds__` asking ptxas for registers that fit `blocks` blocks of 128 threads an SM."""
    return _sub(r'extern "C" __global__ void (\w+_fused_backward)\(',
                rf'extern "C" __global__ void __launch_bounds__(128, {blocks}) \1(')


_IN_ORDER = _sub(r"// consecutive blocks take turns[^\n]*\n[^\n]*\n\s*const unsigned bx = [^\n]*\n"
                 r"\s*const unsigned blk = [^\n]*\n\s*const long long p = [^\n]*",
                 "const long long p = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;")

# name -> (edit of the backward's source or None, SSMC_CUDA_BACKWARD_STEPS_PER_LANE or None, drops work
#          [, threads a block of the backward, where not codegen.BLOCK])
VARIANTS = {
    "generated": (None, None, False),
    "loop over n unrolled 2": (_sub(_N_LOOP, r"#pragma unroll 2\1"), None, False),
    "exp2 as ex2.approx.ftz (1 SASS instruction, not 4)": (_sub(
        re.escape("__device__ __forceinline__ float exp2e(float x) { return exp2f("),
        FTZ.replace("\\", "\\\\") + "__device__ __forceinline__ float exp2e(float x) { return ex2_ftz("), None, False),
    "registers for 5 blocks an SM (__launch_bounds__)": (_bounds(5), None, False),
    "registers for 7 blocks an SM (__launch_bounds__)": (_bounds(7), None, False),
    "blocks in order (not spread over b: more blocks adding to one address at once)": (_IN_ORDER, None, False),
    # (blocks in order: the spread's mapping is worked out for blocks of 4 rows)
    "256 threads a block (8 rows: half the block sums' adds; one copy of the sums, two barriers)": (both(
        _IN_ORDER, _sub(r"__shared__ F sm_(\w+)\[4\]\[(\d+)\];", r"__shared__ F sm_\1[8][\2];"),
        _sub(r"__shared__ F sm_sums\[2\]\[(\d+)\]\[4\]", r"__shared__ F sm_sums[1][\1][8]"),
        _sub(r"sums_at \^= 1;", "__syncthreads();"),
        _sub(r"(sm_sums\[sums_at\]\[j\]\[3\]\[s \+ e\])",
             r"\1 + sm_sums[sums_at][j][4][s + e] + sm_sums[sums_at][j][5][s + e] + sm_sums[sums_at][j][6][s + e]"
             r" + sm_sums[sums_at][j][7][s + e]")), None, False, 256),
    "2 steps a lane": (None, "2", False),
    "8 steps a lane": (None, "8", False),
    "drops: the forward's scan over the lanes": (_NO_FORWARD_SCAN, None, True),
    "drops: the adjoint's scan over the lanes": (_NO_ADJOINT_SCAN, None, True),
    "drops: both scans": (both(_NO_FORWARD_SCAN, _NO_ADJOINT_SCAN), None, True),
    "drops: the block's sums of the grad_B / grad_C terms": (_sub(
        r"__syncthreads\(\);(\s*const int j = threadIdx.x / 32, s = threadIdx.x % 32 \* \d;\s*)if \(j < 2 &&",
        r"\1if (false &&"), None, True),
    "drops: the block sums' barrier (their terms race)": (_sub(
        r"__syncthreads\(\);(\s*const int j = threadIdx.x / 32, s = threadIdx.x % 32 \* \d;)", r"\1"), None, True),
    "drops: the block sums' adds into memory (the barrier kept)": (_sub(
        r"(const int j = threadIdx.x / 32, s = threadIdx.x % 32 \* \d;\s*)if \(j < 2 &&", r"\1if (L < 0 &&"),
        None, True),
    "drops: the exp of the decay": (_sub(r"v_fs_m1 = exp_\(", "v_fs_m1 = F(1) - ("), None, True),
}

_PREFETCH = ('__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" '
             ':: "l"(p)); }\n')
_NEXT_LOAD = re.compile(r"(\n\s*)load_steps<(\d+)>\(next_(ld\d+), ([^;]*\(next_i_n\)[^;]*)\);")


def _prefetch(ahead: int):
    """An edit prefetching into L1, where the next index's B and C are loaded into registers, those of
    the index `ahead` on (ptxas places those loads at the end of the loop's body, just before their
    use: ncu's source counters put 17% of the stall samples on the moves waiting for them)."""
    def edit(source: str) -> str:
        def one(m):
            at = m.group(4).replace("(next_i_n)", f"(min(i_n + {ahead}, n_n - 1))")
            pad, steps, reg, load = m.groups()
            return f"{pad}prefetch_l1({at});{pad}load_steps<{steps}>(next_{reg}, {load});"
        out, n = _NEXT_LOAD.subn(one, source)
        if not n:
            raise NotInSource("the next index's vector loads are not in the generated source")
        return out.replace('extern "C" __global__', _PREFETCH + 'extern "C" __global__', 1)
    return edit


def _in_shared(*names: str):
    """An edit moving the per-index register arrays `names` (indexed by the rolled loop over n, so ptxas
    keeps them in local memory: the kernel's 128-byte stack frame) into shared memory, a slot per
    thread and index."""
    def edit(source: str) -> str:
        for name in names:
            decl = f"F {name}[n_n];"
            if decl not in source:
                raise NotInSource(f"no {decl} in the generated source")
            source = source.replace(decl, f"__shared__ F sh_{name}[n_n][128];")
            source = re.sub(rf"\b{name}\[([^\]]+)\]", rf"sh_{name}[\1][threadIdx.x]", source)
        return source
    return edit


VARIANTS["the carries and grad_A per index in shared memory, not local"] = (
    _in_shared("cr_grad_h", "st_grad_A"), None, False)
VARIANTS["the same, registers for 4 blocks an SM (__launch_bounds__)"] = (
    both(_in_shared("cr_grad_h", "st_grad_A"), _bounds(4)), None, False)
VARIANTS["the next index's B and C prefetched into L1 first"] = (_prefetch(1), None, False)
VARIANTS["B and C of the index after next prefetched into L1"] = (_prefetch(2), None, False)

_BLOCK = fused_backward.BLOCK


def run_variant(name: str, x: dict, dy: torch.Tensor) -> tuple[dict, float]:
    """(gradients, the fused backward kernel's ms) of a training step with variant `name` (fresh runners)."""
    edit, steps, _, *threads = VARIANTS[name]
    runner._RUNNERS.clear()
    fused_backward._RUNNERS.clear()
    fused_backward.BLOCK = threads[0] if threads else _BLOCK  # its launch's grid (the source's edit the rest)
    if steps:
        os.environ["SSMC_CUDA_BACKWARD_STEPS_PER_LANE"] = steps
    try:
        with editing(edit, only=KERNEL):
            g = ssmc.grad(mamba1.SPEC, "cuda", layout=mamba1.LAYOUT)
            grads = g(**x, grad_outputs=dy)
            kernels = kernel_times(lambda: g(**x, grad_outputs=dy), 20)
    finally:
        fused_backward.BLOCK = _BLOCK
        os.environ.pop("SSMC_CUDA_BACKWARD_STEPS_PER_LANE", None)
        runner._RUNNERS.clear()
        fused_backward._RUNNERS.clear()
    backward = [ms for k, ms in kernels.items() if "backward" in k]
    if len(backward) != 1:
        raise RuntimeError(f"expected one backward kernel among {sorted(kernels)}")
    return grads, backward[0]


def _rel_diff(got: dict, want: dict) -> float:
    worst = 0.0
    for k, w in want.items():
        scale = float(w.abs().max()) or 1.0
        worst = max(worst, float((got[k] - w).abs().max()) / scale)
    return worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="also B32 D512 L180")
    ap.add_argument("--only", nargs="*", choices=list(VARIANTS), help="these variants (and the generated kernel)")
    ap.add_argument("--repeat", type=int, default=1, help="time the list of variants this many times, in turn")
    ap.add_argument("--shape", action="append", default=[], metavar="BxDxL",
                    help="another shape to time (B x D x L, N 16); may be given more than once")
    args = ap.parse_args(argv)
    install()
    # the warp kernel's fused backward, also where the lanes backward would run (L <= 192: B32 D512 L180)
    os.environ["SSMC_CUDA_LANES_BACKWARD"] = "0"
    names = ["generated", *[n for n in (args.only or VARIANTS) if n != "generated"]] * args.repeat
    shapes = [(8, 1536, 2048)] + ([(32, 512, 180)] if args.small else [])
    shapes += [tuple(int(v) for v in shape.lower().split("x")) for shape in args.shape]
    print(f"Mamba-1 fused backward, {torch.cuda.get_device_name()}\n")
    print("| shape | variant | backward kernel ms | vs generated | gradients' rel. diff |")
    print("|---|---|---|---|---|")
    failed = False
    for batch, dim, length in shapes:
        values = mamba1.make_inputs(np.random.default_rng(0), length, batch=batch, dim=dim, state=16)
        x = {k: torch.tensor(v, device="cuda", dtype=torch.float32) for k, v in values.items()}
        dy = torch.randn(batch, dim, length, device="cuda")
        want = base = None
        for name in names:
            try:
                grads, ms = run_variant(name, x, dy)
            except NotInSource:
                print(f"| B{batch} D{dim} L{length} | {name} | not in this shape's kernel | | |")
                continue
            except Exception as exc:  # a variant that does not build or run: said, the others still run
                print(f"| B{batch} D{dim} L{length} | {name} | {type(exc).__name__}: {str(exc)[:80]} | | |")
                failed = failed or not VARIANTS[name][2]
                continue
            want = grads if want is None else want
            base = ms if base is None else base
            diff = _rel_diff(grads, want)
            if not VARIANTS[name][2] and not diff <= 1e-4:
                failed = True  # a variant that keeps the results did not
            print(f"| B{batch} D{dim} L{length} | {name} | {ms:.4f} | {ms / base:.3f} | {diff:.1e} |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
