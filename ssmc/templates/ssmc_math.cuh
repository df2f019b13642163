// ssmc's scalar math for generated kernels: one overload per compute type (float, double).
// Stable forms where the naive one overflows (sigmoid, softplus); NaN-propagating max / min
// (as NumPy's maximum / minimum, which the interpreter uses).
// Half types only when a kernel reads or writes them (SSMC_HALF): NVRTC without a CUDA toolkit
// beside it has no headers, and float / double kernels need none.
#pragma once
#ifdef SSMC_HALF
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#endif

namespace ssmc {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ double to_f(double x) { return x; }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
#ifdef SSMC_HALF
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
#endif

#define SSMC_UNARY(NAME, F_EXPR, D_EXPR) \
    __device__ __forceinline__ float NAME(float x) { return F_EXPR; } \
    __device__ __forceinline__ double NAME(double x) { return D_EXPR; }

// float exp as exp2f(x log2 e): ex2.approx and a multiply, where expf is about 8 instructions (the
// lanes kernel's Mamba-1 forward at B8 D1536 L2048 on an H200: 0.418 against 0.492 ms); within
// 8 + 1.5 |x| ulp for |x| <= 80 (the product x log2 e is rounded: up to |x| ulp; 62 ulp measured at
// x = 45, tests/test_cuda.py), far inside float32's tolerances.
__device__ __forceinline__ float exp2e(float x) { return exp2f(x * 1.4426950408889634f); }

SSMC_UNARY(neg, -x, -x)
SSMC_UNARY(exp_, exp2e(x), ::exp(x))
SSMC_UNARY(exp2_, exp2f(x), ::exp2(x))  // exp(y) as exp2(y log2 e), the factor folded into a param (state_lanes.py)
SSMC_UNARY(log_, logf(x), ::log(x))
SSMC_UNARY(sqrt_, sqrtf(x), ::sqrt(x))
SSMC_UNARY(rsqrt_, rsqrtf(x), 1.0 / ::sqrt(x))
SSMC_UNARY(abs_, fabsf(x), ::fabs(x))
SSMC_UNARY(tanh_, tanhf(x), ::tanh(x))
SSMC_UNARY(erf_, erff(x), ::erf(x))
SSMC_UNARY(relu, (x > 0.0f ? x : (x != x ? x : 0.0f)), (x > 0.0 ? x : (x != x ? x : 0.0)))

__device__ __forceinline__ float sigmoid(float x) {  // 1 + e is in [1, 2]: __fdividef's 2 ulp hold
    float e = exp2e(-fabsf(x));
    return x >= 0.0f ? __fdividef(1.0f, 1.0f + e) : __fdividef(e, 1.0f + e);
}
__device__ __forceinline__ double sigmoid(double x) {
    double e = ::exp(-::fabs(x));
    return x >= 0.0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
}
// log1p(e) for e in [0, 1] (softplus's, e = exp(-|x|)): 2 atanh(s), s = e / (2 + e) in [0, 1/3], by
// its odd series to s^13 (the rest below 2^-26 relative); softplus so is within 4 ulp over |x| <= 80
// (float32 emulation against float64) in about 12 instructions, where log1pf takes about 40 (the
// Mamba-1 forward computes one per channel and step)
__device__ __forceinline__ float log1p_unit(float e) {
    const float s = __fdividef(e, 2.0f + e), s2 = s * s;  // 2 + e is in [2, 3]: __fdividef's 2 ulp hold
    float p = 1.0f / 13.0f;
    p = fmaf(p, s2, 1.0f / 11.0f);
    p = fmaf(p, s2, 1.0f / 9.0f);
    p = fmaf(p, s2, 1.0f / 7.0f);
    p = fmaf(p, s2, 1.0f / 5.0f);
    p = fmaf(p, s2, 1.0f / 3.0f);
    p = fmaf(p, s2, 1.0f);
    return 2.0f * s * p;
}
__device__ __forceinline__ float softplus(float x) { return fmaxf(x, 0.0f) + log1p_unit(exp2e(-fabsf(x))); }
__device__ __forceinline__ double softplus(double x) { return ::fmax(x, 0.0) + ::log1p(::exp(-::fabs(x))); }
__device__ __forceinline__ float silu(float x) { return x * sigmoid(x); }
__device__ __forceinline__ double silu(double x) { return x * sigmoid(x); }
__device__ __forceinline__ float gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
__device__ __forceinline__ double gelu(double x) { return 0.5 * x * (1.0 + ::erf(x * 0.70710678118654752)); }

template <typename T> __device__ __forceinline__ T max_(T a, T b) { return (a != a || a >= b) ? a : b; }
template <typename T> __device__ __forceinline__ T min_(T a, T b) { return (a != a || a <= b) ? a : b; }
__device__ __forceinline__ float pow_(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double pow_(double a, double b) { return ::pow(a, b); }
// SSMC_ELEMENTARY_BEGIN (kept in a module only where its kernels call one of these: source.math_header)
SSMC_UNARY(sin_, sinf(x), ::sin(x))
SSMC_UNARY(cos_, cosf(x), ::cos(x))
SSMC_UNARY(tan_, tanf(x), ::tan(x))
SSMC_UNARY(log1p_, log1pf(x), ::log1p(x))
SSMC_UNARY(expm1_, expm1f(x), ::expm1(x))
SSMC_UNARY(sign_, (x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x)), (x > 0.0 ? 1.0 : (x < 0.0 ? -1.0 : x)))  // 0 and NaN as they are
__device__ __forceinline__ float atan2_(float y, float x) { return atan2f(y, x); }
__device__ __forceinline__ double atan2_(double y, double x) { return ::atan2(y, x); }
// SSMC_ELEMENTARY_END

// Copies BYTES (4, 8 or 16) from global to shared memory without a register in between: cp.async on
// sm_80 and later (complete once `copy_async_wait` returns), a load and a store before.
template <int BYTES> __device__ __forceinline__ void copy_async(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n"
                 :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src), "n"(BYTES) : "memory");
#else
    if constexpr (BYTES == 4) *(float*)dst = *(const float*)src;
    else if constexpr (BYTES == 8) *(double*)dst = *(const double*)src;
    else *(float4*)dst = *(const float4*)src;
#endif
}
// threadIdx.x read again where it is used: what is derived from it cannot be kept across a loop's
// iterations (the lanes kernel's whole-chunk copies: their addresses, kept, took 24 more registers)
__device__ __forceinline__ int fresh_thread_index() {
#ifdef __CUDA_ARCH__
    int t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return t;
#else
    return (int)threadIdx.x;
#endif
}
__device__ __forceinline__ void copy_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// K consecutive values from `src`, aligned to 16 bytes where K % 4 == 0 (else to 8 where K is
// even): one vector load per 4 (2) values where a lane reads its K consecutive steps; `dst` in the
// compute type (float, or double where another input is float64).
template <int K, typename T> __device__ __forceinline__ void load_steps(T* dst, const float* __restrict__ src) {
    if constexpr (K % 4 == 0) {
        #pragma unroll
        for (int i = 0; i < K / 4; ++i) {
            const float4 v = reinterpret_cast<const float4*>(src)[i];
            dst[4 * i] = v.x; dst[4 * i + 1] = v.y; dst[4 * i + 2] = v.z; dst[4 * i + 3] = v.w;
        }
    } else if constexpr (K % 2 == 0) {
        #pragma unroll
        for (int i = 0; i < K / 2; ++i) {
            const float2 v = reinterpret_cast<const float2*>(src)[i];
            dst[2 * i] = v.x; dst[2 * i + 1] = v.y;
        }
    } else {
        #pragma unroll
        for (int i = 0; i < K; ++i) dst[i] = src[i];
    }
}

// dst[0 .. K-1] = v[0 .. K-1] (a lane's K consecutive steps; dst aligned as for `load_steps`): one
// vector store per 4 (2) values.
template <int K, typename T> __device__ __forceinline__ void store_steps(float* __restrict__ dst, const T* v) {
    if constexpr (K % 4 == 0) {
        #pragma unroll
        for (int i = 0; i < K / 4; ++i)
            reinterpret_cast<float4*>(dst)[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
    } else if constexpr (K % 2 == 0) {
        #pragma unroll
        for (int i = 0; i < K / 2; ++i) reinterpret_cast<float2*>(dst)[i] = make_float2(v[2 * i], v[2 * i + 1]);
    } else {
        #pragma unroll
        for (int i = 0; i < K; ++i) dst[i] = v[i];
    }
}

// dst[0 .. K-1] += v[0 .. K-1] atomically (a lane's K consecutive steps; dst aligned to 16 bytes when K
// is a multiple of 4, 8 when even): on sm_90 and later one vector reduction per 4 (2) values, which
// touches the L2 sectors of a warp's 32 K values once; scalar atomic adds elsewhere.
template <int K> __device__ __forceinline__ void add_steps(float* dst, const float* v) {
#if __CUDA_ARCH__ >= 900
    if constexpr (K % 4 == 0) {
        #pragma unroll
        for (int i = 0; i < K / 4; ++i)
            asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
                         :: "l"(dst + 4 * i), "f"(v[4 * i]), "f"(v[4 * i + 1]), "f"(v[4 * i + 2]), "f"(v[4 * i + 3])
                         : "memory");
        return;
    } else if constexpr (K % 2 == 0) {
        #pragma unroll
        for (int i = 0; i < K / 2; ++i)
            asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(dst + 2 * i), "f"(v[2 * i]), "f"(v[2 * i + 1])
                         : "memory");
        return;
    }
#endif
    #pragma unroll
    for (int i = 0; i < K; ++i) atomicAdd(dst + i, v[i]);
}

}  // namespace ssmc
