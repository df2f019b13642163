"""``cu_seqlens=`` (#43 item 5, ssmc/packed.py): sequences packed along time in a batch of 1, states
restarting at each boundary. A packed call equals running each sequence alone, forward and every gradient
(the sequences', the params', the initial states'); each malformed `cu_seqlens` is a ValueError naming it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from profiles import examples

import ssmc
from ssmc.examples import hgrn, lstm, mamba1

torch = pytest.importorskip("torch")
st = pytest.importorskip("ssmc.torch")

MODULES = {"hgrn": hgrn, "lstm": lstm, "mamba1": mamba1}  # no params; two states; time last ("b d t")
BACKEND = "interpreter"


def _names(p):
    return [d.name for d in p.inputs], [s.name for s in p.states]


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _packed_case(module, lengths, seed):
    """Packed inputs (batch 1, time = sum of lengths), per-sequence initial states [N, ...], as float64 arrays."""
    values = module.make_inputs(np.random.default_rng(seed), sum(lengths), batch=len(lengths))
    p = module.SPEC.program
    seqs = {d.name for d in p.seqs}
    inputs, states = _names(p)
    return ({n: values[n][:1] if n in seqs else values[n] for n in inputs}, {s: values[s] for s in states})


def _alone(module, inputs, states, lengths, with_states, weights):
    """Each sequence in its own call on its own leaf tensors: (outputs per sequence, finals per sequence,
    the gradients assembled: sequences concatenated along time, params summed, states stacked)."""
    p = module.SPEC.program
    f = st.function(module.SPEC, BACKEND, layout=module.LAYOUT, return_final_states=True)
    seq_time = ssmc.api.time_positions(p, module.LAYOUT)[0]
    names, state_names = _names(p)
    out_time = list(ssmc.api.time_positions(p, module.LAYOUT)[1].values())
    ys, finals, grads = [], [], {n: [] for n in names + state_names}
    start = 0
    for i, n in enumerate(lengths):
        leaves = {k: torch.tensor(np.take(x, range(start, start + n), axis=seq_time[k]) if k in seq_time else x,
                                  requires_grad=True) for k, x in inputs.items()}
        h0 = {s: torch.tensor(h[i:i + 1], requires_grad=True) for s, h in states.items()} if with_states else {}
        y, fin = f(**leaves, **h0)
        y, fin = _tuple(y), _tuple(fin)
        loss = sum((a * torch.take_along_dim(w, torch.arange(start, start + n).reshape(
            [-1 if d == pos else 1 for d in range(a.dim())]), dim=pos)).sum()
            for a, w, pos in zip(y, weights[0], out_time))
        loss = loss + sum((b * w[i:i + 1]).sum() for b, w in zip(fin, weights[1]))
        loss.backward()
        ys.append([a.detach() for a in y])
        finals.append([b.detach() for b in fin])
        for k, t in {**leaves, **h0}.items():
            grads[k].append(t.grad)
        start += n
    assembled = {}
    for k, parts in grads.items():
        if not parts:
            continue
        if k in seq_time:
            assembled[k] = torch.cat(parts, dim=seq_time[k])
        elif k in state_names:
            assembled[k] = torch.cat(parts, dim=0)
        else:
            assembled[k] = sum(parts)
    return ys, finals, assembled


@settings(max_examples=examples(12, ci=4), deadline=None)
@given(module=hs.sampled_from(sorted(MODULES)), lengths=hs.lists(hs.integers(1, 4), min_size=1, max_size=4),
       with_states=hs.booleans(), seed=hs.integers(0, 2**16))
def test_packed_equals_each_sequence_alone_forward_and_gradients(module, lengths, with_states, seed):
    module = MODULES[module]
    p = module.SPEC.program
    inputs, states = _packed_case(module, lengths, seed)
    f = st.function(module.SPEC, BACKEND, layout=module.LAYOUT, return_final_states=True)
    cu = torch.tensor(np.cumsum([0, *lengths]))
    leaves = {k: torch.tensor(x, requires_grad=True) for k, x in inputs.items()}
    h0 = {s: torch.tensor(h, requires_grad=True) for s, h in states.items()} if with_states else {}
    y, fin = f(**leaves, **h0, cu_seqlens=cu)
    y, fin = _tuple(y), _tuple(fin)
    rng = np.random.default_rng(seed + 1)  # cotangents: random weights on every output and final state
    weights = ([torch.tensor(rng.standard_normal(a.shape)) for a in y],
               [torch.tensor(rng.standard_normal(b.shape)) for b in fin])
    assert all(b.shape[0] == len(lengths) for b in fin)  # final states per sequence
    (sum((a * w).sum() for a, w in zip(y, weights[0])) + sum((b * w).sum() for b, w in zip(fin, weights[1]))
     ).backward()

    ys, finals, grads = _alone(module, inputs, states, lengths, with_states, weights)
    out_time = list(ssmc.api.time_positions(p, module.LAYOUT)[1].values())
    for k, pos in enumerate(out_time):
        torch.testing.assert_close(y[k].detach(), torch.cat([one[k] for one in ys], dim=pos), rtol=1e-12, atol=1e-12)
    for k in range(len(fin)):
        torch.testing.assert_close(fin[k].detach(), torch.cat([one[k] for one in finals], dim=0),
                                   rtol=1e-12, atol=1e-12)
    for k, t in {**leaves, **h0}.items():
        torch.testing.assert_close(t.grad, grads[k], rtol=1e-10, atol=1e-12, msg=k)


def _one_call_case(module, backend, lengths, seed, device="cpu"):
    """The packed call without initial states or final states (one call of packed.reset_program): its
    outputs and every input's gradient against each sequence run alone (`_alone`, on the interpreter)."""
    inputs, states = _packed_case(module, lengths, seed)
    f = st.function(module.SPEC, backend, layout=module.LAYOUT)
    dtype = torch.float64 if device == "cpu" else torch.float32
    leaves = {k: torch.tensor(x, dtype=dtype, device=device, requires_grad=True) for k, x in inputs.items()}
    y = _tuple(f(**leaves, cu_seqlens=torch.tensor(np.cumsum([0, *lengths]))))
    assert f._reset_fn is not None, "the packed call did not take the one-call path"
    rng = np.random.default_rng(seed + 1)
    weights = ([torch.tensor(rng.standard_normal(a.shape)) for a in y], [])
    sum((a.double().cpu() * w).sum() for a, w in zip(y, weights[0])).backward()
    ys, _, grads = _alone(module, inputs, states, lengths, False, weights)
    out_time = list(ssmc.api.time_positions(module.SPEC.program, module.LAYOUT)[1].values())
    tol = 1e-10 if device == "cpu" else 1e-4
    for k, pos in enumerate(out_time):
        want = torch.cat([one[k] for one in ys], dim=pos)
        assert (y[k].detach().double().cpu() - want).abs().max() <= tol * max(want.abs().max().item(), 1.0)
    for k, t in leaves.items():
        assert (t.grad.double().cpu() - grads[k]).abs().max() <= tol * max(grads[k].abs().max().item(), 1.0), k


@settings(max_examples=examples(8, ci=3), deadline=None)
@given(module=hs.sampled_from(sorted(MODULES)), lengths=hs.lists(hs.integers(1, 5), min_size=1, max_size=4),
       seed=hs.integers(0, 2**16))
def test_packed_without_states_is_one_call_equal_to_each_sequence_alone(module, lengths, seed):
    _one_call_case(MODULES[module], BACKEND, lengths, seed)


def test_packed_one_call_on_numba():
    _one_call_case(hgrn, "numba", [3, 1, 5, 2], 4)


def test_matrix_linear_keeps_the_calls_per_sequence():
    """The chunked core takes the log of its decay: a matrix-linear program is not made into one call."""
    from ssmc import packed
    from ssmc.examples import mamba2

    assert packed.reset_program(mamba2.SPEC.program) is None
    assert packed.reset_program(lstm.SPEC.program) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("module", sorted(MODULES))
def test_gpu_packed_one_call(module):
    """On CUDA tensors (float32): the one call against each sequence alone, sequences of 1, 7, 180, 1000 steps."""
    _one_call_case(MODULES[module], None, [1, 7, 180, 1000], 5, device="cuda")


def test_one_sequence_equals_the_plain_call_and_compile_takes_cu_seqlens():
    inputs, states = _packed_case(lstm, [6], 3)
    f = st.function(lstm.SPEC, BACKEND, layout=lstm.LAYOUT, return_final_states=True)
    t = {k: torch.tensor(x) for k, x in {**inputs, **states}.items()}
    y, (h, c) = f(**t, cu_seqlens=[0, 6])
    y2, (h2, c2) = f(**t)
    assert torch.equal(y, y2) and torch.equal(h, h2) and torch.equal(c, c2)
    # ssmc.compile's call takes it too (NumPy arrays), the same results
    compiled = ssmc.compile(lstm.SPEC, BACKEND, layout=lstm.LAYOUT)
    cu = np.array([0, 2, 3, 6])
    ya, (ha, ca) = compiled(**inputs, cu_seqlens=cu, return_final_states=True)
    yb, (hb, cb) = f(**{k: torch.tensor(x) for k, x in inputs.items()}, cu_seqlens=torch.tensor(cu))
    np.testing.assert_allclose(ya, yb.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ha, hb.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ca, cb.numpy(), rtol=1e-12, atol=1e-12)
    assert compiled(**inputs, cu_seqlens=cu).shape == (1, 6, 4)


def test_the_layer_takes_cu_seqlens():
    layer = st.Recurrence(lstm.SPEC, layout=lstm.LAYOUT, sizes={"i": 3, "j": 4, "k": 4}, dtype=torch.float64,
                          backend=BACKEND)
    x = torch.randn(1, 5, 3, dtype=torch.float64)
    y, (h, _) = layer(x, cu_seqlens=torch.tensor([0, 2, 5]), return_final_states=True)
    y1, (h1, _) = layer(x[:, 2:], return_final_states=True)
    torch.testing.assert_close(y[:, 2:], y1)
    torch.testing.assert_close(h[1:], h1)
    assert h.shape == (2, 4)


def test_each_malformed_cu_seqlens_is_a_value_error_naming_it():
    inputs, _ = _packed_case(hgrn, [5], 0)
    f = st.function(hgrn.SPEC, BACKEND, layout=hgrn.LAYOUT, return_final_states=True)
    x, g = (torch.tensor(inputs[n]) for n in ("x", "f"))
    cases = {
        "first offset is 0": [1, 3, 5],
        "strictly increasing": [0, 3, 3, 5],
        "packed length 5": [0, 2, 4],
        "1-D array": [[0, 5]],
        "integer offsets": [0.0, 5.0],
    }
    for message, cu in cases.items():
        with pytest.raises(ValueError, match=f"cu_seqlens: .*{message}"):
            f(x, g, cu_seqlens=torch.tensor(cu))
    with pytest.raises(ValueError, match=r"cu_seqlens: .*batch of 1; 'x' has a batch of 2"):
        f(x.repeat(2, 1, 1), g.repeat(2, 1, 1), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="cu_seqlens: 2 sequences, so initial state 'h' has 2"):
        f(x, g, h=torch.zeros(3, 5, dtype=torch.float64), cu_seqlens=torch.tensor([0, 2, 5]))


@ssmc.recurrence
def per_value_decay(S: ssmc.State["b k v"], q: ssmc.Seq["b k"], k: ssmc.Seq["b k"], v: ssmc.Seq["b v"],
                    g: ssmc.Seq["b v"]):
    S = ssmc.exp(g) * S + k * v   # a decay along the value axis: no chunked core takes it
    y = ssmc.dot(S, q, over="k")
    return S, y


def test_the_one_call_reset_path_is_refused_only_where_the_chunked_core_takes_the_program():
    """A packed call runs as one call with a reset sequence unless the chunked matrix-linear core takes the
    program (a reset inside its update would hide that form: then a call per sequence), so a recurrence with
    a per-value decay, which runs on the diagonal scans, keeps the one call."""
    from ssmc import packed
    from ssmc.examples import gla, retnet

    assert packed.reset_program(per_value_decay.program) is not None
    assert packed.reset_program(gla.SPEC.program) is None and packed.reset_program(retnet.SPEC.program) is None
    assert packed.reset_program(mamba1.SPEC.program) is not None
