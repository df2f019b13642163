"""ssmc_wgmma: Hopper's warpgroup tensor-core product (``wgmma.mma_async``, sm_90a) as CUDA C, emulated off the GPU.

    text = header()      # the namespace below, for a kernel source that multiplies on sm_90a

A warpgroup (4 consecutive warps, the first at a warp index divisible by 4) computes
``D[64, N] (+)= A[64, 16] B[16, N]`` in fp32 from 16-bit operands. B, and A unless it is given in
registers, are read from shared memory through a 64-bit descriptor of one canonical layout:

    128-byte swizzle, 8-row groups 1024 bytes apart (SBO), rows of 64 16-bit values (128 bytes);
    byte offset of (row r, value c) in a 64-column block: 1024 (r / 8) + 128 (r % 8) + 2 c, with the
    16-byte chunk index (bits 4-6) XORed by r % 8 (bits 7-9) -- so each block must start 1024-aligned.

An operand wider than 64 values is stored as column blocks of 64, `LBO` bytes apart: K-major (the
reduced dim contiguous: Q, K for ``Q K^T``) reads a 16-value slice of one block, its start advanced by
32 bytes a k-step; MN-major (V for ``P V``, its N = the value dim contiguous) spans blocks along N with
LBO and advances 2048 bytes (16 rows) a k-step. `store_offset` is the writers' side of the same layout.

Per thread, the accumulators follow mma.sync's C layout a warp at a time: warp w of the group owns rows
16 w + [0, 16); lane (g, t) = (lane / 4, lane % 4) holds d[4 j + 2 h + c] = D[16 w + g + 8 h][8 j + 2 t + c].
An A operand in registers is four 32-bit words of mma.sync's A layout for the warp's 16 rows. An A operand
in shared memory is K-major, or MN-major (TRANS_A: the M dim contiguous, rows = k) as B's.

Off the GPU each thread computes its own accumulators from the same descriptors (decoded by the layout
above, the A registers gathered by shuffles), so the CPU emulator checks the kernels' descriptors and
layouts, not only their arithmetic; what it cannot check is that the hardware reads the layout as
described here (the GPU tests do). The emulator runs the GPU's own choice of instruction: `mma_ss` and
`mma_rs` pick the m64nNk16 wrapper of N (`SHAPES`) on both, each wrapper takes exactly its N / 2
accumulators a thread (a reference to the array: another size does not compile) and its emulation
computes its N columns. It computes a product at the `wait` that completes its commit group,
not at the issue (shared memory and the accumulators read then), so the emulated tests also check a
kernel's waits: an accumulator read before its wait, or a wait for too few groups, reads stale values.
"""

from __future__ import annotations

import functools

SHAPES = (64, 128, 256)  # the N of the m64nNk16 instructions printed (the PTX shapes: N = 8, 16, ... 256)


def _asm(n: int, regs_a: bool, bf16: bool) -> str:
    """One wgmma.mma_async wrapper for N = `n`, A in registers or shared memory."""
    t = "bf16" if bf16 else "f16"
    acc = ", ".join(f"%{i}" for i in range(n // 2))
    k = n // 2
    if regs_a:
        a_ops, b_op, p_op, nxt = f"{{%{k}, %{k + 1}, %{k + 2}, %{k + 3}}}", f"%{k + 4}", f"%{k + 5}", k + 6
        trans = f"%{nxt}, %{nxt + 1}, %{nxt + 2}"
        inputs = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(acc_in), "n"(1), "n"(1), "n"(TRANS_B)'
        args = "const unsigned a[4], unsigned long long desc_b"
    else:
        a_ops, b_op, p_op, nxt = f"%{k}", f"%{k + 1}", f"%{k + 2}", k + 3
        trans = f"%{nxt}, %{nxt + 1}, %{nxt + 2}, %{nxt + 3}"
        inputs = '"l"(desc_a), "l"(desc_b), "r"(acc_in), "n"(1), "n"(1), "n"(TRANS_A), "n"(TRANS_B)'
        args = "unsigned long long desc_a, unsigned long long desc_b"
    outputs = ", ".join(f'"+f"(d[{i}])' for i in range(n // 2))
    kind = "rs" if regs_a else "ss"
    tparams = "bool TRANS_B" if regs_a else "bool TRANS_A, bool TRANS_B"
    return f"""template <{tparams}> __device__ __forceinline__ void wgmma_{kind}_n{n}_{t}(float (&d)[{n // 2}], {args},
                                                                    int acc_in) {{
    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, {p_op}, 0;\\n"
                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t} {{{acc}}}, {a_ops}, {b_op}, p, {trans};\\n}}\\n"
                 : {outputs}
                 : {inputs});
}}
"""


def _emulated(n: int, regs_a: bool, bf16: bool) -> str:
    """The emulated instruction of `_asm`'s wrapper: the same name and parameters, a product of exactly N
    columns on the accumulators it is given (as the GPU's instruction writes N / 2 registers a thread)."""
    t = "bf16" if bf16 else "f16"
    b = "true" if bf16 else "false"
    if regs_a:
        return f"""template <bool TRANS_B> inline void wgmma_rs_n{n}_{t}(float (&d)[{n // 2}], const unsigned a[4],
        unsigned long long desc_b, int acc_in) {{
    issue<{n}, {b}, false, TRANS_B>(d, a, 0ull, desc_b, acc_in != 0);
}}
"""
    return f"""template <bool TRANS_A, bool TRANS_B> inline void wgmma_ss_n{n}_{t}(float (&d)[{n // 2}],
        unsigned long long desc_a, unsigned long long desc_b, int acc_in) {{
    issue<{n}, {b}, TRANS_A, TRANS_B>(d, nullptr, desc_a, desc_b, acc_in != 0);
}}
"""


def _dispatch() -> str:
    """`mma_ss` and `mma_rs`: the wrapper of N in `SHAPES`, and a compile error at any other N (no fallback to
    another instruction's N: its product would leave columns unwritten)."""
    known = " || ".join(f"N == {n}" for n in SHAPES)
    why = f'"an m64nNk16 wrapper of this N (wgmma.py\'s SHAPES: {", ".join(map(str, SHAPES))})"'

    def chain(call: str) -> str:
        return "    " + " else ".join(f"if constexpr (N == {n}) {{\n"
                                      f"        if constexpr (BF16) {call.format(n=n, t='bf16')};\n"
                                      f"        else {call.format(n=n, t='f16')};\n    }}" for n in SHAPES)

    return f"""template <int N, bool BF16, bool TRANS_A, bool TRANS_B>
__device__ __forceinline__ void mma_ss(float (&d)[N / 2], unsigned long long da, unsigned long long db, bool acc) {{
    static_assert({known}, {why});
{chain("wgmma_ss_n{n}_{t}<TRANS_A, TRANS_B>(d, da, db, acc)")}
}}
template <int N, bool BF16, bool TRANS_B>
__device__ __forceinline__ void mma_rs(float (&d)[N / 2], const unsigned a[4], unsigned long long db, bool acc) {{
    static_assert({known}, {why});
{chain("wgmma_rs_n{n}_{t}<TRANS_B>(d, a, db, acc)")}
}}"""


@functools.cache
def header() -> str:
    """The ssmc_wgmma namespace (module docstring): descriptors, the store layout, the instruction
    wrappers for N in `SHAPES` (bf16 and fp16, A in registers or shared memory) and their emulation, fences
    and theirs, and `mma_ss` / `mma_rs`, which pick a wrapper by N on the GPU and in the emulator alike."""
    shapes = [(n, regs, bf16) for n in SHAPES for regs in (False, True) for bf16 in (True, False)]
    gpu = "\n".join(_asm(*shape) for shape in shapes)
    emulated = "\n".join(_emulated(*shape) for shape in shapes)
    return (_HEADER.replace("@GPU_WRAPPERS@", gpu).replace("@EMULATED_WRAPPERS@", emulated)
            .replace("@DISPATCH@", _dispatch()))


_HEADER = r"""
#ifndef SSMC_WGMMA_CUH
#define SSMC_WGMMA_CUH
// wgmma on sm_90a, its emulation elsewhere (kernels/wgmma.py's docstring gives the layout)
namespace ssmc_wgmma {

#if !defined(__CUDA_ARCH__)
// the emulated block's shared memory base (1024-aligned): shared addresses are offsets from it
static thread_local const unsigned char* emulated_base = nullptr;
#endif

// a shared-memory byte address as the descriptors take it; `set_base` once a thread with the 1024-aligned
// base of the block's tiles (the emulator's addresses are offsets from it)
__device__ __forceinline__ void set_base(const void* base) {
#if !defined(__CUDA_ARCH__)
    emulated_base = static_cast<const unsigned char*>(base);
#else
    (void)base;
#endif
}

__device__ __forceinline__ unsigned smem_u32(const void* p) {
#if defined(__CUDA_ARCH__)
    return (unsigned)__cvta_generic_to_shared(p);
#else
    return (unsigned)(static_cast<const unsigned char*>(p) - emulated_base);
#endif
}

// byte offset of (row r, 16-byte chunk c) in a tile of column blocks of 64 values, `rows` rows a block
__device__ __forceinline__ int store_offset(int r, int c, int rows) {
    return (c >> 3) * rows * 128 + r * 128 + (((c & 7) ^ (r & 7)) << 4);
}

// a 128-byte-swizzled descriptor: start address, leading byte offset (column blocks), stride byte offset (8-row groups)
__device__ __forceinline__ unsigned long long desc(unsigned addr, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)((lbo >> 4) & 0x3FFFu) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}

#if defined(__CUDA_ARCH__)
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// generic-proxy writes (cp.async, st.shared) visible to the async proxy that wgmma reads through
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// keeps the compiler from moving reads of the accumulators above the wait
template <int M> __device__ __forceinline__ void hold(float (&d)[M]) {
#pragma unroll
    for (int i = 0; i < M; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

@GPU_WRAPPERS@
#else
__device__ __forceinline__ void fence() {}
__device__ __forceinline__ void fence_async_shared() {}
template <int M> __device__ __forceinline__ void hold(float (&)[M]) {}

// the 16-bit value at descriptor `dsc`'s (row-or-k `r`, column `c`) in the layout of the docstring
// (K-major: r = the M/N row, c = k < 16; MN-major: r = k, c = the N column over blocks of 64)
template <bool BF16> inline float decoded(unsigned long long dsc, int r, int c) {
    if ((dsc >> 62) != 1ull) __builtin_trap();  // only the 128-byte swizzle is laid out here
    const unsigned start = (unsigned)(dsc & 0x3FFFull) << 4, lbo = (unsigned)((dsc >> 16) & 0x3FFFull) << 4,
                   sbo = (unsigned)((dsc >> 32) & 0x3FFFull) << 4;
    unsigned off = start + (unsigned)(r / 8) * sbo + (unsigned)(r % 8) * 128u;
    off += (unsigned)(c / 64) * lbo + (unsigned)(c % 64) * 2u;
    off ^= ((off >> 7) & 7u) << 4;
    unsigned short bits;
    __builtin_memcpy(&bits, emulated_base + off, 2);
    return ssmc_mma::half_float<BF16>(bits);
}

// An issued product, computed when the wait that completes its commit group runs, as on the GPU, where the
// accumulators are defined only after that wait and the shared-memory operands may be read until it: A's
// registers are gathered at the issue (every lane shuffles then), B (and A from shared memory) and the
// accumulators are read at the wait. So a kernel that reads an accumulator before its wait, waits for too
// few groups, or overwrites an operand's shared memory before the wait gets wrong results here too.
struct Pending {
    void (*run)(const Pending&);
    float* d;
    float arow[2][16];
    unsigned long long da, db;
    bool regs_a, acc;
    int group;
};
struct Pendings { Pending ops[64]; int count, committed; };
static thread_local ssmc_emu::PerThread<Pendings> pendings;  // this thread's, as a thread_local per emulated thread

// one thread's share of D[64, N] (+)= A B: its rows 16 w + g (+ 8) and columns 8 j + 2 t (+ 1)
template <int N, bool BF16, bool TRANS_A, bool TRANS_B>
inline void complete(const Pending& op) {
    const int lane = (int)(threadIdx.x % 32), w = (int)(threadIdx.x / 32) % 4, g = lane / 4, t = lane % 4;
    float arow[2][16];
    for (int h = 0; h < 2; ++h) {
        for (int k = 0; k < 16; ++k) {
            const int m = 16 * w + g + 8 * h;
            arow[h][k] = op.regs_a ? op.arow[h][k] : TRANS_A ? decoded<BF16>(op.da, k, m) : decoded<BF16>(op.da, m, k);
        }
    }
    for (int j = 0; j < N / 8; ++j) {
        for (int c = 0; c < 2; ++c) {
            const int n = 8 * j + 2 * t + c;
            for (int h = 0; h < 2; ++h) {
                float sum = 0.0f;
                for (int k = 0; k < 16; ++k)
                    sum += arow[h][k] * (TRANS_B ? decoded<BF16>(op.db, k, n) : decoded<BF16>(op.db, n, k));
                float& x = op.d[4 * j + 2 * h + c];
                x = op.acc ? x + sum : sum;
            }
        }
    }
}

template <int N, bool BF16, bool TRANS_A, bool TRANS_B>
inline void issue(float* d, const unsigned* a, unsigned long long da, unsigned long long db, bool acc) {
    static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma's m64nNk16 shapes for 16-bit inputs: N = 8, 16, ... 256");
    const int lane = (int)(threadIdx.x % 32), g = lane / 4;
    Pending op{&complete<N, BF16, TRANS_A, TRANS_B>, d, {}, da, db, a != nullptr, acc, 0};
    for (int tp = 0; tp < 4; ++tp) {
        for (int e = 0; e < 4; ++e) {  // every lane shuffles alike (the emulator's shuffles are warp-wide)
            const unsigned word = __shfl_sync(0xffffffffu, a != nullptr ? a[e] : 0u, 4 * g + tp);
            if (a == nullptr) continue;
            const int h = e & 1, k = 2 * tp + 8 * (e >> 1);
            op.arow[h][k] = ssmc_mma::half_float<BF16>((unsigned short)(word & 0xffffu));
            op.arow[h][k + 1] = ssmc_mma::half_float<BF16>((unsigned short)(word >> 16));
        }
    }
    Pendings& q = *pendings;
    if (q.count == 64) __builtin_trap();  // more products in flight than any kernel issues between waits
    op.group = q.committed;  // the group the next commit closes
    q.ops[q.count++] = op;
}

__device__ __forceinline__ void commit() { ++pendings->committed; }

// every product of the groups committed before the latest N, computed in issue order
template <int N> __device__ __forceinline__ void wait() {
    Pendings& q = *pendings;
    int kept = 0;
    for (int i = 0; i < q.count; ++i) {
        if (q.ops[i].group < q.committed - N) q.ops[i].run(q.ops[i]);
        else q.ops[kept++] = q.ops[i];
    }
    q.count = kept;
}

// the GPU's wrappers emulated (`_emulated`): each computes its own N's columns
@EMULATED_WRAPPERS@
#endif

// D[64, N] (+)= A B by the wrapper of N: the one dispatch of the GPU and the emulator, so that the emulated
// tests run the instruction the GPU runs
@DISPATCH@

}  // namespace ssmc_wgmma
#endif
"""
