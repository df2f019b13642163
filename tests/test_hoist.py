"""The hoisting pass (`ssmc/lowering/hoist.py`): hoisted == unhoisted, and it fires where it should.

Relative error = max|got - want| / max|want| against the float64 interpreter on the original
program; thresholds: 1e-12 (hoisted program through the interpreter, float64), 1e-10 (Numba,
float64), 2e-4 forward / 2e-3 gradients (Numba, float32).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from profiles import examples

import ssmc
from ssmc.backends import interpreter
from ssmc.backends.numba.runner import runner_for
from ssmc.ir.node import toposort
from ssmc.lowering.hoist import compute_params, compute_post, compute_pre, gemm_like, hoist, split_contraction
from ssmc.lowering.plan import lower
from ssmc.passes.autodiff import derive_backward

SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow], "derandomize": True}
lstm = importlib.import_module("ssmc.examples.lstm")


@ssmc.recurrence
def projected_gate(h: ssmc.State["b d"], x: ssmc.Seq["b e"], Wf: ssmc.Param["e d"], Wx: ssmc.Param["e d"],
                   Wo: ssmc.Param["d o"]):
    """A gated linear RNN with input and output projections: pre (x Wf, x Wx) and post (h Wo)."""
    h = ssmc.sigmoid(ssmc.dot(x, Wf, over="e")) * h + ssmc.tanh(ssmc.dot(x, Wx, over="e"))
    return h, ssmc.dot(h, Wo, over="d")


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def random_run(program, rng, sizes, length):
    seqs = {d.name: rng.standard_normal((length, *(sizes[a] for a in d.axes))) for d in program.seqs}
    params = {d.name: 0.3 * rng.standard_normal([sizes[a] for a in d.axes]) for d in program.params}
    initial = {d.name: 0.5 * rng.standard_normal([sizes[a] for a in d.axes]) for d in program.states}
    return seqs, params, initial


def hoisted_through_interpreter(h, seqs, params, initial, sizes, length):
    """The hoisted program run by the interpreter, with the pass's own pre / post evaluation."""
    seqs = {**seqs, **compute_pre(h, seqs, params)}
    outs, finals = interpreter.run_recurrence(h.program, seqs, {**params, **compute_params(h, params)}, initial,
                                              sizes, length)
    post_outs, post_finals = compute_post(h, seqs, params, outs, initial)
    return {**outs, **post_outs}, {**finals, **post_finals}


def programs():
    """(label, program, sizes) of every form the tests run: forwards, carries and adjoints."""
    out = []
    for label, spec, base in (("lstm", lstm.SPEC, {"g": 4}), ("projected_gate", projected_gate, {})):
        bw = derive_backward(spec.program)
        for part, p in (("forward", spec.program), ("carries", bw.carries), ("adjoint", bw.adjoint)):
            out.append((f"{label}-{part}", p, base))
    return out


def mingru_programs():
    """(label, program, sizes) of minGRU's forward, carries and adjoint (`_sizes`: i, then d as k)."""
    spec = importlib.import_module("ssmc.examples.mingru").SPEC
    bw = derive_backward(spec.program)
    return [(f"mingru-{part}", p, {}) for part, p in
            (("forward", spec.program), ("carries", bw.carries), ("adjoint", bw.adjoint))]


def lstm_sizes(b, i, k):
    return {"b": b, "i": i, "k": k, "j": k, "g": 4}


def gate_sizes(b, e, d, o):
    return {"b": b, "e": e, "d": d, "o": o}


def _sizes(label, b, i, k):
    if label.startswith("mingru"):
        return {"b": b, "i": i, "d": k}
    return lstm_sizes(b, i, k) if label.startswith("lstm") else gate_sizes(b, i, k, i + 2)


# -- the pass fires where it should ----------------------------------------------------------------


def test_the_lstm_gate_projection_is_hoisted_before_the_time_loop():
    h = hoist(lstm.SPEC.program)
    assert [n for n, _ in h.pre] == ["hz0"]
    assert split_contraction(h.pre[0][1])[0] == ("i",)
    assert not h.factors and not h.post_outputs


def test_the_lstm_adjoint_hoists_every_param_gradient_and_grad_x_and_needs_no_split():
    adj = derive_backward(lstm.SPEC.program).adjoint
    assert lower(adj).strategy == "split"
    h = hoist(adj)
    assert len(h.pre) == 2                                      # x W and h U of the recomputed gates
    assert {n for n, _ in h.post_outputs} == {"grad_x"}
    assert {s for s, _ in h.post_accumulators} == {"grad_W", "grad_U", "grad_bias"}
    assert [s.name for s in h.program.states] == ["grad_h", "grad_c"]
    assert lower(h.program).strategy == "fused"
    assert runner_for(adj, "float32").hoisted.changed          # the Numba backend uses it


def test_diagonal_scans_are_left_alone():
    mamba1 = importlib.import_module("ssmc.examples.mamba1")
    h = hoist(mamba1.SPEC.program)
    assert not h.changed and h.program is mamba1.SPEC.program


def test_gemm_like_needs_two_sides_with_free_axes():
    p = projected_gate.program
    summed, fs = split_contraction(hoist(p).pre[0][1])
    assert gemm_like(summed, fs)
    assert not gemm_like(summed, fs[:1])
    assert not gemm_like((), fs)


# -- hoisted == unhoisted -----------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 7, 180])
@pytest.mark.parametrize("label,program,base", programs(), ids=[p[0] for p in programs()])
def test_hoisted_program_through_the_interpreter_equals_the_original(label, program, base, length):
    rng = np.random.default_rng(length)
    sizes = {**_sizes(label, 3, 5, 6), **base}
    seqs, params, initial = random_run(program, rng, sizes, length)
    want = interpreter.run_recurrence(program, seqs, params, initial, sizes, length)
    got = hoisted_through_interpreter(hoist(program), seqs, params, initial, sizes, length)
    for w, g in zip(want, got):
        assert set(g) >= set(w)
        for k in w:
            assert g[k].shape == w[k].shape, k
            assert rel_err(g[k], w[k]) <= 1e-12, k


def torch_hoisted_through_interpreter(h, seqs, params, initial, sizes, length, batch_outer=False):
    """As `hoisted_through_interpreter`, the pre / post products evaluated by torch (on the CPU here;
    the CUDA backend's `HoistedRunner` passes the same `TorchArrays` its GPU tensors). `batch_outer`:
    the sequences as time-first views of arrays laid out "b t ..." (the products' reshapes are views)."""
    import torch

    from ssmc.backends.cuda.hoisted import TORCH

    def tensor(v):
        if batch_outer and v.ndim > 2:
            return torch.from_numpy(np.ascontiguousarray(v.swapaxes(0, 1))).transpose(0, 1)
        return torch.from_numpy(v)

    t = {n: tensor(v) for n, v in seqs.items()}
    tp = {n: torch.from_numpy(v) for n, v in params.items()}
    ti = {n: torch.from_numpy(v) for n, v in initial.items()}
    pre = compute_pre(h, t, tp, xp=TORCH)
    arrays = {**seqs, **{n: v.numpy() for n, v in pre.items()}}
    hp = {n: v.numpy() for n, v in compute_params(h, tp, xp=TORCH).items()}
    outs, finals = interpreter.run_recurrence(h.program, arrays, {**params, **hp}, initial, sizes, length)
    written = {n: tensor(np.ascontiguousarray(v)) for n, v in outs.items()}
    post_outs, post_finals = compute_post(h, {**t, **pre}, tp, written, ti, xp=TORCH)
    return ({**outs, **{n: v.numpy() for n, v in post_outs.items()}},
            {**finals, **{n: v.numpy() for n, v in post_finals.items()}})


@pytest.mark.parametrize("transpose,batch_outer", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("length", [1, 7, 180])
@pytest.mark.parametrize("label,program,base", programs() + mingru_programs(),
                         ids=[p[0] for p in programs() + mingru_programs()])
def test_products_evaluated_by_torch_equal_the_original(label, program, base, length, transpose, batch_outer):
    """The CUDA backend's path (`hoist(transpose=False)`, torch's matmul over views of the sequences as
    they lie, or einsum) and the Numba one's."""
    rng = np.random.default_rng(length + 1)
    sizes = {**_sizes(label, 3, 5, 6), **base}
    seqs, params, initial = random_run(program, rng, sizes, length)
    want = interpreter.run_recurrence(program, seqs, params, initial, sizes, length)
    h = hoist(program, transpose=transpose)
    assert h.pre or h.factors
    got = torch_hoisted_through_interpreter(h, seqs, params, initial, sizes, length, batch_outer)
    for w, g in zip(want, got):
        for k in w:
            assert g[k].shape == w[k].shape, k
            assert rel_err(g[k], w[k]) <= 1e-12, k


def test_the_cuda_backend_hoists_the_mingru_products_and_leaves_mamba_alone():
    from ssmc.backends.cuda.hoisted import hoisted_runner
    from ssmc.backends.registry import preparer

    mingru = importlib.import_module("ssmc.examples.mingru")
    mamba1 = importlib.import_module("ssmc.examples.mamba1")
    run = hoisted_runner(mingru.SPEC.program)
    assert [n for n, _ in run.hoisted.pre] == ["hz0", "hz1"] and not run.hoisted.transposed
    assert preparer("cuda", mingru.SPEC.program, np.dtype("float32")) is None  # the general run takes it
    assert hoisted_runner(mamba1.SPEC.program) is None
    assert hoisted_runner(derive_backward(mamba1.SPEC.program).adjoint) is None


# each example compiles one of `programs()` with Numba in one dtype (17 s on CI's 2 cores): 4 in CI
@settings(max_examples=examples(8, ci=4), **SETTINGS)
@given(data=st.data(), length=st.sampled_from([1, 7, 180]), dtype=st.sampled_from(["float64", "float32"]))
def test_numba_with_hoisting_matches_the_interpreter_at_awkward_sizes(data, length, dtype):
    """Contraction axes 1..37 (not powers of two), forward / carries / adjoint programs."""
    label, program, base = data.draw(st.sampled_from(programs()), label="program")
    b, i, k = (data.draw(st.integers(1, 37), label=n) for n in "bik")
    sizes = {**_sizes(label, b, i, k), **base}
    rng = np.random.default_rng(length + b)
    seqs, params, initial = random_run(program, rng, sizes, length)
    want = interpreter.run_recurrence(program, seqs, params, initial, sizes, length)
    cast = {n: {k: v.astype(dtype) for k, v in d.items()} for n, d in
            (("seqs", seqs), ("params", params), ("initial", initial))}
    got = runner_for(program, dtype).run(cast["seqs"], cast["params"], cast["initial"], sizes, length)
    tol = 1e-10 if dtype == "float64" else 2e-4 * (10 if "adjoint" in label else 1)
    for w, g in zip(want, got):
        for key in w:
            assert g[key].dtype == np.dtype(dtype) and g[key].shape == w[key].shape, key
            assert rel_err(g[key], w[key]) <= tol, (key, rel_err(g[key], w[key]))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("length", [1, 7, 180])
def test_projected_gate_gradients_match_the_interpreter(length, dtype):
    rng = np.random.default_rng(length)
    inputs = {"x": rng.standard_normal((3, length, 13)), "Wf": 0.3 * rng.standard_normal((13, 7)),
              "Wx": 0.3 * rng.standard_normal((13, 7)), "Wo": 0.3 * rng.standard_normal((7, 5)),
              "h": rng.standard_normal((3, 7))}
    inputs = {k: v.astype(dtype) for k, v in inputs.items()}
    dy = rng.standard_normal((3, length, 5)).astype(dtype)
    got = ssmc.grad(projected_gate, "numba", layout="b t ...", chunk=16)(**inputs, grad_outputs=dy)
    want = ssmc.grad(projected_gate, "interpreter", layout="b t ...", chunk=16)(**inputs, grad_outputs=dy)
    for key in want:
        assert rel_err(got[key], want[key]) <= (1e-10 if dtype == "float64" else 2e-3), key


# -- the LSTM lowering picks the fast strategies ------------------------------------------------------


def _source(program, dtype="float32") -> str:
    return runner_for(program, dtype).source


def test_the_lstm_lowering_tiles_its_recurrent_products_and_transposes_U_for_the_adjoint():
    """Fails if a heuristic silently stops firing: forward h U, adjoint grad_gates U^T, each one
    register-tiled call (`backends/numba/tiles.py`) on a param packed once per kernel call."""
    fwd = _source(lstm.SPEC.program)
    assert "bs_b = " in fwd and "for q_b in range(b0_b_end - b0_b):" in fwd  # blocks of b share U
    assert "] = U[i_j, i_g, i_k]" in fwd                            # U packed ...
    assert _tile_calls(fwd) == ["tile_product(m0.reshape((bs_b, n_g * n_k)), st_h.reshape((bs_b, n_k)), "
                                "pk0, b0_b_end - b0_b)"]                           # ... for h U
    assert "hz0[t, (b0_b + q_b)" in fwd and "x[t" not in fwd      # x W hoisted out of the loop
    adj_program = derive_backward(lstm.SPEC.program).adjoint
    h = runner_for(adj_program, "float32").hoisted
    assert [(n, p, a) for n, p, a in h.transposed] == [("hp0", "U", ("g", "k", "j"))]
    adj = _source(adj_program)
    assert "] = hp0[i_g, i_k, i_j]" in adj                         # grad_h = sum_{g,k} gz U, one call
    assert len(_tile_calls(adj)) == 1 and "for q_b in range(b0_b_end - b0_b):" in adj
    assert runner_for(adj_program, "float32").lowered.strategy == "fused"


def _tile_calls(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines() if line.strip().startswith("tile_product(")]


def test_numba_matmul_matches_numpy_at_awkward_shapes():
    from ssmc.backends.numba.gemm import matmul

    rng = np.random.default_rng(0)
    # tiles are 6 rows x 2 vectors, k runs in blocks of 256: shapes that overhang both, several
    # blocks of k (the later ones add to C), and a transposed (column-major) A
    shapes = [(1, 1, 1), (1, 9, 1), (7, 1, 3), (9, 17, 1030), (37, 256, 5), (8, 0, 4),
              (13, 300, 100), (6, 513, 64), (200, 700, 33)]
    for m, k, n in shapes:
        for dtype, tol in (("float64", 1e-13), ("float32", 1e-5)):
            a = rng.standard_normal((m, k)).astype(dtype)
            if m % 2:
                a = np.ascontiguousarray(a.T).T
            b = rng.standard_normal((k, n)).astype(dtype)
            got = matmul(a, b)
            want = a.astype(np.float64) @ b.astype(np.float64)
            assert got.dtype == np.dtype(dtype) and got.shape == (m, n)
            assert np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max()) * max(1, k)


def test_lstm_adjoint_reads_its_gate_gradient_as_matrices_without_copies():
    """The gate gradient gz [g b k] is reordered once to (t, b, g, k): grad_x = gz (t b, g k) W and
    grad_W = gz^T (g k, t b) x then read it as views (the old order copied it for each product)."""
    from ssmc.lowering.hoist import _copied, _product_order

    h = hoist(derive_backward(lstm.SPEC.program).adjoint)
    ((name, f),) = h.factors
    assert f.axes == ("g", "b", "k") and _product_order(h, name, f) == ("b", "g", "k")
    gz = np.zeros((5, 3, 4, 6))                      # (t, b, g, k), C order
    labels = ("~t", "b", "g", "k")
    assert _copied(gz, labels, ("~t", "b"), ("g", "k"), contiguous=True) == 0
    assert _copied(gz, labels, ("g", "k"), ("~t", "b"), contiguous=False) == 0
    assert _copied(gz, labels, ("g", "k"), ("b", "~t"), contiguous=False) == gz.nbytes
    assert _copied(gz, labels, ("b", "~t"), ("g", "k"), contiguous=True) == gz.nbytes


def test_a_training_step_computes_the_lstm_products_once():
    """The recording forward keeps x W in the tape and writes h U, which its loop computes anyway,
    per step; the adjoint takes both from there instead of recomputing them by matrix products:
    4 products a training step (x W; grad_x, grad_W, grad_U), same gradients as a backward that
    recomputes them."""
    import ssmc.backends.numba.runner as numba_runner

    rng = np.random.default_rng(3)
    inputs = lstm.make_inputs(rng, 23, batch=3, inp=5, hidden=4)
    g = ssmc.grad(lstm.SPEC, "numba", layout=lstm.LAYOUT)
    calls = []
    real = numba_runner.matmul
    numba_runner.matmul = lambda a, b: (calls.append((a.shape, b.shape)), real(a, b))[1]
    try:
        _, _, tape = g.forward(**inputs)
        forward_calls = len(calls)
        (node, product), (saved, h_u) = tape.products.items()
        cot = {"y": rng.standard_normal((3, 23, 4))}
        got = g.backward(tape, grad_outputs=cot)
    finally:
        numba_runner.matmul = real
    assert node.op.value == "sum" and product.shape == (23, 3, 4, 4) and h_u.shape == (23, 3, 4, 4)
    assert {n.arg for n in toposort([saved]) if n.op.value == "input"} == {"h", "U"}
    assert forward_calls == 1 and len(calls) == 1 + 3   # adjoint: grad_x, grad_W, grad_U
    tape.products.clear()                                # now the adjoint recomputes x W and h U
    want = g.backward(tape, grad_outputs=cot)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


def _run_nests(env: dict, shape, *nests) -> list[np.ndarray]:
    """The accumulator ``m`` (int64 zeros of `shape`) after each nest, run as the printed Python."""
    from ssmc.backends.numba.codegen import statements

    env = {**env, "F": float, "fma": lambda a, b, c: a * b + c}
    results = []
    for stmts in nests:
        local = {**env, "m": np.zeros(shape, dtype=np.int64)}
        exec("\n".join(statements(stmts, 0)), {}, local)
        results.append(local["m"])
    return results


@settings(max_examples=20, **SETTINGS)
@given(extent=st.integers(0, 37), inner=st.integers(1, 5))
def test_unrolled_sums_add_the_same_terms(extent, inner):
    """The unrolled nest (as Python) equals the plain one for any extent, remainders included."""
    from ssmc.lowering.loops import Assign, Bin, Load, Loop
    from ssmc.lowering.unroll import unroll_sums

    nest = [Loop("i_j", "n_j", [Loop("i_k", "n_k", [
        Assign(Load("m", ("i_k",)), Bin("*", Load("h", ("i_j",)), Load("U", ("i_j", "i_k"))), "+=")])])]
    unrolled = unroll_sums(nest)
    assert len(unrolled) == 2 and unrolled[0].var == "u_j"
    rng = np.random.default_rng(extent)
    env = {"n_j": extent, "n_k": inner, "h": rng.integers(-9, 9, extent), "U": rng.integers(-9, 9, (extent, inner))}
    results = _run_nests(env, inner, nest, unrolled)
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], env["h"] @ env["U"])


@settings(max_examples=20, **SETTINGS)
@given(rows=st.integers(0, 7), extent=st.integers(0, 19), inner=st.integers(1, 5))
def test_paired_rows_add_the_same_terms(rows, extent, inner):
    """A blocked nest (rows q inside the summed loop j, sharing U's loads) runs rows 4 at a time and
    the last ones alone; the sums equal the plain nest's for any number of rows."""
    from ssmc.backends.numba.codegen import statements
    from ssmc.lowering.loops import Assign, Bin, Load, Loop
    from ssmc.lowering.unroll import unroll_sums

    nest = [Loop("i_j", "n_j", [Loop("q_b", "n_q", [Loop("i_k", "n_k", [
        Assign(Load("m", ("q_b", "i_k")), Bin("*", Load("h", ("q_b", "i_j")), Load("U", ("i_j", "i_k"))), "+=")])])])]
    unrolled = unroll_sums(nest)
    source = "\n".join(statements(unrolled, 0))
    assert "for q_b2 in range((n_q) // 4):" in source and "for q_b in range((n_q) % 4):" in source
    rng = np.random.default_rng(extent)
    env = {"n_j": extent, "n_q": rows, "n_k": inner, "h": rng.integers(-9, 9, (rows, extent)),
           "U": rng.integers(-9, 9, (extent, inner))}
    results = _run_nests(env, (rows, inner), nest, unrolled)
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], env["h"] @ env["U"])


@settings(max_examples=25, **SETTINGS)
@given(rows=st.integers(0, 9), outer=st.integers(0, 3), extent=st.integers(0, 11), inner=st.integers(1, 5))
def test_rows_outside_the_summed_loop_add_the_same_terms(rows, outer, extent, inner):
    """An LSTM adjoint's nest ``for g: for q: for k: for j: m[q, j] += gz[q, g, k] U[g, k, j]`` runs
    rows 4 at a time inside g; every element gets the same sum (integers, so exactly), for any
    number of rows and any remainder of k."""
    from ssmc.backends.numba.codegen import statements
    from ssmc.lowering.loops import Assign, Bin, Load, Loop
    from ssmc.lowering.unroll import unroll_sums

    nest = [Loop("i_g", "n_g", [Loop("q_b", "n_q", [Loop("i_k", "n_k", [Loop("i_j", "n_j", [
        Assign(Load("m", ("q_b", "i_j")), Bin("*", Load("gz", ("q_b", "i_g", "i_k")), Load("U", ("i_g", "i_k", "i_j"))),
               "+=")])])])])]
    unrolled = unroll_sums(nest)
    source = "\n".join(statements(unrolled, 0))
    assert "for q_b2 in range((n_q) // 4):" in source and "for u_k in range((n_k) // 4):" in source
    rng = np.random.default_rng(extent)
    env = {"n_g": outer, "n_q": rows, "n_k": extent, "n_j": inner,
           "gz": rng.integers(-9, 9, (rows, outer, extent)), "U": rng.integers(-9, 9, (outer, extent, inner))}
    results = _run_nests(env, (rows, inner), nest, unrolled)
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], np.einsum("qgk,gkj->qj", env["gz"], env["U"]))
