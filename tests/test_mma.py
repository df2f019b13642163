"""The tensor-core tile product of generated kernels (templates/ssmc_mma.cuh): its fragments, emulated
on the CPU, against NumPy's product of the same 16-bit values; its 16-bit conversions against NumPy's
and torch's rounding; the mma.sync path compiled by NVRTC for sm_80 and sm_90; on a GPU, the
instruction against the emulation's answer."""

from __future__ import annotations

import numpy as np
import pytest

from ssmc.backends.cuda import emulator, nvrtc
from ssmc.backends.cuda.source import mma_header

# one warp: A [16,16] and B [16,8] as raw 16-bit values, loaded into the fragments the header
# documents; D [16,8] float written back from the fragments
KERNEL = r"""
template <bool BF16> __device__ void tile(const unsigned short* A, const unsigned short* B, float* D) {
    const int lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    unsigned a[4], b[2];
    a[0] = ssmc_mma::pack(A[g * 16 + 2 * q], A[g * 16 + 2 * q + 1]);
    a[1] = ssmc_mma::pack(A[(g + 8) * 16 + 2 * q], A[(g + 8) * 16 + 2 * q + 1]);
    a[2] = ssmc_mma::pack(A[g * 16 + 2 * q + 8], A[g * 16 + 2 * q + 9]);
    a[3] = ssmc_mma::pack(A[(g + 8) * 16 + 2 * q + 8], A[(g + 8) * 16 + 2 * q + 9]);
    b[0] = ssmc_mma::pack(B[(2 * q) * 8 + g], B[(2 * q + 1) * 8 + g]);
    b[1] = ssmc_mma::pack(B[(2 * q + 8) * 8 + g], B[(2 * q + 9) * 8 + g]);
    float d[4] = {D[g * 8 + 2 * q], D[g * 8 + 2 * q + 1], D[(g + 8) * 8 + 2 * q], D[(g + 8) * 8 + 2 * q + 1]};
    ssmc_mma::mma_16816<BF16>(d, a, b);
    D[g * 8 + 2 * q] = d[0];
    D[g * 8 + 2 * q + 1] = d[1];
    D[(g + 8) * 8 + 2 * q] = d[2];
    D[(g + 8) * 8 + 2 * q + 1] = d[3];
}
extern "C" __global__ void tile_bf16(int length, int nblk, const unsigned short* A, const unsigned short* B,
                                     float* D) { tile<true>(A, B, D); }
extern "C" __global__ void tile_fp16(int length, int nblk, const unsigned short* A, const unsigned short* B,
                                     float* D) { tile<false>(A, B, D); }
// ldsm: a 32 x 16 tile of 16-bit values in shared memory (rows of 24: padded, 16-byte aligned) loaded as
// x4 (the four 8x8 quarters of rows 0-15), x4 trans, x2 (rows 16-31, columns 0-7 and 8-15), x1 trans (rows
// 16-23, columns 8-15); each lane writes its registers out in order, 11 a lane
extern "C" __global__ void ldsm_tiles(int length, int nblk, const unsigned short* T, unsigned* R) {
    __shared__ __align__(16) unsigned short s[32 * 24];
    const int lane = threadIdx.x % 32;
    for (int i = lane; i < 32 * 16; i += 32) s[(i / 16) * 24 + i % 16] = T[i];
    __syncwarp();
    const int r8 = lane % 8, m = lane / 8;
    unsigned r[11];
    // M_m: rows (m % 2) * 8 + [0, 8), columns (m / 2) * 8 + [0, 8)
    ssmc_mma::ldsm<4, false>(r, &s[((m % 2) * 8 + r8) * 24 + (m / 2) * 8]);
    ssmc_mma::ldsm<4, true>(r + 4, &s[((m % 2) * 8 + r8) * 24 + (m / 2) * 8]);
    ssmc_mma::ldsm<2, false>(r + 8, &s[(16 + r8) * 24 + (m % 2) * 8]);
    ssmc_mma::ldsm<1, true>(r + 10, &s[(16 + r8) * 24 + 8]);
    for (int i = 0; i < 11; ++i) R[lane * 11 + i] = r[i];
}
extern "C" __global__ void convert(int length, int nblk, const float* x, unsigned short* bf, unsigned short* hf,
                                   float* back) {
    for (int i = threadIdx.x; i < length; i += blockDim.x) {
        bf[i] = ssmc_mma::bf16_bits(x[i]);
        hf[i] = ssmc_mma::fp16_bits(x[i]);
        back[2 * i] = ssmc_mma::bf16_float(bf[i]);
        back[2 * i + 1] = ssmc_mma::fp16_float(hf[i]);
    }
}
"""


def _source() -> str:
    return mma_header() + KERNEL


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (finite values)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_float(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32)


def _operands(rng, bf16: bool):
    a = rng.standard_normal((16, 16)).astype(np.float32)
    b = rng.standard_normal((16, 8)).astype(np.float32)
    d = rng.standard_normal((16, 8)).astype(np.float32)
    if bf16:
        ha, hb = _bf16_bits(a), _bf16_bits(b)
        fa, fb = _bf16_float(ha), _bf16_float(hb)
    else:
        ha, hb = a.astype(np.float16).view(np.uint16), b.astype(np.float16).view(np.uint16)
        fa, fb = a.astype(np.float16).astype(np.float32), b.astype(np.float16).astype(np.float32)
    want = d.astype(np.float64) + fa.astype(np.float64) @ fb.astype(np.float64)
    return ha, hb, d, want


needs_emulator = pytest.mark.skipif(not emulator.available(), reason="no C++ compiler for the CUDA emulator")


@needs_emulator
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp16"])
def test_emulated_tile_product_is_the_product_of_its_fragments(bf16):
    ha, hb, d, want = _operands(np.random.default_rng(0), bf16)
    kernel = emulator.emulated(_source(), "tile_bf16" if bf16 else "tile_fp16")
    kernel((1, 32), 0, 1, [ha.ctypes.data, hb.ctypes.data, d.ctypes.data])
    np.testing.assert_allclose(d, want, rtol=1e-5, atol=1e-5)


@needs_emulator
def test_16_bit_conversions_round_to_nearest_even():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(200) * 10.0 ** rng.integers(-9, 6, 200),  # fp16 subnormals to overflow
                        [0.0, -0.0, 1.0, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 2.98e-8, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8]]
                       ).astype(np.float32)
    bf = np.zeros(x.size, np.uint16)
    hf = np.zeros(x.size, np.uint16)
    back = np.zeros(2 * x.size, np.float32)
    kernel = emulator.emulated(_source(), "convert")
    kernel((1, 64), x.size, 1, [x.ctypes.data, bf.ctypes.data, hf.ctypes.data, back.ctypes.data])
    np.testing.assert_array_equal(bf, _bf16_bits(x))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(hf, x.astype(np.float16).view(np.uint16))
        np.testing.assert_array_equal(back[1::2], x.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(back[0::2], _bf16_float(_bf16_bits(x)))


def _ldsm_want(t: np.ndarray) -> np.ndarray:
    """What each lane of `ldsm_tiles` holds, from the fragment layout the header documents: [32 lanes, 11]."""
    want = np.zeros((32, 11), np.uint32)

    def tile(lane, r0, c0, trans):
        g, q, m = lane // 4, lane % 4, t[r0:r0 + 8, c0:c0 + 8]
        lo, hi = (m[2 * q, g], m[2 * q + 1, g]) if trans else (m[g, 2 * q], m[g, 2 * q + 1])
        return np.uint32(lo) | (np.uint32(hi) << 16)
    for lane in range(32):
        for i in range(4):
            want[lane, i] = tile(lane, (i % 2) * 8, (i // 2) * 8, False)
            want[lane, 4 + i] = tile(lane, (i % 2) * 8, (i // 2) * 8, True)
        want[lane, 8], want[lane, 9] = tile(lane, 16, 0, False), tile(lane, 16, 8, False)
        want[lane, 10] = tile(lane, 16, 8, True)
    return want


@needs_emulator
def test_emulated_ldmatrix_gives_the_documented_fragments():
    t = np.random.default_rng(3).integers(0, 2 ** 16, (32, 16)).astype(np.uint16)
    got = np.zeros((32, 11), np.uint32)
    emulator.emulated(_source(), "ldsm_tiles")((1, 32), 0, 1, [t.ctypes.data, got.ctypes.data])
    np.testing.assert_array_equal(got, _ldsm_want(t))


@pytest.mark.skipif(not nvrtc.available(), reason="no NVRTC")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_tile_product_compiles_to_mma_sync(arch):
    compiled = nvrtc.compile_source(_source(), arch=arch, options=("--std=c++17", "-ftz=true"))
    assert "tile_bf16" in compiled.log and "tile_fp16" in compiled.log and "ldsm_tiles" in compiled.log


@pytest.mark.gpu
def test_ldmatrix_on_the_gpu_gives_the_documented_fragments():
    cp = pytest.importorskip("cupy")
    t = np.random.default_rng(4).integers(0, 2 ** 16, (32, 16)).astype(np.uint16)
    got = cp.zeros((32, 11), cp.uint32)
    cp.RawModule(code=_source(), options=("--std=c++17",)).get_function("ldsm_tiles")(
        (1,), (32,), (np.int32(0), np.int32(1), cp.asarray(t), got))
    np.testing.assert_array_equal(cp.asnumpy(got), _ldsm_want(t))


@pytest.mark.gpu
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp16"])
def test_mma_sync_on_the_gpu_agrees_with_numpy(bf16):
    cp = pytest.importorskip("cupy")
    ha, hb, d, want = _operands(np.random.default_rng(2), bf16)
    module = cp.RawModule(code=_source(), options=("--std=c++17",))
    fn = module.get_function("tile_bf16" if bf16 else "tile_fp16")
    A, B, D = cp.asarray(ha), cp.asarray(hb), cp.asarray(d)
    fn((1,), (32,), (np.int32(0), np.int32(1), A, B, D))
    np.testing.assert_allclose(cp.asnumpy(D), want, rtol=1e-5, atol=1e-5)
