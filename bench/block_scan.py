"""Block-level scans over time in shared memory: Hillis-Steele against Blelloch against the warp
shuffles ssmc generates, on the first-order scan ``h_t = a_t h_{t-1} + x_t`` (GPU).

A block of 256 threads owns one channel and walks its sequence in tiles of 256 x 4 steps. Each
thread reduces its 4 steps to one pair (A, X) (the tile's map from the carry in to the carry out:
h -> A h + X), the block scans the 256 pairs (exclusive; the pair before thread i composes steps
0 .. 4 i - 1 of the tile), and each thread replays its 4 steps from the carry so found:

    for tile in tiles:                               # a plain loop per channel
        pairs[i] = compose(step 4i, ..., step 4i + 3)          # registers
        before[i] = carry o pairs[0] o ... o pairs[i - 1]      # the block scan (what differs)
        h = before[i]; for j in 0..3: h = a[4i + j] h + x[4i + j]; out[4i + j] = h
        carry = before[255] o pairs[255]

The block scans compared (composition is associative, not commutative; "o" keeps time order):

- ``hillis``: Hillis-Steele in shared memory, 8 rounds over all 256 pairs (double-buffered, one
  barrier a round): 256 x 8 compositions, 8 barriers;
- ``blelloch``: Blelloch's up-sweep and down-sweep in shared memory, work-efficient (2 x 255
  compositions) but 16 rounds, most with few threads busy, 16 barriers;
- ``warp``: what ssmc's warp kernels do (codegen `_inclusive_lane_scan`, `_combine_across_warps`):
  `__shfl_up_sync` within each warp (5 rounds, no shared memory, no barrier), the 8 warps' totals
  through shared memory, folded by each warp over the warps before it: 2 barriers.

Outputs are checked against a float64 loop on the GPU first; times are medians of triton's do_bench
over fresh random inputs. B8 D2048 L4096 fp32, time contiguous ("b d t"), as TARGETS.md's scan.

    python bench/block_scan.py [--batch 8 --dim 2048 --length 4096] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import torch

THREADS = 256
STEPS = 4  # consecutive steps a thread owns in a tile: one float4 (the kernels assume 4)
TOL = 1e-4

SOURCE = r"""
struct Pair { float a, x; };  // the map h -> a h + x

// `first` then `second` (time order): h -> second.a (first.a h + first.x) + second.x
__device__ __forceinline__ Pair compose(Pair first, Pair second)
{
    return {first.a * second.a, second.a * first.x + second.x};
}

__device__ __forceinline__ Pair shfl_up(Pair p, int offset)
{
    return {__shfl_up_sync(0xffffffffu, p.a, offset), __shfl_up_sync(0xffffffffu, p.x, offset)};
}

// The exclusive scan of the block's pairs (THREADS of them, one a thread) into `before`, each
// variant below; `carry` composes everything before the tile and is the same in every thread.
__device__ __forceinline__ Pair scan_hillis(Pair mine, Pair carry, Pair (*buf)[THREADS])
{
    const int i = threadIdx.x;
    int in = 0;
    buf[0][i] = mine;
    __syncthreads();
    #pragma unroll
    for (int offset = 1; offset < THREADS; offset *= 2) {  // inclusive, double-buffered
        Pair p = buf[in][i];
        if (i >= offset) p = compose(buf[in][i - offset], p);
        buf[in ^ 1][i] = p;
        in ^= 1;
        __syncthreads();
    }
    const Pair before = i == 0 ? carry : compose(carry, buf[in][i - 1]);
    __syncthreads();  // every thread read buf before the next tile writes it
    return before;
}

__device__ __forceinline__ Pair scan_blelloch(Pair mine, Pair carry, Pair (*buf)[THREADS])
{
    Pair* s = buf[0];
    const int i = threadIdx.x;
    s[i] = mine;
    __syncthreads();
    #pragma unroll
    for (int stride = 1; stride < THREADS; stride *= 2) {  // up-sweep: s[k] composes its subtree
        const int k = (i + 1) * stride * 2 - 1;
        if (k < THREADS) s[k] = compose(s[k - stride], s[k]);
        __syncthreads();
    }
    if (i == 0) s[THREADS - 1] = carry;  // the identity, here the carry into the tile
    __syncthreads();
    #pragma unroll
    for (int stride = THREADS / 2; stride >= 1; stride /= 2) {  // down-sweep: what comes before
        const int k = (i + 1) * stride * 2 - 1;
        if (k < THREADS) {
            const Pair left = s[k - stride];
            s[k - stride] = s[k];
            s[k] = compose(s[k], left);
        }
        __syncthreads();
    }
    const Pair before = s[i];
    __syncthreads();
    return before;
}

__device__ __forceinline__ Pair scan_warp(Pair mine, Pair carry, Pair (*buf)[THREADS])
{
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    Pair p = mine;
    #pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {  // inclusive within the warp
        const Pair q = shfl_up(p, offset);
        if (lane >= offset) p = compose(q, p);
    }
    Pair* totals = buf[0];
    if (lane == 31) totals[w] = p;
    __syncthreads();
    Pair into = carry;  // the carry into this warp: the tile's carry, then the warps before it
    for (int v = 0; v < w; ++v) into = compose(into, totals[v]);
    const Pair prev = shfl_up(p, 1);
    const Pair before = lane == 0 ? into : compose(into, prev);
    __syncthreads();
    return before;
}

// One block a channel: out[c, t] = h_t for h_t = a[c, t] h_{t-1} + x[c, t], h_{-1} = 0. L % 4 == 0.
template <int VARIANT>
__device__ void scan_channels(const float* __restrict__ a, const float* __restrict__ x, float* __restrict__ out,
                              int L)
{
    __shared__ Pair buf[2][THREADS];
    const long long base = (long long)blockIdx.x * L;
    Pair carry = {1.f, 0.f};
    for (int t0 = 0; t0 < L; t0 += THREADS * STEPS) {
        const int t = t0 + threadIdx.x * STEPS;
        float4 va = make_float4(1.f, 1.f, 1.f, 1.f), vx = make_float4(0.f, 0.f, 0.f, 0.f);
        if (t < L) {
            va = *reinterpret_cast<const float4*>(a + base + t);
            vx = *reinterpret_cast<const float4*>(x + base + t);
        }
        Pair mine = {va.x, vx.x};
        mine = compose(mine, Pair{va.y, vx.y});
        mine = compose(mine, Pair{va.z, vx.z});
        mine = compose(mine, Pair{va.w, vx.w});
        const Pair before = VARIANT == 0 ? scan_hillis(mine, carry, buf)
                          : VARIANT == 1 ? scan_blelloch(mine, carry, buf)
                                         : scan_warp(mine, carry, buf);
        if (t < L) {
            float4 h;  // the carry before the tile is h = 0 composed: before.x
            h.x = va.x * before.x + vx.x;
            h.y = va.y * h.x + vx.y;
            h.z = va.z * h.y + vx.z;
            h.w = va.w * h.z + vx.w;
            *reinterpret_cast<float4*>(out + base + t) = h;
        }
        // the whole tile: the last thread's before composed with its own pair, shared by all
        if (threadIdx.x == THREADS - 1) buf[1][0] = compose(before, mine);
        __syncthreads();
        carry = buf[1][0];
        __syncthreads();
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) scan_hillis_k(const float* a, const float* x, float* out, int L)
{ scan_channels<0>(a, x, out, L); }
extern "C" __global__ void __launch_bounds__(THREADS) scan_blelloch_k(const float* a, const float* x, float* out, int L)
{ scan_channels<1>(a, x, out, L); }
extern "C" __global__ void __launch_bounds__(THREADS) scan_warp_k(const float* a, const float* x, float* out, int L)
{ scan_channels<2>(a, x, out, L); }
"""

VARIANTS = {"hillis": "scan_hillis_k", "blelloch": "scan_blelloch_k", "warp": "scan_warp_k"}


def source() -> str:
    return f"#define THREADS {THREADS}\n#define STEPS {STEPS}\n" + SOURCE


def build():
    """The three kernels by variant name (CuPy RawModule, NVRTC)."""
    import cupy

    module = cupy.RawModule(code=source(), options=("-std=c++17",), name_expressions=None)
    return {name: module.get_function(fn) for name, fn in VARIANTS.items()}


def reference(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """h_t = a_t h_{t-1} + x_t in float64, a plain loop over time (channels in parallel)."""
    a64, x64 = a.double(), x.double()
    h = torch.zeros(a.shape[:-1], dtype=torch.float64, device=a.device)
    out = torch.empty_like(a64)
    for t in range(a.shape[-1]):
        h = a64[..., t] * h + x64[..., t]
        out[..., t] = h
    return out


def inputs(B: int, D: int, L: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.rand((B, D, L), generator=g, device="cuda") * 0.2 + 0.8  # decays in (0.8, 1)
    x = torch.randn((B, D, L), generator=g, device="cuda")
    return a, x


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    args = ap.parse_args(argv)
    import cupy
    import triton

    B, D, L = args.batch, args.dim, args.length
    if L % STEPS:
        raise SystemExit(f"--length must be a multiple of {STEPS}")
    kernels = build()
    channels = B * D
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)  # torch's, as do_bench times it

    def launch(name, a, x, out):
        kernels[name]((channels,), (THREADS,), (a.data_ptr(), x.data_ptr(), out.data_ptr(), cupy.int32(L)),
                      stream=stream)

    a, x = inputs(B, D, L, 0)
    want = reference(a, x)
    rows = []
    for name in VARIANTS:
        out = torch.empty_like(a)
        launch(name, a, x, out)
        torch.cuda.synchronize()
        err = ((out.double() - want).norm() / want.norm()).item()
        if not err < TOL:
            raise SystemExit(f"{name}: relative error {err:.2e} against float64 (tolerance {TOL})")
        times = []
        for seed in (1, 2, 3):  # fresh inputs each time (the checked a, x stay for the next variant)
            ta, tx = inputs(B, D, L, seed)
            tout = torch.empty_like(ta)
            times.append(triton.testing.do_bench(lambda ta=ta, tx=tx, tout=tout, name=name: launch(name, ta, tx, tout),
                                                 warmup=25, rep=100))
        rows.append({"variant": name, "ms": sorted(times)[1], "rel_err": err})
    best = min(r["ms"] for r in rows)
    device = torch.cuda.get_device_name()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"block scans over time, B{B} D{D} L{L} fp32, {THREADS} threads x {STEPS} steps a tile, "
             f"{device}, {stamp}", "", "| block scan | ms | vs fastest | rel err |", "|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['ms']:.3f} | {best / r['ms']:.2f}x | {r['rel_err']:.1e} |" for r in rows]
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "block_scan.md").write_text("\n".join(lines) + "\n")
        (args.out / "block_scan.json").write_text(json.dumps({"device": device, "date": stamp, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
