"""Hashes of every generated CUDA and Numba source of the examples, to check that a change leaves them
byte-identical (or to list the kernels it changes).

    python bench/source_snapshot.py > before.json        # on the old code
    python bench/source_snapshot.py --compare before.json  # on the new: the kernels whose source changed

CUDA: `ssmc inspect`'s kernels (forward, training forward, recompute, adjoint or the fused backward)
of each recurrence example at the sizes below, with time outermost and time contiguous, float32 and
bfloat16; nothing is compiled. Numba: each example's forward and gradient modules at its own small sizes.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import sys

from ssmc.backends.cuda.report import kernel_reports

# (example, sizes, lengths): the benchmark shapes and the small ones the tests use
SHAPES = [
    ("hgrn", {"b": 8, "d": 2048}, (180, 4096)),
    ("mingru", {"b": 8, "d": 256, "i": 256}, (180, 1024)),
    ("mamba1", {"b": 8, "d": 1536, "n": 16}, (180, 2048)),
    ("mamba1", {"b": 32, "d": 512, "n": 16}, (180,)),
    ("mamba1_block", {"b": 8, "d": 1536, "n": 16}, (2048,)),
    ("mamba2", {"b": 2, "g": 1, "r": 8, "p": 64, "n": 64}, (1024,)),
    ("retnet", {"b": 2, "h": 4, "k": 64, "v": 64}, (1024,)),
    ("linear_attention", {"b": 2, "h": 4, "k": 64, "v": 64}, (1024,)),
    ("lstm", {"b": 64, "i": 512, "k": 512}, (180,)),
    ("gru", {"b": 64, "i": 512, "k": 512}, (180,)),
]
# every example at the tests' small sizes (each axis 16 where not given) and awkward lengths
SHAPES += [(name, {}, (1, 7, 180)) for name in sorted({n for n, _, _ in SHAPES})]


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def cuda_sources(small_only: bool = False) -> dict[str, str]:
    out = {}
    for name, sizes, lengths in SHAPES:
        if small_only and sizes:
            continue
        program = importlib.import_module(f"ssmc.examples.{name}").SPEC.program
        sizes = {**{a: 16 for d in program.decls for a in d.axes}, **program.static_sizes, **sizes}
        for length in lengths:
            for dtype in ("float32", "bfloat16"):
                for contiguous in (False, True):
                    try:
                        reports = kernel_reports(program, sizes, length, dtype, compile_kernels=False,
                                                 time_contiguous=contiguous)
                    except ValueError as e:  # a forced strategy that cannot run this program
                        out[f"cuda {name} L{length} {dtype} contiguous={contiguous}"] = f"refused {e}"
                        continue
                    for r in reports:
                        key = f"cuda {name} {sizes} L{length} {dtype} contiguous={contiguous} {r.program} {r.name}"
                        out[key] = f"{r.strategy} {_digest(r.source)}"
    return out


def forced_sources() -> dict[str, str]:
    """The kernels each strategy forced by SSMC_CUDA_STRATEGY builds, where it can run, at small sizes."""
    out = {}
    for strategy in ("fused", "time blocks", "warp", "rows", "lanes"):
        os.environ["SSMC_CUDA_STRATEGY"] = strategy
        try:
            for key, value in cuda_sources(small_only=True).items():
                out[f"forced {strategy}: {key}"] = value
        finally:
            del os.environ["SSMC_CUDA_STRATEGY"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", metavar="BEFORE.json", help="list the kernels that differ from this snapshot")
    args = parser.parse_args()
    now = {**cuda_sources(), **forced_sources()}
    if not args.compare:
        json.dump(now, sys.stdout, indent=1, sort_keys=True)
        return 0
    with open(args.compare) as f:
        before = json.load(f)
    changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    for k in changed:
        print(f"{k}: {before.get(k, '-')} -> {now.get(k, '-')}")
    print(f"{len(changed)} of {len(before.keys() | now.keys())} kernels differ")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
