"""Generated score_mods and mask_mods (tests/attention_strategies.py) through `ssmc.torch.function` against the
float64 interpreter (issue #42): the output and every gradient (q, k, v, each param), rows without a key zero with
zero gradients, nothing NaN; the flash kernels on the CPU emulator (bf16, head dim 64, small batches, lengths 1 to
180, Lq apart from Lk, grouped-query heads), and on a GPU (``-m gpu``: fp32 on the tiled path, bf16 on the flash
kernels, head dims 64 and 128, lengths to 1000, both layouts). Each example asserts the path its spec takes (the
flash forward and backward, the flash forward and the tiled backward, or the tiled path) and the reason given for
a refused kernel; `test_generated_specs_mostly_take_the_flash_kernels` that the strategy draws mostly the first.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from attention_strategies import PATHS, attention_inputs, attention_specs
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from profiles import QUIET, examples

import ssmc
from ssmc.backends.cuda import emulator
from ssmc.backends.cuda.kernels.flash import backward as flash_bwd
from ssmc.backends.cuda.kernels.flash import forward as flash

torch = pytest.importorskip("torch")

import ssmc.torch  # noqa: E402

LAYOUTS = ["b h t ...", "b t h ..."]
EMULATED_LENGTHS = [1, 7, 63, 64, 65, 180]
GPU_LENGTHS = [1, 7, 63, 64, 65, 180, 1000]
# the emulator's cost grows with the blocks launched and the tiles each walks: larger draws lose heads
EMULATED_HEADS = 2
EMULATED_WORK = 180 * 180

# bf16 against float64 from the same bf16 inputs and cotangent, max |got - want| over the largest |want|
# (at least 1): the output rounded to bf16 and P rounded to bf16 as the P V operand (the flash forward tests'
# 1.5e-2); q, k, v's gradients from P, dS and dO as 16-bit operands, dk and dv stored in 16 bits (the flash
# backward tests' 2e-2); the params' gradients, fp32 sums over every (query, key) pair of summands whose
# operands are exact (no 16-bit rounding: within 1e-5 on the emulator), 2e-3 there and on a GPU the flash
# backward tests' 1e-2 (sums of a million terms in another order, delta from the output at L 1000)
BF16_TOL = {"out": 1.5e-2, "grad": 2e-2, "param": 2e-3}
GPU_BF16_TOL = {**BF16_TOL, "param": 1e-2}
# fp32 on the tiled path: ||got - want|| / ||want|| (products of fp32 operands), as test_attention_torch's
# test_on_cuda_tensors
FP32_TOL = 1e-4


def _sizes(draw, case, lq: int, lk: int, emulated: bool) -> dict:
    """Batch and heads (q's "h", k's and v's "hkv"): 1 or 2 each, q's heads twice k's under GQA; on the emulator
    (its time grows with the blocks launched, b * h * Lq / 128 and b * hkv * Lk / 64, and with the tiles each
    walks) b * h at most 2, and 1 at Lq = Lk = 180."""
    b, hkv = draw(st.integers(1, 2), "b"), draw(st.integers(1, 2), "hkv")
    group = 2 if case.gqa else 1
    while emulated and (b * hkv * group > EMULATED_HEADS or b * hkv * group * lq * lk > EMULATED_WORK) and (
            b > 1 or hkv > 1):
        b, hkv = (1, hkv) if b > 1 else (b, 1)
    return {"b": b, "h": hkv * group, "hkv": hkv}


def _array(rng, sizes, heads, length, dim, layout):
    x = rng.standard_normal((sizes["b"], heads, length, dim))
    return x if layout == "b h t ..." else np.ascontiguousarray(x.transpose(0, 2, 1, 3))


def _err(got: np.ndarray, want: np.ndarray, dtype) -> tuple[float, float]:
    """(error, tolerance scale): bf16 the largest deviation and the largest |want| (at least 1); fp32 the norms."""
    if dtype == torch.float32:
        return float(np.linalg.norm(got - want)), max(float(np.linalg.norm(want)), 1e-30)
    return float(np.abs(got - want).max(initial=0.0)), max(float(np.abs(want).max(initial=0.0)), 1.0)


def check_case(case, lq: int, lk: int, sizes: dict, d: int, layout: str, dtype, device: str, seed: int,
               bf16_tol: dict = BF16_TOL) -> tuple:
    """Run `case.spec` through `ssmc.torch.function` on `device` in `dtype` (params fp32), forward and backward,
    and compare with the interpreter in float64 on the same rounded inputs and cotangent. Returns (the path taken,
    "flash", "flash forward" or "tiled", asserted to be the one `case` expects for 16-bit inputs at a kernel's head
    dim, else the tiled path, its reason the dtype; whether some row sees no key; each result's error as a fraction
    of its tolerance)."""
    rng = np.random.default_rng(seed)
    spec = case.spec
    x = {"q": _array(rng, sizes, sizes["h"], lq, d, layout), "k": _array(rng, sizes, sizes["hkv"], lk, d, layout),
         "v": _array(rng, sizes, sizes["hkv"], lk, d, layout)}
    params = attention_inputs(case, sizes, lq, rng)
    t = {n: torch.tensor(a, device=device).to(dtype).requires_grad_() for n, a in x.items()}
    for n, a in params.items():
        t[n] = (torch.tensor(a, device=device) if case.kinds[n] == "doc"
                else torch.tensor(a, device=device).float().requires_grad_())
    fn = ssmc.torch.function(spec, layout=layout)
    out = fn(**t)
    assert out.dtype == dtype
    d_out = torch.tensor(rng.standard_normal(tuple(out.shape)), device=device).to(dtype)
    out.backward(d_out)
    tiled = fn.tiled

    # the path taken, and why a kernel was refused
    if dtype == torch.float32:  # refused for the spec where the kernels cannot print it, else for the dtype
        path, why = "tiled", case.reason if case.path == "tiled" else "dtype"
        assert tiled.flash_reason is not None and why in tiled.flash_reason, tiled.flash_reason
    else:
        path = ("tiled" if tiled.flash_reason is not None
                else "flash forward" if tiled.flash_backward_reason is not None else "flash")
        assert path == case.path, (path, tiled.flash_reason, tiled.flash_backward_reason)
        reason = tiled.flash_reason if path == "tiled" else tiled.flash_backward_reason
        assert (reason is None) == (case.reason is None) and (reason is None or case.reason in reason), reason

    # the interpreter in float64 on the values the call saw
    exact = {n: a.detach().double().cpu().numpy() if n not in params or case.kinds[n] != "doc" else params[n]
             for n, a in t.items()}
    cot = d_out.double().cpu().numpy()
    want_out, want_lse = ssmc.compile(spec, "interpreter", layout=layout)(**exact, return_lse=True)
    want = ssmc.grad(spec, "interpreter", layout=layout)(**exact, grad_outputs=cot)
    got = {n: a.grad.double().cpu().numpy() for n, a in t.items() if a.grad is not None}
    assert set(got) == set(want), (set(got), set(want))
    got_out = out.detach().double().cpu().numpy()

    tol = {k: FP32_TOL for k in bf16_tol} if dtype == torch.float32 else bf16_tol
    errors = {}
    for name, g, w, kind in [("out", got_out, want_out, "out"),
                             *((n, got[n], want[n], "grad" if n in "qkv" else "param") for n in want)]:
        assert g.shape == w.shape, name
        assert np.isfinite(g).all(), f"{name}: not finite"
        err, scale = _err(g, w, dtype)
        errors[name] = err / scale / tol[kind]
        assert err <= tol[kind] * scale, f"{name}: error {err:.3g} over {tol[kind]:.3g} of {scale:.3g}"

    # rows without a key (the interpreter's lse -inf): output and dq exactly zero
    empty = np.isneginf(want_lse)
    assert (got_out[empty] == 0).all() and (got["q"][empty] == 0).all()
    return path, bool(empty.any()), errors


def _report(result):
    """Hypothesis' statistics (``--hypothesis-show-statistics``): how often each path ran, rows without a key."""
    path, empty, errors = result
    event(path)
    if empty:
        event("rows without a key")
    note(", ".join(f"{n} {e:.2f}" for n, e in errors.items()) + " of the tolerance")


# -- the strategy: what it draws and which path each spec takes --------------------------------------------------

def test_generated_specs_mostly_take_the_flash_kernels():
    """The printers' own verdicts (`forward.unsupported`, `backward.unsupported`) on 300 drawn specs are the paths
    the strategy says, each refusal's reason naming its cause; most specs take the flash kernels both ways, and
    every path, soft-capping, tables, document ids, GQA and rows without a key are drawn."""
    counts: Counter = Counter()

    @settings(max_examples=300, derandomize=True, database=None, deadline=None)
    @given(attention_specs())
    def draw(case):
        forward, backward = flash.unsupported(case.spec.program), flash_bwd.unsupported(case.spec.program)
        path = "tiled" if forward is not None else "flash forward" if backward is not None else "flash"
        assert path == case.path, (path, forward, backward)
        reason = forward if path == "tiled" else backward
        assert reason is None or PATHS[path] in reason, reason
        counts[path] += 1
        src = case.source
        counts.update(feature for feature, there in (
            ("softcap", "ssmc.tanh(s /" in src), ("table", "table[" in src), ("doc", case.doc), ("gqa", case.gqa),
            ("empty rows", "(q_idx <" in src or "(q_idx >=" in src or "(kv_idx < q_idx)" in src)) if there)

    draw()
    total = counts["flash"] + counts["flash forward"] + counts["tiled"]
    assert counts["flash"] >= 0.7 * total and counts["flash forward"] > 0 and counts["tiled"] > 0, counts
    for feature in ("softcap", "table", "doc", "gqa", "empty rows"):
        assert counts[feature] >= 0.05 * total, (feature, counts)


# -- on the CPU emulator -------------------------------------------------------------------------------------------

needs_emulator = pytest.mark.skipif(not emulator.available(), reason="no C++ compiler for the CUDA emulator")


@needs_emulator
@settings(max_examples=examples(15, ci=8), deadline=None,
          suppress_health_check=[*QUIET, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_emulated_flash_kernels_match_the_interpreter(data, monkeypatch):
    """bf16, head dim 64, batch and heads 1 or 2 (q's twice k's under GQA), Lq and Lk from `EMULATED_LENGTHS`
    (one length with document ids), both layouts: the flash kernels on the emulator where the spec takes them."""
    case = data.draw(attention_specs(), "case")
    lq = data.draw(st.sampled_from(EMULATED_LENGTHS), "Lq")
    lk = lq if case.same_length else data.draw(st.sampled_from(EMULATED_LENGTHS), "Lk")
    sizes = _sizes(data.draw, case, lq, lk, True)
    layout = data.draw(st.sampled_from(LAYOUTS), "layout")
    seed = data.draw(st.integers(0, 2**31 - 1), "seed")
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    _report(check_case(case, lq, lk, sizes, 64, layout, torch.bfloat16, "cpu", seed))


# -- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@settings(max_examples=examples(20), deadline=None)
@given(st.data())
def test_gpu_generated_specs_match_the_interpreter(data):
    """fp32 (the tiled path, `FP32_TOL`) and bf16 (the flash kernels, `BF16_TOL`), head dims 64 and 128, lengths
    to 1000, both layouts, GQA; batch and heads 1 or 2 (q's twice k's under GQA)."""
    case = data.draw(attention_specs(), "case")
    lq = data.draw(st.sampled_from(GPU_LENGTHS), "Lq")
    lk = lq if case.same_length else data.draw(st.sampled_from(GPU_LENGTHS), "Lk")
    sizes = _sizes(data.draw, case, lq, lk, False)
    d = data.draw(st.sampled_from([64, 128]), "d")
    layout = data.draw(st.sampled_from(LAYOUTS), "layout")
    dtype = data.draw(st.sampled_from([torch.bfloat16, torch.bfloat16, torch.float32]), "dtype")
    seed = data.draw(st.integers(0, 2**31 - 1), "seed")
    _report(check_case(case, lq, lk, sizes, d, layout, dtype, "cuda", seed, GPU_BF16_TOL))
