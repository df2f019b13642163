"""The flash forward's span tables from the generated span kernel (kernels/flash/spans.py) on the CUDA emulator:
equal to `mask_blocks.span_tables`' torch result (then `row_span_table`) value for value, over lengths, ids, masks,
block and tile sizes; a planted error in the printed rule fails; the forward's torch ops and launches a call; the
kernel builds with NVRTC."""

from __future__ import annotations

import numpy as np
import pytest
from attention_strategies import document_ids

import ssmc

torch = pytest.importorskip("torch")

LENGTHS = [1, 7, 63, 64, 65, 180, 1000]


def doc(q_idx, kv_idx, doc: ssmc.Seq["b"]):
    return doc[q_idx] == doc[kv_idx]


def doc_causal(q_idx, kv_idx, doc: ssmc.Seq["b"]):
    return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])


def doc_window(q_idx, kv_idx, doc: ssmc.Seq["b"]):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 100) & (doc[q_idx] == doc[kv_idx])


def doc_or_prefix(q_idx, kv_idx, doc: ssmc.Seq["b"]):
    return (doc[q_idx] == doc[kv_idx]) | (kv_idx < 70)


def prefix_lm(q_idx, kv_idx, doc: ssmc.Seq["b"]):
    return ((kv_idx <= q_idx) | (kv_idx < 40)) & ~(doc[q_idx] != doc[kv_idx])


def doc_arith(q_idx, kv_idx, doc: ssmc.Seq["b"]):  # sums of reads, |.|, a product, a min: the widened rules
    near = ssmc.abs(doc[q_idx] - doc[kv_idx]) * 2.0 <= ssmc.minimum(q_idx - kv_idx, 1.0)
    return near & (kv_idx - 1 >= -q_idx * 0.5 - 30)


MASKS = {f.__name__: f for f in (doc, doc_causal, doc_window, doc_or_prefix, prefix_lm, doc_arith)}


def _mask(name):
    return ssmc.attention(mask_mod=MASKS[name]).program


def _emulator():
    from ssmc.backends.cuda import emulator

    if not emulator.available():
        pytest.skip("no C++ compiler for the CUDA emulator")


def _both(mask, length, bm, bn, reads, gqa=(2, 3)):
    from ssmc.backends.cuda.kernels.flash.forward import row_span_table
    from ssmc.backends.cuda.kernels.flash.spans import span_kernel_table
    from ssmc.passes.mask_blocks import span_tables

    got = span_kernel_table(mask, length, length, bm, bn, {}, reads, gqa)
    assert got is not None
    want = row_span_table(span_tables(mask, length, length, bm, bn, {}, reads), gqa)
    return got.tolist(), want.tolist()


def _reads(ids, dtype, merged=False):
    """`forward.sequence_reads`' shapes: a row per batch index (one [b t] tensor, transposed: strided), or one row
    of the (min, max) over the batch (`merged`)."""
    t = torch.tensor(ids.T.copy(), dtype=dtype)  # time first, as bound
    if merged:
        return {"doc": (t.amin(1)[None], t.amax(1)[None])}
    return {"doc": (t.t(), t.t())}


@pytest.mark.parametrize("dtype", ["int64", "float32"])
@pytest.mark.parametrize("kind", ["sorted", "unsorted", "one", "each"])
def test_span_kernel_equals_the_torch_tables(kind, dtype):
    _emulator()
    dtype = getattr(torch, dtype)
    for length in LENGTHS:
        rng = np.random.default_rng(length)
        ids = document_ids(kind, 3, length, rng)
        for name in MASKS:
            mask = _mask(name).mask
            for merged in (False, True):
                got, want = _both(mask, length, 128, 64, _reads(ids, dtype, merged))
                assert got == want, (name, length, merged)


@pytest.mark.parametrize("bm, bn", [(64, 64), (128, 32), (128, 128)])
def test_span_kernel_equals_the_torch_tables_at_the_kernels_tiles(bm, bn):
    _emulator()
    for length in LENGTHS:
        ids = document_ids("sorted", 2, length, np.random.default_rng(length + 1))
        for name in ("doc_causal", "doc_window"):
            got, want = _both(_mask(name).mask, length, bm, bn, _reads(ids, torch.int64))
            assert got == want, (name, length)


@pytest.mark.parametrize("kind", ["sorted", "unsorted", "one", "each"])
def test_span_kernel_key_blocks_equal_the_torch_tables(kind):
    """The backward's key-block tables (`key_bn` of 64 and 128) from the same launch as the query blocks'."""
    _emulator()
    from ssmc.backends.cuda.kernels.flash.backward import key_block_tables
    from ssmc.backends.cuda.kernels.flash.forward import row_span_table
    from ssmc.backends.cuda.kernels.flash.spans import span_kernel_table
    from ssmc.passes.mask_blocks import span_tables

    for length in LENGTHS:
        ids = document_ids(kind, 3, length, np.random.default_rng(length + 2))
        for name in ("doc", "doc_causal", "doc_window", "doc_or_prefix"):
            mask = _mask(name).mask
            reads = _reads(ids, torch.int64)
            spans = span_tables(mask, length, length, 64, 64, {}, reads)
            for bn in (64, 128):
                got = span_kernel_table(mask, length, length, 64, 64, {}, reads, (4, 1), bn)
                assert got[0].tolist() == row_span_table(spans, (4, 1)).tolist(), (name, length)
                want = row_span_table(key_block_tables(spans, length, bn), (4, 1))
                assert got[1].tolist() == want.tolist(), (name, length, bn)


def test_a_planted_error_in_the_printed_rule_fails(monkeypatch):
    """The ids' overlap printed one off (``<`` for ``<=``: ranges that touch read as apart): the tables differ (so
    the tests above can fail)."""
    _emulator()
    from ssmc.backends.cuda.kernels.flash import spans

    real = spans.print_rule

    def planted(*args, **kw):
        body, reads, names = real(*args, **kw)
        assert "rk[0][0] <= rq[0][1]" in body
        return body.replace("rk[0][0] <= rq[0][1]", "rk[0][0] < rq[0][1]"), reads, names

    monkeypatch.setattr(spans, "print_rule", planted)
    monkeypatch.setattr(spans, "_SOURCES", {})
    ids = document_ids("one", 2, 180, np.random.default_rng(0))
    got, want = _both(_mask("doc_causal").mask, 180, 64, 64, _reads(ids, torch.int64))
    assert got != want


def test_an_unprintable_rule_keeps_the_torch_ops():
    from ssmc.backends.cuda.kernels.flash.spans import span_kernel_table

    ids = torch.zeros((1, 10), dtype=torch.float16)
    assert span_kernel_table(_mask("doc").mask, 10, 10, 64, 64, {}, {"doc": (ids, ids)}) is None


def _forward_call(monkeypatch, length=200):
    from ssmc.backends.tiled_attention import TiledAttention

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    spec = ssmc.attention(mask_mod=doc_causal)
    rng = np.random.default_rng(0)
    b, h, d = 2, 2, 64
    q, k, v = (torch.tensor(rng.standard_normal((b, h, length, d)), dtype=torch.bfloat16) for _ in range(3))
    ids = torch.tensor(np.sort(rng.integers(0, 5, (b, length)), axis=1))
    tiled = TiledAttention(spec.program)
    call = tiled.bind(q, k, v, "b h t ...", {"doc": ids})
    return tiled, call


def test_the_forward_builds_its_spans_in_one_launch(monkeypatch):
    """A document-masked forward call: the same output with the kernel's tables as with the torch ops', its span
    tables one emulated launch (the forward's kernel the other) and a few torch ops, where the torch path takes
    dozens (counted by a dispatch mode; the kernels' launches by the emulator's counter)."""
    _emulator()
    from torch.utils._python_dispatch import TorchDispatchMode

    from ssmc.backends.cuda import emulator

    tiled, call = _forward_call(monkeypatch)

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    outs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("SSMC_CUDA_SPAN_KERNEL", switch)
        fwd = tiled.flash(call)
        assert fwd is not None
        fwd(call)  # the first call builds and caches its launch
        Count.ops, before = 0, emulator.launched
        with Count():
            outs[switch] = fwd(call)
        counts[switch] = (Count.ops, emulator.launched - before)
    assert torch.equal(outs["0"][0], outs["1"][0]) and torch.equal(outs["0"][1], outs["1"][1])
    print("torch ops, emulated launches a forward call (torch spans, span kernel):", counts)
    assert counts["1"][1] == counts["0"][1] + 1
    assert counts["1"][0] + 30 < counts["0"][0]


def _nvrtc_available() -> bool:
    from ssmc.backends.cuda import nvrtc

    return nvrtc.available()


@pytest.mark.skipif(not _nvrtc_available(), reason="no NVRTC")
@pytest.mark.parametrize("dtype", ["int64", "float32"])
def test_the_span_kernel_builds_with_nvrtc(dtype):
    from ssmc.backends.cuda import nvrtc
    from ssmc.backends.cuda.kernels.flash.spans import span_source
    from ssmc.backends.cuda.source import compile_options

    ids = torch.zeros((2, 10), dtype=getattr(torch, dtype))
    for name in MASKS:
        text, kname, *_ = span_source(_mask(name).mask, 128, 64, (), {"doc": (ids, ids)})
        for arch in ("sm_80", "sm_90"):
            usage = nvrtc.compile_source(text, arch=arch, options=compile_options(text)).resources[kname]
            assert not usage.spills, (name, arch, str(usage))


def test_the_backward_builds_its_spans_in_one_launch(monkeypatch):
    """The backward's span tables of a call (key blocks, the dQ kernel's query blocks): the same values, one
    emulated launch and a few torch ops with the kernel, dozens of torch ops (no launch of ours) without."""
    _emulator()
    from torch.utils._python_dispatch import TorchDispatchMode

    from ssmc.backends.cuda import emulator

    tiled, call = _forward_call(monkeypatch)
    bwd = tiled.flash_backward(call)
    assert bwd is not None

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    counts, tables = {}, {}
    for switch in ("0", "1"):
        monkeypatch.setenv("SSMC_CUDA_SPAN_KERNEL", switch)
        for bn in (64, 128):
            bwd.sequence_span_tensors(call, bn, True)  # builds the kernel once
            Count.ops, before = 0, emulator.launched
            with Count():
                tables[switch, bn] = [t.tolist() for t in bwd.sequence_span_tensors(call, bn, True)]
            counts[switch, bn] = (Count.ops, emulator.launched - before)
    print("torch ops, emulated launches of the backward's span tables (torch, kernel):", counts)
    for bn in (64, 128):
        assert tables["0", bn] == tables["1", bn]
        assert counts["1", bn][1] == 1 and counts["0", bn][1] == 0 and counts["1", bn][0] + 30 < counts["0", bn][0]


# each mask once over `o` (ssmc to trace it, NumPy to evaluate it), `d` the read of the ids at a position
SOUND_MASKS = [
    lambda q, k, d, o: ~(d(q) != d(k)) & (k <= q + 3),
    lambda q, k, d, o: o.abs(d(q) - d(k)) * 2.0 <= o.minimum(q - k, 1.0),
    lambda q, k, d, o: o.where(d(q) > d(k), q - k, k * 0.5) < 40.0,
    lambda q, k, d, o: (o.maximum(d(q), k - 50.0) >= d(k) * 3.0) | (q * d(k) > k + 90.0),
    lambda q, k, d, o: ~((d(k) - q) * (k - d(q)) < -5.0),
]


def _traced(f):
    def mask(q_idx, kv_idx, doc: ssmc.Seq["b"]):
        return f(q_idx, kv_idx, doc.__getitem__, ssmc)

    return ssmc.attention(mask_mod=mask).program.mask


@pytest.mark.parametrize("dtype", ["int64", "float32"])
def test_span_kernel_tables_are_sound_against_the_mask(dtype):
    """Brute force, apart from the torch tables: per row (or the rows' merged ranges), every (q, k) the mask leaves
    visible has k in its query block's [lo, hi), and every key of [full_lo, full_hi) is visible to every query of
    the block (to every row's, merged); over lq != lk, ids shorter than the queries (reads clamped), rows of
    different ids; the backward's key blocks from the same launch equal the torch ones."""
    _emulator()
    from ssmc.backends.cuda.kernels.flash.backward import key_block_tables
    from ssmc.backends.cuda.kernels.flash.forward import row_span_table
    from ssmc.backends.cuda.kernels.flash.spans import span_kernel_table
    from ssmc.passes.mask_blocks import span_tables

    rng = np.random.default_rng(5)
    fdt = np.float32 if dtype == "float32" else np.float64
    for m, f in enumerate(SOUND_MASKS):
        mask = _traced(f)
        for lq, lk, length in ((70, 200, 200), (200, 70, 190)):
            ids = np.sort(rng.integers(0, 12, (2, length)), axis=1) if m % 2 else rng.integers(0, 4, (2, length))
            qi, ki = np.arange(lq, dtype=fdt)[:, None], np.arange(lk, dtype=fdt)[None]
            vis = np.stack([np.broadcast_to(f(qi, ki, lambda i, row=row: row.astype(fdt)[
                np.clip(i.astype(np.int64), 0, len(row) - 1)], np), (lq, lk)) for row in ids])
            for merged in (False, True):
                reads = _reads(ids, getattr(torch, dtype), merged)
                table, keys = span_kernel_table(mask, lq, lk, 64, 64, {}, reads, (1, 1), 128)
                spans = span_tables(mask, lq, lk, 64, 64, {}, reads)
                assert table.tolist() == row_span_table(spans, (1, 1)).tolist(), (m, lq, lk, merged)
                assert keys.tolist() == row_span_table(key_block_tables(spans, lk, 128), (1, 1)).tolist()
                nb = -(-lq // 64)
                rows = [(vis.any(0), vis.all(0))] if merged else [(v, v) for v in vis]
                for r, (some, every) in enumerate(rows):
                    for b, (lo, hi, flo, fhi) in enumerate(table.view(len(rows), -1)[r, :4 * nb].view(nb, 4).tolist()):
                        cols = np.flatnonzero(some[b * 64:(b + 1) * 64].any(0))
                        assert cols.size == 0 or (lo <= cols.min() and cols.max() < hi), (m, lq, lk, merged, r, b)
                        assert every[b * 64:(b + 1) * 64, flo:fhi].all() and fhi <= lk, (m, lq, lk, merged, r, b)


@pytest.mark.skipif(not _nvrtc_available(), reason="no NVRTC")
@pytest.mark.parametrize("dtype", ["int64", "int32", "uint8", "float32", "float64"])
@pytest.mark.parametrize("key_bn", [0, 128])
def test_the_fused_span_kernel_builds_with_nvrtc(dtype, key_bn):
    """The span kernel that writes the param table from the ids as given (`spans.fused_tables`), for each id type
    and with the backward's key blocks: built for sm_80 and sm_90 without spills."""
    from ssmc.backends.cuda import nvrtc
    from ssmc.backends.cuda.kernels.flash.spans import span_source
    from ssmc.backends.cuda.source import compile_options

    for name in ("doc", "doc_causal", "doc_window"):
        text, kname, *_ = span_source(_mask(name).mask, 64, 64, (), {}, key_bn, (("doc", f"torch.{dtype}"),))
        assert "ptable" in text
        for arch in ("sm_80", "sm_90"):
            usage = nvrtc.compile_source(text, arch=arch, options=compile_options(text)).resources[kname]
            assert not usage.spills, (name, arch, str(usage))
