"""The flash attention forward kernel (backends/cuda/kernels/flash): its printed modifiers, the kernel
run on the CPU emulator at tiny sizes against the interpreter (float64, from the same 16-bit inputs),
its NVRTC build for sm_80 / sm_90 without spills, and on a GPU (``-m gpu``) against the tiled torch
path and torch's SDPA, and plugged into `TiledAttention.forward`."""

from __future__ import annotations

import math

import numpy as np
import pytest
from profiles import in_ci, nightly_case

import ssmc
from ssmc.backends import interpreter
from ssmc.backends.cuda import emulator, nvrtc
from ssmc.backends.cuda.kernels.flash import forward as flash

torch = pytest.importorskip("torch")


def alibi(score, q_idx, kv_idx, slope: ssmc.Param["h"]):
    return score - slope * (q_idx - kv_idx)


def softcap(score, q_idx, kv_idx, cap: ssmc.Param["h"]):
    return cap * ssmc.tanh(score / cap)


def never_late(q_idx, kv_idx):
    """Queries past 8 see no key: rows without a key (out 0, lse -inf)."""
    return (kv_idx <= q_idx) & (q_idx < 8)


def _spec(score_mod, mask_mod):
    return ssmc.attention(score_mod=score_mod, mask_mod=mask_mod, batch="b h", head_dim="d")


SPECS = {
    "causal": _spec(None, ssmc.causal),
    "alibi": _spec(alibi, ssmc.causal),
    "window": _spec(None, ssmc.sliding_window(20)),
    "full": _spec(None, None),
    "softcap_empty_rows": _spec(softcap, never_late),
}


def _params(program, sizes, rng) -> dict:
    out = {}
    for d in program.params:
        shape = [sizes[a] for a in d.axes]
        out[d.name] = 2.0 ** (-8.0 * rng.random(shape)) if d.name == "slope" else 1.0 + rng.random(shape)
    return out


def _half_bits(x: np.ndarray, bf16: bool) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16 if bf16 else torch.float16)
    return t.view(torch.int16).numpy().view(np.uint16)


def _half_float(bits: np.ndarray, bf16: bool) -> np.ndarray:
    t = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16 if bf16 else torch.float16)
    return t.to(torch.float64).numpy()


def _reference(program, q, k, v, params, sizes):
    """The interpreter's (out, lse) for canonical [b, h, t, d] float64 inputs, as [b, h, t, ...]."""
    out, lse = interpreter.run_attention(program, *(np.moveaxis(x, 2, 0) for x in (q, k, v)), params, sizes)
    return np.moveaxis(out, 0, 2), np.moveaxis(lse, 0, 2)


_EMULATED: dict = {}  # (spec, d, bf16, config) -> the emulated kernel: one C++ build per source across tests
NEW_CONFIGS = ["bm128w8", "bm128w8n128", "bm128w4"]  # the 128-row forward kernels (forward_bm128.cu.j2)
# on the GPU, the wgmma kernel too where the GPU is an sm_90 part
_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
GPU_CONFIGS = NEW_CONFIGS + (["wg128", "wg128s"] if _SM90 else [])


def _emulated(name: str, d: int, bf16: bool, config: str = "bm64"):
    key = (name, d, bf16, config)
    if key not in _EMULATED:
        kname, text = flash.kernel_source(SPECS[name].program, d, bf16, config)
        _EMULATED[key] = emulator.emulated(text, kname)
    return _EMULATED[key]


def _run_emulated(name, lq, lk, heads, d=64, bf16=True, seed=0, config="bm64"):
    """(got out, got lse, want out, want lse) of spec `name` at b=1, `heads` heads, on the emulator, in
    forward config `config`."""
    program = SPECS[name].program
    rng = np.random.default_rng(seed)
    sizes = {"b": 1, "h": heads, "d": d}
    bits = {n: _half_bits(rng.standard_normal((1, heads, length, d)), bf16)
            for n, length in (("q", lq), ("k", lk), ("v", lk))}
    params = _params(program, sizes, rng)
    table = flash.param_table(program, {n: torch.from_numpy(np.asarray(x)) for n, x in params.items()}, sizes)
    table = np.ascontiguousarray(table.numpy(), np.float32).reshape(-1)
    if table.size == 0:
        table = np.zeros(1, np.float32)
    cfg = flash.config(d, config)
    spans = np.asarray(flash.span_table(flash.block_spans(program.mask, lq, lk, sizes, cfg.bm, cfg.bn)), np.int32)
    # out and lse start as NaN: a row or column the kernel does not write fails the check
    out = np.full((1, heads, lq, d), 0x7fff if bf16 else 0x7e00, np.uint16)
    lse = np.full((1, heads, lq), np.nan, np.float32)
    arrays = [bits["q"], bits["k"], bits["v"], table, spans, out, lse]
    kernel = _emulated(name, d, bf16, config)
    kernel((-(-lq // cfg.bm) * heads, cfg.threads), lq, lk, [a.ctypes.data for a in arrays] + [0])
    q, k, v = (_half_float(bits[n], bf16) for n in "qkv")
    want_out, want_lse = _reference(program, q, k, v, params, sizes)
    return _half_float(out, bf16), lse, want_out, want_lse


needs_emulator = pytest.mark.skipif(not emulator.available(), reason="no C++ compiler for the CUDA emulator")

# P is rounded to 16 bits as the P V operand and out to 16 bits: outputs, averages of O(1) values,
# within a few of their ulps; lse is exact up to fp32 sums of products of the 16-bit inputs
OUT_TOL = {True: 1.5e-2, False: 2e-3}
LSE_TOL = 1e-4


def _check(got_out, got_lse, want_out, want_lse, bf16=True):
    assert not np.isnan(got_lse).any()
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[finite], want_lse[finite], rtol=LSE_TOL, atol=LSE_TOL)
    np.testing.assert_allclose(got_out, want_out, atol=OUT_TOL[bf16], rtol=0)
    assert not np.isnan(got_out).any()


# -- the printer ----------------------------------------------------------------------------------------

def test_modifiers_print_as_straight_line_c():
    text = flash.kernel_source(SPECS["alibi"].program, 64, True)[1]
    assert "const float n5 = (n1 * n4);" in text or "prm[0]" in text
    assert "(kv_idx <= q_idx)" in text
    assert flash.unsupported(SPECS["window"].program) is None


def test_modifiers_beyond_the_subset_are_refused_with_a_reason():
    def mixed(score, q_idx, kv_idx, w: ssmc.Param["h r"]):
        return score + w.sum("r")

    reason = flash.unsupported(ssmc.attention(score_mod=mixed, batch="b h", head_dim="d").program)
    assert reason is not None and "'w'" in reason


BRUTE_MASKS = {
    "causal": lambda i, j: j <= i,
    "window": lambda i, j: (j <= i) & (i - j < 20),
    "full": lambda i, j: np.ones_like(i + j, bool),
    "softcap_empty_rows": lambda i, j: (j <= i) & (i < 8),
}


@pytest.mark.parametrize("name", list(BRUTE_MASKS))
@pytest.mark.parametrize("lq, lk", [(1, 1), (70, 70), (200, 130), (130, 300), (256, 256)])
def test_block_spans_are_sound_and_find_the_full_tiles(name, lq, lk):
    """Keys outside a block's [lo, hi) are masked for each of its queries; tiles in [full_lo, full_hi)
    are visible to all of them and below Lk; causal finds every tile below the diagonal full."""
    spans = flash.block_spans(SPECS[name].program.mask, lq, lk, {"b": 1, "h": 1, "d": 64})
    visible = BRUTE_MASKS[name](np.arange(lq)[:, None], np.arange(lk)[None, :])
    assert len(spans) == -(-lq // flash.BM)
    for b, (lo, hi, flo, fhi) in enumerate(spans):
        rows = visible[b * flash.BM:(b + 1) * flash.BM]
        assert not rows[:, :lo].any() and not rows[:, hi:].any()
        assert fhi <= lk and (flo == fhi or lo <= flo < fhi <= hi) and (fhi - flo) % flash.BN == 0
        assert rows[:, flo:fhi].all()
        if name == "causal" and lq == lk:
            assert (flo, fhi) == ((0, b * flash.BM) if b > 0 else (0, 0))


# -- the kernel on the CPU emulator ---------------------------------------------------------------------

@needs_emulator
@pytest.mark.parametrize("name, length", [
    (n, length) if length != 7 else nightly_case(n, length, reason="a partial tile: L 1's and 33's")
    for n in ("causal", "alibi") for length in (1, 7, 33, 70)]
                         + [("window", 7), ("window", 70), ("full", 7), ("full", 70)])
def test_emulated_flash_forward_matches_the_interpreter(name, length):
    heads = 2 if length <= 33 else 1
    _check(*_run_emulated(name, length, length, heads))


@needs_emulator
@pytest.mark.parametrize("name, lq, lk", [("alibi", 70, 7), ("alibi", 7, 70), ("window", 130, 130),
                                          ("alibi", 130, 130)])
def test_emulated_flash_forward_with_lq_and_lk_apart_and_skipped_tiles(name, lq, lk):
    """(130, 130) with a window of 20: the last query block's span starts at key 64 (tile 0 skipped);
    causal: full tiles (no mask evaluated) below the diagonal."""
    _check(*_run_emulated(name, lq, lk, 1, seed=lq + lk))


@needs_emulator
def test_emulated_rows_without_a_key_give_zero_and_minus_infinity():
    got_out, got_lse, want_out, want_lse = _run_emulated("softcap_empty_rows", 20, 20, 1)
    assert np.isneginf(got_lse[..., 8:]).all() and (got_out[..., 8:, :] == 0).all()
    _check(got_out, got_lse, want_out, want_lse)


@needs_emulator
def test_emulated_flash_forward_fp16_and_head_dim_128():
    _check(*_run_emulated("alibi", 33, 33, 1, d=128, bf16=False), bf16=False)


# the 128-row kernels: two query blocks, several key tiles (d 64: 2 of 128 in bm128w8, 4 of 64 in bm128w4),
# lengths off the tiles, Lq != Lk, a window whose last block skips tiles, rows without a key, fp16 at d 128
BM128_CASES = [("causal", 200, 200, 64, True), ("alibi", 150, 150, 64, True), ("window", 300, 300, 64, True),
               ("full", 7, 150, 64, True), ("alibi", 150, 40, 64, True), ("softcap_empty_rows", 20, 20, 64, True),
               ("alibi", 130, 100, 128, False)]
# bm128w8n128 is bm128w8's source with key tiles of 128: the cases where that changes the tiles' split
BM128_EMULATED = ([(c, *case) for c in ("bm128w8", "bm128w4") for case in BM128_CASES]
                  + [("bm128w8n128", *case) for case in BM128_CASES if case[0] in ("window", "full") or case[3] == 128])
# CI's 2 cores (a 256-thread block is 256 OS threads): one case of each config's distinct path, the rest
# locally and nightly
if in_ci():
    BM128_EMULATED = [("bm128w4", "alibi", 150, 40, 64, True), ("bm128w4", "alibi", 130, 100, 128, False),
                      ("bm128w8", "window", 300, 300, 64, True), ("bm128w8n128", "alibi", 130, 100, 128, False)]


# the wgmma kernel (its products emulated from the descriptors: the swizzled layout, the column blocks and the
# k-steps' addresses are checked here, the hardware's reading of them on the GPU): both head dims, a partial
# tile, Lq != Lk, rows without a key, fp16
WGMMA_EMULATED = [("causal", 200, 200, 64, True), ("alibi", 130, 100, 128, False),
                  ("softcap_empty_rows", 20, 20, 128, True), ("window", 300, 300, 64, True),
                  ("full", 7, 150, 128, True)]
WGMMA_EMULATED = [("wg128", *case) for case in WGMMA_EMULATED] + [("wg128s", *case) for case in WGMMA_EMULATED]
if in_ci():  # "wg128s": its staggered warpgroup's first, middle and last tiles at L 300 (three tiles)
    WGMMA_EMULATED = [*WGMMA_EMULATED[:3], ("wg128s", "window", 300, 300, 64, True)]


@needs_emulator
@pytest.mark.parametrize("config, name, lq, lk, d, bf16", WGMMA_EMULATED)
def test_emulated_wgmma_forward_matches_the_interpreter(config, name, lq, lk, d, bf16, monkeypatch):
    _check(*_run_emulated(name, lq, lk, 1, d=d, bf16=bf16, seed=lq + 5 * lk, config=config), bf16=bf16)


@needs_emulator
@pytest.mark.parametrize("config, name, lq, lk, d, bf16", BM128_EMULATED)
def test_emulated_bm128_forward_matches_the_interpreter(config, name, lq, lk, d, bf16, monkeypatch):
    """The 128-row kernels (K and V double-buffered: a tile read before its cp.async group's wait, or a
    stage overwritten while a warp still reads it, shows here) against the interpreter."""
    _check(*_run_emulated(name, lq, lk, 1, d=d, bf16=bf16, seed=lq + 3 * lk, config=config), bf16=bf16)


def test_the_forward_config_comes_from_the_options(monkeypatch):
    monkeypatch.delenv("SSMC_CUDA_FLASH_FORWARD", raising=False)
    assert flash.config(128).name == flash.DEFAULT_CONFIG[128] and flash.config(64).name == flash.DEFAULT_CONFIG[64]
    monkeypatch.setenv("SSMC_CUDA_FLASH_FORWARD", "bm128w8")
    cfg = flash.config(128)
    assert (cfg.name, cfg.bm, cfg.threads) == ("bm128w8", 128, 256)
    assert "bm128w8" in flash.kernel_source(SPECS["alibi"].program, 128, True)[0]
    assert flash.config(64, "bm64").shared(64) == 0
    monkeypatch.setenv("SSMC_CUDA_FLASH_FORWARD", "bm96")
    with pytest.raises(ValueError, match="SSMC_CUDA_FLASH_FORWARD"):
        flash.config(128)


@pytest.mark.parametrize("name", list(BRUTE_MASKS))
@pytest.mark.parametrize("bm, bn", [(128, 32), (128, 64), (128, 128)])
def test_block_spans_of_the_bm128_tiles_are_sound(name, bm, bn):
    lq, lk = 300, 290
    spans = flash.block_spans(SPECS[name].program.mask, lq, lk, {"b": 1, "h": 1, "d": 64}, bm, bn)
    visible = BRUTE_MASKS[name](np.arange(lq)[:, None], np.arange(lk)[None, :])
    assert len(spans) == -(-lq // bm)
    for b, (lo, hi, flo, fhi) in enumerate(spans):
        rows = visible[b * bm:(b + 1) * bm]
        assert not rows[:, :lo].any() and not rows[:, hi:].any() and lo % bn == 0
        assert fhi <= lk and (flo == fhi or lo <= flo < fhi <= hi) and (fhi - flo) % bn == 0
        assert rows[:, flo:fhi].all()
        if name == "causal":
            assert (flo, fhi) == (0, (b * bm // bn) * bn)


# -- NVRTC: the kernel builds for sm_80 and sm_90 without spills -----------------------------------------

# (config, head dim): each config at each head dim it has a build for; CI: "bm64" and the head dim's default
FORWARD_BUILDS = [(c, d) if c in ("bm64", flash.DEFAULT_CONFIG[d]) else nightly_case(
    c, d, reason="a forward config that is not the head dim's default (SSMC_CUDA_FLASH_FORWARD picks it)")
    for d in flash.HEAD_DIMS for c in ["bm64", *NEW_CONFIGS] if d in flash.CONFIGS[c]]


@pytest.mark.skipif(not nvrtc.available(), reason="no NVRTC")
@pytest.mark.parametrize("config, d", FORWARD_BUILDS)
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", ["alibi", "window", "softcap_empty_rows"])
def test_flash_forward_compiles_without_spills(arch, d, name, config):
    """No spills, at most 255 registers; static shared memory within 48 KiB ("bm64"), dynamic within
    the 227 KiB an sm_80 / sm_90 block may have and small enough for one block an SM (the 128-row kernels)."""
    from ssmc.backends.cuda.source import compile_options

    kname, text = flash.kernel_source(SPECS[name].program, d, True, config)
    compiled = nvrtc.compile_source(text, arch=arch, options=compile_options(text))
    usage = compiled.resources[kname]
    assert not usage.spills and usage.registers <= 255, str(usage)
    assert usage.shared_bytes <= 48 * 1024
    dynamic = flash.config(d, config).shared(d)
    assert (dynamic == 0) == (config == "bm64") and usage.shared_bytes + dynamic <= 160 * 1024


@pytest.mark.skipif(not nvrtc.available(), reason="no NVRTC")
@pytest.mark.parametrize("config, d", [(c, d) for c in ("wg128", "wg128s") for d in flash.HEAD_DIMS
                                      if d in flash.CONFIGS[c]])
@pytest.mark.parametrize("name", ["alibi", "window", "softcap_empty_rows"])
def test_wgmma_forward_compiles_for_sm_90a_without_spills(config, d, name):
    """The wgmma kernels for sm_90a: no spills, and shared memory for one block an SM."""
    from ssmc.backends.cuda.source import compile_options

    kname, text = flash.kernel_source(SPECS[name].program, d, True, config)
    compiled = nvrtc.compile_source(text, arch="sm_90a", options=compile_options(text))
    usage = compiled.resources[kname]
    assert not usage.spills and usage.registers <= 255, str(usage)
    assert usage.shared_bytes == 0 and flash.config(d, config).shared(d) <= 227 * 1024


def test_the_wgmma_config_is_refused_off_sm_90(monkeypatch):
    assert flash.config(128, "wg128").wgmma and flash.config(128, "wg128").arch == "sm_90a"
    assert flash.config(64).name == flash.DEFAULT_CONFIG[64]  # no device: not the Hopper default
    monkeypatch.setitem(flash._HOPPER, 0, False)
    with pytest.raises(ValueError, match="sm_90"):
        flash.config(128, "wg128", torch.device("cuda", 0))
    monkeypatch.setitem(flash._HOPPER, 0, True)
    monkeypatch.delenv("SSMC_CUDA_FLASH_FORWARD", raising=False)
    assert flash.config(128, None, torch.device("cuda", 0)).name == flash.HOPPER_CONFIG[128]


# -- on a GPU -------------------------------------------------------------------------------------------

GPU_LENGTHS = [1, 7, 180, 1000, 4097]


def _gpu_inputs(program, length, dtype, heads=4, d=128, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn((2, heads, length, d), device="cuda", dtype=dtype, generator=gen) for _ in range(3))
    params = {}
    for p in program.params:
        params[p.name] = (2.0 ** (-8.0 * torch.rand(heads, device="cuda")) if p.name == "slope"
                          else 1.0 + torch.rand(heads, device="cuda"))
    return q, k, v, params


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "alibi", "window", "full", "softcap_empty_rows"])
@pytest.mark.parametrize("length", GPU_LENGTHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_flash_forward_matches_the_tiled_path(name, length, dtype, monkeypatch):
    from ssmc.backends.tiled_attention import TiledAttention

    dtype = getattr(torch, dtype)
    program = SPECS[name].program
    q, k, v, params = _gpu_inputs(program, length, dtype)
    tiled = TiledAttention(program)
    call = tiled.bind(q, k, v, "b h t ...", params)
    assert flash.call_unsupported(call) is None
    out, lse = flash.FlashForward(program)(call)
    monkeypatch.setenv("SSMC_CUDA_FLASH", "0")
    want_out, want_lse = tiled.forward(call)
    torch.cuda.synchronize()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    assert (lse[fin] - want_lse[fin]).abs().max().item() < 2e-3
    tol = 1.6e-2 if dtype == torch.bfloat16 else 2e-3  # about one ulp of the 16-bit result
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS)
@pytest.mark.parametrize("name", ["causal", "alibi", "window", "full", "softcap_empty_rows"])
@pytest.mark.parametrize("length", GPU_LENGTHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_bm128_forward_matches_the_tiled_path(config, name, length, dtype, d, monkeypatch):
    """The 128-row kernels at both head dims against the tiled path (float32 products of the same
    16-bit inputs), the fp32 output (out32) too, which starts as NaN: an element not written fails."""
    from ssmc.backends.tiled_attention import TiledAttention

    dtype = getattr(torch, dtype)
    program = SPECS[name].program
    q, k, v, params = _gpu_inputs(program, length, dtype, d=d)
    tiled = TiledAttention(program)
    call = tiled.bind(q, k, v, "b h t ...", params)
    out32 = torch.full(q.shape, float("nan"), device="cuda")
    out, lse = flash.FlashForward(program, config=config)(call, out32)
    monkeypatch.setenv("SSMC_CUDA_FLASH", "0")
    want_out, want_lse = tiled.forward(call)
    torch.cuda.synchronize()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    fin = torch.isfinite(want_lse)
    assert (lse[fin] - want_lse[fin]).abs().max().item() < 2e-3
    tol = 1.6e-2 if dtype == torch.bfloat16 else 2e-3  # about one ulp of the 16-bit result
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    # out32 is unrounded, but its P V product took P rounded to 16 bits (up to 2^-8 of p in bf16): out's tolerance
    torch.testing.assert_close(out32, want_out.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS)
@pytest.mark.parametrize("length", [1, 180, 4097])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_bm128_forward_through_the_switch_matches_sdpa(config, length, d, monkeypatch):
    """SSMC_CUDA_FLASH_FORWARD picks the kernel of a compiled spec's call (its name in the loaded
    functions), and the causal output matches SDPA's."""
    from ssmc.backends.cuda.kernels import loaded

    monkeypatch.setenv("SSMC_CUDA_FLASH_FORWARD", config)
    program = SPECS["causal"].program
    q, k, v, _ = _gpu_inputs(program, length, torch.bfloat16, d=d)
    got = torch.as_tensor(SPECS["causal"].compile(layout="b h t ...")(q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)
    assert any(f"_{config}_" in key[3] for key in loaded._functions)


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS)
def test_gpu_bm128_forward_at_the_benchmark_shape_matches_bm64(config):
    """B4 H16 L4096 d128 bf16 causal + ALiBi: the 128-row kernel's output and lse against the 64-row
    kernel's (the same rounding points: within a 16-bit ulp and fp32 sums)."""
    from ssmc.backends.tiled_attention import TiledAttention

    program = SPECS["alibi"].program
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn((4, 16, 4096, 128), device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    slope = 2.0 ** (-8.0 * torch.arange(1, 17, device="cuda", dtype=torch.float32) / 16)
    call = TiledAttention(program).bind(q, k, v, "b h t ...", {"slope": slope})
    out, lse = flash.FlashForward(program, config=config)(call)
    want, want_lse = flash.FlashForward(program, config="bm64")(call)
    assert (lse - want_lse).abs().max().item() < 1e-3
    torch.testing.assert_close(out.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("length", GPU_LENGTHS)
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_flash_causal_matches_sdpa(length, d):
    program = SPECS["causal"].program
    q, k, v, _ = _gpu_inputs(program, length, torch.bfloat16, d=d)
    f = SPECS["causal"].compile(layout="b h t ...")
    got = torch.as_tensor(f(q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.gpu
def test_gpu_tiled_forward_runs_the_flash_kernel_and_the_switch_turns_it_off(monkeypatch):
    from ssmc.backends.tiled_attention import TiledAttention

    program = SPECS["alibi"].program
    q, k, v, params = _gpu_inputs(program, 300, torch.bfloat16)
    tiled = TiledAttention(program)
    call = tiled.bind(q, k, v, "b h t ...", params)
    out, _ = tiled.forward(call)
    assert out.dtype == torch.bfloat16  # the kernel's (the tiled path's is fp32)
    monkeypatch.setenv("SSMC_CUDA_FLASH", "0")
    out0, _ = tiled.forward(call)
    assert out0.dtype == torch.float32
    torch.testing.assert_close(out.float(), out0, atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_gpu_gradients_flow_through_ssmc_torch_function():
    import ssmc.torch

    program = SPECS["alibi"].program
    q, k, v, params = _gpu_inputs(program, 200, torch.bfloat16, d=64)
    fn = ssmc.torch.function(SPECS["alibi"], layout="b h t ...")
    q.requires_grad_(True)
    out = fn(q, k, v, params["slope"])
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    assert math.isfinite(out.float().sum().item())


# -- plugged into the tiled path: the whole call on the emulator (SSMC_CUDA_EMULATE=1, CPU tensors) ---------

@needs_emulator
@pytest.mark.parametrize("layout, config", [("b h t ...", None), ("b t h ...", None), ("b t h ...", "bm128w8")])
def test_emulated_call_through_the_tiled_path_runs_the_kernel(layout, config, monkeypatch):
    """A compiled spec's call on CPU bf16 tensors with the emulator on: bind, the params' table, the
    spans and the launch of `TiledAttention.forward`'s flash branch, in both layouts, in the default
    config and a 128-row one (SSMC_CUDA_FLASH_FORWARD); SSMC_CUDA_FLASH=0 gives the tiled path's answer back."""
    from ssmc.backends.tiled_attention import TiledAttention

    if config is not None:
        monkeypatch.setenv("SSMC_CUDA_FLASH_FORWARD", config)

    program = SPECS["alibi"].program
    rng = np.random.default_rng(5)
    sizes = {"b": 2, "h": 3, "d": 64}
    lq = 40
    shape = (2, 3, lq, 64) if layout == "b h t ..." else (2, lq, 3, 64)
    q, k, v = (torch.from_numpy(rng.standard_normal(shape)).to(torch.bfloat16) for _ in range(3))
    slope = torch.from_numpy(_params(program, sizes, rng)["slope"])
    tiled = TiledAttention(program)
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    got, got_lse = tiled(q, k, v, layout, {"slope": slope}, return_lse=True)
    assert tiled.flash_reason is None
    if config is not None:  # the switch's kernel ran (loaded on the emulator)
        from ssmc.backends.cuda.kernels import loaded

        assert any(key[0] == "cpu" and f"_{config}_" in key[3] for key in loaded._functions)
    monkeypatch.setenv("SSMC_CUDA_FLASH", "0")
    want, want_lse = tiled(q, k, v, layout, {"slope": slope}, return_lse=True)
    assert tiled.flash_reason == "SSMC_CUDA_FLASH=0"
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)  # a bf16 ulp apart at most
    assert got_lse.dtype == want_lse.dtype == torch.float32
    assert (got_lse - want_lse).abs().max().item() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("lq, lk", [(7, 1000), (1000, 7), (180, 4097)])
def test_gpu_time_major_layout_and_lq_apart_from_lk(lq, lk, monkeypatch):
    """Layout "b t h ...", Lq != Lk, d64 fp16: the compiled spec's call against SSMC_CUDA_FLASH=0's."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn((2, lq, 4, 64), device="cuda", dtype=torch.float16, generator=gen)
    k, v = (torch.randn((2, lk, 4, 64), device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
    slope = 2.0 ** (-8.0 * torch.rand(4, device="cuda"))
    f = SPECS["alibi"].compile(layout="b t h ...")
    got = torch.as_tensor(f(q, k, v, slope=slope))
    monkeypatch.setenv("SSMC_CUDA_FLASH", "0")
    want = torch.as_tensor(f(q, k, v, slope=slope))
    assert got.shape == want.shape == (2, lq, 4, 64)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-3)
