// Tensor-core tiles for generated kernels: the warp-wide product D[16x8] += A[16x16] B[16x8] of
// 16-bit inputs (bf16 or fp16) with float accumulators, as PTX's mma.sync.m16n8k16, and the raw
// 16-bit conversions the kernels store their tiles in.
//
// On sm_80+ the product is one `mma.sync` instruction. Elsewhere (the CPU emulator,
// backends/cuda/emulator.py, where __CUDA_ARCH__ is undefined) the same fragments are multiplied
// through shuffles, lane by lane, so a kernel's indexing of its fragments is tested without a GPU.
//
// Fragments (PTX ISA, "mma.m16n8k16"), with g = lane / 4 and q = lane % 4, two 16-bit values per
// 32-bit register, the lower half first:
//   A (row-major 16x16): a[0] = A[g][2q, 2q+1]      a[1] = A[g+8][2q, 2q+1]
//                        a[2] = A[g][2q+8, 2q+9]    a[3] = A[g+8][2q+8, 2q+9]
//   B (16x8, k by n):    b[0] = B[2q, 2q+1][g]      b[1] = B[2q+8, 2q+9][g]
//   C, D (16x8 float):   d[0], d[1] = D[g][2q, 2q+1]    d[2], d[3] = D[g+8][2q, 2q+1]
// and D[16x8] += A[16x8] B[8x8] of tf32 inputs (fp32 bit patterns of which the product reads the upper 19
// bits: sign, exponent, 10 bits of mantissa), as mma.sync.m16n8k8.tf32, one value a register:
//   A (row-major 16x8):  a[0] = A[g][q]   a[1] = A[g+8][q]   a[2] = A[g][q+4]   a[3] = A[g+8][q+4]
//   B (8x8, k by n):     b[0] = B[q][g]   b[1] = B[q+4][g]
//   C, D as above.
// NVRTC has no system headers: nothing here includes any.
#pragma once

namespace ssmc_mma {

// bf16: the upper 16 bits of a float, rounded to nearest even (NaN kept quiet)
__device__ __forceinline__ unsigned short bf16_bits(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ float bf16_float(unsigned short h) { return __uint_as_float((unsigned)h << 16); }

// fp16 (IEEE binary16), round to nearest even; subnormals and overflow to infinity handled
__device__ __forceinline__ unsigned short fp16_bits(float x) {
    const unsigned u = __float_as_uint(x);
    const unsigned sign = (u >> 16) & 0x8000u;
    const unsigned absu = u & 0x7fffffffu;
    if (absu > 0x7f800000u) return (unsigned short)(sign | 0x7e00u);   // NaN
    if (absu >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // rounds past 65504: inf
    if (absu < 0x38800000u) {                                          // subnormal half (or zero)
        const float m = __uint_as_float(absu) * 16777216.0f;           // x * 2^24: the half's units
        const unsigned r = (unsigned)__float2int_rn(m);
        return (unsigned short)(sign | r);
    }
    unsigned v = absu - 0x38000000u;  // rebias the exponent 127 -> 15
    v += 0xfffu + ((v >> 13) & 1u);
    return (unsigned short)(sign | (v >> 13));
}
__device__ __forceinline__ float fp16_float(unsigned short h) {
    const unsigned sign = ((unsigned)h & 0x8000u) << 16;
    const unsigned e = ((unsigned)h >> 10) & 0x1fu, m = (unsigned)h & 0x3ffu;
    if (e == 0) return __uint_as_float(sign) + (sign ? -1.0f : 1.0f) * (float)m * 5.9604644775390625e-08f;
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

// two 16-bit values in one register, `lo` in the lower half (the fragments' order)
__device__ __forceinline__ unsigned pack(unsigned short lo, unsigned short hi) {
    return (unsigned)lo | ((unsigned)hi << 16);
}

template <bool BF16> __device__ __forceinline__ float half_float(unsigned short h) {
    return BF16 ? bf16_float(h) : fp16_float(h);
}
template <bool BF16> __device__ __forceinline__ unsigned short float_half(float x) {
    return BF16 ? bf16_bits(x) : fp16_bits(x);
}

// two floats rounded to the 16-bit type in one register, `lo` in the lower half: one cvt on sm_80+ (round to
// nearest even, as the portable conversion)
template <bool BF16> __device__ __forceinline__ unsigned pack2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned r;
    if (BF16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return pack(float_half<BF16>(lo), float_half<BF16>(hi));
#endif
}

#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
// the emulations' gather (mma_16816, mma_1688, where no mma.sync): lane (g, q) takes, from lane g*4 + j, A's
// registers of rows g and g+8, and from lanes (2q)*4 + j and (2q+1)*4 + j, B's registers of columns 2q, 2q+1
__device__ __forceinline__ void emulated_gather(const unsigned a[4], const unsigned b[2], int j, unsigned ra[4],
                                                unsigned rb0[2], unsigned rb1[2]) {
    const int lane = (int)(threadIdx.x % 32), g = lane / 4, q = lane % 4;
    for (int r = 0; r < 4; ++r) ra[r] = __shfl_sync(0xffffffffu, a[r], g * 4 + j);
    for (int r = 0; r < 2; ++r) {
        rb0[r] = __shfl_sync(0xffffffffu, b[r], (2 * q) * 4 + j);
        rb1[r] = __shfl_sync(0xffffffffu, b[r], (2 * q + 1) * 4 + j);
    }
}
#endif

// d += A B for one warp (the fragments above); every lane of the warp calls it, converged
template <bool BF16> __device__ __forceinline__ void mma_16816(float d[4], const unsigned a[4], const unsigned b[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if (BF16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    }
#else
    // the emulator: lane (g, q) gathers row g and g+8 of A and columns 2q, 2q+1 of B, k pair by k pair.
    // A[g][2j, 2j+1] (and +8 along k) lives in lane g*4 + j; B[2j, 2j+1][n] in lane n*4 + j.
    for (int j = 0; j < 4; ++j) {
        unsigned ra[4], rb0[2], rb1[2];
        emulated_gather(a, b, j, ra, rb0, rb1);
        for (int kh = 0; kh < 2; ++kh) {          // k in [0, 8) then [8, 16)
            for (int s = 0; s < 2; ++s) {         // the lower then the upper 16 bits: k = 2j + s
                const int shift = 16 * s;
                const float a_top = half_float<BF16>((unsigned short)(ra[2 * kh] >> shift));
                const float a_bot = half_float<BF16>((unsigned short)(ra[2 * kh + 1] >> shift));
                const float b0 = half_float<BF16>((unsigned short)(rb0[kh] >> shift));
                const float b1 = half_float<BF16>((unsigned short)(rb1[kh] >> shift));
                d[0] += a_top * b0;
                d[1] += a_top * b1;
                d[2] += a_bot * b0;
                d[3] += a_bot * b1;
            }
        }
    }
#endif
}

// x rounded to tf32 (to nearest, ties away from zero: cvt.rna.tf32.f32), as fp32 bits whose lower 13 are zero
__device__ __forceinline__ unsigned tf32_bits(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
#else
    const unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u) return u;  // inf and NaN as they are
    return (u + 0x1000u) & 0xffffe000u;
#endif
}

// d += A B for one warp (tf32 fragments above); every lane of the warp calls it, converged
__device__ __forceinline__ void mma_1688(float d[4], const unsigned a[4], const unsigned b[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    // the emulator: lane (g, q) gathers rows g and g+8 of A and columns 2q, 2q+1 of B, k by k (the inputs'
    // lower 13 bits dropped, as the tensor cores read them; a product of two tf32 values is exact in fp32).
    // A[g][k] lives in lane g*4 + k % 4 (a[0] for k < 4, a[2] past), A[g+8][k] likewise in a[1] / a[3];
    // B[k][n] in lane n*4 + k % 4 (b[0] for k < 4, b[1] past).
    for (int j = 0; j < 4; ++j) {
        unsigned ra[4], rb0[2], rb1[2];
        emulated_gather(a, b, j, ra, rb0, rb1);
        for (int kh = 0; kh < 2; ++kh) {  // k = j, then j + 4
            const float a_top = __uint_as_float(ra[2 * kh] & 0xffffe000u);
            const float a_bot = __uint_as_float(ra[2 * kh + 1] & 0xffffe000u);
            const float b0 = __uint_as_float(rb0[kh] & 0xffffe000u);
            const float b1 = __uint_as_float(rb1[kh] & 0xffffe000u);
            d[0] += a_top * b0;
            d[1] += a_top * b1;
            d[2] += a_bot * b0;
            d[3] += a_bot * b1;
        }
    }
#endif
}

// ldmatrix from shared memory (sm_80+): the warp loads N (1, 2 or 4) 8x8 tiles M_i of 16-bit values; lane l
// gives the address of row l % 8 of M_i, i = l / 8 (rows 16-byte aligned; lanes past 8N: any valid address);
// lane (g, q) = (l / 4, l % 4) gets r[i] = M_i[g][2q, 2q+1], or with TRANS M_i[2q][g], M_i[2q+1][g] (a B
// fragment of a tile stored k-major). One instruction for what would be 2N scalar shared loads and their
// addresses a lane. Off the GPU, through shuffles of the row addresses.
template <int N, bool TRANS> __device__ __forceinline__ void ldsm(unsigned r[N], const unsigned short* p) {
    static_assert(N == 1 || N == 2 || N == 4, "ldmatrix loads 1, 2 or 4 tiles");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    if (N == 4 && TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 { %0, %1, %2, %3 }, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    } else if (N == 4) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 { %0, %1, %2, %3 }, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    } else if (N == 2 && TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 { %0, %1 }, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1]) : "r"(a));
    } else if (N == 2) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 { %0, %1 }, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
    } else if (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 { %0 }, [%1];\n" : "=r"(r[0]) : "r"(a));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 { %0 }, [%1];\n" : "=r"(r[0]) : "r"(a));
    }
#else
    const int lane = (int)(threadIdx.x % 32), g = lane / 4, q = lane % 4;
    for (int i = 0; i < N; ++i) {
        if (TRANS) {
            const unsigned short* lo = __shfl_sync(0xffffffffu, p, 8 * i + 2 * q);
            const unsigned short* hi = __shfl_sync(0xffffffffu, p, 8 * i + 2 * q + 1);
            r[i] = pack(lo[g], hi[g]);
        } else {
            const unsigned short* row = __shfl_sync(0xffffffffu, p, 8 * i + g);
            r[i] = pack(row[2 * q], row[2 * q + 1]);
        }
    }
#endif
}

}  // namespace ssmc_mma
