"""Head dim 256 on the flash kernels: the configs chosen there, every d 256 kernel's NVRTC build for sm_80 and
sm_90 without spills, the forward, backward (dQ, dK, dV and a param's gradient) and decode on the CPU emulator
(SSMC_CUDA_EMULATE=1) against the interpreter and the float64 tiled path, and on a GPU (``-m gpu``) against
torch's SDPA."""

from __future__ import annotations

import numpy as np
import pytest

import ssmc
from ssmc.backends.cuda import nvrtc
from ssmc.backends.cuda.kernels.flash import backward as flash_bwd
from ssmc.backends.cuda.kernels.flash import decode
from ssmc.backends.cuda.kernels.flash import forward as flash

torch = pytest.importorskip("torch")

from profiles import nightly_case  # noqa: E402
from test_attention_gqa import GQA, _emulated_gradients_match_float64, _emulated_inputs  # noqa: E402
from test_flash_attention import SPECS, _check, _run_emulated, needs_emulator  # noqa: E402
from test_flash_backward import _check as _check_grads  # noqa: E402
from test_flash_backward import _run_emulated as _run_emulated_backward  # noqa: E402

D = 256
# an sm_80 block's dynamic and static shared memory together, and an sm_90 block's
SHARED_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024, "sm_90a": 227 * 1024}


# -- the configs ---------------------------------------------------------------------------------------------

def test_d256_configs_and_the_options_fallback(monkeypatch):
    """d 256 takes "bm128w8" (Q from shared memory, key tiles of 32) forward, "wg128" with key tiles of 64 on sm_90
    parts, and the split "w8q16s2" backward; a config the options
    name without a d 256 build gives way to the default, one named in the call is a ValueError; the dQ kernel
    mode sums dQ by atomics at d 256; d 64 and 128 keep theirs."""
    assert flash.config(D) == flash.Config("bm128w8", 128, 32, 8, qreg=False)
    assert flash.HOPPER_CONFIG[D] == "wg128" and flash.CONFIGS["wg128"][D] == flash.Config("wg128", 128, 64, 8,
                                                                                            wgmma=True)
    assert flash_bwd.config(D) == flash_bwd.Config("w8q16s2", 8, 16, split=2)
    assert flash_bwd.config(D).bn == 64 and flash_bwd.config(D).gqa
    assert (flash.DEFAULT_CONFIG[64], flash.DEFAULT_CONFIG[128]) == ("bm128w4", "bm128w4")
    assert (flash_bwd.DEFAULT_CONFIG[64], flash_bwd.DEFAULT_CONFIG[128]) == ("w4q64", "w8q32")
    monkeypatch.setenv("SSMC_CUDA_FLASH_FORWARD", "bm128w4")
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD_CONFIG", "w4q64")
    monkeypatch.setenv("SSMC_CUDA_FLASH_DQ", "kernel")
    assert flash.config(D).name == "bm128w8" and flash.config(128).name == "bm128w4"
    assert flash_bwd.config(D).name == "w8q16s2" and flash_bwd.config(128).name == "w4q64"
    assert flash_bwd.atomic_dq(D) and not flash_bwd.atomic_dq(128)
    with pytest.raises(ValueError, match="no build at head dim 256"):
        flash.config(D, "wg128s")
    with pytest.raises(ValueError, match="no build at head dim 256"):
        flash_bwd.config(D, "wgws")
    with pytest.raises(ValueError, match="dQ kernel"):
        flash_bwd.dq_source(SPECS["causal"].program, D, True)
    assert decode.THREADS[D] == 256 and decode.fitted_splits(1000, D, 64) == 32  # 32 keys a pass


# -- NVRTC: every d 256 kernel builds for sm_80 and sm_90 without spills --------------------------------------

def _resources(kname: str, text: str, arch: str):
    from ssmc.backends.cuda.source import compile_options

    return nvrtc.compile_source(text, arch=arch, options=compile_options(text)).resources[kname]


def _fits(usage, dynamic: int, arch: str):
    assert not usage.spills and usage.registers <= 255, str(usage)
    assert usage.shared_bytes <= 48 * 1024 and usage.shared_bytes + dynamic <= SHARED_LIMIT[arch], str(usage)


# the multi-head builds at d 256: test_flash_attention's and test_flash_backward's spill tests, the decode kernel's
# test_attention_step's; here the GQA builds

@pytest.mark.skipif(not nvrtc.available(), reason="no NVRTC")
@pytest.mark.parametrize("config, arch", [("bm128w8", "sm_80"), ("bm128w8", "sm_90"), ("wg128", "sm_90a")])
@pytest.mark.parametrize("name", ["alibi", nightly_case("window", reason="a second spec")])
def test_d256_gqa_forward_compiles_without_spills(config, arch, name):
    """The forward's d 256 configs' GQA builds (the mma.sync one for sm_80 and sm_90, the wgmma one for sm_90a):
    no spills, shared memory within a block's."""
    kname, text = flash.kernel_source(SPECS[name].program, D, True, config, gqa=True)
    assert "_gqa_" in kname
    _fits(_resources(kname, text, arch), flash.CONFIGS[config][D].shared(D), arch)


@pytest.mark.skipif(not nvrtc.available(), reason="no NVRTC")
def test_wgmma_products_take_the_instruction_of_their_n():
    """wgmma's mma_rs (as mma_ss) runs the m64nNk16 wrapper of its own N: at N = 256 (the d 256 forward's P V) the
    n256 instruction on 128 accumulators a thread, at an N without a wrapper a compile error (the dispatch once ran
    the n128 wrapper for any N but 64: O's columns past 128 stayed zero on the GPU, while the emulator computed
    them all)."""
    from ssmc.backends.cuda.kernels import wgmma

    def probe(n: int) -> str:
        return wgmma.header() + f"""
extern "C" __global__ void probe(float* out, unsigned long long db) {{
    float d[{n // 2}];
    const unsigned a[4] = {{0u, 0u, 0u, 0u}};
    for (int i = 0; i < {n // 2}; ++i) d[i] = out[i];
    ssmc_wgmma::fence();
    ssmc_wgmma::mma_rs<{n}, true, true>(d, a, db, true);
    ssmc_wgmma::commit();
    ssmc_wgmma::wait<0>();
    for (int i = 0; i < {n // 2}; ++i) out[i] = d[i];
}}
"""

    assert 256 in wgmma.SHAPES
    nvrtc.compile_source(probe(256), arch="sm_90a")
    with pytest.raises(nvrtc.NvrtcError, match="m64nNk16 wrapper of this N"):
        nvrtc.compile_source(probe(192), arch="sm_90a")


@pytest.mark.skipif(not nvrtc.available(), reason="no NVRTC")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", ["alibi", "window", nightly_case("softcap_empty_rows", reason="a third spec")])
def test_d256_gqa_backward_compiles_without_spills(arch, name):
    """The key-block kernel's GQA build at d 256 ("w8q16s2", atomic dQ: the only dQ there), and the delta
    kernel: no spills, shared memory within a block's."""
    cfg = flash_bwd.config(D)
    kname, text = flash_bwd.kernel_source(SPECS[name].program, D, True, atomic_dq=True, config_name=cfg.name, gqa=True)
    assert "_gqa_" in kname
    _fits(_resources(kname, text, arch), cfg.shared(D, True), arch)
    if name == "alibi":
        for out32 in (False, True):
            _fits(_resources(*flash_bwd.delta_source(D, True, out32), arch), 0, arch)


# -- the CPU emulator --------------------------------------------------------------------------------------

# one row, a partial key tile (7), several tiles and two query blocks (130 over tiles of 32), Lq != Lk both
# ways, a window of 20 (skipped tiles); "wg128" (wgmma, its P V product an n256 instruction): several key tiles of
# 64 and a partial one, two query blocks and a window
_TWO_BLOCKS = "two query blocks of 128 rows: the window case has them"
FORWARD_CASES = [("bm128w8", "causal", 1, 1), ("bm128w8", "causal", 7, 7),
                 nightly_case("bm128w8", "causal", 130, 130, reason=_TWO_BLOCKS),
                 ("bm128w8", "window", 65, 65), ("bm128w8", "alibi", 65, 7), ("bm128w8", "alibi", 7, 65),
                 ("bm128w8", "window", 130, 65), ("wg128", "alibi", 65, 130), ("wg128", "window", 130, 65)]


@needs_emulator
@pytest.mark.parametrize("config, name, lq, lk", FORWARD_CASES)
def test_emulated_d256_forward_matches_the_interpreter(config, name, lq, lk):
    """out and lse of the d 256 forward configs, bf16, against the interpreter in float64 (same tolerances as d
    64 and 128; "wg128" through the wgmma emulation of the instructions the GPU runs)."""
    _check(*_run_emulated(name, lq, lk, 1, d=D, bf16=True, seed=lq + 3 * lk, config=config), bf16=True)


# the backward's default at d 256 ("w8q16s2": blocks of 64 keys, query tiles of 16): one row, a partial key
# block, Lq != Lk both ways (several query tiles a block, several key blocks), a window, ALiBi's slope gradient
BACKWARD_CASES = [("causal", 1, 1), ("alibi", 7, 7), ("alibi", 65, 65), ("window", 65, 65), ("alibi", 65, 7),
                  ("causal", 7, 130)]


@needs_emulator
@pytest.mark.parametrize("name, lq, lk", BACKWARD_CASES)
def test_emulated_d256_backward_matches_the_tiled_backward(name, lq, lk, monkeypatch):
    """dq, dk, dv (and the slope's gradient) of the d 256 backward, bf16, against the float64 tiled backward."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    assert flash_bwd.config(D).name == "w8q16s2"
    _check_grads(*_run_emulated_backward(name, lq, lk, 1, d=D, seed=lq + 5 * lk))


@needs_emulator
def test_emulated_d256_fp16_forward_and_backward(monkeypatch):
    """fp16 inputs at d 256: the forward (ALiBi, Lq != Lk) and the backward (causal, several key blocks) within
    fp16's tolerances."""
    _check(*_run_emulated("alibi", 65, 7, 1, d=D, bf16=False, seed=4, config="bm128w8"), bf16=False)
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    _check_grads(*_run_emulated_backward("causal", 7, 130, 1, d=D, bf16=False, seed=5), bf16=False)


@needs_emulator
def test_emulated_d256_gqa_reads_kv_heads_unrepeated(monkeypatch):
    """2 query heads on 1 KV head (batch 2) at d 256: the forward and the key-block kernel's GQA build (dK and dV summed
    over the group in registers) with no repeat of k or v, against the float64 tiled path."""
    x, slope, rng = _emulated_inputs(11, 2, 1, 20, 33, d=D)
    assert _emulated_gradients_match_float64(GQA.program, x, slope, rng, monkeypatch) == (None, None)


@needs_emulator
@pytest.mark.parametrize("name, length, splits", [("alibi", 40, 2), ("window", 33, None)])
def test_emulated_d256_decode_steps_equal_the_full_call(name, length, splits, monkeypatch):
    """The decode kernel at d 256 (256 threads a block, a key a warp), step by step, against the interpreter's
    full call from the same bf16 inputs (the output rounded to bf16 once); two splits combined."""
    from test_attention_step import _inputs, _want
    from test_flash_attention import OUT_TOL

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    q, k, v, params = _inputs(name, length, b=1, h=1, d=D, seed=3)
    q, k, v = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v))
    s = ssmc.step(SPECS[name], backend="cuda", layout="b h t ...")
    s.splits = splits
    cache = s.cache({"b": 1, "h": 1, "d": D}, max_len=length, dtype=torch.bfloat16)
    outs = []
    for t in range(length):
        y = s(q[:, :, t].contiguous(), k[:, :, t].contiguous(), v[:, :, t].contiguous(), cache,
              **{n: torch.from_numpy(x) for n, x in params.items()})
        assert s.kernel_reason is None, s.kernel_reason
        outs.append(y.double().numpy().copy())
    got = np.stack(outs, axis=2)
    want = _want(name, *(x.double().numpy() for x in (q, k, v)), params)
    np.testing.assert_allclose(got, want, atol=OUT_TOL[True], rtol=0)
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)


# -- on a GPU: against SDPA ----------------------------------------------------------------------------------

def _gpu_qkv(b, hq, hkv, length, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((b, hq, length, D), device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn((b, hkv, length, D), device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    return q, k, v, torch.randn((b, hq, length, D), device="cuda", dtype=torch.bfloat16, generator=gen)


def _sdpa_grads(q, k, v, do, group):
    """(out, dq, dk, dv) of SDPA, causal, in float32 from the same bf16 inputs (k, v repeated to q's heads)."""
    x = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    kk, vv = (t.repeat_interleave(group, dim=1) for t in x[1:])
    out = torch.nn.functional.scaled_dot_product_attention(x[0], kk, vv, is_causal=True)
    return (out, *torch.autograd.grad(out, x, do.float()))


@pytest.mark.gpu
@pytest.mark.parametrize("hkv", [4, 2])
def test_gpu_d256_forward_and_backward_match_sdpa(hkv):
    """B2 H4 L1000 d 256 bf16 causal through ssmc.torch (the flash forward and backward, GQA with 2 KV heads):
    out, dq, dk, dv within bf16's tolerance of SDPA's in float32 (relative error in norm, and the largest
    error against the largest value)."""
    import ssmc.torch

    spec = SPECS["causal"] if hkv == 4 else ssmc.attention(mask_mod=ssmc.causal, batch="b h", head_dim="d",
                                                            kv_heads="h")
    q, k, v, do = _gpu_qkv(2, 4, hkv, 1000, seed=hkv)
    f = ssmc.torch.function(spec, layout="b h t ...")
    x = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = f(*x)
    got = (out, *torch.autograd.grad(out, x, do))
    assert f.tiled.flash_reason is None and f.tiled.flash_backward_reason is None
    want = _sdpa_grads(q, k, v, do, 4 // hkv)
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        assert g.shape == w.shape, name
        diff = g.float() - w
        assert diff.norm() <= 2e-2 * w.norm(), f"{name}: relative error {(diff.norm() / w.norm()).item():.3g}"
        err = diff.abs().max().item()
        assert err <= 4e-2 * w.abs().max().item(), f"{name}: max error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["wg128", "bm128w8"])
@pytest.mark.parametrize("b, hq, hkv, length", [(2, 4, 4, 1000), (2, 4, 2, 1000), (4, 16, 16, 4096)])
def test_gpu_d256_forward_configs_match_sdpa(config, b, hq, hkv, length, monkeypatch):
    """Each d 256 forward config named by SSMC_CUDA_FLASH_FORWARD (the sm_90a "wg128", the default on sm_90
    parts; the mma.sync "bm128w8", the default elsewhere), causal bf16, GQA too: out within bf16's tolerance of
    SDPA's in float32 (relative error in norm, the largest error against the largest value), every column of it
    (wg128's P V product is one n256 instruction a k-step)."""
    import ssmc.torch
    from ssmc.backends.cuda.kernels import loaded

    if config == "wg128" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma config needs an sm_90 GPU")
    monkeypatch.setenv("SSMC_CUDA_FLASH_FORWARD", config)
    spec = SPECS["causal"] if hkv == hq else ssmc.attention(mask_mod=ssmc.causal, batch="b h", head_dim="d",
                                                            kv_heads="h")
    q, k, v, _ = _gpu_qkv(b, hq, hkv, length, seed=length + hkv)
    f = ssmc.torch.function(spec, layout="b h t ...")
    got = f(q, k, v).float()
    assert f.tiled.flash_reason is None, f.tiled.flash_reason
    assert any("_d256_" in key[3] and f"_{config}_" in key[3] for key in loaded._functions)
    kk, vv = (t.float().repeat_interleave(hq // hkv, dim=1) for t in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), kk, vv, is_causal=True)
    diff = got - want
    assert diff.norm() <= 2e-2 * want.norm(), f"relative error {(diff.norm() / want.norm()).item():.3g}"
    for half in (slice(0, 128), slice(128, 256)):
        err = diff[..., half].abs().max().item()
        assert err <= 4e-2 * want.abs().max().item(), f"columns {half}: max error {err:.3g}"


@pytest.mark.gpu
def test_gpu_d256_decode_matches_sdpa():
    """B2 H4 d 256 bf16, 3000 tokens prefilled then one causal step (several splits): against SDPA on the cache."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    s = ssmc.step(SPECS["causal"], backend="cuda", layout="b h t ...")
    cache = s.cache({"b": 2, "h": 4, "d": D}, max_len=3001, dtype=torch.bfloat16, device="cuda")
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    cache.length = 3000
    q, k, v = (torch.randn(2, 4, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    out = s(q, k, v, cache)
    assert s.kernel_reason is None, s.kernel_reason
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, None].float(), cache.k.float(),
                                                            cache.v.float())[:, :, 0]
    torch.testing.assert_close(out.float(), want, atol=1.6e-2, rtol=1.6e-2)
