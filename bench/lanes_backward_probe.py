"""A hand-written probe of the Mamba-1 backward as lanes (GPU): the kernel the generator should produce
next, checked against ssmc's gradients and timed against its fused backward in one run.

ssmc's forward runs Mamba-1 as the "lanes" kernel (backends/cuda/lanes.py: G lanes a row [b d], each
owning S values of n for the whole sequence, time in order, no scan); its backward is still the
state-major warp kernel (a warp a row, time across the lanes: per n and round a forward summary, a
scan, the carries, an adjoint summary, a reverse scan, the adjoint), about 80% of a training step.
This probe runs the backward the lanes way. A block holds R rows x G lanes; chunks of T steps go
last first; per chunk:

    stage u, delta, z, grad_y (rows) and B, C (along n) into shared memory
    pre    (block, rows x steps): dt = softplus(delta + bias), dt u, m0 = grad_y silu(z)
    lanes  from the state saved at the chunk's start (a forward that saves every chunk):
             the chunk's forward, the state kept at every G steps (T / G x S values a lane);
             then per G steps, last first, per state value: those G steps again (the carries
             h_{t-1}, the decays), the adjoint over them backwards:
                 lam = lam_next + m0 C;  grad_A += lam h_{t-1} e dt;  lam_next = lam e
                 sums over n (grad_dt's, grad_u's, y's for grad_z): one register a step, then
                     across the row's G lanes by a reduce-scatter
                 grad_B, grad_C terms (sums over d): across the warp's 8 rows by a reduce-scatter,
                     into a shared slab per warp
    block  the two warps' slabs added, one atomic add per (n, step) and block
    post   (block, rows x steps): grad_u, grad_delta, grad_z; grad_D, grad_delta_bias summed
           per thread, added atomically at the end (as grad_A)

Float32, layout "b d t" (time contiguous), L a multiple of T, D of R; the chunk states come from a
plain float32 loop here (a training forward would write them, as the lanes kernel writes its
rounds now). Prints each variant's registers, shared memory and time, and ssmc's training step's
kernels (its fused backward's time among them); exits non-zero where a variant disagrees.

Variants (`VARIANTS`): where a lane keeps the chunk's states (registers or shared memory), whether
the loops over a chunk's groups of G steps are unrolled, how many blocks an SM __launch_bounds__
asks for, and "lean" (dt u recomputed rather than staged, one slab for the block added to by shared
atomics: 37.6 KB of shared memory, so 6 blocks an SM). The first probe ("registers": 255 registers,
8 warps an SM, 1.45 waves at B8 D1536) ran as fast as the fused backward there, 1.30 ms on an H100,
and 2.1x faster at B32 D512 L192 (bench/results/2026-11-25-h100-lanes-backward-probe.md).

    python bench/lanes_backward_probe.py [--batch 8 --dim 1536 --length 2048] [--variant NAME]
"""

from __future__ import annotations

import argparse

import torch

G, S, N, R, T = 4, 4, 16, 16, 32  # lanes a row, n a lane, state size, rows a block, steps a chunk
TOL = 1e-4

SOURCE = r"""
#define G 4
#define S 4
#define N 16
#define R 16
#define T 32
#define P 36
#define BLOCK (R * G)
#define GROUPS (T / G)
// CKPT_SHARED, GROUP_UNROLL and MIN_BLOCKS come from the variant (VARIANTS below)
#if CKPT_SHARED
#define CK(gb, j) s_ck[gb][j][threadIdx.x]
#else
#define CK(gb, j) ck[gb][j]
#endif
#if LEAN  // dt u recomputed from the staged u; one slab for the block, added to by shared atomics
#define DTU(r, t) (p_dt[r][t] * s_u[r][t])
#define SLABS 1
#else
#define DTU(r, t) p_dtu[r][t]
#define SLABS 2
#endif
#if GROUP_UNROLL
#define GROUP_LOOP _Pragma("unroll")
#else
#define GROUP_LOOP _Pragma("unroll 1")
#endif

__device__ __forceinline__ float softplus_(float x) { return x > 20.f ? x : log1pf(__expf(x)); }
__device__ __forceinline__ float sigmoid_(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }

// The G lanes of a row each hold v[0 .. G-1], one value a step; lane g gets the row's sum of v[g].
__device__ __forceinline__ float row_sum_scatter(float* v, int g)
{
    #pragma unroll
    for (int w = G / 2; w >= 1; w /= 2) {
        const bool upper = g & w;
        #pragma unroll
        for (int j = 0; j < w; ++j) {
            const float send = upper ? v[j] : v[j + w];
            const float keep = upper ? v[j + w] : v[j];
            v[j] = keep + __shfl_xor_sync(0xffffffffu, send, w);
        }
    }
    return v[0];
}

extern "C" __global__ void __launch_bounds__(BLOCK, MIN_BLOCKS) mamba1_lanes_backward(
    int L, int Bn, int Dn,
    const float* __restrict__ u, const float* __restrict__ delta, const float* __restrict__ z,
    const float* __restrict__ gy, const float* __restrict__ Bm, const float* __restrict__ Cm,
    const float* __restrict__ A, const float* __restrict__ Dp, const float* __restrict__ bias,
    const float* __restrict__ chunks, const float* __restrict__ init_gh,
    float* __restrict__ g_u, float* __restrict__ g_delta, float* __restrict__ g_z,
    float* __restrict__ g_B, float* __restrict__ g_C, float* __restrict__ g_A, float* __restrict__ g_D,
    float* __restrict__ g_bias, float* __restrict__ g_h0)
{
    __shared__ __align__(16) float s_u[R][P], s_delta[R][P], s_z[R][P], s_gy[R][P];
    __shared__ __align__(16) float s_B[N][P], s_C[N][P];
    __shared__ __align__(16) float p_dt[R][P], p_m0[R][P];
#if !LEAN
    __shared__ __align__(16) float p_dtu[R][P];
#endif
    __shared__ __align__(16) float p_s6[R][P], p_s7[R][P], p_s15[R][P];
    __shared__ __align__(16) float slab[SLABS][2][N][T];  // [warp][grad_B or grad_C][n][step]: over the warp's rows
#if CKPT_SHARED
    __shared__ float s_ck[GROUPS][S][BLOCK];  // the chunk's states every G steps, each thread its own column
#endif
    const int ch = threadIdx.x / G, g = threadIdx.x % G, lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const int row_blocks = Dn / R;
    const int b = blockIdx.x / row_blocks, r0 = (blockIdx.x % row_blocks) * R, d = r0 + ch;
    float rpA[S], Araw[S], lam[S], gA[S];
    #pragma unroll
    for (int j = 0; j < S; ++j) {
        const int n = g + j * G;
        Araw[j] = A[d * N + n];
        rpA[j] = Araw[j] * 1.4426950408889634f;
        lam[j] = init_gh[((long long)b * Dn + d) * N + n];
        gA[j] = 0.f;
    }
    float accD[2] = {0.f, 0.f}, accBias[2] = {0.f, 0.f};  // this thread's post rows: tid / 8 + 8 k
    for (int c = L / T - 1; c >= 0; --c) {
        const int t0 = c * T;
        __syncthreads();  // the chunk after is done with the staging
        #pragma unroll
        for (int k = 0; k < R * T / 4 / BLOCK; ++k) {
            const int i = threadIdx.x + k * BLOCK, r = i / (T / 4), t4 = (i % (T / 4)) * 4;
            const long long off = ((long long)b * Dn + r0 + r) * L + t0 + t4;
            *reinterpret_cast<float4*>(&s_u[r][t4]) = *reinterpret_cast<const float4*>(u + off);
            *reinterpret_cast<float4*>(&s_delta[r][t4]) = *reinterpret_cast<const float4*>(delta + off);
            *reinterpret_cast<float4*>(&s_z[r][t4]) = *reinterpret_cast<const float4*>(z + off);
            *reinterpret_cast<float4*>(&s_gy[r][t4]) = *reinterpret_cast<const float4*>(gy + off);
        }
        #pragma unroll
        for (int k = 0; k < N * T / 4 / BLOCK; ++k) {
            const int i = threadIdx.x + k * BLOCK, s = i / (T / 4), t4 = (i % (T / 4)) * 4;
            const long long off = ((long long)b * N + s) * L + t0 + t4;
            *reinterpret_cast<float4*>(&s_B[s][t4]) = *reinterpret_cast<const float4*>(Bm + off);
            *reinterpret_cast<float4*>(&s_C[s][t4]) = *reinterpret_cast<const float4*>(Cm + off);
        }
#if LEAN
        for (int i = threadIdx.x; i < 2 * N * T; i += BLOCK) (&slab[0][0][0][0])[i] = 0.f;
#endif
        __syncthreads();
        #pragma unroll 4
        for (int i = threadIdx.x; i < R * T; i += BLOCK) {  // pre: per row and step
            const int r = i / T, tt = i % T;
            const float dt = softplus_(s_delta[r][tt] + bias[r0 + r]);
            p_dt[r][tt] = dt;
#if !LEAN
            p_dtu[r][tt] = dt * s_u[r][tt];
#endif
            const float zz = s_z[r][tt];
            p_m0[r][tt] = s_gy[r][tt] * zz * sigmoid_(zz);
        }
        __syncthreads();
        // the chunk's forward, its state kept every G steps
        float h[S];
#if !CKPT_SHARED
        float ck[GROUPS][S];
#endif
        #pragma unroll
        for (int j = 0; j < S; ++j) h[j] = chunks[(((long long)c * Bn + b) * Dn + d) * N + g + j * G];
        GROUP_LOOP
        for (int gb = 0; gb < GROUPS; ++gb) {
            float dt[G], dtu[G];
            #pragma unroll
            for (int tt = 0; tt < G; ++tt) { dt[tt] = p_dt[ch][gb * G + tt]; dtu[tt] = DTU(ch, gb * G + tt); }
            #pragma unroll
            for (int j = 0; j < S; ++j) {
                CK(gb, j) = h[j];
                const int n = g + j * G;
                #pragma unroll
                for (int tt = 0; tt < G; ++tt) h[j] = exp2f(dt[tt] * rpA[j]) * h[j] + dtu[tt] * s_B[n][gb * G + tt];
            }
        }
        // the adjoint, G steps at a time, last first
        GROUP_LOOP
        for (int gb = GROUPS - 1; gb >= 0; --gb) {
            float dt[G], dtu[G], m0[G], s6[G], s7[G], s15[G];
            #pragma unroll
            for (int tt = 0; tt < G; ++tt) {
                dt[tt] = p_dt[ch][gb * G + tt];
                dtu[tt] = DTU(ch, gb * G + tt);
                m0[tt] = p_m0[ch][gb * G + tt];
                s6[tt] = s7[tt] = s15[tt] = 0.f;
            }
            #pragma unroll
            for (int j = 0; j < S; ++j) {
                const int n = g + j * G;
                float Bv[G], Cv[G], hp[G], e[G];
                float hh = CK(gb, j);
                #pragma unroll
                for (int tt = 0; tt < G; ++tt) {
                    Bv[tt] = s_B[n][gb * G + tt];
                    Cv[tt] = s_C[n][gb * G + tt];
                    e[tt] = exp2f(dt[tt] * rpA[j]);
                    hp[tt] = hh;
                    hh = e[tt] * hh + dtu[tt] * Bv[tt];
                }
                float v[2 * G];  // grad_B terms, then grad_C terms, of the G steps
                #pragma unroll
                for (int tt = G - 1; tt >= 0; --tt) {
                    const float ht = e[tt] * hp[tt] + dtu[tt] * Bv[tt];
                    const float lm = lam[j] + m0[tt] * Cv[tt];
                    const float m3 = lm * hp[tt] * e[tt];
                    gA[j] += m3 * dt[tt];
                    s6[tt] += lm * Bv[tt];
                    s7[tt] += m3 * Araw[j];
                    s15[tt] += ht * Cv[tt];
                    v[tt] = lm * dtu[tt];
                    v[G + tt] = m0[tt] * ht;
                    lam[j] = lm * e[tt];
                }
                // over the warp's 8 rows (lane bits 4, 3, 2): each lane keeps one of the 8 sums
                #pragma unroll
                for (int m = 16, half = G; m >= 4; m /= 2, half /= 2) {
                    const bool upper = lane & m;
                    #pragma unroll
                    for (int q = 0; q < half; ++q) {
                        const float send = upper ? v[q] : v[q + half];
                        const float keep = upper ? v[q + half] : v[q];
                        v[q] = keep + __shfl_xor_sync(0xffffffffu, send, m);
                    }
                }
                const int which = ((lane >> 4) & 1) * 4 + ((lane >> 3) & 1) * 2 + ((lane >> 2) & 1);
#if LEAN
                atomicAdd(&slab[0][which / G][n][gb * G + which % G], v[0]);
#else
                slab[w][which / G][n][gb * G + which % G] = v[0];
#endif
            }
            p_s6[ch][gb * G + g] = row_sum_scatter(s6, g);
            p_s7[ch][gb * G + g] = row_sum_scatter(s7, g);
            p_s15[ch][gb * G + g] = row_sum_scatter(s15, g);
        }
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < 2 * N * T / 4 / BLOCK; ++k) {  // grad_B, grad_C: the block's two warps added
            const int i = threadIdx.x + k * BLOCK, arr = i / (N * T / 4), rem = i % (N * T / 4);
            const int n = rem / (T / 4), t4 = (rem % (T / 4)) * 4;
            const float4 a0 = *reinterpret_cast<const float4*>(&slab[0][arr][n][t4]);
            const float4 a1 = SLABS == 2 ? *reinterpret_cast<const float4*>(&slab[SLABS - 1][arr][n][t4])
                                         : make_float4(0.f, 0.f, 0.f, 0.f);
            float* dst = (arr ? g_C : g_B) + ((long long)b * N + n) * L + t0 + t4;
            atomicAdd(dst, a0.x + a1.x);
            atomicAdd(dst + 1, a0.y + a1.y);
            atomicAdd(dst + 2, a0.z + a1.z);
            atomicAdd(dst + 3, a0.w + a1.w);
        }
        #pragma unroll
        for (int k = 0; k < R * T / 4 / BLOCK; ++k) {  // post: 4 steps of a row a thread
            const int i = threadIdx.x + k * BLOCK, r = i / (T / 4), t4 = (i % (T / 4)) * 4;
            const float Dd = Dp[r0 + r], bd = bias[r0 + r];
            float ou[4], od[4], oz[4];
            #pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int tt = t4 + q;
                const float dt = p_dt[r][tt], m0 = p_m0[r][tt], uu = s_u[r][tt], zz = s_z[r][tt];
                const float s6 = p_s6[r][tt], s7 = p_s7[r][tt], s15 = p_s15[r][tt];
                ou[q] = s6 * dt + m0 * Dd;
                od[q] = (s6 * uu + s7) * sigmoid_(s_delta[r][tt] + bd);
                const float sg = sigmoid_(zz);
                oz[q] = s_gy[r][tt] * (s15 + Dd * uu) * ((1.f + zz - zz * sg) * sg);
                accD[k] += m0 * uu;
                accBias[k] += od[q];
            }
            const long long off = ((long long)b * Dn + r0 + r) * L + t0 + t4;
            *reinterpret_cast<float4*>(g_u + off) = make_float4(ou[0], ou[1], ou[2], ou[3]);
            *reinterpret_cast<float4*>(g_delta + off) = make_float4(od[0], od[1], od[2], od[3]);
            *reinterpret_cast<float4*>(g_z + off) = make_float4(oz[0], oz[1], oz[2], oz[3]);
        }
    }
    #pragma unroll
    for (int k = 0; k < R * T / 4 / BLOCK; ++k) {
        const int r = (threadIdx.x + k * BLOCK) / (T / 4);
        atomicAdd(g_D + r0 + r, accD[k]);
        atomicAdd(g_bias + r0 + r, accBias[k]);
    }
    #pragma unroll
    for (int j = 0; j < S; ++j) {
        const int n = g + j * G;
        atomicAdd(g_A + d * N + n, gA[j]);
        g_h0[((long long)b * Dn + d) * N + n] = lam[j];
    }
}
"""


# Where a lane keeps the chunk's states (one every G steps, GROUPS x S values) and how the kernel is
# bounded. "registers" is the first probe (255 registers, 4 blocks an SM, 1.45 waves at B8 D1536 on
# an H100); the others keep them in shared memory (8 KiB a block), their loops over the chunk's
# groups rolled or not, with __launch_bounds__ asking for 6 or 8 blocks an SM (<= 168 / 128 registers).
VARIANTS = {
    "registers": {"CKPT_SHARED": 0, "GROUP_UNROLL": 1, "MIN_BLOCKS": 1, "LEAN": 0},
    "shared": {"CKPT_SHARED": 1, "GROUP_UNROLL": 1, "MIN_BLOCKS": 1, "LEAN": 0},
    "shared-rolled": {"CKPT_SHARED": 1, "GROUP_UNROLL": 0, "MIN_BLOCKS": 1, "LEAN": 0},
    "shared-rolled-6": {"CKPT_SHARED": 1, "GROUP_UNROLL": 0, "MIN_BLOCKS": 6, "LEAN": 0},
    "lean-rolled-6": {"CKPT_SHARED": 1, "GROUP_UNROLL": 0, "MIN_BLOCKS": 6, "LEAN": 1},
    "shared-rolled-8": {"CKPT_SHARED": 1, "GROUP_UNROLL": 0, "MIN_BLOCKS": 8, "LEAN": 0},
    "lean-6": {"CKPT_SHARED": 1, "GROUP_UNROLL": 1, "MIN_BLOCKS": 6, "LEAN": 1},
}


def source(variant: str) -> str:
    """The probe's CUDA source for one of `VARIANTS`."""
    return "".join(f"#define {k} {v}\n" for k, v in VARIANTS[variant].items()) + SOURCE


def build(variant: str):
    import cupy

    return cupy.RawModule(code=source(variant), options=("-std=c++17",)).get_function("mamba1_lanes_backward")


def inputs(B: int, D: int, L: int, seed: int) -> dict:
    """Mamba-1's inputs as bench/workloads/diagonal.py draws them (layout "b d t"; B, C [b n t])."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda")

    return {"u": r(B, D, L), "delta": 0.5 * r(B, D, L), "A": -torch.exp(0.5 * r(D, N)), "B": r(B, N, L),
            "C": r(B, N, L), "D": r(D), "z": r(B, D, L), "delta_bias": torch.rand(D, generator=g, device="cuda") - 2}


def chunk_states(x: dict) -> torch.Tensor:
    """The state before every T-th step, [L / T, b, d, n]: what a training forward would save."""
    dt = torch.nn.functional.softplus(x["delta"] + x["delta_bias"][:, None])  # [b d t]
    B, D, L = dt.shape
    h = torch.zeros(B, D, N, device="cuda")
    out = torch.empty(L // T, B, D, N, device="cuda")
    for t in range(L):
        if t % T == 0:
            out[t // T] = h
        step_in = (dt[:, :, t] * x["u"][:, :, t])[:, :, None] * x["B"][:, None, :, t]  # dt u B: [b d n]
        h = torch.exp(dt[:, :, t, None] * x["A"]) * h + step_in
    return out


class Probe:
    """The probe's launch with its output buffers (the summed ones zeroed per call, as a step would)."""

    def __init__(self, kernel, x: dict, dy: torch.Tensor, chunks: torch.Tensor):
        import cupy

        self.kernel, self.x, self.dy, self.chunks = kernel, x, dy, chunks
        B, D, L = x["u"].shape
        self.shape = (B, D, L)
        self.init_gh = torch.zeros(B, D, N, device="cuda")
        self.stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def __call__(self) -> dict:
        import cupy

        B, D, L = self.shape
        x = self.x
        grads = {k: torch.empty_like(x[k]) for k in ("u", "delta", "z")}
        grads |= {k: torch.zeros_like(x[k]) for k in ("B", "C", "A", "D", "delta_bias")}
        grads["h0"] = torch.empty(B, D, N, device="cuda")
        args = [x["u"], x["delta"], x["z"], self.dy, x["B"], x["C"], x["A"], x["D"], x["delta_bias"], self.chunks,
                self.init_gh] + [grads[k] for k in ("u", "delta", "z", "B", "C", "A", "D", "delta_bias", "h0")]
        self.kernel((B * (D // R),), (R * G,), (cupy.int32(L), cupy.int32(B), cupy.int32(D),
                                                *(a.data_ptr() for a in args)), stream=self.stream)
        return grads


def kernel_times(fn, reps: int = 20) -> dict[str, float]:
    """Mean GPU time per call of each kernel `fn` launches (torch.profiler), ms."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.device_time_total / reps / 1000 for e in prof.key_averages() if e.device_type.name == "CUDA"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--variant", default="all", choices=["all", *VARIANTS],
                    help="where the chunk's states live and how the kernel is bounded (VARIANTS)")
    args = ap.parse_args(argv)
    import triton

    import ssmc
    from ssmc.examples import mamba1

    B, D, L = args.batch, args.dim, args.length
    if L % T or D % R:
        raise SystemExit(f"the probe takes lengths of whole chunks ({T}) and channels of whole blocks ({R})")
    grad = ssmc.grad(mamba1.SPEC, "cuda", layout="b d t")
    names = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias"]
    checked = inputs(B, D, L, 0)
    dy = torch.randn(B, D, L, device="cuda")
    want = grad(**checked, grad_outputs=dy)
    checked_chunks = chunk_states(checked)
    x = inputs(B, D, L, 1)  # fresh inputs for the timings
    chunks = chunk_states(x)
    device = torch.cuda.get_device_name()
    print(f"Mamba-1 B{B} D{D} L{L} N{N} fp32, {device}")
    failed = []
    for variant in VARIANTS if args.variant == "all" else [args.variant]:
        kernel = build(variant)
        got = Probe(kernel, checked, dy, checked_chunks)()
        torch.cuda.synchronize()
        error = max(((got[k] - want[k]).norm() / want[k].norm()).item() for k in names)
        if not error < TOL:
            print(f"{variant}: relative error {error:.1e} against ssmc's gradients (tolerance {TOL}): not timed")
            failed.append(variant)
            continue
        probe = Probe(kernel, x, dy, chunks)
        t_probe = triton.testing.do_bench(probe, warmup=50, rep=200)
        t_kernel = kernel_times(probe).get("mamba1_lanes_backward", float("nan"))
        print(f"{variant}: {kernel.num_regs} registers, {kernel.shared_size_bytes} B shared; kernel {t_kernel:.3f} ms, "
              f"with the zero fills {t_probe:.3f} ms; largest relative error {error:.1e}")
    step = lambda: grad(**x, grad_outputs=dy)  # noqa: E731
    t_step = triton.testing.do_bench(step, warmup=50, rep=200)
    kernels = kernel_times(step)
    print(f"ssmc training step (forward + fused backward): {t_step:.3f} ms; its kernels: "
          + ", ".join(f"{k[:40]} {v:.3f}" for k, v in kernels.items()))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
