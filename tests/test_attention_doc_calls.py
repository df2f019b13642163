"""Document-masked attention calls (issue #42) as a training loop makes them, on the CUDA emulator: per call the
flash kernels' param table and span tables come from this call's ids and params in one launch
(kernels/flash/spans.py `fused_tables`), so new ids, ids changed in place and params changed in place (through
``.data`` too, which no version counter sees) each give the reference's output and gradients; ids of every kind
(int32, int64 far apart or far from 0, uint8, fractional floats, NaN, unsorted) keep every comparison of a row and
give the span tables of the torch ops; a call's torch ops and launches, counted against plain causal attention, and
no host read. On a GPU: a training step captured as a CUDA graph, replayed on new ids."""

from __future__ import annotations

import math

import numpy as np
import pytest
from cuda_graphs import captured

import ssmc
import ssmc.torch

torch = pytest.importorskip("torch")

R = 8  # the bias table's entries


def doc_causal(q_idx, kv_idx, doc: ssmc.Seq["b"]):
    return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])


def rel_bias(score, q_idx, kv_idx, table: ssmc.Param["h r=8"]):
    return score + table[ssmc.clamp(q_idx - kv_idx, 0, R - 1)]


def alibi(score, q_idx, kv_idx, slope: ssmc.Param["h"]):
    return score - slope * (q_idx - kv_idx)


SPECS = {
    "doc": ssmc.attention(mask_mod=doc_causal, batch="b h", head_dim="d"),
    "causal": ssmc.attention(mask_mod=ssmc.causal, batch="b h", head_dim="d"),
    "table": ssmc.attention(score_mod=rel_bias, mask_mod=doc_causal, batch="b h", head_dim="d"),
    "slope": ssmc.attention(score_mod=alibi, mask_mod=doc_causal, batch="b h", head_dim="d"),
}
B, H, L, D = 2, 2, 70, 64


def _emulate(monkeypatch):
    from ssmc.backends.cuda import emulator

    if not emulator.available():
        pytest.skip("no C++ compiler for the CUDA emulator")
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")


def _qkv(seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_(True)
            for _ in range(3)]


def _docs(seed, b=B, length=L, documents=3):
    """Sorted document ids [b, length] int64, `documents` a row (random boundaries, differing between rows)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.sort(torch.randint(1, length, (b, documents - 1), generator=g), dim=1).values
    return (torch.arange(length)[None, :, None] >= starts[:, None, :]).sum(-1)


def reference(q, k, v, doc, table=None, slope=None):
    """The spec's attention in float64 torch (every score materialized): q, k, v [b h t d], doc [b t], table [h r],
    slope [h]; differentiable."""
    q, k, v = (t.double() for t in (q, k, v))
    i = torch.arange(q.shape[2])
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if table is not None:
        s = s + table.double()[:, (i[:, None] - i[None]).clamp(0, R - 1)][None]
    if slope is not None:
        s = s - slope.double()[None, :, None, None] * (i[:, None] - i[None]).double()
    vis = (i[None, :] <= i[:, None])[None, None] & (doc[:, None, :, None] == doc[:, None, None, :])
    return torch.softmax(s.masked_fill(~vis, -math.inf), -1) @ v


def _step(fn, q, k, v, cotangent, **params):
    """(output, gradients of q, k, v and the params that ask) of one call and its backward."""
    leaves = [q, k, v, *(t for t in params.values() if t.requires_grad)]
    for t in leaves:
        t.grad = None
    y = fn(q, k, v, **params)
    y.backward(cotangent)
    return y.detach().double(), [t.grad.double() for t in leaves]


def _check(got, want, what):
    (y, grads), (y_ref, grads_ref) = got, want
    for name, a, b in [("out", y, y_ref), *zip(("dq", "dk", "dv", "dparam"), grads, grads_ref)]:
        tol = 3e-2 * max(1.0, float(b.abs().max()))
        err = float((a - b).abs().max())
        assert err <= tol, f"{what}: {name} off by {err:.3g} (tolerance {tol:.3g})"


def _want(q, k, v, cotangent, doc, **params):
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    extra = {n: t.detach().double().requires_grad_(t.requires_grad) for n, t in params.items()}
    y = reference(*leaves, doc, **extra)
    y.backward(cotangent.double())
    return y.detach(), [t.grad for t in (*leaves, *(t for t in extra.values() if t.requires_grad))]


def _fused_plans(fn) -> list:
    """The fused tables' plans the op's flash forward and backward made (None where the tables were built apart)."""
    tiled = fn.tiled
    forward = [p for hit in tiled._flash._launches.values() for p in hit[-1].values()]
    backward = [p for plan in tiled._flash_bwd._plans.values() for p in plan.fused.values()]
    assert forward and backward
    return forward + backward


def test_new_ids_and_ids_changed_in_place_between_calls(monkeypatch):
    """Calls of one signature on other ids (a new tensor, then the first changed in place, as a data loader's
    pinned buffer is): each call's output and gradients are the reference's on its own ids, none a stale table's."""
    _emulate(monkeypatch)
    fn = ssmc.torch.function(SPECS["doc"], layout="b h t ...")
    q, k, v = _qkv(0)
    cotangent = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(9))
    first, second, third = _docs(1), _docs(2), _docs(3, documents=5)
    assert not torch.equal(first, second)
    ids = first.clone()
    _check(_step(fn, q, k, v, cotangent, doc=ids), _want(q, k, v, cotangent, first), "first ids")
    _check(_step(fn, q, k, v, cotangent, doc=second), _want(q, k, v, cotangent, second), "new ids")
    ids.copy_(third)  # in place: the same tensor, storage and shape as the first call's
    _check(_step(fn, q, k, v, cotangent, doc=ids), _want(q, k, v, cotangent, third), "ids changed in place")
    assert fn.tiled.flash_reason is None and fn.tiled.flash_backward_reason is None
    assert all(p is not None for p in _fused_plans(fn))  # the forward's and the backward's fused tables


@pytest.mark.parametrize("name", ["table", "slope"])
def test_params_changed_in_place_between_calls(name, monkeypatch):
    """A spec with ids and a param (a bias table, an ALiBi slope per head): the param changed in place between
    calls, through ``.data`` (no version bump) for the table, under no_grad (a version bump) for the slope; each
    call's output and gradients are the reference's on the param's values then."""
    _emulate(monkeypatch)
    fn = ssmc.torch.function(SPECS[name], layout="b h t ...")
    q, k, v = _qkv(4)
    g = torch.Generator().manual_seed(5)
    param = (torch.randn(H, R, generator=g) if name == "table" else torch.tensor([0.25, 0.5])).requires_grad_(True)
    cotangent = torch.randn(B, H, L, D, generator=g)
    doc = _docs(6)
    for change in range(3):
        if change == 1 and name == "table":
            param.data.add_(1.0)  # `.data`: the param's version counter does not move
        elif change == 1:
            with torch.no_grad():
                param.mul_(1.5)
        if change == 2:
            doc = _docs(7)
        _check(_step(fn, q, k, v, cotangent, doc=doc, **{name: param}),
               _want(q, k, v, cotangent, doc, **{name: param}), f"call {change}")
    assert all(p is not None for p in _fused_plans(fn))


def _ids(kind, rows, length, rng):
    """[rows, length] ids of a kind: the fused kernel's fast path (whole numbers less than 2**24 apart: id - min)
    and its ranks (far apart, fractional, NaN)."""
    base = np.sort(rng.integers(0, 5, (rows, length)), axis=1)
    if kind == "int32":
        return torch.tensor(base, dtype=torch.int32)
    if kind == "uint8":
        return torch.tensor(base, dtype=torch.uint8)
    if kind == "negative":
        return torch.tensor(base - 3, dtype=torch.int64)
    if kind == "unsorted":
        return torch.tensor(rng.integers(-2, 3, (rows, length)), dtype=torch.int64)
    if kind == "int64_offset":  # close together, far from 0: past float32's and float64's exact integers
        return torch.tensor(base, dtype=torch.int64) + (2 ** 62 + 12345)
    if kind == "int64_apart":  # 2**40 apart: float32 would merge them all
        return torch.tensor(base - 2, dtype=torch.int64) * 2 ** 40
    if kind == "float64_fraction":
        return torch.tensor(base * 0.37 - 0.5, dtype=torch.float64)
    if kind == "float32":
        return torch.tensor(base * 1000.0 + 2.0 ** 30, dtype=torch.float32)
    ids = torch.tensor(base, dtype=torch.float64)  # "nan": a few NaN ids among whole ones
    ids[:, 5:8] = math.nan
    return ids


IDS = ["int32", "uint8", "negative", "unsorted", "int64_offset", "int64_apart", "float64_fraction", "float32", "nan"]


@pytest.mark.parametrize("kind", IDS)
def test_fused_tables_keep_every_comparison_and_the_spans(kind, monkeypatch):
    """One fused launch's param table and span tables (forward and backward): the table's columns those of
    `param_table`, each row of ids written so that == and < between two of its positions give what the ids gave (a
    NaN a document of its own, as `row_ranks` has it), and the span tables equal to the torch ops' (from the ids
    renumbered by `row_ranks`)."""
    _emulate(monkeypatch)
    monkeypatch.setenv("SSMC_CUDA_FLASH_FORWARD", "bm128w4")
    from ssmc.backends.cuda.kernels.flash import backward as fb
    from ssmc.backends.cuda.kernels.flash import forward as ff
    from ssmc.backends.cuda.kernels.flash.forward import fused_plan, fused_tables
    from ssmc.backends.tiled_attention import TiledAttention

    rng = np.random.default_rng(IDS.index(kind))
    length = 150
    ids = _ids(kind, B, length, rng)
    q, k, v = (torch.zeros(B, H, length, D, dtype=torch.bfloat16) for _ in range(3))
    program = SPECS["doc"].program
    tiled = TiledAttention(program)
    call = tiled.bind(q, k, v, "b h t ...", {"doc": ids})
    assert set(call.seqs) == {"doc"} and call.seqs["doc"].dtype == ids.dtype  # as given: no conversion at bind
    cfg = ff.config(D, "bm128w4")
    plan = fused_plan(program, call, cfg.bm, cfg.bn, (1, 1))
    assert plan is not None
    buffer, base, spans_at, _ = fused_tables(plan, program, call)
    floats = buffer[:4 * plan.layout.total].view(torch.float32)
    width = ff.table_width(program)
    old = ff.param_table(program, call.param_values(), call.sizes)
    assert torch.equal(floats[:B * H * width], old[:B * H * width])
    tail = floats[plan.layout.prefix:].reshape(B, length)
    for r in range(B):
        a, t = ids[r], tail[r].double()  # compared in their own dtype: int64 past 2**53 stays exact
        nan = torch.isnan(a) if a.is_floating_point() else torch.zeros(length, dtype=torch.bool)
        same = (a[:, None] == a[None]) | (nan[:, None] & nan[None] & torch.eye(length, dtype=torch.bool))
        assert torch.equal(t[:, None] == t[None], same), r
        both = ~nan[:, None] & ~nan[None]
        assert torch.equal((t[:, None] < t[None]) & both, (a[:, None] < a[None]) & both), r
        assert not torch.isnan(t).any() and bool((t >= 0).all()) and bool((t < 2 ** 24).all())
    nb = -(-length // cfg.bm)
    spans = buffer[spans_at - base:spans_at - base + 4 * B * (4 * nb + 2)].view(torch.int32)
    monkeypatch.setenv("SSMC_CUDA_SPAN_KERNEL", "0")  # the torch ops' tables, from the ids' ranks
    fwd = ff.FlashForward(program)
    assert torch.equal(spans, fwd._span_tensor(call, cfg, mean=False)[0])
    bplan = fused_plan(program, call, ff.BM, ff.BN, (1, 1), 128)
    buffer, base, queries_at, keys_at = fused_tables(bplan, program, call)
    keys, queries = fb.FlashBackward(program).sequence_span_tensors(call, 128, True)
    for at, want in ((keys_at, keys), (queries_at, queries)):
        assert torch.equal(buffer[at - base:at - base + 4 * want.numel()].view(torch.int32), want)


def _count_call(fn, q, k, v, cotangent, **params):
    """(torch ops, emulated launches) of a forward call, then of its backward (a dispatch mode counts the ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ssmc.backends.cuda import emulator

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    for _ in range(2):  # the first call of a signature builds and caches its launches
        fn(q, k, v, **params).backward(cotangent)
    counts = []
    Count.ops, before = 0, emulator.launched
    with Count():
        y = fn(q, k, v, **params)
    counts.append((Count.ops, emulator.launched - before))
    Count.ops, before = 0, emulator.launched
    with Count():
        y.backward(cotangent)
    counts.append((Count.ops, emulator.launched - before))
    return counts


def test_a_document_call_costs_a_causal_call_and_one_launch_each_way(monkeypatch):
    """The torch ops and launches of a document-masked call (forward, backward) against a plain causal call's of
    the same q, k, v: one launch more each way (the fused tables) and at most 3 ops more (its buffer, the ids'
    view); tens of ops a call before the fused tables."""
    _emulate(monkeypatch)
    q, k, v = _qkv(8)
    cotangent = torch.randn(B, H, L, D, generator=torch.Generator().manual_seed(10))
    doc = _docs(11)
    counts = {name: _count_call(ssmc.torch.function(SPECS[name], layout="b h t ..."), q, k, v, cotangent,
                                **({"doc": doc} if name == "doc" else {})) for name in ("causal", "doc")}
    print("torch ops, launches (forward, backward):", counts)
    for way in range(2):
        (causal_ops, causal_launches), (doc_ops, doc_launches) = counts["causal"][way], counts["doc"][way]
        assert doc_launches == causal_launches + 1, (way, counts)
        assert doc_ops <= causal_ops + 3, (way, counts)


_HOST_COPIES = ("cpu", "tolist", "item", "numpy", "__bool__", "__float__", "__int__", "__index__", "__array__")


def test_a_document_call_reads_nothing_on_the_host(monkeypatch):
    """A document-masked forward and backward after the first call of their signature (as under CUDA graph
    capture: the first call's caches are filled before it) read no tensor's value on the host."""
    _emulate(monkeypatch)
    fn = ssmc.torch.function(SPECS["table"], layout="b h t ...")
    q, k, v = _qkv(12)
    table = torch.randn(H, R).requires_grad_(True)
    cotangent = torch.randn(B, H, L, D)
    fn(q, k, v, doc=_docs(13), table=table).backward(cotangent)

    def host_read(*args, **kwargs):
        raise AssertionError("a tensor's value read on the host")

    with monkeypatch.context() as m:
        for name in _HOST_COPIES:
            m.setattr(torch.Tensor, name, host_read)
        fn(q, k, v, doc=_docs(14), table=table).backward(cotangent)
        with pytest.raises(AssertionError, match="on the host"):
            torch.ones(1).item()  # the patch holds
    assert all(p is not None for p in _fused_plans(fn))


@pytest.mark.gpu
def test_gpu_cuda_graph_of_a_document_step_replayed_on_new_ids():
    """A training step of the document-masked op (bf16 [B H L D]) captured once with torch.cuda.graph, then replayed
    on new ids (other boundaries, more documents) and q, k, v copied into its inputs: the eager step's output and
    gradients on them."""
    q, k, v = (t.detach().cuda().requires_grad_(True) for t in _qkv(15))
    fn = ssmc.torch.function(SPECS["doc"], layout="b h t ...")
    static = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ids = _docs(16).cuda()

    def step():
        y = fn(*static, doc=ids)
        loss = (y.float() * torch.linspace(-1, 1, D, device="cuda")).sum()
        return [y, *torch.autograd.grad(loss, static)]

    graph, outs = captured(step)
    for seed in (17, 18):
        new_ids = _docs(seed, documents=seed - 13).cuda()
        with torch.no_grad():
            ids.copy_(new_ids)
            for s in static:
                s.mul_(1.1)
        graph.replay()
        torch.cuda.synchronize()
        got = [o.detach().clone() for o in outs]
        eager = [t.detach().clone().requires_grad_(True) for t in static]
        y = fn(*eager, doc=new_ids)
        loss = (y.float() * torch.linspace(-1, 1, D, device="cuda")).sum()
        want = [y.detach(), *torch.autograd.grad(loss, eager)]
        for a, b in zip(got, want):
            assert torch.allclose(a.float(), b.float(), rtol=0, atol=1e-2 * max(1.0, float(b.abs().max())))


@pytest.mark.gpu
def test_gpu_fused_tables_match_the_torch_ops_on_wide_ids(monkeypatch):
    """On the GPU, ids 2**40 apart (the fused kernel's ranks) and ids close together far from 0 (its fast path):
    the output with the fused tables equals the torch ops' tables' (SSMC_CUDA_SPAN_KERNEL=0) bitwise."""
    q, k, v = (t.detach().cuda() for t in _qkv(19))
    for doc in (_docs(20) * 2 ** 40, _docs(21) + 2 ** 62):
        outs = []
        for switch in ("1", "0"):
            monkeypatch.setenv("SSMC_CUDA_SPAN_KERNEL", switch)
            fn = ssmc.torch.function(SPECS["doc"], layout="b h t ...")
            outs.append(fn(q, k, v, doc=doc.cuda()))
        assert torch.equal(outs[0], outs[1])
