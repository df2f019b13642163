"""Hypothesis-generated nonlinear cells on the persistent kernels against the interpreter (issue 41's test):
gate counts 1-4, activations, an inner norm, one or two states, peepholes, coupled gates, heads (a
block-diagonal U). Each drawn cell must take the persistent kernel (a refusal fails the test, so a cell
that silently fell back to the step loop would be seen); outputs, final states and every gradient against
float64. Emulated on the CPU at small sizes (one and several blocks); on a GPU at L = 1, 7, 180, 1000, hidden
sizes that are no multiple of the tiles (37, 129, 700), fp32 and bf16."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from persistent_helpers import BF16_GRAD_TOL, BF16_TOL, check_rounded
from profiles import examples
from strategies import Expr, Signature, Source, build_spec

from ssmc.backends.cuda.kernels.persistent import analysis
from ssmc.backends.cuda.kernels.persistent import runner as persistent_runner

torch = pytest.importorskip("torch")

# activations of a candidate value (smooth: a kink's side could differ between float32 and float64 rounding)
ACTIVATIONS = ("ssmc.tanh({})", "ssmc.silu({})", "ssmc.softplus({}) - 0.7", "ssmc.gelu({})")
NORMS = ("none", "none", "layernorm_z", "layernorm_k", "rmsnorm_k")


@st.composite
def nonlinear_cells(draw):
    """A random cell with one recurrent product, as a user writes one: ``z = x W + h U (+ bias)`` over a gate
    axis of G = 1-4 gates, optionally normalised (a layernorm over "g k" as LayerNorm-LSTM's, or a layernorm
    or rmsnorm over the units k), then unbound into gates; with one state (h) a gated or plain update, with two
    (h, c) an LSTM-like carry whose forget gate may be coupled to the input gate (1 - f) and may read c
    (a peephole), h = o * act(c) or act(norm(c)). With heads n (2 of them), U is [n j g k]: each head its own
    recurrence; the norms then stay off (a sum across the units of a head is not taken with heads).

    As a plain loop: for t: z = x[t] @ W + h @ U + bias; gates = z.unbind(g); c, h = cell(gates, c, h)."""
    heads = draw(st.booleans())
    gates = draw(st.integers(1, 4))
    two = gates >= 3 or (gates == 2 and draw(st.booleans()))
    norm = "none" if heads else draw(st.sampled_from(NORMS))
    act = draw(st.sampled_from(ACTIVATIONS))
    out_act = draw(st.sampled_from(ACTIVATIONS))
    peephole = two and draw(st.booleans())
    coupled = two and gates >= 3 and draw(st.booleans())
    bias = draw(st.booleans())
    unit = "b n k" if heads else "b k"
    gk = "n g={} k" if heads else "g={} k"
    states = [("h", tuple(unit.split()))] + ([("c", tuple(unit.split()))] if two else [])
    lead = ("n",) if heads else ()
    params = [("W", (*lead, "i", f"g={gates}", "k")), ("U", (*lead, "j", f"g={gates}", "k"))]
    if bias:
        params.append(("bias", tuple(gk.format(gates).split())))
    if peephole:
        params.append(("P", ("n", "k") if heads else ("k",)))
    sig = Signature(states, [("x", ("b", "i"))], params)
    src = Source()
    z = "ssmc.dot(x, W, over='i') + 0.5 * ssmc.dot(h.rename(k='j'), U, over='j')" + (" + bias" if bias else "")
    src.lines.append(f"    z = {z}")
    if norm == "layernorm_z":
        src.lines.append("    z = ssmc.layernorm(z, over='g k', eps=1e-5)")
    elif norm in ("layernorm_k", "rmsnorm_k"):
        src.lines.append(f"    z = ssmc.{norm[:-2]}(z, over='k', eps=1e-5)")
    parts = [f"z{g}" for g in range(gates)]
    src.lines.append(f"    {', '.join(parts)}{',' if gates == 1 else ''} = z.unbind('g')")
    if not two:
        if gates == 1:
            update = act.format("z0")
        else:  # a gated (GRU-like) update of h
            src.lines.append("    f = ssmc.sigmoid(z0)")
            update = f"f * h + (1 - f) * {act.format('z1')}"
        src.lines.append(f"    hn = {update}")
        return build_spec(sig, src, [Expr("hn", frozenset(states[0][1]), 10.0, 1.0)],
                          [Expr("hn", frozenset(states[0][1]), 10.0, 1.0)]), _Cell(heads, gates, two, norm)
    f_in = "z1" + (" + P * c" if peephole else "")
    src.lines.append(f"    f = ssmc.sigmoid({f_in})")
    src.lines.append("    i = 1 - f" if coupled or gates == 2 else "    i = ssmc.sigmoid(z0)")
    cand = parts[2] if gates >= 3 else "z0"
    src.lines.append(f"    cn = f * c + i * {act.format(cand)}")
    o = "ssmc.sigmoid(z3)" if gates == 4 else "1.0"
    inner = "ssmc.layernorm(cn, over='k', eps=1e-5)" if norm != "none" and draw(st.booleans()) else "cn"
    src.lines.append(f"    hn = {o} * {out_act.format(inner)}")
    new = [Expr("hn", frozenset(states[0][1]), 10.0, 1.0), Expr("cn", frozenset(states[1][1]), 10.0, 1.0)]
    return build_spec(sig, src, new, [new[0]]), _Cell(heads, gates, two, norm)


class _Cell:
    """What was drawn (for the test's inputs and for reading a failure)."""

    def __init__(self, heads: bool, gates: int, two: bool, norm: str):
        self.heads, self.gates, self.two, self.norm = heads, gates, two, norm

    def __repr__(self):
        return f"cell(heads={self.heads}, gates={self.gates}, two={self.two}, norm={self.norm})"


def _inputs(spec, cell: _Cell, rng, length: int, batch: int, hidden: int, inp: int = 4) -> dict:
    """Inputs with U of spectral radius about 0.8 per head (a larger one makes float32 and float64 part)."""
    n = 2 if cell.heads else None
    sizes = {"b": batch, "i": inp, "j": hidden, "k": hidden, "g": cell.gates, "n": n}
    out = {"x": rng.standard_normal((batch, length, inp))}
    for d in spec.program.params:
        shape = tuple(sizes[a] for a in d.axes)
        scale = 0.8 / np.sqrt(hidden) if d.name == "U" else 0.5 / np.sqrt(inp) if d.name == "W" else 0.3
        out[d.name] = scale * rng.standard_normal(shape)
    for d in spec.program.states:
        out[d.name] = 0.5 * rng.standard_normal(tuple(sizes[a] for a in d.axes))
    return out


def check_cell(spec, cell: _Cell, length: int, batch: int, hidden: int, device: str, dtype, tol: float,
               grad_tol: float, launched: list, seed: int = 0, blocks: int | None = None) -> None:
    """`spec` on the CUDA backend (inputs rounded to `dtype`) against the interpreter's float64 on the same
    rounded values: outputs and final states within `tol`, every gradient within `grad_tol` (max |error| ÷
    max |want|); both directions on the persistent kernels (`blocks`: over that many blocks a head, every
    launch)."""
    rng = np.random.default_rng(seed)
    check_rounded(spec, "b t ...", _inputs(spec, cell, rng, length, batch, hidden), rng, device, dtype, tol, grad_tol,
                  context=(cell, length, batch, hidden))
    assert spec.program.name in launched, f"{cell}: the persistent forward did not run ({_refusals()})"
    assert f"{spec.program.name}_backward" in launched, f"{cell}: the persistent adjoint did not run ({_refusals()})"
    if blocks is not None:
        heads = 2 if cell.heads else 1
        assert set(launched.blocks) == {blocks * heads}, (cell, launched.blocks)


def _refusals() -> list:
    return [r for loop in persistent_runner._LOOPS.values() if loop is not None for r in loop.refusals.values()]


# -- emulated: one block and several ---------------------------------------------------------------------------

@settings(max_examples=examples(6, ci=3), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(drawn=nonlinear_cells(), length=st.sampled_from([1, 7]), blocks=st.sampled_from([1, 3]),
       seed=st.integers(0, 2**16))
def test_emulated_cells_match_the_interpreter(drawn, length, blocks, seed, emulated_cuda, launched):
    """fp32, B3 H5 (3 blocks a head: a block for every 2 units, MIN_BLOCK_PAIRS forced down; the emulator runs
    them step by step, `runner.EMULATED_BLOCKS`: without it, one block a head whatever MIN_BLOCK_PAIRS says)."""
    spec, cell = drawn
    launched.clear()
    with pytest.MonkeyPatch.context() as mp:
        if blocks > 1:
            mp.setattr(analysis, "MIN_BLOCK_PAIRS", 1)
            mp.setattr(persistent_runner, "EMULATED_BLOCKS", blocks * (2 if cell.heads else 1))
        check_cell(spec, cell, length, 3, 5, "cpu", torch.float32, 1e-5, 1e-4, launched, seed, blocks)


def test_the_cells_can_fail(emulated_cuda, launched, monkeypatch):
    """A planted error (the first gate's recurrent product scaled by 1.01 in the printed cell) fails the check."""
    spec, cell = _lstm_like()
    check_cell(spec, cell, 5, 3, 5, "cpu", torch.float32, 1e-5, 1e-4, launched)
    original = persistent_runner.kernel_source

    def planted(*a, **k):
        source = original(*a, **k)
        assert "F(0.5) * acc[q][0]" in source
        return source.replace("F(0.5) * acc[q][0]", "F(0.505) * acc[q][0]")
    monkeypatch.setattr(persistent_runner, "kernel_source", planted)
    monkeypatch.setattr(persistent_runner, "_LOOPS", {})  # runners whose sources the check above did not print
    launched.clear()
    with pytest.raises(AssertionError, match="cell"):
        check_cell(spec, cell, 5, 3, 5, "cpu", torch.float32, 1e-5, 1e-4, launched)


def _lstm_like():
    from strategies import Expr as E

    sig = Signature([("h", ("b", "k")), ("c", ("b", "k"))], [("x", ("b", "i"))],
                    [("W", ("i", "g=4", "k")), ("U", ("j", "g=4", "k"))])
    src = Source()
    src.lines += ["    z = ssmc.dot(x, W, over='i') + 0.5 * ssmc.dot(h.rename(k='j'), U, over='j')",
                  "    z0, z1, z2, z3 = z.unbind('g')",
                  "    cn = ssmc.sigmoid(z1) * c + ssmc.sigmoid(z0) * ssmc.tanh(z2)",
                  "    hn = ssmc.sigmoid(z3) * ssmc.tanh(cn)"]
    new = [E("hn", frozenset("bk"), 1.0, 1.0), E("cn", frozenset("bk"), 1.0, 1.0)]
    return build_spec(sig, src, new, [new[0]]), _Cell(False, 4, True, "none")


# -- GPU ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@settings(max_examples=examples(12, ci=12), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(drawn=nonlinear_cells(), length=st.sampled_from([1, 7, 180, 1000]), hidden=st.sampled_from([37, 129, 700]),
       half=st.booleans(), seed=st.integers(0, 2**16))
def test_gpu_cells_match_the_interpreter(drawn, length, hidden, half, seed, launched):
    """Many blocks and the grid barrier (MIN_BLOCK_PAIRS 1), B5; fp32 (3xTF32 products: 1e-4, gradients 1e-3)
    and bf16 (the tensor-core form: tests/test_persistent_half.py's bounds)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    spec, cell = drawn
    if length == 1000 and hidden == 700:
        length = 180  # the interpreter's float64 loop would take minutes
    launched.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(analysis, "MIN_BLOCK_PAIRS", 1)
        if half:
            check_cell(spec, cell, length, 5, hidden, "cuda", torch.bfloat16, BF16_TOL, BF16_GRAD_TOL, launched, seed)
        else:
            check_cell(spec, cell, length, 5, hidden, "cuda", torch.float32, 1e-4, 1e-3, launched, seed)
