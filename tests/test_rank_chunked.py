"""Rank-R injections on the chunked matrix-linear path (passes/matrix_linear.py `MatrixLinear.terms`,
backends/cuda/kernels/chunk/rank.py `RankCore`: R sub-steps a step of the rank-1 chunked core).

- the analysis: a dot over a rank axis, sums of explicit terms, β and signs folded into v, the rank;
  refusals that still say why;
- the CUDA backend emulated on the CPU (float64) against the interpreter: outputs, final state and every
  gradient at L = 1, 7, 65, 180 with chunks of 16 (L·R leaves partial chunks), per-head, per-key, param and
  no decays; a planted bug (the decay on the wrong sub-step) fails that check;
- `ssmc inspect` says the core is chunked with its rank.
"""

from __future__ import annotations

import numpy as np
import pytest

import ssmc
from ssmc.passes.matrix_linear import chunk_stages, core_form, matrix_linear
from tests.profiles import in_ci

torch = pytest.importorskip("torch")


@ssmc.recurrence
def rank_dot(S: ssmc.State["b h k v"], q: ssmc.Seq["b h k"], k: ssmc.Seq["b h r k"], v: ssmc.Seq["b h r v"],
             a: ssmc.Seq["b h"]):
    """A dot over r (rank r), a decay per head and step exp(a); the spec is a core as written."""
    S = ssmc.exp(a) * S + ssmc.dot(k, v, over="r")
    y = ssmc.dot(S, q, over="k")
    return S, y


@ssmc.recurrence
def rank_terms(S: ssmc.State["b h k v"], q: ssmc.Seq["b h k"], k1: ssmc.Seq["b h k"], v1: ssmc.Seq["b h v"],
               k2: ssmc.Seq["b h k"], v2: ssmc.Seq["b h v"], g: ssmc.Seq["b h k"], beta: ssmc.Seq["b h"]):
    """Two explicit terms (rank 2), a per-key decay (GLA-like), β on the second term, subtracted."""
    S = ssmc.exp(g) * S + k1 * v1 - beta * (k2 * v2)
    y = ssmc.dot(S, q, over="k")
    return S, y


@ssmc.recurrence
def rank_beta(S: ssmc.State["b h k v"], q: ssmc.Seq["b h k"], k: ssmc.Seq["b h r k"], v: ssmc.Seq["b h r v"],
              beta: ssmc.Seq["b h r"]):
    """No decay, a β per rank slice inside the dot (folded into v by the pre stage)."""
    S = S + ssmc.dot(k, v * beta, over="r")
    y = ssmc.dot(S, q, over="k")
    return S, y


@ssmc.recurrence
def rank_mixed(S: ssmc.State["b h k v"], q: ssmc.Seq["b h k"], k: ssmc.Seq["b r k"], v: ssmc.Seq["b h r v"],
               k1: ssmc.Seq["b h k"], v1: ssmc.Seq["b h v"], gamma: ssmc.Param["h"]):
    """A dot over r (k shared by the heads) plus one term (rank r + 1), a param decay given as is (RetNet's
    gamma: positive at run time, lacking b, so the core's output comes permuted), a post stage."""
    S = gamma * S + ssmc.dot(k, v, over="r") + k1 * v1
    y = ssmc.dot(S, q, over="k") * 0.5
    return S, y


@ssmc.recurrence
def rank_const(S: ssmc.State["b k v"], q: ssmc.Seq["b k"], k: ssmc.Seq["b r k"], v: ssmc.Seq["b r v"]):
    """A constant decay (its log a constant), no head axis but the batch."""
    S = 0.9 * S + ssmc.dot(k, v, over="r")
    y = ssmc.dot(S, q, over="k")
    return S, y


@ssmc.recurrence
def rank_gate(S: ssmc.State["b h k v"], q: ssmc.Seq["b h k"], k: ssmc.Seq["b h k"], v: ssmc.Seq["b h v"],
              k2: ssmc.Seq["b k"], g: ssmc.Seq["b h"]):
    """A sigmoid gate as decay (kept as a, written by pre), one v in two terms (its gradients summed), k2
    shared by the heads, a feature map on q, a post stage o + v."""
    S = ssmc.sigmoid(g) * S + k * v + k2 * v
    y = ssmc.dot(S, ssmc.silu(q), over="k") + v
    return S, y


@ssmc.recurrence
def rank_per_value(S: ssmc.State["b k v"], q: ssmc.Seq["b k"], k: ssmc.Seq["b k"], v: ssmc.Seq["b v"],
                   k2: ssmc.Seq["b k"], v2: ssmc.Seq["b v"], g: ssmc.Seq["b v"]):
    S = ssmc.exp(g) * S + k * v + k2 * v2
    y = ssmc.dot(S, q, over="k")
    return S, y


@ssmc.recurrence
def rank_no_key(S: ssmc.State["b k v"], q: ssmc.Seq["b k"], k: ssmc.Seq["b k"], v: ssmc.Seq["b v"],
                w: ssmc.Seq["b v"]):
    S = S + k * v + w
    y = ssmc.dot(S, q, over="k")
    return S, y


@ssmc.recurrence
def rank_projection(S: ssmc.State["b h k v"], q: ssmc.Seq["b h k"], k: ssmc.Seq["b h k"], x: ssmc.Seq["b h r"],
                    W: ssmc.Param["v r"], k1: ssmc.Seq["b h k"], v1: ssmc.Seq["b h v"], a: ssmc.Seq["b h"]):
    """Two terms, the first's v a projection over r (negated inside its sum): rank 2, r no rank axis."""
    S = ssmc.exp(a) * S + k * ssmc.dot(W, -x, over="r") + k1 * v1
    y = ssmc.dot(S, q, over="k")
    return S, y


SPECS = {"rank_dot": rank_dot, "rank_terms": rank_terms, "rank_beta": rank_beta, "rank_mixed": rank_mixed,
         "rank_const": rank_const, "rank_gate": rank_gate}
SIZES = {"b": 2, "h": 2, "k": 3, "v": 4, "r": 3}


def _inputs(spec, length: int, rng) -> dict:
    """Random inputs in layout "b t ..." (time second); log decays <= 0, gamma in (0.5, 1)."""
    out = {}
    for d in spec.program.inputs:
        shape = [SIZES[a] for a in d.axes]
        if d.role.value == "seq":
            shape.insert(1, length)
        out[d.name] = rng.standard_normal(shape)
    for name in ("a", "g"):
        if name in out:
            out[name] = -np.abs(out[name])
    if "gamma" in out:
        out["gamma"] = rng.uniform(0.5, 1.0, out["gamma"].shape)
    for s in spec.program.states:
        out[s.name] = 0.5 * rng.standard_normal([SIZES[a] for a in s.axes])
    return out


def _relative(a, b) -> float:
    a = np.asarray(a.detach().cpu() if hasattr(a, "detach") else a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _check(spec, length: int, tol: float = 1e-10, seed: int = 0):
    rng = np.random.default_rng(seed + length)
    inputs = _inputs(spec, length, rng)
    ref = ssmc.compile(spec, layout="b t ...", backend="interpreter")(**inputs, return_final_states=True)
    got = ssmc.compile(spec, layout="b t ...", backend="cuda", dtype="float64")(**inputs, return_final_states=True)
    assert _relative(got[0], ref[0]) < tol and _relative(got[1], ref[1]) < tol, (
        length, _relative(got[0], ref[0]), _relative(got[1], ref[1]))
    cot = {"y": rng.standard_normal(np.shape(ref[0]))}
    lam = {"S": rng.standard_normal(np.shape(ref[1]))}
    want = ssmc.grad(spec, backend="interpreter", layout="b t ...")(**inputs, grad_outputs=cot, grad_final_states=lam)
    grads = ssmc.grad(spec, backend="cuda", layout="b t ...", dtype="float64")(**inputs, grad_outputs=cot,
                                                                           grad_final_states=lam)
    assert set(grads) == set(want) == {d.name for d in spec.program.inputs} | {"S"}
    for name in want:
        assert _relative(grads[name], want[name]) < tol, (length, name, _relative(grads[name], want[name]))


@pytest.fixture
def counted(monkeypatch):
    """The rank-R core's forward and backward calls, counted (the path must be the one tested)."""
    from ssmc.backends.cuda.kernels.chunk.rank import RankCore

    calls = {"forward": 0, "backward": 0}
    for what in calls:
        original = getattr(RankCore, what)

        def wrapped(self, *a, _original=original, _what=what, **k):
            calls[_what] += 1
            return _original(self, *a, **k)
        monkeypatch.setattr(RankCore, what, wrapped)
    return calls


# -- the analysis ------------------------------------------------------------------------------------

def test_rank_r_injections_are_taken_with_their_terms():
    ml = matrix_linear(rank_dot.program)
    assert (ml.key, ml.value, ml.heads) == ("k", "v", ("b", "h")) and ml.log_decay.arg == "a"
    assert [(k.arg, v.arg, r) for k, v, r in ml.terms] == [("k", "v", "r")] and ml.beta is None
    assert ml.rank(SIZES) == 3 and "injection of rank r" in ml.describe()
    assert core_form(rank_dot.program) is not None and chunk_stages(rank_dot.program) is None

    ml = matrix_linear(rank_terms.program)
    assert ml.per_key and ml.rank(SIZES) == 2 and ml.rank_text == "2"
    assert ml.terms[0][0].arg == "k1" and ml.terms[0][1].arg == "v1" and ml.terms[1][0].arg == "k2"
    assert ml.terms[1][1].op.name == "NEG"  # -β v2, folded
    fused = chunk_stages(rank_terms.program)
    assert [s.kind for s in fused.stages] == ["pre", "core"] and fused.stages[0].writes == ("rank_terms_v",)
    core = core_form(fused.stages[1].program)
    assert [(k.arg, v.arg, r) for k, v, r in core.terms] == [("k1", "v1", None), ("k2", "rank_terms_v", None)]

    fused = chunk_stages(rank_beta.program)
    core = core_form(fused.stages[1].program)
    assert core.log_decay is None and core.decay is None and core.terms[0][1].axes == ("b", "h", "r", "v")

    ml = matrix_linear(rank_mixed.program)
    assert ml.rank(SIZES) == 4 and ml.rank_text == "r + 1" and ml.decay.arg == "gamma"
    assert [s.kind for s in chunk_stages(rank_mixed.program).stages] == ["core", "post"]
    gate = chunk_stages(rank_gate.program)
    assert [s.kind for s in gate.stages] == ["pre", "core", "post"]
    assert core_form(gate.stages[1].program).decay is not None and matrix_linear(rank_gate.program).rank({}) == 2

    from ssmc.backends.cuda.kernels.chunk import chunked_core
    from ssmc.backends.cuda.kernels.chunk.rank import RankCore
    assert isinstance(chunked_core(rank_dot.program, "float64"), RankCore)


@pytest.mark.parametrize("spec, reason", [
    (rank_per_value, "the decay varies along the value axis v"),
    (rank_no_key, "no factor along the contracted axis k"),
])
def test_rank_r_refusals_say_why(spec, reason):
    got = matrix_linear(spec.program)
    assert isinstance(got, str) and reason in got, got


def test_inspect_says_chunked_with_the_rank(capsys):
    from pathlib import Path

    from ssmc.cli import main

    path = Path(__file__).resolve()
    assert main(["inspect", f"{path}:rank_dot", "--sizes", "b=2,h=4,r=2,k=64,v=64", "--length", "256"]) == 0
    out = capsys.readouterr().out
    assert "chunked: rank_dot (matrix linear S [b h k v]" in out and "injection of rank r" in out, out


# -- against the interpreter ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SPECS))
def test_rank_r_matches_the_interpreter(name, emulated_cuda, counted):
    """Every length in one test per spec (the stages' kernels compiled once); chunks of 16: L·R = 7·3, 65·2,
    180·4 ... leave a partial last chunk."""
    emulated_cuda.setenv("SSMC_CUDA_CHUNK", "16")
    for length in (1, 7, 65, 180):
        _check(SPECS[name], length)
    assert counted["forward"] >= 4 and counted["backward"] == 4


def test_a_planted_bug_fails(emulated_cuda, monkeypatch):
    """The decay applied on the last sub-step of a step rather than the first: the check must fail."""
    from ssmc.backends.cuda.kernels.chunk.rank import RankCore

    original = RankCore._long

    def planted(self, seqs, params, sizes, length):
        out = original(self, seqs, params, sizes, length)
        g = out[self.decay_name]
        rank = self.ml.rank(sizes)
        out[self.decay_name] = g.reshape(length, rank, *g.shape[1:]).roll(1, 1).reshape(g.shape)
        return out
    monkeypatch.setattr(RankCore, "_long", planted)
    with pytest.raises(AssertionError):
        _check(rank_dot, 7)


def test_bfloat16_training_runs_the_kernels_on_the_sub_steps(emulated_cuda, monkeypatch):
    """bf16 q, k, v through `ssmc.torch.function` (K = V = 64, the kernels' sizes; 33 steps of rank 2: 66
    sub-steps, a partial chunk): the inner core's forward and VJP on the tensor-core kernels (emulated; the
    sequences read as given, `RankCore.half_inputs`), the output and every gradient within bf16's rounding of
    the interpreter's float64. Not in CI (the emulated kernels' time; the kernels themselves are
    tests/test_chunk_kernels.py's)."""
    from ssmc.backends.cuda import emulator
    from ssmc.backends.cuda.kernels.chunk import mma

    if not emulator.available() or in_ci():
        pytest.skip("no C++ compiler for the CUDA emulator" if not in_ci() else "CI: the emulated kernels' time")
    import ssmc.torch

    calls = []
    for name in ("forward", "backward"):
        original = getattr(mma, name)
        monkeypatch.setattr(mma, name, lambda *a, _o=original, _n=name, **k: (calls.append(_n), _o(*a, **k))[1])
    monkeypatch.setitem(SIZES, "k", 64)
    monkeypatch.setitem(SIZES, "v", 64)
    monkeypatch.setitem(SIZES, "r", 2)
    monkeypatch.setitem(SIZES, "b", 1)
    rng = np.random.default_rng(1)
    inputs = _inputs(rank_dot, 33, rng)
    ref = ssmc.compile(rank_dot, layout="b t ...", backend="interpreter")(**inputs)
    dy = rng.standard_normal(np.shape(ref))
    want = ssmc.grad(rank_dot, backend="interpreter", layout="b t ...")(**inputs, grad_outputs={"y": dy})
    leaves = {k: torch.tensor(v).to(torch.bfloat16 if k in ("q", "k", "v") else torch.float32).requires_grad_(True)
              for k, v in inputs.items()}
    y = ssmc.torch.function(rank_dot, "cuda", layout="b t ...")(**leaves)
    y.backward(torch.tensor(dy).to(y.dtype))
    assert calls == ["forward", "backward"]
    assert y.dtype == torch.bfloat16 and _relative(y.float(), ref) < 2e-2
    for name in want:
        assert _relative(leaves[name].grad.float(), want[name]) < 2e-2, (name, _relative(leaves[name].grad.float(),
                                                                                          want[name]))


def test_a_projection_inside_one_factor_is_no_rank_axis(emulated_cuda):
    """A sum over r inside v's factors alone (``k * dot(W, x, over="r")``, a projection) is one factor of a rank-1
    term, not r sub-steps a step (each operand |r| times its size): rank 2 at any |r|; outputs, final state and
    gradients equal the interpreter's (float64, 1e-10) at L = 1 and 7."""
    ml = matrix_linear(rank_projection.program)
    assert not isinstance(ml, str) and ml.rank({"r": 64}) == 2 and all(r is None for _, _, r in ml.terms)
    for length in (1, 7):
        _check(rank_projection, length)
