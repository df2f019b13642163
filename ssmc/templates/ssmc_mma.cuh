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
    const int lane = (int)(threadIdx.x % 32), g = lane / 4, q = lane % 4;
    for (int j = 0; j < 4; ++j) {
        unsigned ra[4], rb0[2], rb1[2];
        for (int r = 0; r < 4; ++r) ra[r] = __shfl_sync(0xffffffffu, a[r], g * 4 + j);
        for (int r = 0; r < 2; ++r) {
            rb0[r] = __shfl_sync(0xffffffffu, b[r], (2 * q) * 4 + j);
            rb1[r] = __shfl_sync(0xffffffffu, b[r], (2 * q + 1) * 4 + j);
        }
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
    const int lane = (int)(threadIdx.x % 32), g = lane / 4, q = lane % 4;
    for (int j = 0; j < 4; ++j) {
        unsigned ra[4], rb0[2], rb1[2];
        for (int r = 0; r < 4; ++r) ra[r] = __shfl_sync(0xffffffffu, a[r], g * 4 + j);
        for (int r = 0; r < 2; ++r) {
            rb0[r] = __shfl_sync(0xffffffffu, b[r], (2 * q) * 4 + j);
            rb1[r] = __shfl_sync(0xffffffffu, b[r], (2 * q + 1) * 4 + j);
        }
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

}  // namespace ssmc_mma
