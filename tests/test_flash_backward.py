"""The flash attention backward kernel (backends/cuda/kernels/flash/backward.py): its key-block spans
against brute force, the kernel run on the CPU emulator at tiny sizes against the tiled backward in
float64 (from the same 16-bit inputs), plugged into `TiledAttention.gradients` and `ssmc.torch.function`
(emulated), its NVRTC build for sm_80 / sm_90 without spills, and on a GPU (``-m gpu``) against the
tiled backward and torch autograd of SDPA."""

from __future__ import annotations

import numpy as np
import pytest

import ssmc
from ssmc.backends.cuda import emulator, nvrtc
from ssmc.backends.cuda.kernels.flash import backward as flash_bwd
from ssmc.backends.cuda.kernels.flash import forward as flash

torch = pytest.importorskip("torch")

from profiles import in_ci, nightly, nightly_case  # noqa: E402
from test_flash_attention import BRUTE_MASKS, GPU_LENGTHS, SPECS, _gpu_inputs, _params  # noqa: E402

needs_emulator = pytest.mark.skipif(not emulator.available(), reason="no C++ compiler for the CUDA emulator")

# relative to the gradient's largest entry: P, dS and dO are rounded to 16 bits as operands, dk and dv
# stored in 16 bits, delta taken from the 16-bit output (as FlashAttention)
GRAD_TOL = {True: 2e-2, False: 4e-3}
PARAM_TOL = {True: 1e-2, False: 2e-3}


# -- the spans of key blocks ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(BRUTE_MASKS))
@pytest.mark.parametrize("lq, lk", [(1, 1), (70, 70), (200, 130), (130, 300), (256, 256)])
def test_key_block_spans_are_sound_and_find_the_full_tiles(name, lq, lk):
    """Queries outside a key block's [qlo, qhi) see none of its keys; in [qflo, qfhi) every key of the
    block is visible to every query and below Lk."""
    spans = flash_bwd.key_block_spans(SPECS[name].program.mask, lq, lk, {"b": 1, "h": 1, "d": 64})
    visible = BRUTE_MASKS[name](np.arange(lq)[:, None], np.arange(lk)[None, :])
    assert len(spans) == -(-lk // flash.BN)
    for kb, (qlo, qhi, qflo, qfhi) in enumerate(spans):
        cols = visible[:, kb * flash.BN:(kb + 1) * flash.BN]
        assert not cols[:qlo].any() and not cols[qhi:].any()
        assert qflo == qfhi or (qlo <= qflo < qfhi <= qhi and (kb + 1) * flash.BN <= lk)
        assert cols[qflo:min(qfhi, lq)].all()
        if name == "causal" and lq == lk == 256:
            assert (qflo, qfhi) == ((kb + 1) * flash.BM, 256) or qflo == qfhi


@pytest.mark.parametrize("name", list(BRUTE_MASKS))
@pytest.mark.parametrize("lq, lk", [(1, 1), (70, 70), (200, 130), (130, 300), (256, 256), (300, 200)])
def test_key_block_spans_of_128_keys_are_sound(name, lq, lk):
    """The spans of the 8-warp kernel's blocks of 128 keys (two tiles of the mask's analysis merged)."""
    spans = flash_bwd.key_block_spans(SPECS[name].program.mask, lq, lk, {"b": 1, "h": 1, "d": 64}, bn=128)
    visible = BRUTE_MASKS[name](np.arange(lq)[:, None], np.arange(lk)[None, :])
    assert len(spans) == -(-lk // 128)
    for kb, (qlo, qhi, qflo, qfhi) in enumerate(spans):
        cols = visible[:, kb * 128:(kb + 1) * 128]
        assert not cols[:qlo].any() and not cols[qhi:].any()
        assert qflo == qfhi or (qlo <= qflo < qfhi <= qhi and (kb + 1) * 128 <= lk)
        assert cols[qflo:min(qfhi, lq)].all()
    if name == "causal" and lq == lk == 256:
        assert spans == [(0, 256, 128, 256), (128, 256, 0, 0)]


# -- the kernel on the CPU emulator ---------------------------------------------------------------------------

def _half(x: np.ndarray, dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)


def _run_emulated(name, lq, lk, heads, d=64, bf16=True, seed=0, monkeypatch=None):
    """(got, want): the kernel's gradients and the tiled backward's in float64 from the same 16-bit q, k,
    v, d_out (the output for delta: the float64 forward's, in fp32 for a spec with params, else rounded
    to 16 bits, as `TiledAttention` hands the forward kernel's to the backward)."""
    from ssmc.backends.tiled_attention import TiledAttention

    program = SPECS[name].program
    dtype = torch.bfloat16 if bf16 else torch.float16
    rng = np.random.default_rng(seed)
    sizes = {"b": 1, "h": heads, "d": d}
    q, do = (_half(rng.standard_normal((1, heads, lq, d)), dtype) for _ in range(2))
    k, v = (_half(rng.standard_normal((1, heads, lk, d)), dtype) for _ in range(2))
    params = {n: torch.from_numpy(np.asarray(x, np.float64)) for n, x in _params(program, sizes, rng).items()}
    tiled = TiledAttention(program)
    call64 = tiled.bind(q.double(), k.double(), v.double(), "b h t ...", params)
    out64, lse64 = tiled.forward(call64)
    want = tiled.backward(call64, lse64, do.double())
    call = tiled.bind(q, k, v, "b h t ...", params)
    assert flash.call_unsupported(call) is None
    out = out64.float() if program.params else out64.to(dtype)  # as `TiledAttention.delta_output` says
    got = flash_bwd.FlashBackward(program)(call, out, lse64.float(), do.float())
    return got, want


def _check(got, want, bf16=True):
    for name, w in want.items():
        g = got[name].double()
        assert g.shape == w.shape, name
        assert torch.isfinite(g).all(), name
        tol = (GRAD_TOL if name in "qkv" else PARAM_TOL)[bf16] * max(w.abs().max().item(), 1e-3)
        err = (g - w).abs().max().item()
        assert err <= tol, f"{name}: max error {err:.3g} over {tol:.3g}"


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")


# the emulator takes seconds a case: the larger ones only in the nightly run (tests/profiles.py); CI skips
# the sizes whose tiles another case of the mask takes too (causal: one row, a partial tile, full tiles below
# the diagonal; ALiBi: Lq above Lk, below it, several key blocks)
_SAME_TILES = "the tiles of another case of this mask (one row, a partial tile, full tiles, Lq apart from Lk)"
EMULATED_CASES = ([("causal", 1, 1), nightly_case("causal", 7, 7, reason=_SAME_TILES), ("causal", 33, 33),
                   nightly_case("causal", 70, 70, reason=_SAME_TILES), ("causal", 130, 130)]
                  + [nightly_case("alibi", 7, 7, reason=_SAME_TILES), nightly_case("alibi", 70, 70, reason=_SAME_TILES),
                     ("alibi", 70, 7), ("alibi", 7, 70), ("alibi", 33, 100),
                     ("window", 130, 130), ("full", 33, 33), ("softcap_empty_rows", 20, 20),
                     ("softcap_empty_rows", 70, 7)]
                  + ([("alibi", 130, 130), ("alibi", 33, 130), ("window", 70, 33), ("full", 70, 130)]
                     if nightly() else []))


@needs_emulator
@pytest.mark.parametrize("name, lq, lk", EMULATED_CASES)
def test_emulated_flash_backward_matches_the_tiled_backward(name, lq, lk, emulate):
    """Causal (full tiles below the diagonal at 130), ALiBi (its slope's gradient), a window of 20 (a
    skipped key block), no mask, a soft-cap with rows that see no key; Lq apart from Lk."""
    heads = 2 if max(lq, lk) <= 33 else 1
    _check(*_run_emulated(name, lq, lk, heads, seed=lq + 3 * lk))


@needs_emulator
@pytest.mark.parametrize("lq, lk", [(33, 33), (33, 70)] + ([(70, 130)] if nightly() else []))
def test_emulated_flash_backward_fp16_and_head_dim_128(lq, lk, emulate):
    _check(*_run_emulated("alibi", lq, lk, 1, d=128, bf16=False, seed=lq), bf16=False)


@needs_emulator
@pytest.mark.parametrize("name, lq, lk, d, bf16", [
    ("alibi", 130, 70, 64, True),
    nightly_case("alibi", 7, 70, 64, True, reason="Lq 130's walk: a partial query block over two key tiles"),
    ("softcap_empty_rows", 70, 7, 128, False)])
def test_emulated_flash_backward_with_the_dq_kernel(name, lq, lk, d, bf16, emulate, monkeypatch):
    """SSMC_CUDA_FLASH_DQ=kernel: the key-block kernel without atomics, then the dQ kernel per query block
    (full key tiles for query blocks 1 and 2 at Lq 130; rows without a key; fp16 d128)."""
    monkeypatch.setenv("SSMC_CUDA_FLASH_DQ", "kernel")
    _check(*_run_emulated(name, lq, lk, 1, d=d, bf16=bf16, seed=lq + lk), bf16=bf16)


@needs_emulator
@pytest.mark.parametrize("config", [
    c if c in (flash_bwd.DEFAULT_CONFIG[64], flash_bwd.HOPPER_CONFIG[64]) else nightly_case(
        c, reason="a config not d 64's default (every other emulated case runs d 64's; fp16 d 128 runs d 128's)")
    for c in flash_bwd.CONFIGS if 64 in flash_bwd.CONFIGS[c]])
@pytest.mark.parametrize("name, lq, lk", [("window", 200, 200), ("alibi", 130, 70)])
def test_emulated_flash_backward_in_each_config(config, name, lq, lk, emulate, monkeypatch):
    """SSMC_CUDA_FLASH_BACKWARD_CONFIG: the 4-warp kernel of 64 keys and small query tiles ("bn64"), and the
    kernels of query tiles of 64 (32) rows in two stages over 64 keys ("w4q64") or 128 ("w8q64", "w8q32"):
    several query tiles a block (the stages alternate), full tiles, skipped blocks (window), the last block
    past Lk."""
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD_CONFIG", config)
    assert flash_bwd.config(64).name == config
    _check(*_run_emulated(name, lq, lk, 1, seed=lq + lk))


@needs_emulator
@pytest.mark.parametrize("config, name, lq, lk, bf16", [
    ("wg", "causal", 130, 130, True),
    nightly_case("wg", "alibi", 70, 130, False,
                 reason="the wgmma kernel's d 128 split once more, with a param and fp16"),
    ("wgp", "causal", 130, 130, False),
    nightly_case("wgp", "window", 200, 200, True, reason="the pipelined loop's tiles: causal's case walks them too")])
def test_emulated_wgmma_backward_at_d128(config, name, lq, lk, bf16, emulate, monkeypatch):
    """The wgmma key-block kernels at d 128: two warpgroups of 64 keys, dQ's columns split between them; "wgp"'s
    pipelined loop (lse and delta of the next tile loaded ahead, dS from P rounded to 16 bits: fp16's tolerance)."""
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD_CONFIG", config)
    assert ("wg::wait<1>()" in flash_bwd.kernel_source(SPECS[name].program, 128, bf16)[1]) == (config == "wgp")
    _check(*_run_emulated(name, lq, lk, 1, d=128, bf16=bf16, seed=lq + lk), bf16=bf16)


_SPECIALIZED = "a warp-specialized config, no default (wgwss at d 128 causal runs in CI)"


@needs_emulator
@pytest.mark.parametrize("config, name, lq, lk, d, bf16", [
    ("wgwss", "causal", 130, 130, 128, False),
    nightly_case("wgws", "causal", 130, 130, 128, True, reason=_SPECIALIZED),
    nightly_case("wgwse", "causal", 130, 130, 128, False, reason=_SPECIALIZED),
    nightly_case("wgwse", "window", 200, 200, 64, True, reason=_SPECIALIZED),
    nightly_case("wgwsa", "window", 200, 200, 128, True, reason=_SPECIALIZED),
    nightly_case("wgwss", "full", 70, 130, 128, True, reason=_SPECIALIZED),
    nightly_case("wgwss", "alibi", 70, 130, 128, False, reason=_SPECIALIZED),
    nightly_case("wgws", "softcap_empty_rows", 70, 7, 128, False, reason=_SPECIALIZED),
    nightly_case("wgws", "causal", 130, 130, 64, True, reason=_SPECIALIZED),
    nightly_case("wgwsa", "alibi", 7, 70, 64, True, reason=_SPECIALIZED)])
def test_emulated_warp_specialized_backward(config, name, lq, lk, d, bf16, emulate, monkeypatch):
    """The warp-specialized wgmma kernels (``backward_wgmma_ws.cu.j2``): a producer warpgroup loading the query tiles
    into two stages on mbarriers, the consumers' loop of "wgp" (causal, window, no mask) or of "wg" (ALiBi, soft-cap:
    dQ by atomics), dQ summed by bulk reductions of the block's tile ("wgws"), of each warpgroup's own keys
    ("wgwss", no barrier between the warpgroups) or by atomics ("wgwsa"), the next tile's S^T issued at the end of
    this one ("wgwse"); several tiles a block, so every stage and dS^T buffer is used twice."""
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD_CONFIG", config)
    cfg = flash_bwd.config(d)
    assert cfg.specialized and cfg.threads == 32 * cfg.warps + 128
    _check(*_run_emulated(name, lq, lk, 1, d=d, bf16=bf16, seed=lq + lk), bf16=bf16)


# waits of the warp-specialized kernel as its rendered source spells them, and what is left without each
_TILE_END = "\n".join("            " + line for line in (
    "lag(warp & 1);", "wg::wait<0>();", "wg::hold(dva);", "wg::hold(dka);", "mbar_arrive(&bars[STAGES + s]);"))
_MISSING_WAITS = {
    "the consumers' wait for a stage's loads": ("mbar_wait(&bars[s], (n / STAGES) & 1);", ";"),
    "the consumers' wait for the next tile's loads before its S^T (wgwse)": (
        "mbar_wait(&bars[s1], ((n + 1) / STAGES) & 1);", ";"),
    "the producer's wait for a free stage": ("if (n >= STAGES) mbar_wait(&bars[STAGES + s], (n / STAGES - 1) & 1);",
                                             ";"),
    "the consumers' wait for dQ's tile to be read": ("if (n > 0) mbar_wait(&bars[DQ_EMPTY], (n - 1) & 1);", ";"),
    "the bulk reductions' wait before the tile is handed back": ("reduce_wait<false>();", ";"),
    "the consumers' barrier before dQ reads every warpgroup's dS^T": (
        "consumers_sync();  // every warpgroup's dS^T written", ";"),
    "a stage released before dK's product has read it": (
        _TILE_END, "            mbar_arrive(&bars[STAGES + s]);\n" + _TILE_END.rsplit("\n", 1)[0]),
}


@needs_emulator
@pytest.mark.parametrize("what", [w if w.startswith("the consumers' wait for a stage") else nightly_case(
    w, reason="another wait of the same kernel (CI: the consumers' wait for a stage's loads)") for w in _MISSING_WAITS])
def test_emulated_warp_specialized_backward_fails_without_a_wait(what, emulate, monkeypatch):
    """The emulator orders the kernel's threads by its mbarriers, named barriers and bulk-copy waits as the GPU may:
    a stage's loads land at the first wait that sees them (every other phase: at the last arrival), odd warps and
    the copy engine run last (`ssmc_emu::lag`). Without any one of the waits the gradients are wrong or the block
    hangs ("wgws" at d 128: two consumer warpgroups, the block's dQ tile summed by bulk reductions)."""
    from ssmc.backends.cuda import emulator as emu

    old, new = _MISSING_WAITS[what]
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD_CONFIG", "wgwse" if what.endswith("(wgwse)") else "wgws")
    source = flash_bwd.kernel_source

    def without(*args, **kwargs):
        name, text = source(*args, **kwargs)
        assert text.count(old) == 1, what
        return name, text.replace(old, new)

    monkeypatch.setattr(flash_bwd, "kernel_source", without)
    with pytest.raises((AssertionError, emu.EmulatedHang)):
        _check(*_run_emulated("causal", 130, 130, 1, d=128, bf16=False, seed=260), bf16=False)


def test_the_hopper_backward_config(monkeypatch):
    """On an sm_90 part (`flash._HOPPER` set for cuda:0): the warp-specialized "wgws" at d 128 ("wg"'s loop in it for
    ALiBi summing its slope, the pipelined one without), "wgp" at d 64; a grouped-query call reads k and v
    un-repeated under both (their GQA builds), repeated under a config without one ("wgwse"); the option overrides
    both."""
    from types import SimpleNamespace

    monkeypatch.setitem(flash._HOPPER, 0, True)
    monkeypatch.delenv("SSMC_CUDA_FLASH_BACKWARD_CONFIG", raising=False)
    dev = torch.device("cuda", 0)
    assert flash_bwd.config(128, None, dev).name == "wgws" and flash_bwd.config(64, None, dev).name == "wgp"
    alibi = flash_bwd.FlashBackward(SPECS["alibi"].program)
    assert [flash_bwd._pipelines(flash_bwd._printed(alibi.program, 128, grads)[0]) for grads in (True, False)] == [
        False, True]
    call = SimpleNamespace(group=4, q=SimpleNamespace(shape=(2, 32, 70, 128), device=dev))
    assert alibi.reads_kv_heads(call)
    call.q.shape = (2, 32, 70, 64)
    assert alibi.reads_kv_heads(call)
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD_CONFIG", "wgwse")
    assert not alibi.reads_kv_heads(call)
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD_CONFIG", "wg")
    assert flash_bwd.config(128, None, dev).name == "wg"


def test_an_unknown_backward_config_is_a_value_error(monkeypatch):
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD_CONFIG", "w16")
    with pytest.raises(ValueError, match="SSMC_CUDA_FLASH_BACKWARD_CONFIG"):
        flash_bwd.config(64)


def test_an_unknown_dq_mode_is_a_value_error(monkeypatch):
    monkeypatch.setenv("SSMC_CUDA_FLASH_DQ", "sometimes")
    with pytest.raises(ValueError, match="SSMC_CUDA_FLASH_DQ"):
        flash_bwd.dq_mode()


@needs_emulator
def test_emulated_rows_without_a_key_get_zero_gradients(emulate):
    got, _ = _run_emulated("softcap_empty_rows", 20, 20, 1)
    assert (got["q"][..., 8:, :] == 0).all()


@needs_emulator
@pytest.mark.parametrize("config, dq", [("wgp", "atomic"), ("w4q64", "kernel")])
def test_emulated_kernels_write_every_gradient_element(config, dq, emulate, monkeypatch):
    """dq, dk, dv start as NaN (`torch.empty` patched): the delta kernel zeroes the atomic dQ's accumulator, the
    key-block kernel stores every row of dk and dv (keys 7.. that no query sees under causal at Lq 7 < Lk 70
    get zeros), the dQ kernel every row of dq; an element none writes fails. ("wgp" at d 64: its pipelined loop,
    the next tile's lse and delta past Lq.)"""
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD_CONFIG", config)
    monkeypatch.setenv("SSMC_CUDA_FLASH_DQ", dq)
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    got, want = _run_emulated("causal", 7, 70, 1, seed=11)
    assert (got["k"][..., 7:, :] == 0).all() and (got["v"][..., 7:, :] == 0).all()
    _check(got, want)


@needs_emulator
def test_emulated_gradients_through_the_tiled_path_run_the_kernels(monkeypatch):
    """`TiledAttention.gradients` on CPU bf16 tensors in layout "b t h ..." with the emulator on: the
    forward and backward kernels; SSMC_CUDA_FLASH_BACKWARD=0 gives the tiled backward's answer back."""
    from ssmc.backends.tiled_attention import TiledAttention

    program = SPECS["alibi"].program
    rng = np.random.default_rng(5)
    layout, lq = "b t h ...", 40
    q, k, v, do = (_half(rng.standard_normal((2, lq, 2, 64)), torch.bfloat16) for _ in range(4))
    slope = torch.from_numpy(_params(program, {"b": 2, "h": 2}, rng)["slope"])
    tiled = TiledAttention(program)
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    got = tiled.gradients(q, k, v, do, layout, {"slope": slope})
    assert tiled.flash_reason is None and tiled.flash_backward_reason is None
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD", "0")
    want = tiled.gradients(q, k, v, do, layout, {"slope": slope})
    assert tiled.flash_backward_reason == "SSMC_CUDA_FLASH_BACKWARD=0"
    for name in ("q", "k", "v"):
        assert got[name].dtype == want[name].dtype == torch.bfloat16 and got[name].shape == want[name].shape
    _check(got, {n: w.double() for n, w in want.items()})


@needs_emulator
@pytest.mark.parametrize("name", ["alibi", "causal"])
def test_emulated_torch_function_backward_runs_the_kernel(name, monkeypatch):
    """ssmc.torch.function's autograd on CPU bf16 tensors, emulated: the flash backward (delta from the
    saved fp32 output with a param, from the 16-bit output without) against SSMC_CUDA_FLASH_BACKWARD=0."""
    import ssmc.torch

    rng = np.random.default_rng(7)
    fn = ssmc.torch.function(SPECS[name], layout="b h t ...")
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    q, k, v, do = (_half(rng.standard_normal((1, 2, 30, 64)), torch.bfloat16) for _ in range(4))
    params = [torch.from_numpy(_params(SPECS[name].program, {"b": 1, "h": 2}, rng)["slope"]).float()
              ] if name == "alibi" else []

    def grads():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, *params)]
        fn(*leaves).backward(do)
        return {n: t.grad.double() for n, t in zip(("q", "k", "v", "slope"), leaves)}

    got = grads()
    assert fn.tiled.flash_backward_reason is None
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD", "0")
    _check(got, grads())


@needs_emulator
def test_emulated_fixed_params_take_the_pipelined_loop_and_sum_nothing(monkeypatch):
    """ALiBi whose slope needs no gradient (a fixed slope, the usual case): the key-block kernel prints no
    param summand, so "wgp" takes its pipelined loop (it does not with the slope's gradient); through
    ssmc.torch.function, emulated, q, k and v's gradients equal the tiled backward's and the slope gets none."""
    import ssmc.torch

    program = SPECS["alibi"].program
    pipelined = "wg::wait<1>()"
    assert pipelined not in flash_bwd.kernel_source(program, 64, True, config_name="wgp")[1]
    assert pipelined in flash_bwd.kernel_source(program, 64, True, config_name="wgp", param_grads=False)[1]
    rng = np.random.default_rng(5)
    fn = ssmc.torch.function(SPECS["alibi"], layout="b h t ...")
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD_CONFIG", "wgp")
    q, k, v, do = (_half(rng.standard_normal((1, 2, 70, 64)), torch.bfloat16) for _ in range(4))
    slope = torch.from_numpy(_params(program, {"b": 1, "h": 2}, rng)["slope"]).float()

    def grads():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        fn(*leaves, slope).backward(do)
        return {n: t.grad.double() for n, t in zip("qkv", leaves)}

    got = grads()
    assert fn.tiled.flash_backward_reason is None
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD", "0")
    _check(got, grads())
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    fn(*leaves, slope).backward(do)
    assert slope.grad is None


# -- NVRTC: the kernel builds for sm_80 and sm_90 without spills -----------------------------------------------

@pytest.mark.skipif(not nvrtc.available(), reason="no NVRTC")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("name", ["alibi", "window", "softcap_empty_rows"])
def test_flash_backward_compiles_without_spills(arch, d, name):
    """The key-block kernel in each config with atomic dQ and without, and the dQ kernel (without both at
    d 256, where the dQ kernel has no build: atomic dQ only); static shared memory within 48 KiB, the wide
    configs' dynamic shared memory within an sm_80 / sm_90 block's."""
    from ssmc.backends.cuda.source import compile_options

    program = SPECS[name].program
    configs = flash_bwd.CONFIGS
    # CI builds the head dim's default configs, mma.sync and wgmma (the others: SSMC_CUDA_FLASH_BACKWARD_CONFIG),
    # locally and nightly every config; the wgmma config ("wg") builds for sm_90a where the others build for
    # sm_90, and not for sm_80
    built = (dict.fromkeys([flash_bwd.DEFAULT_CONFIG[d], flash_bwd.HOPPER_CONFIG[d]]) if in_ci()
             else [c for c in configs if d in configs[c]])
    kernel_dq = d in flash_bwd.BN_DQ
    sources = [(*flash_bwd.kernel_source(program, d, True, atomic_dq=atomic, config_name=config),
                configs[config][d].shared(d, atomic), configs[config][d].bq, configs[config][d].wgmma)
               for config in built for atomic in (True, False)[:1 + kernel_dq]
               if arch == "sm_90" or not configs[config][d].wgmma]
    if kernel_dq:
        sources.append((*flash_bwd.dq_source(program, d, True), 0, 0, False))
    for kname, text, dynamic, bq, wgmma in sources:
        build = "sm_90a" if wgmma else arch
        usage = nvrtc.compile_source(text, arch=build, options=compile_options(text)).resources[kname]
        if wgmma:
            assert not usage.spills, str(usage)
        elif d == 128 and bq == 64:
            # query tiles of 64 at d 128 sit at 255 registers: ptxas may put a few words on the stack (no
            # default config there)
            assert usage.spill_store_bytes <= 32 and configs[flash_bwd.DEFAULT_CONFIG[d]][d].bq != 64, str(usage)
        else:
            assert not usage.spills, str(usage)
        assert usage.shared_bytes <= 48 * 1024
        assert usage.shared_bytes + dynamic <= {"sm_80": 163, "sm_90": 227}[arch] * 1024, str(usage)


def test_backward_modifiers_print_and_param_sums_are_per_batch_index():
    text = flash_bwd.kernel_source(SPECS["alibi"].program, 64, True)[1]
    assert "d_param0(float grad_score" in text and "pacc[0] +=" in text
    assert flash_bwd.unsupported(SPECS["softcap_empty_rows"].program) is None


# -- on a GPU -----------------------------------------------------------------------------------------------

def _gpu_grads(fn, q, k, v, params, do):
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, *params.values())]
    fn(*leaves).backward(do)
    return {n: t.grad for n, t in zip(("q", "k", "v", *params), leaves)}


def _close(got, want, bf16):
    for name, w in want.items():
        g, w = got[name].double(), w.double()
        tol = (GRAD_TOL if name in "qkv" else PARAM_TOL)[bf16] * max(w.abs().max().item(), 1e-3)
        assert torch.isfinite(g).all(), name
        err = (g - w).abs().max().item()
        assert err <= tol, f"{name}: max error {err:.3g} over {tol:.3g}"


def _float64_param_grads(spec, q, k, v, params, do, layout):
    """The params' gradients of the tiled backward in float64 from the same 16-bit inputs (its own float64
    forward and lse). At Lq >> Lk with ALiBi a far row's lse is about -slope (i - Lk) (hundreds), so the
    flash forward's fp32 lse puts P off by ~1e-5 relative per row; the fp32 tiled backward from that lse
    carries it into the slope's summands -(i - j) dM as ~i rowsum(dO O) 1e-5 a row (several times the
    tolerance at slopes near 1), where the kernels' row-sum correction cancels the -i part: the fp32 tiled
    backward is no reference for the params there."""
    from ssmc.backends.tiled_attention import TiledAttention

    grads = TiledAttention(spec.program).gradients(q.double(), k.double(), v.double(), do.double(), layout,
                                                   {n: p.double() for n, p in params.items()})
    return {n: grads[n] for n in params}


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "alibi", "window", "full", "softcap_empty_rows"])
@pytest.mark.parametrize("length", GPU_LENGTHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_flash_backward_matches_the_tiled_backward(name, length, dtype, monkeypatch):
    import ssmc.torch

    dtype = getattr(torch, dtype)
    q, k, v, params = _gpu_inputs(SPECS[name].program, length, dtype)
    do = torch.randn_like(q)
    fn = ssmc.torch.function(SPECS[name], layout="b h t ...")
    got = _gpu_grads(fn, q, k, v, params, do)
    assert fn.tiled.flash_backward_reason is None
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD", "0")
    want = _gpu_grads(fn, q, k, v, params, do)
    _close(got, want, dtype == torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("length", GPU_LENGTHS)
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_flash_backward_with_a_fixed_slope_matches_the_tiled_backward(length, d, monkeypatch):
    """ALiBi whose slope needs no gradient: the kernels sum no param (the pipelined loop on sm_90 parts)."""
    import ssmc.torch

    q, k, v, params = _gpu_inputs(SPECS["alibi"].program, length, torch.bfloat16, d=d)
    do = torch.randn_like(q)
    fn = ssmc.torch.function(SPECS["alibi"], layout="b h t ...")

    def grads():
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        fn(*leaves, *params.values()).backward(do)
        return {n: t.grad for n, t in zip("qkv", leaves)}
    got = grads()
    assert fn.tiled.flash_backward_reason is None
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD", "0")
    _close(got, grads(), True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal", "alibi", "softcap_empty_rows"])
@pytest.mark.parametrize("length", [7, 1000, 4097])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_dq_kernel_matches_the_tiled_backward_and_repeats_bitwise(name, length, d, monkeypatch):
    import ssmc.torch

    q, k, v, params = _gpu_inputs(SPECS[name].program, length, torch.bfloat16, d=d)
    do = torch.randn_like(q)
    fn = ssmc.torch.function(SPECS[name], layout="b h t ...")
    monkeypatch.setenv("SSMC_CUDA_FLASH_DQ", "kernel")
    got = _gpu_grads(fn, q, k, v, params, do)
    again = _gpu_grads(fn, q, k, v, params, do)
    assert fn.tiled.flash_backward_reason is None
    assert all(torch.equal(got[n], again[n]) for n in got)
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD", "0")
    _close(got, _gpu_grads(fn, q, k, v, params, do), True)


@pytest.mark.gpu
@pytest.mark.parametrize("length", GPU_LENGTHS)
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_flash_backward_causal_matches_sdpa_autograd(length, d):
    import ssmc.torch

    q, k, v, _ = _gpu_inputs(SPECS["causal"].program, length, torch.bfloat16, d=d)
    do = torch.randn_like(q)
    fn = ssmc.torch.function(SPECS["causal"], layout="b h t ...")
    got = _gpu_grads(fn, q, k, v, {}, do)
    assert fn.tiled.flash_backward_reason is None

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    _close(got, _gpu_grads(sdpa, q, k, v, {}, do), True)


@pytest.mark.gpu
@pytest.mark.parametrize("lq, lk", [(7, 1000), (1000, 7), (180, 4097)])
def test_gpu_flash_backward_time_major_layout_and_lq_apart_from_lk(lq, lk, monkeypatch):
    """q, k, v against the tiled backward; the slope (one head's slope 1: lse in the hundreds at Lq 1000,
    Lk 7) against the float64 one (`_float64_param_grads`)."""
    import ssmc.torch

    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn((2, lq, 4, 64), device="cuda", dtype=torch.float16, generator=gen)
    k, v = (torch.randn((2, lk, 4, 64), device="cuda", dtype=torch.float16, generator=gen) for _ in range(2))
    params = {"slope": torch.tensor([1.0, 0.5, 0.1, 2.0 ** -8], device="cuda")}
    do = torch.randn(q.shape, device="cuda", dtype=torch.float16, generator=gen)
    fn = ssmc.torch.function(SPECS["alibi"], layout="b t h ...")
    got = _gpu_grads(fn, q, k, v, params, do)
    assert fn.tiled.flash_backward_reason is None
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD", "0")
    want = _gpu_grads(fn, q, k, v, params, do)
    _close(got, {n: want[n] for n in "qkv"}, False)
    _close(got, _float64_param_grads(SPECS["alibi"], q, k, v, params, do, "b t h ..."), False)


@needs_emulator
@pytest.mark.parametrize("layout, dq", [("b t h ...", "atomic"), ("b h t ...", "kernel")])
def test_emulated_param_gradient_with_more_queries_than_keys_from_the_forward_kernels_output(layout, dq, monkeypatch):
    """ALiBi at Lq 70 > Lk 7, the forward and backward kernels both emulated (delta from the forward
    kernel's fp32 output, whose P V product took P rounded to 16 bits, so rowsum(dO O) is off
    rowsum(P dP) by ~1e-3 a row): the slope's summands -(i - j) dM grow with the query index while a row's
    dM should sum to 0, so without the kernels' correction sum_i (sum_j dM) (sum_j P (i - j)) the slope's
    gradient was 6x the tolerance off the float64 backward (both dQ modes: the key-block kernel's row
    sums by atomics, the dQ kernel's per query block)."""
    from ssmc.backends.tiled_attention import TiledAttention

    program = SPECS["alibi"].program
    rng = np.random.default_rng(11)
    lq, lk, heads = 130, 7, 2
    shape = (lambda t: (1, t, heads, 64)) if layout == "b t h ..." else (lambda t: (1, heads, t, 64))
    q, do = (_half(rng.standard_normal(shape(lq)), torch.bfloat16) for _ in range(2))
    k, v = (_half(rng.standard_normal(shape(lk)), torch.bfloat16) for _ in range(2))
    slope = torch.from_numpy(np.asarray(_params(program, {"b": 1, "h": heads}, rng)["slope"], np.float64))
    want = TiledAttention(program).gradients(q.double(), k.double(), v.double(), do.double(), layout,
                                             {"slope": slope})
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    monkeypatch.setenv("SSMC_CUDA_FLASH_DQ", dq)
    tiled = TiledAttention(program)
    got = tiled.gradients(q, k, v, do, layout, {"slope": slope.float()})
    assert tiled.flash_reason is None and tiled.flash_backward_reason is None
    _check(got, want)



def scaled_alibi(score, q_idx, kv_idx, slope: ssmc.Param["h"], temp: ssmc.Param["h"]):
    return score * temp - slope * (q_idx - kv_idx)


@needs_emulator
def test_emulated_two_params_with_more_queries_than_keys(monkeypatch):
    """Two params (a temperature and ALiBi's slope: the row sums' general path, 3 values a row) through
    the emulated forward and backward kernels at Lq 130 > Lk 7, against the float64 backward."""
    from ssmc.backends.tiled_attention import TiledAttention

    program = ssmc.attention(score_mod=scaled_alibi, mask_mod=ssmc.causal, batch="b h", head_dim="d").program
    rng = np.random.default_rng(12)
    lq, lk, heads = 130, 7, 2
    q, do = (_half(rng.standard_normal((1, heads, lq, 64)), torch.bfloat16) for _ in range(2))
    k, v = (_half(rng.standard_normal((1, heads, lk, 64)), torch.bfloat16) for _ in range(2))
    params = {n: torch.from_numpy(np.asarray(x, np.float64))
              for n, x in _params(program, {"b": 1, "h": heads}, rng).items()}
    want = TiledAttention(program).gradients(q.double(), k.double(), v.double(), do.double(), "b h t ...", params)
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    tiled = TiledAttention(program)
    got = tiled.gradients(q, k, v, do, "b h t ...", {n: x.float() for n, x in params.items()})
    assert tiled.flash_reason is None and tiled.flash_backward_reason is None
    _check(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(flash_bwd.CONFIGS))
@pytest.mark.parametrize("name", ["causal", "alibi", "window", "softcap_empty_rows"])
@pytest.mark.parametrize("lq, lk", [(1000, 1000), (4097, 4097), (1000, 7), (180, 4097)])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_flash_backward_configs_match_the_tiled_backward(config, name, lq, lk, d, monkeypatch):
    """Each key-block kernel config (SSMC_CUDA_FLASH_BACKWARD_CONFIG) against the tiled backward, bf16."""
    import ssmc.torch

    if d not in flash_bwd.CONFIGS[config]:
        pytest.skip(f"{config} has no build at head dim {d}")
    if flash_bwd.CONFIGS[config][d].wgmma and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma config needs an sm_90 GPU")

    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD_CONFIG", config)
    gen = torch.Generator(device="cuda").manual_seed(lq + lk + d)
    q = torch.randn((2, 4, lq, d), device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn((2, 4, lk, d), device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    params = {n: 2.0 ** (-8.0 * torch.rand(4, device="cuda", generator=gen)) if n == "slope"
              else 1.0 + torch.rand(4, device="cuda", generator=gen)
              for n in (p.name for p in SPECS[name].program.params)}
    do = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    fn = ssmc.torch.function(SPECS[name], layout="b h t ...")
    got = _gpu_grads(fn, q, k, v, params, do)
    assert fn.tiled.flash_backward_reason is None
    monkeypatch.setenv("SSMC_CUDA_FLASH_BACKWARD", "0")
    want = _gpu_grads(fn, q, k, v, params, do)
    _close(got, {n: want[n] for n in "qkv"}, True)
    if params:  # against float64 (`_float64_param_grads`: at Lq 1000, Lk 7 the fp32 tiled slope is off)
        _close(got, _float64_param_grads(SPECS[name], q, k, v, params, do, "b h t ..."), True)


@needs_emulator
@pytest.mark.skipif(not nightly(), reason="Lq 1000 emulated: the nightly run's (tests/profiles.py)")
def test_emulated_slope_gradient_where_far_rows_have_an_lse_in_the_hundreds(monkeypatch):
    """ALiBi at Lq 1000, Lk 7, slope 1, fp16, time-major (the GPU failure's case): a far row's lse is about
    -(i - 7), so the forward kernel's fp32 lse puts sum_j P off 1 by ~1e-5 a row; the kernels' slope
    gradient (delta's row-sum correction cancels the -i part of the summands) stays within the tolerance
    of the float64 backward, which the fp32 tiled backward from that lse need not (`_float64_param_grads`)."""
    from ssmc.backends.tiled_attention import TiledAttention

    program = SPECS["alibi"].program
    rng = np.random.default_rng(5)
    q, do = (_half(rng.standard_normal((1, 1000, 1, 64)), torch.float16) for _ in range(2))
    k, v = (_half(rng.standard_normal((1, 7, 1, 64)), torch.float16) for _ in range(2))
    slope = torch.ones(1, dtype=torch.float64)
    want = TiledAttention(program).gradients(q.double(), k.double(), v.double(), do.double(), "b t h ...",
                                             {"slope": slope})
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    tiled = TiledAttention(program)
    got = tiled.gradients(q, k, v, do, "b t h ...", {"slope": slope.float()})
    assert tiled.flash_reason is None and tiled.flash_backward_reason is None
    _check(got, want, bf16=False)
