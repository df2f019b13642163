"""Grouped-query attention (`ssmc.attention(..., kv_heads="h")`): k and v with fewer heads than q.

Every path (the interpreter, the tiled torch path on the CPU, `ssmc.grad`, the torch function's
autograd; the flash kernels on a GPU) against the same attention with k and v repeated to q's heads
by hand, each KV head serving `Hq / Hkv` query heads in a row: outputs equal, q's gradient equal, k's
and v's the repeated ones' summed over each group. Errors before compute for heads that do not divide.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import ssmc
from ssmc.errors import SpecError

torch = pytest.importorskip("torch")

from profiles import nightly, nightly_case  # noqa: E402

import ssmc.torch  # noqa: E402


def alibi(score, q_idx, kv_idx, slope: ssmc.Param["h"]):
    return score - slope * (q_idx - kv_idx)


GQA = ssmc.attention(score_mod=alibi, mask_mod=ssmc.causal, batch="b h", head_dim="d", kv_heads="h")
MHA = ssmc.attention(score_mod=alibi, mask_mod=ssmc.causal, batch="b h", head_dim="d")
LAYOUT = "b h t ..."


def _inputs(rng, hq=6, hkv=2, lq=7, lk=7, d=8, e=8):
    return {"q": rng.standard_normal((2, hq, lq, d)), "k": rng.standard_normal((2, hkv, lk, d)),
            "v": rng.standard_normal((2, hkv, lk, e)), "slope": rng.uniform(0.1, 1.0, hq)}


def _repeated(a: dict) -> dict:
    group = a["q"].shape[1] // a["k"].shape[1]
    return {**a, "k": np.repeat(a["k"], group, axis=1), "v": np.repeat(a["v"], group, axis=1)}


def _summed(g: np.ndarray, hkv: int) -> np.ndarray:
    return g.reshape(g.shape[0], hkv, -1, *g.shape[2:]).sum(2)


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
@pytest.mark.parametrize("hq, hkv, lq, lk", [(6, 2, 7, 7), (4, 4, 1, 9), (4, 1, 180, 65)])
def test_gqa_forward_and_gradients_match_repeated_heads(backend, hq, hkv, lq, lk):
    """`backend` "numba" runs the tiled torch path (float64, CPU); "interpreter" the interpreter."""
    rng = np.random.default_rng(hq + 10 * lq)
    a = _inputs(rng, hq, hkv, lq, lk)
    got = ssmc.compile(GQA, backend, layout=LAYOUT)(**a)
    want = ssmc.compile(MHA, "interpreter", layout=LAYOUT)(**_repeated(a))
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    cot = rng.standard_normal(want.shape)
    grads = ssmc.grad(GQA, backend, layout=LAYOUT)(**a, grad_outputs=cot)
    full = ssmc.grad(MHA, "interpreter", layout=LAYOUT)(**_repeated(a), grad_outputs=cot)
    assert grads["k"].shape == a["k"].shape and grads["v"].shape == a["v"].shape
    for name in ("q", "slope"):
        np.testing.assert_allclose(grads[name], full[name], rtol=1e-9, atol=1e-11, err_msg=name)
    for name in ("k", "v"):
        np.testing.assert_allclose(grads[name], _summed(full[name], hkv), rtol=1e-9, atol=1e-11, err_msg=name)


def test_gqa_torch_function_autograd():
    """The torch function's backward hands k and v gradients of their own (fewer) heads, equal to torch
    autograd through repeat_interleave of the same attention without GQA."""
    rng = np.random.default_rng(3)
    a = {n: torch.tensor(x, requires_grad=True) for n, x in _inputs(rng, 4, 2, 33, 33).items()}
    out = ssmc.torch.function(GQA, layout=LAYOUT)(**a)
    cot = torch.tensor(rng.standard_normal(out.shape))
    got = torch.autograd.grad(out, list(a.values()), cot)
    rep = {**a, "k": a["k"].repeat_interleave(2, dim=1), "v": a["v"].repeat_interleave(2, dim=1)}
    ref = ssmc.torch.function(MHA, layout=LAYOUT)(**rep)
    want = torch.autograd.grad(ref, list(a.values()), cot)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for name, g, w in zip(a, got, want):
        assert g.shape == a[name].shape
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=name)


def test_gqa_errors_before_compute():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"'k'/'v' have 4 heads along 'h', which does not divide the 6 of 'q'"):
        ssmc.compile(GQA, "interpreter", layout=LAYOUT)(**_inputs(rng, 6, 4))
    with pytest.raises(ValueError, match=r"size 6 in 'q' but 2 in 'k'/'v' \(ssmc.attention\(\.\.\., kv_heads"):
        ssmc.compile(MHA, "interpreter", layout=LAYOUT)(**_inputs(rng, 6, 2))
    with pytest.raises(ValueError, match=r"size 3 in 'q' but 2"):  # only the kv_heads axis may differ
        a = _inputs(rng, 4, 2)
        a["q"] = np.concatenate([a["q"], a["q"][:1]], axis=0)  # batch 3 against k's and v's 2
        ssmc.compile(GQA, "interpreter", layout=LAYOUT)(**a)
    with pytest.raises(SpecError, match="kv_heads 'g' is not one of the batch axes"):
        ssmc.attention(mask_mod=ssmc.causal, batch="b h", kv_heads="g")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_gqa_flash_matches_repeated_heads(d):
    """bf16 on the flash kernels, 8 query heads on 2 KV heads, against the float64 tiled path of the
    repeated heads: outputs and every gradient within bf16's tolerance."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rng = np.random.default_rng(d)
    a = _inputs(rng, 8, 2, 300, 300, d, d)
    f = ssmc.torch.function(GQA, layout=LAYOUT)
    x = {n: torch.tensor(v, device="cuda", dtype=torch.bfloat16 if n != "slope" else torch.float32,
                         requires_grad=True) for n, v in a.items()}
    out = f(**x)
    cot = torch.tensor(rng.standard_normal(out.shape), device="cuda", dtype=torch.bfloat16)
    got = torch.autograd.grad(out, list(x.values()), cot)
    ref_in = {n: t.detach().double().requires_grad_(True) for n, t in x.items()}
    rep = {**ref_in, "k": ref_in["k"].repeat_interleave(4, dim=1), "v": ref_in["v"].repeat_interleave(4, dim=1)}
    ref = ssmc.torch.function(MHA, layout=LAYOUT)(**rep)
    want = torch.autograd.grad(ref, list(ref_in.values()), cot.double())
    assert f.tiled.flash_reason is None, f.tiled.flash_reason
    for name, g, w in [("out", out, ref), *zip(a, got, want)]:
        g, w = g.double(), w.detach()
        assert (g - w).norm() / w.norm() <= 2e-2, name


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
def test_gqa_decode_steps_equal_the_full_call(backend):
    """`ssmc.step` of a GQA spec: k_t and v_t with their own 2 heads, a cache of q's 6; L steps give the
    full call's outputs."""
    rng = np.random.default_rng(11)
    a = _inputs(rng, 6, 2, 9, 9)
    want = ssmc.compile(GQA, "interpreter", layout=LAYOUT)(**a)
    s = ssmc.step(GQA, backend, layout=LAYOUT)
    cache = s.cache({"b": 2, "h": 6, "d": 8}, max_len=9, dtype=None if backend == "interpreter" else torch.float64)
    tensor = np.asarray if backend == "interpreter" else torch.tensor
    for t in range(9):
        y = s(*(tensor(a[n][:, :, t]) for n in "qkv"), cache, slope=tensor(a["slope"]))
        np.testing.assert_allclose(np.asarray(y), want[:, :, t], rtol=1e-10, atol=1e-12)


# -- the flash forward reads k and v with their own heads (on the CPU emulator) ------------------------------

def test_kv_index_is_the_repeated_heads_index():
    """`kv_index` (the kernels' formula) against NumPy's repeat of the KV heads: batch axes [outer, H, inner]
    flattened, each KV head serving `group` query heads in a row."""
    from ssmc.backends.cuda.kernels.flash.forward import kv_index

    for outer, hkv, group, inner in [(1, 1, 1, 1), (2, 3, 4, 1), (3, 2, 2, 5), (1, 4, 1, 3)]:
        kv = np.arange(outer * hkv * inner).reshape(outer, hkv, inner)
        want = np.repeat(kv, group, axis=1).reshape(-1)
        got = [kv_index(bh, group, inner) for bh in range(outer * hkv * group * inner)]
        assert got == want.tolist()


GQA_HB = ssmc.attention(score_mod=alibi, mask_mod=ssmc.causal, batch="h b", head_dim="d", kv_heads="h")


def _emulated_inputs(seed, hq, hkv, lq, lk, d=64):
    """bf16 CPU tensors [b h t d] (b = 2) and the slope (float64)."""
    rng = np.random.default_rng(seed)
    a = _inputs(rng, hq, hkv, lq, lk, d, d)
    x = {n: torch.from_numpy(a[n]).to(torch.bfloat16) for n in "qkv"}
    return x, torch.from_numpy(a["slope"]), rng


def _no_repeat(monkeypatch):
    """Any repeat of k's and v's heads from here on fails the test (`prologue.repeat_heads`, which binding
    and `Call.repeated` call, and torch's repeat_interleave)."""
    from ssmc.backends import tiled_attention
    from ssmc.runtime import prologue

    def refuse(x, times, *args, **kwargs):
        if times != 1:
            raise AssertionError("k or v repeated to q's heads")
        return x
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", refuse)
    monkeypatch.setattr(prologue, "repeat_heads", refuse)
    monkeypatch.setattr(tiled_attention, "repeat_heads", refuse)


def _needs_emulator():
    from ssmc.backends.cuda import emulator

    if not emulator.available():
        pytest.skip("no C++ compiler for the CUDA emulator")


# the default config (the emulator's: mma.sync, 128 rows) at groups 4, 2 and 1; the other two templates at
# group 2 with the heads axis first (bm64; wg128s, the sm_90 default at head dim 128, its two warpgroups and
# three stages over 3 key tiles)
GQA_FORWARD_CASES = [(GQA, 4, 1, 70, 33, None), (GQA_HB, 4, 2, 33, 100, None),
                     nightly_case(GQA, 2, 2, 7, 7, None, reason="group 1: the flash tests' calls"),
                     nightly_case(GQA_HB, 4, 2, 33, 100, "bm64", reason="a forward config that is no default"),
                     (GQA_HB, 4, 2, 130, 300, "wg128s")]


@pytest.mark.parametrize("spec, hq, hkv, lq, lk, config", GQA_FORWARD_CASES)
def test_emulated_gqa_forward_reads_kv_heads_unrepeated(spec, hq, hkv, lq, lk, config, monkeypatch):
    """The flash forward on the emulator (SSMC_CUDA_EMULATE=1, CPU bf16 tensors) with k and v of their own
    heads: no repeat anywhere in the call, k's and v's own memory handed to the kernel (batch "b h",
    contiguous), out and lse as the float64 tiled path's of the same rounded inputs (k, v repeated there).
    Groups 4, 2 (batch "h b": the heads axis first, b after it in the flattened index) and 1; `config`:
    SSMC_CUDA_FLASH_FORWARD's (None: the default)."""
    _needs_emulator()
    if config is not None:
        monkeypatch.setenv("SSMC_CUDA_FLASH_FORWARD", config)
    from ssmc.backends.cuda import launch
    from ssmc.backends.tiled_attention import TiledAttention

    x, slope, _ = _emulated_inputs(hq + lq, hq, hkv, lq, lk)
    tiled = TiledAttention(spec.program)
    launched = []
    real = launch.launch_kernel
    monkeypatch.setattr(launch, "launch_kernel", lambda fn, grid, *rest, **kw: (launched.append(rest[2]),
                                                                                real(fn, grid, *rest, **kw)))
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    with monkeypatch.context() as m:
        _no_repeat(m)
        got, got_lse = tiled(x["q"], x["k"], x["v"], LAYOUT, {"slope": slope}, return_lse=True)
    assert tiled.flash_reason is None, tiled.flash_reason
    assert len(launched) == 1
    if spec is GQA:  # canonical already: the kernel reads the arguments' own memory
        assert launched[0][1:3] == [x["k"].data_ptr(), x["v"].data_ptr()]
    want, want_lse = tiled(*(x[n].double() for n in "qkv"), LAYOUT, {"slope": slope}, return_lse=True)
    assert got.shape == want.shape == (2, hq, lq, 64)
    torch.testing.assert_close(got.double(), want, atol=1.5e-2, rtol=0)
    torch.testing.assert_close(got_lse.double(), want_lse, atol=1e-4, rtol=1e-4)


GQA_GRAD_CASES = [(GQA, 4, 2, 33, 40)] + ([(GQA_HB, 4, 1, 70, 70), (GQA, 4, 4, 7, 9)] if nightly() else [])


@pytest.mark.parametrize("spec, hq, hkv, lq, lk", GQA_GRAD_CASES)
def test_emulated_gqa_gradients_match_the_float64_tiled_path(spec, hq, hkv, lq, lk, monkeypatch):
    """`TiledAttention.gradients` on the emulated flash kernels (the forward reading KV head h // group, the
    backward's key-block kernel in the emulator's default config, "w4q64", a block per KV head and key block
    summing dK and dV over the group's query heads): no repeat in the call, every gradient of k's and v's own
    heads within bf16's tolerance of the float64 tiled path's."""
    _needs_emulator()
    x, slope, rng = _emulated_inputs(hq + 7 * lq, hq, hkv, lq, lk)
    _, backward_reason = _emulated_gradients_match_float64(spec.program, x, slope, rng, monkeypatch)
    assert backward_reason is None, backward_reason


def _emulated_gradients_match_float64(program, x: dict, slope, rng, monkeypatch):
    """`TiledAttention.gradients` of `program` on `x` (bf16 q, k, v [b h t d], k and v of their own heads) and
    `slope` with the flash kernels emulated and no repeat of k and v allowed (`_no_repeat`), against the float64
    tiled path: every gradient within bf16's tolerance (q, k, v 2e-2, the slope 1e-2 of the largest value).
    Returns (flash_reason, flash_backward_reason) of the bf16 call, for the caller to check."""
    from ssmc.backends.tiled_attention import TiledAttention

    b, hq, lq, d = x["q"].shape
    cot = torch.from_numpy(rng.standard_normal((b, hq, lq, d))).to(torch.bfloat16)
    tiled = TiledAttention(program)
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    with monkeypatch.context() as m:
        _no_repeat(m)
        got = tiled.gradients(x["q"], x["k"], x["v"], cot, LAYOUT, {"slope": slope})
    reasons = (tiled.flash_reason, tiled.flash_backward_reason)  # (the float64 call below sets its own)
    want = tiled.gradients(*(x[n].double() for n in "qkv"), cot.double(), LAYOUT, {"slope": slope})
    for name, w in want.items():
        g = got[name].double()
        assert g.shape == w.shape == (x[name].shape if name in x else slope.shape), name
        tol = (2e-2 if name in x else 1e-2) * w.abs().max().item()
        assert (g - w).abs().max().item() <= tol, name
    return reasons


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hkv", [1, 2, 4])
def test_gpu_gqa_forward_reads_kv_heads_unrepeated(d, hkv, monkeypatch):
    """The flash forward on the GPU (the device's default config) with batch "h b" (b after the heads axis
    in the flattened index) and groups 4, 2, 1 at awkward lengths: no repeat in the call, out and lse
    within bf16's tolerance of the float64 tiled path of the same inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from ssmc.backends.tiled_attention import TiledAttention

    rng = np.random.default_rng(d + hkv)
    a = _inputs(rng, 4, hkv, 333, 517, d, d)
    x = {n: torch.tensor(a[n], device="cuda", dtype=torch.bfloat16) for n in "qkv"}
    slope = torch.tensor(a["slope"], device="cuda")
    tiled = TiledAttention(GQA_HB.program)
    with monkeypatch.context() as m:
        _no_repeat(m)
        got, got_lse = tiled(x["q"], x["k"], x["v"], LAYOUT, {"slope": slope}, return_lse=True)
    assert tiled.flash_reason is None, tiled.flash_reason
    want, want_lse = tiled(*(x[n].double() for n in "qkv"), LAYOUT, {"slope": slope.double()}, return_lse=True)
    torch.testing.assert_close(got.double(), want, atol=1.5e-2, rtol=0)
    torch.testing.assert_close(got_lse.double(), want_lse, atol=1e-4, rtol=1e-4)


def _gqa_builds():
    from ssmc.backends.cuda.kernels.flash import forward as flash

    cases = []
    for d in (64, 128):
        for config in dict.fromkeys(["bm64", flash.DEFAULT_CONFIG[d], flash.HOPPER_CONFIG[d]]):
            arch = "sm_90a" if flash.CONFIGS[config][d].wgmma else "sm_90"
            for name in ("window", "alibi"):
                default = config != "bm64" and name == "window"  # the mask that pressed bm64's registers
                cases.append((config, d, arch, name) if default else
                             nightly_case(config, d, arch, name, reason="a non-default config or a second spec"))
    return cases


@pytest.mark.parametrize("config, d, arch, name", _gqa_builds())
def test_gqa_forward_kernels_compile_without_spills(config, d, arch, name):
    """The GQA forward kernels (their own build: the multi-head ones keep their registers) for the default
    configs and bm64: no spills under NVRTC, and the multi-head source reads no group."""
    from ssmc.backends.cuda import nvrtc
    from ssmc.backends.cuda.kernels.flash import forward as flash
    from ssmc.backends.cuda.source import compile_options

    if not nvrtc.available():
        pytest.skip("no NVRTC")
    from test_flash_attention import SPECS

    program = SPECS[name].program
    kname, text = flash.kernel_source(program, d, True, config, gqa=True)
    assert "_gqa_" in kname and "kv_group" in text
    assert "kv_group" not in flash.kernel_source(program, d, True, config)[1]
    usage = nvrtc.compile_source(text, arch=arch, options=compile_options(text)).resources[kname]
    assert not usage.spills and usage.registers <= 255, str(usage)


# -- the flash backward reads k and v with their own heads (wgmma key-block kernels: a block per KV head) ------

CAUSAL_GQA = ssmc.attention(mask_mod=ssmc.causal, batch="b h", head_dim="d", kv_heads="h")

# (backward config, spec, hq, hkv, lq, lk, dq mode): "wg" with ALiBi (its slope's sums flushed per query head)
# and batch "h b" (inner size 2); "wgp"'s pipelined loop (causal, no params); the dQ kernel reading KV head h // G
GQA_NATIVE_BACKWARD_CASES = [
    ("wg", GQA_HB, 4, 1, 33, 40, "atomic"),
    nightly_case("wgp", CAUSAL_GQA, 4, 2, 130, 70, "atomic", reason="the pipelined loop: wg's case walks the heads"),
    nightly_case("wg", GQA, 4, 1, 33, 40, "kernel", reason="the dQ kernel's GQA build"),
    # the warp-specialized blocks (sm_90's default at d 128): the producer's ring crosses the heads
    ("wgws", CAUSAL_GQA, 4, 2, 130, 70, "atomic"),
    ("wgws", GQA_HB, 4, 1, 33, 40, "atomic"),  # "wg"'s loop in it: the slope's sums per warp and head, I = 2
    nightly_case("wgws", CAUSAL_GQA, 4, 2, 33, 130, "atomic", reason="key blocks no query sees, several heads")]


@pytest.mark.parametrize("config, spec, hq, hkv, lq, lk, dq", GQA_NATIVE_BACKWARD_CASES)
def test_emulated_gqa_backward_reads_kv_heads_unrepeated(config, spec, hq, hkv, lq, lk, dq, monkeypatch):
    """The wgmma backward kernels on the emulator with k and v of their own heads: no repeat anywhere in the
    call (forward and backward), the key-block kernel launched once per KV head and key block (its grid a
    group's worth smaller), every gradient (dk, dv of k's and v's own heads) within bf16's tolerance of the
    float64 tiled path's."""
    _needs_emulator()
    from ssmc.backends.cuda import launch
    from ssmc.backends.cuda.kernels.flash import backward as flash_bwd
    from ssmc.backends.tiled_attention import TiledAttention

    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD_CONFIG", config)
    monkeypatch.setenv("SSMC_CUDA_FLASH_DQ", dq)
    x, slope, rng = _emulated_inputs(hq + 5 * lq, hq, hkv, lq, lk)
    params = {"slope": slope} if spec.program.params else {}
    cot = torch.from_numpy(rng.standard_normal((2, hq, lq, 64))).to(torch.bfloat16)
    tiled = TiledAttention(spec.program)
    grids = []
    real = launch.launch_kernel
    monkeypatch.setattr(launch, "launch_kernel", lambda fn, grid, *rest, **kw: (grids.append(grid),
                                                                                real(fn, grid, *rest, **kw)))
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    with monkeypatch.context() as m:
        _no_repeat(m)
        got = tiled.gradients(x["q"], x["k"], x["v"], cot, LAYOUT, params)
    assert tiled.flash_backward_reason is None, tiled.flash_backward_reason
    nkb = -(-lk // flash_bwd.CONFIGS[config][64].bn)
    assert (nkb * 2 * hkv, flash_bwd.CONFIGS[config][64].threads) in grids, grids  # a block per KV index
    want = tiled.gradients(*(x[n].double() for n in "qkv"), cot.double(), LAYOUT, params)
    for name, w in want.items():
        g = got[name].double()
        assert g.shape == w.shape == (x[name].shape if name in x else slope.shape), name
        tol = (2e-2 if name in x else 1e-2) * w.abs().max().item()
        assert (g - w).abs().max().item() <= tol, name


def _reads_group(source: str) -> bool:
    """Whether a kernel's source reads the group from the spans' tail (`forward.span_table`)."""
    return re.search(r"spans\[4 \* n[kq]b\]", source) is not None


def _gqa_backward_builds():
    from ssmc.backends.cuda.kernels.flash import backward as flash_bwd

    cases = []
    for d in (64, 128):
        for config in ("wgp", "wg", "wgws", "wgwss", flash_bwd.DEFAULT_CONFIG[d]):
            for name in ("causal", "alibi", "window", "softcap_empty_rows"):
                # CI: the GQA benchmark's kernel, and the sm_80 default's at d 128 (its registers the tightest)
                ci = d == 128 and name == "causal" and config in ("wgws", flash_bwd.DEFAULT_CONFIG[d])
                cases.append((config, d, name) if ci else
                             nightly_case(config, d, name, reason="a second config, head dim or spec"))
    return cases


@pytest.mark.parametrize("config, d, name", _gqa_backward_builds())
def test_gqa_backward_kernels_compile_without_spills(config, d, name):
    """The key-block kernels' GQA builds (with atomic dQ and without; wgmma for sm_90a, the mma.sync default
    for sm_80) and the dQ kernel's: no spills under NVRTC; the multi-head sources read no group."""
    from ssmc.backends.cuda import nvrtc
    from ssmc.backends.cuda.kernels.flash import backward as flash_bwd
    from ssmc.backends.cuda.source import compile_options

    if not nvrtc.available():
        pytest.skip("no NVRTC")
    from test_flash_attention import SPECS

    program = SPECS[name].program
    arch = "sm_90a" if flash_bwd.CONFIGS[config][d].wgmma else "sm_80"
    builds = [(*flash_bwd.kernel_source(program, d, True, atomic, config, gqa=True), arch) for atomic in (True, False)]
    if program.params and flash_bwd.CONFIGS[config][d].specialized:  # the pipelined loop reading params it sums not
        builds.append((*flash_bwd.kernel_source(program, d, True, True, config, gqa=True, param_grads=False), arch))
    if config == "wg":
        builds.append((*flash_bwd.dq_source(program, d, True, gqa=True), "sm_90"))
    for kname, text, build in builds:
        assert "_gqa_" in kname and _reads_group(text)
        usage = nvrtc.compile_source(text, arch=build, options=compile_options(text)).resources[kname]
        if (name == "softcap_empty_rows" and d == 128 and config in ("wg", "wgp", "wgws", "wgwss")
                and "_kv_" not in kname and kname.startswith("flash_bwd_d")):
            # the soft-cap (a param, dS reading the score) on "wg"'s loop: its multi-head build sits at 254
            # registers (the warp-specialized blocks': setmaxnreg's 240) and ptxas puts a word or two on the
            # stack for the group's loop
            assert usage.spill_store_bytes <= 8, str(usage)
        else:
            assert not usage.spills and usage.registers <= 255, str(usage)
    # the multi-head sources read no group from the spans' tail ("wgws" folds its head loop: a group of 1)
    assert not _reads_group(flash_bwd.kernel_source(program, d, True, True, config)[1])
    assert not _reads_group(flash_bwd.dq_source(program, d, True)[1])


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("spec", ["alibi", "causal"])
@pytest.mark.parametrize("lq, lk", [(1, 1), (65, 65), (180, 180), (65, 180), (180, 65)])
def test_gpu_gqa_backward_reads_kv_heads_unrepeated(spec, d, lq, lk, monkeypatch):
    """The flash backward on the GPU (the device's default configs: on sm_90 the wgmma kernels' GQA builds,
    "wgws" at d 128, "wgp" at d 64; ALiBi on "wg"'s loop, causal on the pipelined one) at group 4 with batch
    "h b", awkward lengths: no repeat in the call, every gradient within bf16's tolerance of the float64 tiled
    path's of the same inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from ssmc.backends.tiled_attention import TiledAttention

    program = (GQA_HB if spec == "alibi" else ssmc.attention(mask_mod=ssmc.causal, batch="h b", head_dim="d",
                                                              kv_heads="h")).program
    rng = np.random.default_rng(d + lq + 3 * lk)
    a = _inputs(rng, 8, 2, lq, lk, d, d)
    x = {n: torch.tensor(a[n], device="cuda", dtype=torch.bfloat16) for n in "qkv"}
    params = {"slope": torch.tensor(a["slope"], device="cuda")} if program.params else {}
    cot = torch.tensor(rng.standard_normal((2, 8, lq, d)), device="cuda", dtype=torch.bfloat16)
    tiled = TiledAttention(program)
    with monkeypatch.context() as m:
        _no_repeat(m)
        got = tiled.gradients(x["q"], x["k"], x["v"], cot, LAYOUT, params)
    assert tiled.flash_backward_reason is None, tiled.flash_backward_reason
    want = tiled.gradients(*(x[n].double() for n in "qkv"), cot.double(), LAYOUT,
                           {n: t.double() for n, t in params.items()})
    for name, w in want.items():
        g = got[name].double()
        assert g.shape == w.shape, name
        assert torch.isfinite(g).all(), name
        tol = (2e-2 if name in x else 1e-2) * max(w.abs().max().item(), 1e-3)
        assert (g - w).abs().max().item() <= tol, name
