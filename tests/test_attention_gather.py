"""Indexed reads in attention's modifiers (issue #42): a relative-position bias table ``table[i - j]`` and
document masks from per-position ids ``doc[q_idx] == doc[kv_idx]``.

Checked on the interpreter against a NumPy loop, its gradients against finite differences; the tiled torch
path (the CPU backends' attention, float64 and float32), ``ssmc.torch.function``, a decode step, and the flash
kernels on the CUDA emulator (forward configs, backward, grouped-query attention, the table's gradient bitwise
repeatable) against the interpreter; the kernels' NVRTC builds for spills; the document masks' tile skipping
(sound, tight for sorted ids, a span table per batch row, made on the ids' device with no host copy and equal to
the rules' tile-by-tile answer; ids renumbered in order where float32 would merge them); the spec errors at the
user's line. GPU tests against a torch reference, and a document-masked call under torch's sync debug mode.
"""

import os
from pathlib import Path

import numpy as np
import pytest
from attention_strategies import document_ids

import ssmc

R = 8  # the bias table's entries (a static size: clamp's bound)

FILE = os.path.basename(__file__)
_SOURCE = Path(__file__).read_text().splitlines()


def rel_bias(score, q_idx, kv_idx, table: ssmc.Param["h r=8"]):
    return score + table[ssmc.clamp(q_idx - kv_idx, 0, R - 1)]


def rel_bias_clamped(score, q_idx, kv_idx, table: ssmc.Param["h r"]):
    return score + table[q_idx - kv_idx + 2]  # out-of-range indices clamp to the table's ends


def doc_mask(q_idx, kv_idx, doc: ssmc.Seq["b"]):
    return doc[q_idx] == doc[kv_idx]


def doc_causal(q_idx, kv_idx, doc: ssmc.Seq["b"]):
    return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])


def doc_strict(q_idx, kv_idx, doc: ssmc.Seq["b"]):
    return (kv_idx < q_idx) & (doc[q_idx] == doc[kv_idx])  # a document's first query sees no key


SPECS = {
    "rel": ssmc.attention(rel_bias),
    "rel_clamped": ssmc.attention(rel_bias_clamped),
    "doc": ssmc.attention(mask_mod=doc_mask),
    "doc_causal": ssmc.attention(mask_mod=doc_causal),
    "rel_doc_causal": ssmc.attention(rel_bias, doc_causal),
    "rel_doc_strict": ssmc.attention(rel_bias, doc_strict),
}


def _bias(name, table, lq, lk):
    """[h, i, j] of the spec's bias (0 without a table)."""
    i, j = np.arange(lq)[:, None], np.arange(lk)[None]
    if name.startswith("rel_clamped"):
        return table[:, np.clip(i - j + 2, 0, table.shape[1] - 1)]
    if name.startswith("rel"):
        return table[:, np.clip(i - j, 0, R - 1)]
    return np.zeros((1, lq, lk))


def _visible(name, doc, lq, lk):
    """[b, i, j] of the spec's mask."""
    i, j = np.arange(lq)[:, None], np.arange(lk)[None]
    same = doc[:, :, None] == doc[:, None, :] if "doc" in name else np.ones((1, lq, lk), bool)
    if name.endswith("causal"):
        return same & (j <= i)
    if name.endswith("strict"):
        return same & (j < i)
    return same


def reference(name, q, k, v, table, doc):
    """The module docstring's loop in NumPy: q, k, v [b h t d], table [h r], doc [b t]."""
    lq, lk = q.shape[2], k.shape[2]
    s = np.einsum("bhid,bhjd->bhij", q, k) / np.sqrt(q.shape[-1]) + _bias(name, table, lq, lk)[None]
    vis = np.broadcast_to(_visible(name, doc, lq, lk)[:, None], s.shape)
    s = np.where(vis, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(vis, np.exp(s - m), 0.0)
    total = p.sum(-1, keepdims=True)
    p = np.where(total > 0, p / np.where(total > 0, total, 1.0), 0.0)
    return np.einsum("bhij,bhjd->bhid", p, v)


def inputs(name, b, h, length, d, seed, sorted_ids=True):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((b, h, length, d)) for _ in range(3))
    x = {"q": q, "k": k, "v": v}
    if name.startswith("rel"):
        x["table"] = rng.standard_normal((h, 5 if "clamped" in name else R))
    if "doc" in name:
        ids = rng.integers(0, max(1, length // 4), (b, length))
        x["doc"] = np.sort(ids, axis=1) if sorted_ids else ids
    return x, rng


def _params(x):
    return {n: x[n] for n in ("table", "doc") if n in x}


def _ref(name, x):
    table = x.get("table", np.zeros((x["q"].shape[1], R)))
    doc = x.get("doc", np.zeros((x["q"].shape[0], x["q"].shape[2]), int))
    return reference(name, x["q"], x["k"], x["v"], table, doc)


# -- the interpreter against NumPy, its gradients against finite differences ---------------------------------

@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("length", [1, 7, 65])
def test_interpreter_matches_numpy(name, length):
    x, _ = inputs(name, 2, 3, length, 4, seed=length)
    f = ssmc.compile(SPECS[name], "interpreter", layout="b h t ...")
    out = f(x["q"], x["k"], x["v"], **_params(x))
    np.testing.assert_allclose(out, _ref(name, x), rtol=1e-12, atol=1e-12)
    assert np.isfinite(out).all()


def test_rows_without_a_key_give_zeros_and_zero_gradients():
    name = "rel_doc_strict"
    x, rng = inputs(name, 1, 2, 9, 4, seed=3)
    x["doc"] = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2]])
    f = ssmc.compile(SPECS[name], "interpreter", layout="b h t ...")
    out = f(x["q"], x["k"], x["v"], **_params(x))
    firsts = [0, 3, 5]  # each document's first query sees no key
    assert (out[:, :, firsts] == 0).all() and np.isfinite(out).all()
    d_out = rng.standard_normal(out.shape)
    for backend in ("interpreter", "numba"):
        g = ssmc.grad(SPECS[name], backend, layout="b h t ...")(x["q"], x["k"], x["v"], d_out, **_params(x))
        assert all(np.isfinite(np.asarray(t)).all() for t in g.values())
        assert (np.asarray(g["q"])[:, :, firsts] == 0).all()


def _loss(f, x, d_out, **change):
    y = {**x, **change}
    return float((f(y["q"], y["k"], y["v"], **_params(y)) * d_out).sum())


@pytest.mark.parametrize("name", ["rel", "rel_clamped", "rel_doc_causal"])
def test_interpreter_gradients_match_finite_differences(name):
    x, rng = inputs(name, 1, 2, 7, 3, seed=11)
    f = ssmc.compile(SPECS[name], "interpreter", layout="b h t ...")
    d_out = rng.standard_normal(x["q"].shape)
    g = ssmc.grad(SPECS[name], "interpreter", layout="b h t ...")(x["q"], x["k"], x["v"], d_out, **_params(x))
    assert "doc" not in g  # ids get no gradient
    eps = 1e-6
    for arg in ("q", "k", "v", "table"):
        fd = np.zeros_like(x[arg])
        for idx in np.ndindex(x[arg].shape):
            up, down = x[arg].copy(), x[arg].copy()
            up[idx] += eps
            down[idx] -= eps
            fd[idx] = (_loss(f, x, d_out, **{arg: up}) - _loss(f, x, d_out, **{arg: down})) / (2 * eps)
        np.testing.assert_allclose(g[arg], fd, rtol=1e-6, atol=1e-7, err_msg=arg)


def test_table_gradient_is_the_scatter_add_over_positions():
    """d table[h, r] = sum over (b, i, j) with clamp(i - j) = r of dM[b, h, i, j]: the entries no position reads
    (r past the longest distance) get exactly zero."""
    name = "rel"
    x, rng = inputs(name, 1, 2, 4, 3, seed=5)  # distances 0..3: entries 4..7 unread
    d_out = rng.standard_normal(x["q"].shape)
    g = ssmc.grad(SPECS[name], "interpreter", layout="b h t ...")(x["q"], x["k"], x["v"], d_out, **_params(x))
    assert (g["table"][:, 4:] == 0).all() and (g["table"][:, :4] != 0).all()


# -- the tiled torch path (the CPU backends' attention) and ssmc.torch ---------------------------------------

@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("length, d", [(1, 16), (7, 16), (65, 64)])
def test_tiled_path_matches_the_interpreter(name, length, d):
    pytest.importorskip("torch")
    x, rng = inputs(name, 2, 2, length, d, seed=length + d)
    d_out = rng.standard_normal(x["q"].shape)
    args = (x["q"], x["k"], x["v"])
    want = ssmc.compile(SPECS[name], "interpreter", layout="b h t ...")(*args, **_params(x))
    got = ssmc.compile(SPECS[name], "numba", layout="b h t ...")(*args, **_params(x))
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    want_g = ssmc.grad(SPECS[name], "interpreter", layout="b h t ...")(*args, d_out, **_params(x))
    got_g = ssmc.grad(SPECS[name], "numba", layout="b h t ...")(*args, d_out, **_params(x))
    assert set(got_g) == set(want_g)
    for n in want_g:
        np.testing.assert_allclose(np.asarray(got_g[n]), want_g[n], rtol=1e-9, atol=1e-10, err_msg=n)


def test_tiled_path_float32_and_small_blocks():
    """Blocks of 16 query rows (several per call, spans from the ids) in float32 against float64."""
    torch = pytest.importorskip("torch")
    from ssmc.backends.tiled_attention import TiledAttention

    name = "rel_doc_causal"
    x, rng = inputs(name, 2, 2, 65, 16, seed=9)
    tiled = TiledAttention(SPECS[name].program)
    t = {n: torch.tensor(a, dtype=torch.float32) if n not in ("doc",) else torch.tensor(a) for n, a in x.items()}
    call = tiled.bind(t["q"], t["k"], t["v"], "b h t ...", _params(t))
    out, lse = tiled.forward(call, block=16)
    np.testing.assert_allclose(out.numpy(), _ref(name, x), rtol=2e-5, atol=2e-5)
    d_out = torch.tensor(rng.standard_normal(x["q"].shape), dtype=torch.float32)
    grads = tiled.backward(call, lse, d_out, block=16)
    want = ssmc.grad(SPECS[name], "interpreter", layout="b h t ...")(x["q"], x["k"], x["v"], d_out.numpy(),
                                                                       **_params(x))
    for n in ("q", "k", "v", "table"):
        np.testing.assert_allclose(grads[n].numpy(), want[n], rtol=1e-4, atol=1e-4, err_msg=n)


def test_table_gradient_is_deterministic():
    torch = pytest.importorskip("torch")
    name = "rel_doc_causal"
    x, rng = inputs(name, 2, 4, 65, 16, seed=2)
    d_out = rng.standard_normal(x["q"].shape).astype(np.float32)
    g = ssmc.grad(SPECS[name], "numba", layout="b h t ...")
    xs = {n: a.astype(np.float32) if n != "doc" else a for n, a in x.items()}
    first = g(xs["q"], xs["k"], xs["v"], d_out, **_params(xs))["table"]
    again = g(xs["q"], xs["k"], xs["v"], d_out, **_params(xs))["table"]
    assert torch.equal(torch.as_tensor(first), torch.as_tensor(again))


def test_torch_function_gradients_reach_the_table_not_the_ids():
    torch = pytest.importorskip("torch")
    import ssmc.torch as st

    name = "rel_doc_causal"
    x, rng = inputs(name, 2, 2, 7, 16, seed=4)
    fn = st.function(SPECS[name], layout="b h t ...")
    t = {n: torch.tensor(a, requires_grad=n != "doc") for n, a in x.items()}
    out = fn(t["q"], t["k"], t["v"], table=t["table"], doc=t["doc"])
    d_out = rng.standard_normal(x["q"].shape)
    out.backward(torch.tensor(d_out))
    want = ssmc.grad(SPECS[name], "interpreter", layout="b h t ...")(x["q"], x["k"], x["v"], d_out, **_params(x))
    np.testing.assert_allclose(out.detach().numpy(), _ref(name, x), rtol=1e-10, atol=1e-12)
    for n in ("q", "k", "v", "table"):
        np.testing.assert_allclose(t[n].grad.numpy(), want[n], rtol=1e-9, atol=1e-10, err_msg=n)


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
def test_a_decode_step_reads_the_table(backend):
    """ssmc.step of a spec with a table: token by token against the whole sequence (the decode kernel does not
    take tables: the step's torch path)."""
    torch = pytest.importorskip("torch")
    spec = ssmc.attention(rel_bias, ssmc.causal)  # a step sees the keys so far
    x, _ = inputs("rel", 1, 2, 9, 16, seed=8)
    full = ssmc.compile(spec, "interpreter", layout="b h t ...")(x["q"], x["k"], x["v"], table=x["table"])
    s = ssmc.step(spec, backend, layout="b h t ...")
    sizes = {"b": 1, "h": 2, "d": 16}
    cache = s.cache(sizes, 9) if backend == "interpreter" else s.cache(sizes, 9, dtype=torch.float64)
    conv = (lambda a: a) if backend == "interpreter" else torch.tensor
    got = [np.asarray(s(*(conv(x[n][:, :, i]) for n in "qkv"), cache, table=conv(x["table"]))) for i in range(9)]
    np.testing.assert_allclose(np.stack(got, 2), full, rtol=1e-12, atol=1e-12)


# -- the flash kernels on the CUDA emulator (SSMC_CUDA_EMULATE=1: CPU bf16 tensors) ------------------------------

def _needs_emulator():
    from ssmc.backends.cuda import emulator

    if not emulator.available():
        pytest.skip("no C++ compiler for the CUDA emulator")


def _emulated(name, x, monkeypatch, forward=None, backward=None, dq=None):
    """(tiled path object, bound call of x in bf16) with the flash kernels emulated in the configs given."""
    torch = pytest.importorskip("torch")
    from ssmc.backends.tiled_attention import TiledAttention

    _needs_emulator()
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    for var, value in (("SSMC_CUDA_FLASH_FORWARD", forward), ("SSMC_CUDA_FLASH_BACKWARD_CONFIG", backward),
                       ("SSMC_CUDA_FLASH_DQ", dq)):
        if value is not None:
            monkeypatch.setenv(var, value)
    t = {n: torch.tensor(a, dtype=torch.bfloat16) if n in "qkv" else torch.tensor(a) for n, a in x.items()}
    tiled = TiledAttention(SPECS[name].program)
    return tiled, tiled.bind(t["q"], t["k"], t["v"], "b h t ...", _params(t)), t


def _rounded(x, t):
    return {n: (t[n].double().numpy() if n in "qkv" else x[n]) for n in x}


# forward configs: 64-row blocks, 128-row blocks of 4 warps (the emulator's default), the wgmma kernel (staggered:
# its second warpgroup's mask bits carried a tile, over three key tiles); lengths 1, 7, 65 (a partial tile, several
# tiles), 300, head dims 16 (refused: the tiled path) and 64; unsorted ids once
FORWARD_CASES = [("rel", 7, "bm64", True), ("rel_clamped", 65, "bm128w4", True), ("doc_causal", 65, "bm64", True),
                 ("doc", 65, "bm128w4", False), ("rel_doc_causal", 1, "bm128w4", True),
                 ("rel_doc_strict", 65, "wg128", True), ("doc_causal", 300, "wg128s", True)]


@pytest.mark.parametrize("name, length, config, sorted_ids", FORWARD_CASES)
def test_emulated_flash_forward_matches_float64(name, length, config, sorted_ids, monkeypatch):
    x, _ = inputs(name, 2, 2, length, 64, seed=length, sorted_ids=sorted_ids)
    tiled, call, t = _emulated(name, x, monkeypatch, forward=config)
    assert tiled.flash(call) is not None, tiled.flash_reason
    out, _ = tiled.forward(call)
    want = _ref(name, _rounded(x, t))
    np.testing.assert_allclose(out.float().numpy(), want, rtol=0, atol=2e-2 * max(1.0, np.abs(want).max()))
    assert np.isfinite(out.float().numpy()).all()


def test_emulated_flash_is_refused_at_head_dim_16(monkeypatch):
    x, _ = inputs("rel", 1, 2, 7, 16, seed=1)
    tiled, call, _ = _emulated("rel", x, monkeypatch)
    assert tiled.flash(call) is None and "head dim 16" in tiled.flash_reason


def _flash_gradients_match_float64(name, x, rng, tiled, call, t):
    """The emulated flash backward runs `call` (`_emulated`'s), and its gradients equal the float64 interpreter's on
    the rounded inputs within 3e-2 of each gradient's largest value, all finite."""
    import torch

    assert tiled.flash_backward(call) is not None, tiled.flash_backward_reason
    d_out = torch.tensor(rng.standard_normal(x["q"].shape), dtype=torch.float32)
    out32 = tiled.delta_output(call)
    out, lse = tiled.forward(call, out32=out32)
    grads = tiled.backward(call, lse, d_out, out=out if out32 is None else out32)
    r = _rounded(x, t)
    want = ssmc.grad(SPECS[name], "interpreter", layout="b h t ...")(r["q"], r["k"], r["v"], d_out.numpy(),
                                                                       **_params(r))
    assert set(grads) == set(want)
    for n in want:
        got = grads[n].float().numpy()
        assert np.isfinite(got).all(), n
        np.testing.assert_allclose(got, want[n], rtol=0, atol=3e-2 * max(1.0, np.abs(want[n]).max()), err_msg=n)


@pytest.mark.parametrize("name, length, backward, dq", [
    ("rel", 65, None, None), ("doc_causal", 65, None, None), ("rel_doc_causal", 65, "bn64", "atomic"),
    ("rel_doc_strict", 7, "w8q32", None)])
def test_emulated_flash_gradients_match_float64(name, length, backward, dq, monkeypatch):
    pytest.importorskip("torch")
    x, rng = inputs(name, 1, 2, length, 64, seed=length + 1)
    tiled, call, t = _emulated(name, x, monkeypatch, backward=backward, dq=dq)
    _flash_gradients_match_float64(name, x, rng, tiled, call, t)


# ids packed differently in the two batch rows: row 0 one long document after a short one (its key blocks full
# for later query tiles), row 1 three documents whose boundaries cut those tiles (partly masked there); each
# row's kernels must read their own row's spans (a key block full in row 0 is not in row 1)
_ROW_IDS = np.array([[0] * 10 + [1] * 140, [0] * 45 + [1] * 50 + [2] * 55])


@pytest.mark.parametrize("name, backward, d", [
    ("doc_causal", "wgp", 64),       # sm_90's d 64 config: wgmma, dQ by atomics in the key-block kernel
    ("rel_doc_causal", "wgp", 64),   # with a table: the key-block kernel without dQ, then the dQ kernel
    ("doc_causal", "w4q64", 64),     # the wide kernel (d 64's default elsewhere)
    ("rel_doc_causal", "bn64", 64),  # the 4-warp kernel
    ("doc_causal", "wgws", 64),      # the warp-specialized wgmma kernel
    ("doc_causal", None, 256)])      # d 256's only config "w8q16s2": the wide kernel, dQ by atomics
def test_emulated_flash_gradients_with_ids_that_differ_between_batch_rows(name, backward, d, monkeypatch):
    """Two batch rows with their own document boundaries (`_ROW_IDS`), key blocks of 64 partly masked in one row
    and full in the other: each config's key-block kernel (and the dQ kernel) against float64 (a kernel that read
    row 0's span table for row 1 treated row 1's partly masked tiles as fully visible: errors in the hundreds)."""
    pytest.importorskip("torch")
    from ssmc.backends.cuda.kernels.flash import backward as flash_bwd

    x, rng = inputs(name, 2, 2, _ROW_IDS.shape[1], d, seed=5)
    x["doc"] = _ROW_IDS.copy()
    tiled, call, t = _emulated(name, x, monkeypatch, backward=backward)
    assert flash_bwd.config(d).name == (backward or flash_bwd.DEFAULT_CONFIG[d])
    _flash_gradients_match_float64(name, x, rng, tiled, call, t)


def test_emulated_flash_grouped_query_attention_with_a_table_and_ids(monkeypatch):
    """kv_heads: 4 query heads on 2 KV heads; the table per query head, the ids per batch index: the flash
    forward (reading KV head h // 2) and backward against float64 with k and v repeated."""
    torch = pytest.importorskip("torch")
    from ssmc.backends.tiled_attention import TiledAttention

    _needs_emulator()
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    spec = ssmc.attention(rel_bias, doc_causal, kv_heads="h")
    rng = np.random.default_rng(12)
    b, hq, hkv, length, d = 2, 4, 2, 65, 64
    q = rng.standard_normal((b, hq, length, d))
    k, v = (rng.standard_normal((b, hkv, length, d)) for _ in range(2))
    table = rng.standard_normal((hq, R))
    doc = np.sort(rng.integers(0, 5, (b, length)), axis=1)
    tq, tk, tv = (torch.tensor(a, dtype=torch.bfloat16) for a in (q, k, v))
    tiled = TiledAttention(spec.program)
    call = tiled.bind(tq, tk, tv, "b h t ...", {"table": torch.tensor(table), "doc": torch.tensor(doc)})
    assert tiled.flash(call) is not None and tiled.flash_backward(call) is not None, tiled.flash_backward_reason
    out32 = tiled.delta_output(call)
    out, lse = tiled.forward(call, out32=out32)
    d_out = torch.tensor(rng.standard_normal(q.shape), dtype=torch.float32)
    grads = tiled.backward(call, lse, d_out, out=out32)
    r = [t.double().numpy() for t in (tq, tk, tv)]
    want_out = ssmc.compile(spec, "interpreter", layout="b h t ...")(*r, table=table, doc=doc)
    np.testing.assert_allclose(out.float().numpy(), want_out, rtol=0, atol=2e-2 * np.abs(want_out).max())
    want = ssmc.grad(spec, "interpreter", layout="b h t ...")(*r, d_out.numpy(), table=table, doc=doc)
    for n in ("q", "k", "v", "table"):
        np.testing.assert_allclose(grads[n].float().numpy(), want[n], rtol=0, atol=3e-2 * np.abs(want[n]).max(),
                                   err_msg=n)


def test_emulated_flash_table_gradient_is_repeatable(monkeypatch):
    """The table's entries summed per key block and batch index, their row sums in the dQ kernel: bitwise the
    same twice (the default dQ mode is atomics: a spec with a table takes the dQ kernel)."""
    torch = pytest.importorskip("torch")
    name = "rel_doc_causal"
    x, rng = inputs(name, 1, 2, 65, 64, seed=3)
    tiled, call, _ = _emulated(name, x, monkeypatch)
    d_out = torch.tensor(rng.standard_normal(x["q"].shape), dtype=torch.float32)
    runs = []
    for _ in range(2):
        out32 = tiled.delta_output(call)
        _, lse = tiled.forward(call, out32=out32)
        runs.append(tiled.backward(call, lse, d_out, out=out32)["table"])
    assert tiled.flash_backward_reason is None
    assert torch.equal(runs[0], runs[1])


def test_a_table_of_dynamic_size_takes_the_tiled_backward(monkeypatch):
    x, _ = inputs("rel_clamped", 1, 2, 7, 64, seed=2)
    tiled, call, _ = _emulated("rel_clamped", x, monkeypatch)
    assert tiled.flash(call) is not None
    assert tiled.flash_backward(call) is None and "static size" in tiled.flash_backward_reason


# -- NVRTC: the kernels the calls take build without spills ----------------------------------------------------

def _nvrtc_available() -> bool:
    from ssmc.backends.cuda import nvrtc

    return nvrtc.available()


@pytest.mark.skipif(not _nvrtc_available(), reason="no NVRTC")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", ["rel_doc_causal", "doc_causal"])
def test_the_kernels_build_without_spills(name, d):
    """The forward in the config a call takes (at d 64 with a table "bm128w8": the 4-warp build spilled), the
    wgmma forward (sm_90a); the backward's default and sm_90 configs, atomic dQ only without a table (a table
    takes the dQ kernel), and the dQ kernel."""
    from ssmc.backends.cuda import nvrtc
    from ssmc.backends.cuda.kernels.flash import backward as fb
    from ssmc.backends.cuda.kernels.flash import forward as ff
    from ssmc.backends.cuda.source import compile_options

    program = SPECS[name].program
    tables = name.startswith("rel")
    forward = "bm128w8" if tables and d == 64 else ff.DEFAULT_CONFIG[d]
    builds = [(ff.kernel_source(program, d, True, forward), "sm_80"), (ff.kernel_source(program, d, True, "wg128"),
                                                                        "sm_90a")]
    for config in (fb.DEFAULT_CONFIG[d], fb.HOPPER_CONFIG[d]):
        arch = "sm_90a" if fb.CONFIGS[config][d].wgmma else "sm_80"
        for atomic in ((False,) if tables else (True, False)):
            builds.append((fb.kernel_source(program, d, True, atomic_dq=atomic, config_name=config), arch))
    builds.append((fb.dq_source(program, d, True), "sm_80"))
    for (kname, text), arch in builds:
        usage = nvrtc.compile_source(text, arch=arch, options=compile_options(text)).resources[kname]
        assert not usage.spills and usage.registers <= 255, (kname, arch, str(usage))


def test_the_mask_reads_at_one_index_are_hoisted_out_of_the_elements():
    """``doc[q_idx]`` is a row read, ``doc[kv_idx]`` a column read (made once per row, once per column), and
    ``table[q_idx - kv_idx]`` neither; the hoisted mask reads them from rv and cv, the reads' bodies at their
    own index only."""
    from ssmc.backends.cuda.kernels.flash import forward as ff

    program = SPECS["rel_doc_causal"].program
    rows, cols = ff.hoisted_reads(program.mask, program)
    assert len(rows) == len(cols) == 1 and ff.hoisted_reads(program.score, program) == ([], [])
    printed = ff.printed_mask(program)
    assert (printed["nrow"], printed["ncol"]) == (1, 1)
    assert "rv[0] == cv[0]" in printed["mask_body"] and "prm" not in printed["mask_body"]
    assert "q_idx" in printed["row_body"] and "kv_idx" not in printed["row_body"]
    assert "kv_idx" in printed["col_body"] and "q_idx" not in printed["col_body"]
    assert "rv[0] = " in printed["row_body"] and "cv[0] = " in printed["col_body"]
    causal = ssmc.attention(mask_mod=ssmc.causal).program
    assert ff.printed_mask(causal)["nrow"] == ff.printed_mask(causal)["ncol"] == 0


# -- document masks skip key tiles by the ids' ranges -------------------------------------------------------

@pytest.mark.parametrize("batch, sorted_ids", [(1, True), (3, True), (3, False)])
@pytest.mark.parametrize("name", ["doc", "doc_causal"])
def test_document_spans_are_sound_and_tight_for_sorted_ids(name, batch, sorted_ids):
    """Sound always (every visible key inside its block's span); for one row of sorted ids tight up to tiles
    (several rows share the spans: their ids' ranges merge, sound but wider)."""
    from ssmc.passes.mask_blocks import key_spans

    length, block, tile = 300, 32, 16
    tight = sorted_ids and batch == 1
    x, _ = inputs(name, batch, 1, length, 4, seed=7, sorted_ids=sorted_ids)
    doc = x["doc"]
    ranges = {"doc": (doc.min(0), doc.max(0))}
    spans = key_spans(SPECS[name].program.mask, length, length, block, tile, {}, ranges)
    vis = _visible(name, doc, length, length).any(0)  # visible to some batch index
    visited = 0
    for b, (lo, hi) in enumerate(spans):
        rows = vis[b * block:(b + 1) * block]
        cols = np.flatnonzero(rows.any(0))
        assert lo <= hi and (cols.size == 0 or (lo <= cols.min() and cols.max() < hi)), (b, lo, hi)
        if tight and cols.size:  # tight up to tiles
            assert lo > cols.min() - tile and hi < cols.max() + 1 + tile, (b, lo, hi, cols.min(), cols.max())
        visited += hi - lo
    if tight:
        assert visited < 0.75 * len(spans) * length  # documents of ~4 positions: most tiles skipped


def _scalar_spans(mask, lq, lk, bm, bn, seqs):
    """(lo, hi, full_lo, full_hi) per query block from `mask_blocks._evaluate` tile by tile (the rules one
    rectangle at a time)."""
    from ssmc.ir.node import toposort
    from ssmc.passes.mask_blocks import _bool, _evaluate

    order, out = toposort([mask]), []
    for q0 in range(0, lq, bm):
        q = (float(q0), float(min(q0 + bm, lq) - 1))
        ev = [_bool(_evaluate(order, q, (float(t), float(min(t + bn, lk) - 1)), {}, seqs)) for t in range(0, lk, bn)]
        hits = [i for i, (t, _) in enumerate(ev) if t]
        if not hits:
            out.append((0, 0, 0, 0))
            continue
        best, run = (0, 0), None
        for i in range(hits[0], hits[-1] + 1):
            if (i + 1) * bn <= lk and not ev[i][1]:
                run = (run[0], i + 1) if run is not None and run[1] == i else (i, i + 1)
                if run[1] - run[0] > best[1] - best[0]:
                    best = run
        out.append((hits[0] * bn, min((hits[-1] + 1) * bn, lk), best[0] * bn, best[1] * bn))
    return out


@pytest.mark.parametrize("name", ["doc", "doc_causal", "rel_doc_strict"])
def test_grid_spans_agree_with_the_rules_tile_by_tile(name):
    """`mask_blocks.grid_spans` (every block and tile at once, per call for ids) against `_evaluate` per tile,
    over lengths off the tiles, block sizes of the tiled path and the kernels, sorted and unsorted ids."""
    from ssmc.passes.mask_blocks import grid_spans

    rng = np.random.default_rng(len(name))
    mask = SPECS[name].program.mask
    for trial in range(6):
        length = int(rng.integers(1, 300))
        ids = rng.integers(0, 6, (2, length))
        ids = np.sort(ids, axis=1) if trial % 2 else ids
        seqs = {"doc": (ids.min(0), ids.max(0))}
        for bm, bn in ((64, 64), (128, 64), (16, 64), (128, 128)):
            assert grid_spans(mask, length, length, bm, bn, {}, seqs) == _scalar_spans(mask, length, length, bm, bn,
                                                                                       seqs), (length, bm, bn)


def test_the_kernels_take_a_span_table_a_batch_row():
    """Document ids [b, t]: the flash kernels' spans one table per b (its own ids, so rows packed differently
    each skip their own tiles), each row's layout (spans, then group and inner), the param table's last column the
    batch index's row."""
    torch = pytest.importorskip("torch")
    from ssmc.backends.cuda.kernels.flash import forward as ff
    from ssmc.passes.mask_blocks import grid_spans, span_tables

    program = SPECS["doc_causal"].program
    doc = np.array([[0] * 100 + [1] * 160, [0] * 200 + [1] * 60])  # [b t]
    arrays = {"doc": torch.tensor(doc.T.copy(), dtype=torch.float32)}  # time first, as bound
    reads = ff.sequence_reads(program, arrays)
    assert ff.row_axes(program) == ("b",) and reads["doc"][0].shape == (2, 260)
    spans = span_tables(program.mask, 260, 260, 128, 64, {}, reads)
    per_row = [[tuple(s) for s in row] for row in spans.tolist()]
    for r in range(2):
        assert per_row[r] == grid_spans(program.mask, 260, 260, 128, 64, {}, {"doc": (doc[r], doc[r])})
    assert per_row[0] != per_row[1]
    table = ff.row_span_table(spans, (3, 5)).tolist()
    nb = 3  # query blocks of 128 in 260
    assert len(table) == 2 * (4 * nb + 2)
    assert table[:4 * nb] == [x for span in per_row[0] for x in span] and table[4 * nb:4 * nb + 2] == [3, 5]
    params = ff.param_table(program, arrays, {"b": 2, "h": 3})
    width = ff.table_width(program)
    assert params[:6 * width].reshape(6, width)[:, -1].tolist() == [0, 0, 0, 1, 1, 1]  # bh = b * 3 + h


SPAN_LENGTHS = [1, 7, 63, 64, 65, 180, 1000]


@pytest.mark.parametrize("length", SPAN_LENGTHS)
@pytest.mark.parametrize("kind", ["sorted", "unsorted", "one", "each", "apart"])
def test_device_span_tables_agree_with_the_rules_and_the_mask(kind, length):
    """`mask_blocks.span_tables` (every row, block and tile at once in torch ops) against `_evaluate` per row,
    block and tile, and sound against the mask itself: every visible key inside its block's span, every key of a
    full tile visible to every query of the block; the backward's `key_block_tables` against the host's
    `key_block_spans` loop; rows of different ids in one call."""
    torch = pytest.importorskip("torch")
    from ssmc.backends.cuda.kernels.flash.backward import key_block_spans, key_block_tables
    from ssmc.passes.mask_blocks import span_tables

    rng = np.random.default_rng(length)
    ids = document_ids(kind, 3, length, rng)
    reads = {"doc": (torch.tensor(ids, dtype=torch.float32),) * 2}
    names = ["doc_causal", "rel_doc_strict"] + (["doc"] if length < 200 else [])
    for name in names:
        mask = SPECS[name].program.mask
        vis = _visible(name, ids, length, length)  # [rows, i, j]
        for bm, bn in ((64, 64), (128, 64), (128, 128)) if length < 1000 else ((128, 64),):
            spans = span_tables(mask, length, length, bm, bn, {}, reads)
            assert spans.shape == (3, -(-length // bm), 4)
            for r in range(3):
                seqs = {"doc": (ids[r], ids[r])}
                got = [tuple(x) for x in spans[r].tolist()]
                assert got == _scalar_spans(mask, length, length, bm, bn, seqs), (name, r, bm, bn)
                for b, (lo, hi, flo, fhi) in enumerate(got):
                    rows = vis[r, b * bm:(b + 1) * bm]
                    cols = np.flatnonzero(rows.any(0))
                    assert cols.size == 0 or (lo <= cols.min() and cols.max() < hi), (name, r, b)
                    assert rows[:, flo:fhi].all() and fhi <= length, (name, r, b)
        spans = span_tables(mask, length, length, 64, 64, {}, reads)
        for bn in (64, 128):
            blocks = key_block_tables(spans, length, bn)
            for r in range(3):
                want = key_block_spans(mask, length, length, {}, bn, {"doc": (ids[r], ids[r])})
                assert [tuple(x) for x in blocks[r].tolist()] == want, (name, r, bn)


def test_device_span_tables_without_a_mask_or_a_rule():
    """No mask (ids read by the score only): every tile whole, as the host's `block_spans`; a mask whose ops the
    rules do not bound (a product of reads): every tile visited, none whole."""
    torch = pytest.importorskip("torch")
    from ssmc.backends.cuda.kernels.flash import forward as ff
    from ssmc.passes.mask_blocks import span_tables

    for length in (1, 65, 130):
        want = ff.block_spans(None, length, length, {}, 64, 64)
        assert [tuple(x) for x in span_tables(None, length, length, 64, 64, {})[0].tolist()] == want

    def odd(q_idx, kv_idx, doc: ssmc.Seq["b"]):
        return ssmc.exp(doc[q_idx] * doc[kv_idx]) > 0.5

    mask = ssmc.attention(mask_mod=odd).program.mask
    ids = torch.tensor([[0.0, 1.0, 2.0] * 30])
    spans = span_tables(mask, 90, 90, 64, 64, {}, {"doc": (ids, ids)})[0].tolist()
    assert spans == [[0, 90, 0, 0], [0, 90, 0, 0]]


def test_spans_of_ids_merged_over_a_batch_axis():
    """Ids of no batch axis the spans follow (one table for every batch index): their (min, max) over the batch
    bound a block's reads, sound against every batch index's mask."""
    torch = pytest.importorskip("torch")
    from ssmc.backends.cuda.kernels.flash import forward as ff
    from ssmc.passes.mask_blocks import span_tables

    def doc_h(q_idx, kv_idx, doc: ssmc.Seq["h"]):
        return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])

    program = ssmc.attention(mask_mod=doc_h, batch="b h", kv_heads="h").program
    rng = np.random.default_rng(3)
    ids = np.sort(rng.integers(0, 9, (2, 150)), axis=1)  # [h, t]
    reads = ff.sequence_reads(program, {"doc": torch.tensor(ids.T.copy(), dtype=torch.float32)})
    if ff.row_axes(program) is None:
        assert reads["doc"][0].shape == (1, 150)
    spans = span_tables(program.mask, 150, 150, 64, 64, {}, reads)
    vis = _visible("doc_causal", ids, 150, 150)
    for r in range(spans.shape[0]):
        for b, (lo, hi, flo, fhi) in enumerate(spans[r].tolist()):
            for h in range(2) if spans.shape[0] == 1 else (r,):
                rows = vis[h, b * 64:(b + 1) * 64]
                cols = np.flatnonzero(rows.any(0))
                assert cols.size == 0 or (lo <= cols.min() and cols.max() < hi)
                assert rows[:, flo:fhi].all()


_HOST_COPIES = ("cpu", "tolist", "item", "numpy", "__bool__", "__float__", "__int__", "__index__", "__array__")


def test_the_span_tables_of_a_call_copy_nothing_to_the_host(monkeypatch):
    """Binding a call with document ids (their renumbering, `row_ranks`) and making every span table the flash
    kernels take (forward, key blocks, the dQ kernel's) reads no tensor's value on the host: each of torch's ways
    to do so raises meanwhile (on a GPU each would wait for the device; no loop over rows, blocks or tiles)."""
    torch = pytest.importorskip("torch")
    from ssmc.backends.cuda.kernels.flash import backward as fb
    from ssmc.backends.cuda.kernels.flash import forward as ff
    from ssmc.backends.tiled_attention import TiledAttention

    x, _ = inputs("rel_doc_causal", 3, 2, 180, 64, seed=5)
    t = {n: torch.tensor(a, dtype=torch.bfloat16) if n in "qkv" else torch.tensor(a) for n, a in x.items()}
    tiled = TiledAttention(SPECS["rel_doc_causal"].program)
    fwd, bwd = ff.FlashForward(tiled.program), fb.FlashBackward(tiled.program)
    cfg = ff.config(64, "bm128w4")

    def host_read(*args, **kwargs):
        raise AssertionError("a tensor's value read on the host")

    with monkeypatch.context() as m:
        for name in _HOST_COPIES:
            m.setattr(torch.Tensor, name, host_read)
        call = tiled.bind(t["q"], t["k"], t["v"], "b h t ...", _params(t))
        tables = [fwd._span_tensor(call, cfg)[0], bwd._span_tensor(call, bn=64), bwd._span_tensor(call, bn=128),
                  bwd._span_tensor(call, True), ff.param_table(tiled.program, call.param_values(), call.sizes)]
        with pytest.raises(AssertionError, match="on the host"):
            torch.ones(1).item()  # the patch holds
    assert all(tb.dtype in (torch.int32, torch.float32) for tb in tables)
    spans = ff.block_spans(tiled.program.mask, 180, 180, {}, 128, 64, {"doc": (x["doc"][1], x["doc"][1])})
    per_row = tables[0].reshape(3, -1)[:, :-2].reshape(3, -1, 4)
    assert [tuple(s) for s in per_row[1].tolist()] == spans


def test_row_ranks_keep_every_comparison_of_a_row():
    """`row_ranks`: each batch row's ids numbered in order from 0 (ties equal), so ==, <, ... between two reads of
    a row are what the ids gave; `compared_only` says where the modifiers read ids only so."""
    torch = pytest.importorskip("torch")
    from ssmc.backends.tiled_attention import compared_only, row_ranks

    rng = np.random.default_rng(0)
    ids = rng.integers(-3, 4, (50, 2, 3)).astype(np.float64) * 2.0 ** 40  # [t, *axes], far past 2**24
    ranks = row_ranks(torch.tensor(ids)).numpy()
    for c in np.ndindex(2, 3):
        a, r = ids[(slice(None), *c)], ranks[(slice(None), *c)]
        assert np.array_equal(a[:, None] == a[None], r[:, None] == r[None])
        assert np.array_equal(a[:, None] < a[None], r[:, None] < r[None])
        assert r.min() == 0 and r.max() == len(np.unique(a)) - 1

    def doc_minus(q_idx, kv_idx, doc: ssmc.Seq["b"]):
        return (doc[q_idx] - doc[kv_idx]) == 0

    def doc_bias(score, q_idx, kv_idx, doc: ssmc.Seq["b"]):
        return score + doc[q_idx]

    assert compared_only(SPECS["doc_causal"].program, "doc") and compared_only(SPECS["rel_doc_strict"].program, "doc")
    assert not compared_only(ssmc.attention(mask_mod=doc_minus).program, "doc")
    assert not compared_only(ssmc.attention(doc_bias).program, "doc")


# -- spec errors at the user's line ---------------------------------------------------------------------------

def line_of(marker: str) -> int:
    hits = [i for i, text in enumerate(_SOURCE, 1) if text.rstrip().endswith(f"# <- {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def expect(excinfo, marker: str, *words: str) -> None:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    path, line = msg.split(":")[:2]
    assert path.endswith(FILE) and int(line) == line_of(marker), msg
    for word in words:
        assert word.lower() in msg.lower(), (word, msg)


def test_index_must_be_an_integer_expression():
    def half(score, q_idx, kv_idx, table: ssmc.Param["h r"]):
        return score + table[q_idx * 0.5]  # <- half

    with pytest.raises(ssmc.SpecError) as e:
        ssmc.attention(half)
    expect(e, "half", "integer expression", "0.5")


def test_index_by_a_float_input_is_refused():
    def by_score(score, q_idx, kv_idx, table: ssmc.Param["h r"]):
        return score + table[ssmc.exp(q_idx - kv_idx)]  # <- by_exp

    with pytest.raises(ssmc.SpecError) as e:
        ssmc.attention(by_score)
    expect(e, "by_exp", "integer expression", "exp")

    def by_entry(score, q_idx, kv_idx, table: ssmc.Param["h r"], other: ssmc.Param["r"]):
        return score + table[other[q_idx]]  # <- by_entry

    with pytest.raises(ssmc.SpecError) as e:
        ssmc.attention(by_entry)
    expect(e, "by_entry", "integer expression", "other")


def test_index_along_a_batch_axis_is_refused():
    def per_head(score, q_idx, kv_idx, slope: ssmc.Param["h"]):
        return score + slope[q_idx]  # <- along_batch

    with pytest.raises(ssmc.SpecError) as e:
        ssmc.attention(per_head)
    expect(e, "along_batch", "batch axes", "'h'")


def test_index_with_a_tuple_or_slice_is_refused():
    def pair(score, q_idx, kv_idx, table: ssmc.Param["h r"]):
        return score + table[q_idx, kv_idx]  # <- tuple_index

    with pytest.raises(ssmc.SpecError) as e:
        ssmc.attention(pair)
    expect(e, "tuple_index", "one position")


def test_take_names_an_axis_the_table_has():
    def wrong_axis(score, q_idx, kv_idx, table: ssmc.Param["h r"]):
        return score + table.take("s", q_idx)  # <- wrong_axis

    with pytest.raises(ssmc.SpecError) as e:
        ssmc.attention(wrong_axis)
    expect(e, "wrong_axis", "'s'", "h r")


def test_a_computed_value_cannot_be_indexed():
    def computed(score, q_idx, kv_idx, table: ssmc.Param["h r"]):
        return score + (table * 2)[q_idx]  # <- computed

    with pytest.raises(ssmc.SpecError) as e:
        ssmc.attention(computed)
    expect(e, "computed", "declared input")


def test_a_sequence_is_read_at_q_idx_or_kv_idx_only():
    def shifted(q_idx, kv_idx, doc: ssmc.Seq["b"]):
        return doc[q_idx - 1] == doc[kv_idx]  # <- shifted

    with pytest.raises(ssmc.SpecError) as e:
        ssmc.attention(mask_mod=shifted)
    expect(e, "shifted", "q_idx or kv_idx")

    def whole(q_idx, kv_idx, doc: ssmc.Seq["b"]):  # <- whole
        return doc == 1

    with pytest.raises(ssmc.SpecError) as e:
        ssmc.attention(mask_mod=whole)
    expect(e, "whole", "'doc'", "at a position", "doc[q_idx]")


def test_a_sequence_has_only_batch_axes():
    def extra(q_idx, kv_idx, doc: ssmc.Seq["b n"]):  # <- seq_axes
        return doc[q_idx] == doc[kv_idx]

    with pytest.raises(ssmc.SpecError) as e:
        ssmc.attention(mask_mod=extra, batch="b h")
    expect(e, "seq_axes", "beyond the batch axes")


def test_indexing_in_a_recurrence_is_refused():
    with pytest.raises(ssmc.SpecError) as e:
        @ssmc.recurrence
        def rnn(h: ssmc.State["b"], x: ssmc.Seq["b"], w: ssmc.Param["r"]):
            h = h + w[3]  # <- in_recurrence
            return h, h

    expect(e, "in_recurrence", "attention")


def test_calls_with_ids_of_the_wrong_length_or_with_cu_seqlens_are_refused():
    name = "doc_causal"
    x, _ = inputs(name, 1, 2, 8, 4, seed=1)
    for backend in ("interpreter", "numba"):
        f = ssmc.compile(SPECS[name], backend, layout="b h t ...")
        with pytest.raises(ValueError, match="doc"):
            f(x["q"], x["k"], x["v"], doc=x["doc"][:, :5])
        with pytest.raises(ValueError, match="cu_seqlens"):
            f(x["q"], x["k"], x["v"], doc=x["doc"], cu_seqlens=np.array([0, 4, 8]))
    with pytest.raises(ValueError, match="sequence inputs"):
        ssmc.step(SPECS[name], layout="b h t ...")


def test_float32_calls_keep_ids_float32_cannot_keep_apart():
    """Ids of magnitude 2**24 or more would merge in float32 (16777216 == 16777217 there): where the mask only
    compares two reads of them they are renumbered in order on the device (`row_ranks`: the same results, no
    host check); where it computes with them, a ValueError naming the sequence, before any kernel; float64 q, k, v
    keep them."""
    import torch

    def doc_minus(q_idx, kv_idx, doc: ssmc.Seq["b"]):
        return (kv_idx <= q_idx) & ((doc[q_idx] - doc[kv_idx]) == 0)

    x, _ = inputs("doc_causal", 1, 2, 8, 4, seed=1)
    x["doc"] = np.array([[0, 0, 1, 1, 1, 2, 3, 3]])
    backend = "cuda" if os.environ.get("SSMC_CUDA_EMULATE") else "numba"
    q, k, v = (torch.tensor(x[n], dtype=torch.float32) for n in ("q", "k", "v"))
    big = torch.tensor(x["doc"] + 2 ** 24)  # ids 2**24 and 2**24 + 1 merge in float32
    want = _ref("doc_causal", x)
    f = ssmc.compile(SPECS["doc_causal"], backend, layout="b h t ...")
    np.testing.assert_allclose(torch.as_tensor(f(q, k, v, doc=big)).numpy(), want, rtol=0, atol=1e-5)
    g = ssmc.compile(ssmc.attention(mask_mod=doc_minus), backend, layout="b h t ...")
    with pytest.raises(ValueError, match=r"'doc'.*2\*\*24"):
        g(q, k, v, doc=big)
    got = g(q.double(), k.double(), v.double(), doc=big)
    np.testing.assert_allclose(torch.as_tensor(got).numpy(), want, rtol=0, atol=1e-5)  # q, k, v rounded


def test_flash_backward_refusals_that_keep_results_right():
    """Where the flash backward would be wrong or unrepeatable, it is not taken: ids along the KV-heads axis under
    grouped-query attention (a GQA key block reads its first head's spans: k and v are repeated instead), and a
    table's gradient at a head dim without the fixed-order dQ kernel (d 256: atomics)."""
    from types import SimpleNamespace

    from ssmc.backends.cuda.kernels.flash.backward import BN_DQ, FlashBackward

    def per_head(q_idx, kv_idx, doc: ssmc.Seq["b h"]):
        return doc[q_idx] == doc[kv_idx]

    spec = ssmc.attention(mask_mod=per_head, kv_heads="h")
    call = SimpleNamespace(group=2, q=SimpleNamespace(shape=(1, 4, 8, 64), device=None))
    assert FlashBackward(spec.program).reads_kv_heads(call) is False
    table = FlashBackward(SPECS["rel"].program)
    assert 256 not in BN_DQ and "256" in table.head_dim_reason(256)
    assert table.head_dim_reason(64) is None and FlashBackward(SPECS["doc"].program).head_dim_reason(256) is None


# -- on a GPU: bf16 against a torch reference --------------------------------------------------------------

def _torch_reference(torch, name, q, k, v, table, doc):
    """fp32 reference of q, k, v [b h t d] (upcast), table [h r], doc [b t]."""
    lq = q.shape[2]
    i = torch.arange(lq, device=q.device)
    s = torch.einsum("bhid,bhjd->bhij", q.float(), k.float()) / q.shape[-1] ** 0.5
    if name.startswith("rel"):
        s = s + table.float()[:, (i[:, None] - i[None]).clamp(0, R - 1)][None]
    vis = torch.ones((1, 1, lq, lq), dtype=torch.bool, device=q.device)
    if "doc" in name:
        vis = vis & (doc[:, None, :, None] == doc[:, None, None, :])
    if name.endswith("causal"):
        vis = vis & (i[None] <= i[:, None])
    s = s.masked_fill(~vis, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v.float()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", ["rel", "doc_causal", "rel_doc_causal"])
def test_gpu_bf16_matches_a_torch_reference(name, d):
    import torch

    import ssmc.torch as st

    torch.manual_seed(d)
    b, h, length = 2, 4, 1000
    q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    table = torch.randn(h, R, device="cuda", requires_grad=True)
    bounds = torch.sort(torch.randint(1, length, (b, 6), device="cuda"), dim=1).values
    doc = (torch.arange(length, device="cuda")[None, :, None] >= bounds[:, None, :]).sum(-1).int()  # [b, t] sorted
    fn = st.function(SPECS[name], layout="b h t ...")
    params = {n: t for n, t in (("table", table), ("doc", doc)) if n in {p.name for p in SPECS[name].program.inputs}}
    out = fn(q, k, v, **params)
    d_out = torch.randn_like(out)
    out.backward(d_out)
    grads = {n: t.grad.clone() for n, t in (("q", q), ("k", k), ("v", v), ("table", table)) if t.grad is not None}
    for t in (q, k, v, table):
        t.grad = None
    want = _torch_reference(torch, name, q, k, v, table, doc)
    want.backward(d_out.float())
    assert (out.float() - want).abs().max().item() < 2e-2
    for n, t in (("q", q), ("k", k), ("v", v), ("table", table)):
        if n in grads:
            ref = t.grad.float()
            err = (grads[n].float() - ref).abs().max().item()
            assert err < 3e-2 * max(1.0, ref.abs().max().item()), (n, err)


@pytest.mark.gpu
def test_gpu_document_masked_calls_wait_for_nothing():
    """After a first call of the shape (which compiles, and picks the forward's config from its spans' mean
    length: one read a shape), a document-masked forward and backward with other ids run under torch's sync debug
    mode "error" (the span tables made on the device from the ids, no host copy), and match a torch reference."""
    import torch

    import ssmc.torch as st

    torch.manual_seed(1)
    b, h, length, d = 2, 4, 1000, 64
    q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def ids(n):
        bounds = torch.sort(torch.randint(1, length, (b, n), device="cuda"), dim=1).values
        return (torch.arange(length, device="cuda")[None, :, None] >= bounds[:, None, :]).sum(-1).int()

    fn = st.function(SPECS["doc_causal"], layout="b h t ...")
    fn(q, k, v, doc=ids(3)).sum().backward()
    doc = ids(7)
    d_out = torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fn(q, k, v, doc=doc)
        grads = torch.autograd.grad(out, (q, k, v), d_out)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = _torch_reference(torch, "doc_causal", q, k, v, None, doc)
    want_grads = torch.autograd.grad(want, (q, k, v), d_out.float())
    assert (out.float() - want).abs().max().item() < 2e-2
    for got, ref in zip(grads, want_grads):
        assert (got.float() - ref).abs().max().item() < 3e-2 * max(1.0, ref.abs().max().item())
