"""Check, then time each flash backward config (kernels/flash/backward.py `CONFIGS`) in one run on a GPU.

    python bench/flash_backward_configs.py [--out DIR] [--configs wg,wgp] [--specs causal,alibi] [--small]
    python bench/flash_backward_configs.py --configs wgp,wgws,wgwsa,wgwss,wgwse --specs causal   # warp-specialized

For the specs of bench/flash_check.py (causal, ALiBi, sliding window 512) at B4 H16 L4096 d128 bf16 (and d64;
--small: B2 H4 L1000 d64), per config (``SSMC_CUDA_FLASH_BACKWARD_CONFIG``): a training step through
`ssmc.torch.function`'s autograd (the flash forward and backward kernels); its gradients of q, k, v against
the first config's and the peer's autograd (SDPA for causal, FlexAttention under torch.compile otherwise), as
max |error| / max |gradient|; then the step's time (`flash_check.timed`) and, from one profiled step, the GPU
time of the key-block kernel (``flash_bwd_*`` but the delta kernel), of the other flash kernels (forward,
delta) and of everything else (glue: torch's copies, fills, sums). Prints a markdown table (with --out,
DIR/flash_backward_configs.md); exits non-zero where an error is past 3e-2. Needs torch, triton and cupy.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flash_check  # bench/flash_check.py: the specs, the peers, the timer

import ssmc.torch
from ssmc.backends.cuda.kernels.flash import backward as flash_bwd


def kernel_split(step) -> tuple[float, float, float]:
    """GPU ms of one profiled call of `step` (after a warm-up): (the key-block backward kernel, the other
    flash kernels, everything else)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    timed = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    key = other = glue = 0.0
    for e in [e for e in timed if e.device_type == torch.autograd.DeviceType.CUDA] or timed:
        ms = e.self_device_time_total / 1e3
        if e.key.startswith("flash_bwd") and not e.key.startswith("flash_bwd_delta"):
            key += ms
        elif e.key.startswith("flash_"):
            other += ms
        else:
            glue += ms
    return key, other, glue


def rows_for(name: str, b: int, h: int, length: int, d: int, configs: list[str]) -> list[dict]:
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    slope = 2.0 ** (-8.0 * torch.arange(1, h + 1, device="cuda", dtype=torch.float32) / h)
    fn = ssmc.torch.function(flash_check.SPECS[name], layout="b h t ...")
    inputs = [q, k, v] + ([slope] if name == "alibi" else [])
    if name == "causal":
        ref_name = "SDPA"

        def ref(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        ref_name, ref = "FlexAttention", flash_check.flex_reference(name, b, h, length, slope)
    want = flash_check._grads(ref, [q, k, v], do) if ref is not None else None
    ms_ref = flash_check.timed(lambda: flash_check._grads(ref, [q, k, v], do)) if ref is not None else float("nan")
    out, first = [], None
    for cfg in configs:
        os.environ["SSMC_CUDA_FLASH_BACKWARD_CONFIG"] = cfg
        try:
            got = flash_check._grads(fn, inputs, do)
            if fn.tiled.flash_backward_reason is not None:
                raise SystemExit(f"{name}: the flash backward does not run: {fn.tiled.flash_backward_reason}")
            first = first or got
            err_first = flash_check._rel_err(got[:3], first[:3])
            err_ref = flash_check._rel_err(got[:3], want) if want is not None else float("nan")
            ms = flash_check.timed(lambda: flash_check._grads(fn, inputs, do))
            key, other, glue = kernel_split(lambda: flash_check._grads(fn, inputs, do))
        finally:
            del os.environ["SSMC_CUDA_FLASH_BACKWARD_CONFIG"]
        out.append({"spec": name, "shape": f"B{b} H{h} L{length} d{d}", "config": cfg, "err_first": err_first,
                    "err_ref": err_ref, "ms": ms, "key": key, "other": other, "glue": glue, "ref": ref_name,
                    "ms_ref": ms_ref})
        print(f"{name} B{b} H{h} L{length} d{d} {cfg}: step {ms:.3f} ms ({ref_name} {ms_ref:.3f}); GPU: key-block "
              f"{key:.3f}, other flash {other:.3f}, glue {glue:.3f} ms; err vs {configs[0]} {err_first:.2e}, "
              f"vs {ref_name} {err_ref:.2e}", flush=True)
    return out


def table(rows: list[dict], first: str) -> str:
    lines = [f"| spec | shape | config | grad err vs {first} | vs ref | step ms | key-block kernel ms | "
             "other flash ms | glue ms | ref | ref ms | ref / step |", "|" + "---|" * 12]
    for r in rows:
        ratio = r["ms_ref"] / r["ms"] if math.isfinite(r["ms_ref"]) else float("nan")
        lines.append(f"| {r['spec']} | {r['shape']} | {r['config']} | {r['err_first']:.2e} | {r['err_ref']:.2e} | "
                     f"{r['ms']:.3f} | {r['key']:.3f} | {r['other']:.3f} | {r['glue']:.3f} | {r['ref']} | "
                     f"{r['ms_ref']:.3f} | {ratio:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="folder to write flash_backward_configs.md to")
    parser.add_argument("--small", action="store_true", help="the small shape only")
    parser.add_argument("--configs", default="wg,wgp", help="comma-separated config names (the first: the base)")
    parser.add_argument("--specs", default=",".join(flash_check.SPECS),
                        help="comma-separated specs of bench/flash_check.py (ALiBi, window: FlexAttention compiles)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in flash_bwd.CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}: expected some of {list(flash_bwd.CONFIGS)}")
    specs = args.specs.split(",")
    if any(s not in flash_check.SPECS for s in specs):
        raise SystemExit(f"unknown specs in {specs}: expected some of {list(flash_check.SPECS)}")
    shapes = [(2, 4, 1000, 64)] if args.small else [(4, 16, 4096, 128), (4, 16, 4096, 64)]
    rows = [r for shape in shapes for name in specs for r in rows_for(name, *shape, configs)]
    text = (f"# ssmc flash backward configs\n\n{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, "
            f"dQ {os.environ.get('SSMC_CUDA_FLASH_DQ') or 'atomic'}; a training step (forward + backward) through "
            "ssmc.torch.function; ref: SDPA (causal), FlexAttention under torch.compile (ALiBi, window); "
            "ref / step > 1: ssmc faster.\n\n" + table(rows, configs[0]) + "\n")
    flash_check.config_report(text, args.out, "flash_backward_configs.md", rows, "err_first")


if __name__ == "__main__":
    main()
