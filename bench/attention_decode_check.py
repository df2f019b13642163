"""Check and time ssmc's attention decode step (`ssmc.step` of an attention spec: append to the KV cache and
attend, one generated kernel) against torch's SDPA on the cache slice.

    python bench/attention_decode_check.py [--out DIR] [--calls N]

For B1, B16, B64 at H16 d128, bf16, caches holding 1024 and 8192 tokens (and issue 42's target, B8 H32 with
32768), two specs: causal (for the last
query: every key so far) and causal + ALiBi (a per-head slope param). A row: the cache filled with
random keys and values up to pos = L - 1, then the step at pos (q_t, k_t, v_t of [b h d]); its output
compared first with SDPA on the cache slice [:, :, :L] (ALiBi as an additive float bias, made once outside
the timing), the max |difference| / max |value|. Then the time of a step, each three ways: back to back
in eager Python (CUDA events around N calls; host time counts where a step is host-bound), its host time
per call, and replayed from a CUDA graph of one step (the kernel's time alone, near enough). The peer's
step is the append (two slice writes) plus SDPA, likewise eager and graphed. flash-attn's
`flash_attn_with_kvcache` is not among the peers (no flash-attn wheel in peers/, no network on the
device): not compared. Prints a markdown table; with --out, writes it to DIR/attention_decode.md.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent)]

import ssmc  # noqa: E402


def alibi(score, q_idx, kv_idx, slope: ssmc.Param["h"]):  # noqa: F821 (an axis name)
    return score - slope * (q_idx - kv_idx)


SPECS = {
    "causal": ssmc.attention(mask_mod=ssmc.causal, batch="b h", head_dim="d"),
    "alibi": ssmc.attention(score_mod=alibi, mask_mod=ssmc.causal, batch="b h", head_dim="d"),
}
# (batch, cache length, heads); the last: issue 42's decode target (Lq 1, KV 32768, B8 H32 d128)
SHAPES = [(b, length, 16) for length in (1024, 8192) for b in (1, 16, 64)] + [(8, 32768, 32)]
D = 128


def timed(fn, calls: int) -> tuple[float, float]:
    """(ms a call back to back, host ms a call) over `calls` calls after a warm-up."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / calls
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls, host


def graphed(fn, calls: int) -> float | str:
    """ms a replay of a CUDA graph of one call of `fn` (warmed up first), or why it could not be captured."""
    try:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / calls
    except Exception as err:  # a capture failure is a result to report, not a crash
        return f"no graph ({type(err).__name__}: {str(err)[:60]})"


def row(name: str, b: int, length: int, H: int, calls: int) -> str:
    gen = torch.Generator(device="cuda").manual_seed(b + length)
    s = ssmc.step(SPECS[name], backend="cuda", layout="b h t ...")
    cache = s.cache({"b": b, "h": H, "d": D}, max_len=length, dtype=torch.bfloat16, device="cuda")
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    pos = length - 1
    q, k, v = (torch.randn(b, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    slope = 2.0 ** (-8.0 * torch.arange(1, H + 1, device="cuda", dtype=torch.float32) / H)
    params = {"slope": slope} if name == "alibi" else {}
    out = torch.empty_like(q)

    def step():
        cache.length = pos
        s(q, k, v, cache, out=out, **params)

    step()
    torch.cuda.synchronize()
    assert s.kernel_reason is None, s.kernel_reason
    bias = None
    if name == "alibi":  # score - slope * (pos - j): an additive bias [H, 1, L], made once
        bias = (-slope[:, None, None] * (pos - torch.arange(length, device="cuda", dtype=torch.float32))).to(q.dtype)
    want = F.scaled_dot_product_attention(q[:, :, None], cache.k[:, :, :length], cache.v[:, :, :length],
                                          attn_mask=bias)[:, :, 0]
    err = float((out.float() - want.float()).abs().max() / want.float().abs().max())

    def peer():
        cache.k[:, :, pos] = k
        cache.v[:, :, pos] = v
        return F.scaled_dot_product_attention(q[:, :, None], cache.k[:, :, :length], cache.v[:, :, :length],
                                              attn_mask=bias)

    ms, host = timed(step, calls)
    peer_ms, _ = timed(peer, calls)
    g = graphed(step, calls)
    pg = graphed(peer, calls)
    gbytes = 2 * b * H * length * D * 2 / 1e9  # K and V read once

    def fmt(x):
        return f"{x:.4f}" if isinstance(x, float) else x
    bw = f"{gbytes / (g * 1e-3):.0f}" if isinstance(g, float) else "-"
    ratio = f"{pg / g:.2f}x" if isinstance(g, float) and isinstance(pg, float) else "-"
    return (f"| {name} B{b} H{H} L{length} | {err:.1e} | {ms:.4f} | {host:.4f} | {fmt(g)} | {bw} | {peer_ms:.4f} | "
            f"{fmt(pg)} | {peer_ms / ms:.2f}x | {ratio} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    lines = ["| attention decode d128 bf16 | rel err vs SDPA | ssmc ms / call | ssmc host ms | ssmc graph ms | "
             "GB/s (graph) | SDPA+append ms | SDPA graph ms | eager SDPA/ssmc | graph SDPA/ssmc |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    t0 = time.perf_counter()
    for name in SPECS:
        for b, length, heads in SHAPES:
            lines.append(row(name, b, length, heads, args.calls))
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    lines.append("")
    lines.append("flash-attn's flash_attn_with_kvcache: not available here (no flash-attn in peers/), not compared.")
    lines.append(f"total {time.perf_counter() - t0:.0f} s")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "attention_decode.md").write_text(text)


if __name__ == "__main__":
    main()
