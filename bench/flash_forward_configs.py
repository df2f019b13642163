"""Time each flash forward config (kernels/flash/forward.py `CONFIGS`) against the peers on a GPU.

    python bench/flash_forward_configs.py [--out DIR] [--small] [--configs bm64,bm128w8,bm128w4]

For the specs of bench/flash_check.py (causal, ALiBi, sliding window 512) at B4 H16 L4096 d128 and
B4 H16 L4096 d64 bf16 (--small: B2 H4 L1000 d64): per config, the forward kernel's output against the
64-row kernel's ("bm64") and the peer's (SDPA for causal, FlexAttention under torch.compile otherwise),
max abs error, then its time (`flash_check.timed`) and TFLOP/s over the visible pairs, and the peer's
time. Prints a markdown table (with --out, DIR/flash_forward_configs.md); exits non-zero where an error
is past 3e-2 (bf16 outputs of O(1)). Needs torch, triton and cupy; no network.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flash_check  # bench/flash_check.py: the specs, the peers, the timer

from ssmc.backends.cuda.kernels.flash import forward as flash
from ssmc.backends.tiled_attention import TiledAttention


def rows_for(name: str, b: int, h: int, length: int, d: int, configs: list[str]) -> list[dict]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    slope = 2.0 ** (-8.0 * torch.arange(1, h + 1, device="cuda", dtype=torch.float32) / h)
    program = flash_check.SPECS[name].program
    call = TiledAttention(program).bind(q, k, v, "b h t ...", {"slope": slope} if name == "alibi" else {})
    base, _ = flash.FlashForward(program, config="bm64")(call)
    if name == "causal":
        ref_name, ref = "SDPA", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        flex = flash_check.flex_reference(name, b, h, length, slope)
        ref_name, ref = ("FlexAttention", lambda: flex(q, k, v)) if flex is not None else ("none", None)
    want = ref() if ref is not None else None
    ms_ref = flash_check.timed(ref) if ref is not None else float("nan")
    flops = 4.0 * b * h * length * length * d * flash_check.visible_fraction(name, length)
    out = []
    for cfg in configs:
        fwd = flash.FlashForward(program, config=cfg)
        got, _ = fwd(call)
        err_base = (got.float() - base.float()).abs().max().item()
        err_ref = (got.float() - want.float()).abs().max().item() if want is not None else float("nan")
        ms = flash_check.timed(lambda fwd=fwd: fwd(call))
        out.append({"spec": name, "shape": f"B{b} H{h} L{length} d{d}", "config": cfg, "err_base": err_base,
                    "err_ref": err_ref, "ms": ms, "ref": ref_name, "ms_ref": ms_ref, "tflops": flops / ms / 1e9})
        print(f"{name} B{b} H{h} L{length} d{d} {cfg}: {ms:.3f} ms ({ref_name} {ms_ref:.3f}), err vs bm64 "
              f"{err_base:.2e}, vs {ref_name} {err_ref:.2e}", flush=True)
    return out


def table(rows: list[dict]) -> str:
    lines = ["| spec | shape | config | max abs err vs bm64 | vs ref | ms | TFLOP/s | ref | ref ms | ref / ms |",
             "|" + "---|" * 10]
    for r in rows:
        ratio = r["ms_ref"] / r["ms"] if math.isfinite(r["ms_ref"]) else float("nan")
        lines.append(f"| {r['spec']} | {r['shape']} | {r['config']} | {r['err_base']:.2e} | {r['err_ref']:.2e} | "
                     f"{r['ms']:.3f} | {r['tflops']:.1f} | {r['ref']} | {r['ms_ref']:.3f} | {ratio:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="folder to write flash_forward_configs.md to")
    parser.add_argument("--small", action="store_true", help="the small shape only")
    parser.add_argument("--configs", default=",".join(flash.CONFIGS), help="comma-separated config names")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in flash.CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}: expected some of {list(flash.CONFIGS)}")
    shapes = [(2, 4, 1000, 64)] if args.small else [(4, 16, 4096, 128), (4, 16, 4096, 64)]
    rows = [r for shape in shapes for name in flash_check.SPECS for r in rows_for(name, *shape, configs)]
    text = (f"# ssmc flash forward configs\n\n{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16; "
            "ref: SDPA (causal), FlexAttention under torch.compile (ALiBi, window); ref / ms > 1: ssmc faster.\n\n"
            + table(rows) + "\n")
    flash_check.config_report(text, args.out, "flash_forward_configs.md", rows, "err_base")


if __name__ == "__main__":
    main()
