"""NVRTC on a machine without a GPU: CUDA C to CUBIN, and ptxas's per-kernel report read back."""

from __future__ import annotations

import shlex

import pytest

from ssmc.backends.cuda import nvrtc
from ssmc.backends.cuda.nvrtc import NvrtcError, compile_source, resource_usage

needs_nvrtc = pytest.mark.skipif(not nvrtc.available(), reason=f"NVRTC: {nvrtc.unavailable_reason()}")

ELEMENTWISE = r"""
extern "C" __global__ void axpy(const float* __restrict__ x, float* __restrict__ y, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
"""

# A diagonal recurrence over time with 16 states per thread: s[16] lives in registers because every index
# is a compile-time constant once the loops are unrolled.
UNROLLED_STATE = r"""
extern "C" __global__ void scan16(const float* __restrict__ a, const float* __restrict__ x,
                                  float* __restrict__ y, int T, int D) {
  int d = blockIdx.x * blockDim.x + threadIdx.x;
  if (d >= D) return;
  float s[16];
  #pragma unroll
  for (int j = 0; j < 16; ++j) s[j] = 0.f;
  for (int t = 0; t < T; ++t) {
    float xt = x[t * D + d];
    float acc = 0.f;
    #pragma unroll
    for (int j = 0; j < 16; ++j) {
      s[j] = a[j * D + d] * s[j] + xt;
      acc += s[j];
    }
    y[t * D + d] = acc;
  }
}
"""

# 64 live states mixed every step: far more than 32 registers, so -maxrregcount=32 must spill.
HEAVY = r"""
extern "C" __global__ void heavy(const float* __restrict__ a, float* __restrict__ out, int T, int D) {
  int d = blockIdx.x * blockDim.x + threadIdx.x;
  float s[64];
  #pragma unroll
  for (int j = 0; j < 64; ++j) s[j] = a[j * D + d];
  for (int t = 0; t < T; ++t) {
    float xt = a[(t + 64) * D + d];
    #pragma unroll
    for (int j = 0; j < 64; ++j) s[j] = s[j] * s[(j + 1) & 63] + xt;
  }
  float acc = 0.f;
  #pragma unroll
  for (int j = 0; j < 64; ++j) acc += s[j] * (j + 1);
  out[d] = acc;
}
"""

SHARED = r"""
extern "C" __global__ void reverse256(const float* __restrict__ x, float* __restrict__ y) {
  __shared__ float tile[256];
  tile[threadIdx.x] = x[blockIdx.x * 256 + threadIdx.x];
  __syncthreads();
  y[blockIdx.x * 256 + threadIdx.x] = tile[255 - threadIdx.x];
}
"""

# A log as nvcc -Xptxas -v prints it for sm_80 (constant banks, a non-inlined device function, a mangled kernel).
NVCC_LOG = """\
ptxas info    : 0 bytes gmem, 512 bytes cmem[3]
ptxas info    : Compiling entry function '_Z4scanILi4EEvPfi' for 'sm_80'
ptxas info    : Function properties for _Z4scanILi4EEvPfi
    128 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 31 registers, used 1 barriers, 2048 bytes smem, 128 bytes cumulative stack size, \
364 bytes cmem[0], 8 bytes cmem[2]
ptxas info    : Compile time = 1.647 ms
ptxas info    : Function properties for _Z1ffi
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'plain' for 'sm_80'
ptxas info    : Function properties for plain
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, 360 bytes cmem[0]
"""


def test_resource_usage_reads_an_nvcc_style_log():
    found = resource_usage(NVCC_LOG)
    assert list(found) == ["_Z4scanILi4EEvPfi", "plain"]  # the device function _Z1ffi is no kernel
    k = found["_Z4scanILi4EEvPfi"]
    assert (k.arch, k.registers, k.barriers, k.shared_bytes) == ("sm_80", 31, 1, 2048)
    assert (k.stack_frame_bytes, k.spill_store_bytes, k.spill_load_bytes) == (128, 8, 12)
    assert k.cumulative_stack_bytes == 128
    assert dict(k.constant_banks) == {0: 364, 2: 8} and k.constant_bytes == 372
    assert k.spills
    p = found["plain"]
    assert (p.registers, p.shared_bytes, p.stack_frame_bytes, p.barriers, p.spills) == (8, 0, 0, 0, False)
    assert resource_usage("") == {}


@needs_nvrtc
def test_elementwise_kernel_compiles_to_a_cubin_without_spills():
    out = compile_source(ELEMENTWISE)
    assert out.cubin[:4] == b"\x7fELF"
    assert out.options[:2] == ("-arch=sm_90", "--ptxas-options=-v")
    k = out.resources["axpy"]
    assert k.arch == "sm_90"
    assert 0 < k.registers <= 32
    assert (k.stack_frame_bytes, k.spill_store_bytes, k.spill_load_bytes, k.shared_bytes) == (0, 0, 0, 0)


@needs_nvrtc
def test_local_array_with_constant_indices_stays_in_registers():
    k = compile_source(UNROLLED_STATE).resources["scan16"]
    assert k.registers >= 16  # the 16 states are registers...
    assert not k.spills and k.stack_frame_bytes == 0  # ...not local memory


@needs_nvrtc
def test_register_cap_makes_a_heavy_kernel_spill():
    free = compile_source(HEAVY).resources["heavy"]
    assert free.registers > 64 and not free.spills
    capped = compile_source(HEAVY, options=("-maxrregcount=32",)).resources["heavy"]
    assert capped.registers <= 32
    assert capped.spills and capped.spill_store_bytes > 0 and capped.spill_load_bytes > 0
    assert capped.stack_frame_bytes > 0


@needs_nvrtc
def test_static_shared_memory_and_barriers_are_reported():
    k = compile_source(SHARED).resources["reverse256"]
    assert k.shared_bytes == 256 * 4
    assert k.barriers == 1


@needs_nvrtc
def test_several_kernels_templates_and_headers():
    source = r"""
#include "step.cuh"
template <int N> __global__ void scale(float* x) { x[threadIdx.x] = step(x[threadIdx.x]) * N; }
template __global__ void scale<4>(float*);
extern "C" __global__ void one(float* x) { x[threadIdx.x] = 1.f; }
"""
    out = compile_source(source, headers={"step.cuh": "__device__ inline float step(float v) { return expf(v); }"},
                         name_expressions=("scale<4>",))
    symbol = out.lowered_names["scale<4>"]
    assert symbol.startswith("_Z") and symbol != "scale<4>"
    found = out.resources
    assert found["scale<4>"] is found[symbol]
    assert "one" in found


@needs_nvrtc
def test_syntax_error_raises_with_the_log_and_an_nvcc_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SSMC_CACHE_DIR", str(tmp_path))
    bad = 'extern "C" __global__ void broken(float* x) { x[0] = undefined_name; }\n'
    with pytest.raises(NvrtcError) as info:
        compile_source(bad, options=("-lineinfo",), name="broken.cu")
    err = info.value
    assert 'identifier "undefined_name" is undefined' in err.log
    assert 'identifier "undefined_name" is undefined' in str(err).splitlines()[0]
    assert err.options == ("-arch=sm_90", "--ptxas-options=-v", "-lineinfo")
    assert err.result == "NVRTC_ERROR_COMPILATION"
    words = shlex.split(err.nvcc_command)
    assert words[:2] == ["nvcc", "-cubin"] and "-arch=sm_90" in words and "-lineinfo" in words
    assert words[-1] == err.source_path and err.source_path.startswith(str(tmp_path))
    with open(err.source_path) as f:
        assert f.read() == bad


@needs_nvrtc
def test_bad_option_and_bad_arch():
    with pytest.raises(NvrtcError, match="unrecognized option"):
        compile_source(ELEMENTWISE, options=("--no-such-option",))
    with pytest.raises(ValueError, match="real architecture"):
        compile_source(ELEMENTWISE, arch="compute_90")
    with pytest.raises(ValueError, match="arch="):
        compile_source(ELEMENTWISE, options=("-arch=sm_80",))


@needs_nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_other_architectures(arch):
    assert arch.removesuffix("a") in nvrtc.supported_archs()
    k = compile_source(ELEMENTWISE, arch=arch).resources["axpy"]
    assert k.arch == arch and k.registers > 0
