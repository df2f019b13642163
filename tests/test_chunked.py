"""The chunked matrix-linear path (passes/matrix_linear.py, backends/cuda/kernels/chunk/).

- the analysis: which specs it takes, with which roles, and why it refuses the others;
- the chunked forward and VJP against the interpreter (float64, the CUDA backend emulated on the CPU:
  the chunked core runs on torch CPU tensors, the stages around it as emulated kernels), at awkward
  lengths and chunk sizes, every gradient;
- the VJP against torch autograd of the chunked forward itself, and finite differences;
- decays given as they are (RetNet's gamma) with values <= 0; the switch back to the scans;
- per-key decays (GLA: examples/gla.py, ℓ along the key axis): the analysis, the torch algorithm against a
  plain loop (torch autograd) and finite differences, the whole path against the interpreter at strong decays;
- on a GPU: bf16 and fp32 against float64.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ssmc
from ssmc.examples import gla, linear_attention, lstm, mamba1, mamba2, retnet, simple_gla
from ssmc.passes.matrix_linear import chunk_stages, core_form, matrix_linear
from tests.profiles import examples, in_ci

torch = pytest.importorskip("torch")


# -- specs beside the examples ---------------------------------------------------------------------

@ssmc.recurrence
def gated(S: ssmc.State["b h k v"], q: ssmc.Seq["b h k"], k: ssmc.Seq["b h k"], v: ssmc.Seq["b h v"],
          g: ssmc.Seq["b h"], w: ssmc.Param["h"]):
    """Simple-GLA-like: a sigmoid gate as decay (kept as a, positive), a feature map on q, -k ⊗ v."""
    S = ssmc.sigmoid(g) * S - k * (v * w)
    y = ssmc.dot(S, ssmc.silu(q) * 0.5, over="k") + v
    return S, y


@ssmc.recurrence
def gated_output(S: ssmc.State["b h k v"], q: ssmc.Seq["b h k"], k: ssmc.Seq["b h k"], v: ssmc.Seq["b h v"],
                 z: ssmc.Seq["b h v"]):
    """Linear attention with an output gate: a post stage that stays one."""
    S = S + k * v
    y = ssmc.dot(S, q, over="k") * ssmc.silu(z)
    return S, y


@ssmc.recurrence
def constant_decay(S: ssmc.State["b k v"], q: ssmc.Seq["b k"], k: ssmc.Seq["b k"], v: ssmc.Seq["b v"]):
    S = 0.9 * S + k * v
    y = ssmc.dot(S, q, over="k")
    return S, y


@ssmc.recurrence
def exclusive(S: ssmc.State["b k v"], q: ssmc.Seq["b k"], k: ssmc.Seq["b k"], v: ssmc.Seq["b v"]):
    y = ssmc.dot(S, q, over="k")
    S = S + k * v
    return S, y


@ssmc.recurrence
def rank_two(S: ssmc.State["b k v"], q: ssmc.Seq["b k"], k: ssmc.Seq["b k"], v: ssmc.Seq["b v"],
             k2: ssmc.Seq["b k"], v2: ssmc.Seq["b v"]):
    S = S + k * v + k2 * v2
    y = ssmc.dot(S, q, over="k")
    return S, y


@ssmc.recurrence
def per_key(S: ssmc.State["b k v"], q: ssmc.Seq["b k"], k: ssmc.Seq["b k"], v: ssmc.Seq["b v"],
            g: ssmc.Seq["b k"]):
    S = ssmc.exp(g) * S + k * v
    y = ssmc.dot(S, q, over="k")
    return S, y


@ssmc.recurrence
def per_value(S: ssmc.State["b k v"], q: ssmc.Seq["b k"], k: ssmc.Seq["b k"], v: ssmc.Seq["b v"],
              g: ssmc.Seq["b v"]):
    S = ssmc.exp(g) * S + k * v
    y = ssmc.dot(S, q, over="k")
    return S, y


@ssmc.recurrence
def gla_gate(S: ssmc.State["b h k v"], q: ssmc.Seq["b h k"], k: ssmc.Seq["b h k"], v: ssmc.Seq["b h v"],
             x: ssmc.Seq["b h k"]):
    """GLA with its gate in the spec: ℓ = -softplus(x) / 16 per key, written by a pre stage; β = 2 folded in."""
    S = ssmc.exp(-ssmc.softplus(x) * 0.0625) * S + k * (2.0 * v)
    y = ssmc.dot(S, q, over="k")
    return S, y


@ssmc.recurrence
def gla_grouped(S: ssmc.State["b h k v"], q: ssmc.Seq["b k"], k: ssmc.Seq["b k"], v: ssmc.Seq["b h v"],
                g: ssmc.Seq["b h k"]):
    """GLA with q, k shared by the heads (lacking h), as SSD's B and C lack r."""
    S = ssmc.exp(g) * S + k * v
    y = ssmc.dot(S, q, over="k")
    return S, y


@ssmc.recurrence
def gla_sigmoid(S: ssmc.State["b h k v"], q: ssmc.Seq["b h k"], k: ssmc.Seq["b h k"], v: ssmc.Seq["b h v"],
                g: ssmc.Seq["b h k"]):
    """A per-key decay given as is (kept as a, positive at run time: its log taken), written by pre."""
    S = ssmc.sigmoid(g) * S + k * v
    y = ssmc.dot(S, q, over="k")
    return S, y


@ssmc.recurrence
def gla_param(S: ssmc.State["b h k v"], q: ssmc.Seq["b h k"], k: ssmc.Seq["b h k"], v: ssmc.Seq["b h v"],
              w: ssmc.Param["h k"]):
    """A per-key decay that is a param (RetNet's decays, per key): repeated over the steps."""
    S = ssmc.exp(w) * S + k * v
    y = ssmc.dot(S, q, over="k")
    return S, y


@ssmc.recurrence
def two_queries(S: ssmc.State["b k v"], q: ssmc.Seq["b k"], p: ssmc.Seq["b k"], k: ssmc.Seq["b k"],
                v: ssmc.Seq["b v"]):
    S = S + k * v
    y = ssmc.dot(S, q, over="k") + ssmc.dot(S, p, over="k")
    return S, y


SIZES = {"gated": {"b": 2, "h": 2, "k": 3, "v": 4}, "gated_output": {"b": 2, "h": 2, "k": 3, "v": 4},
         "constant_decay": {"b": 2, "k": 3, "v": 2}, "gla_gate": {"b": 2, "h": 2, "k": 3, "v": 4},
         "gla_grouped": {"b": 2, "h": 3, "k": 3, "v": 4}, "gla_sigmoid": {"b": 2, "h": 2, "k": 3, "v": 4},
         "gla_param": {"b": 2, "h": 2, "k": 3, "v": 4}}


def _inputs(spec, sizes: dict, length: int, rng, layout="b t ..."):
    """Random inputs for a spec of this module in layout "b t ..." (time second)."""
    out = {}
    for d in spec.program.inputs:
        shape = [sizes[a] for a in d.axes]
        if d.role.value == "seq":
            shape.insert(1, length)
        out[d.name] = rng.standard_normal(shape)
    for s in spec.program.states:
        out[s.name] = 0.5 * rng.standard_normal([sizes[a] for a in s.axes])
    return out


# -- the analysis ------------------------------------------------------------------------------------

def test_examples_are_recognised_with_their_roles():
    ml = matrix_linear(mamba2.SPEC.program)
    assert (ml.key, ml.value, ml.heads) == ("n", "p", ("b", "g", "r"))
    assert ml.log_decay is not None and ml.decay is None
    assert ml.q.arg == "C" and ml.k.arg == "B"
    ml = matrix_linear(retnet.SPEC.program)
    assert (ml.key, ml.value, ml.heads, ml.decay.arg) == ("k", "v", ("b", "h"), "gamma")
    ml = matrix_linear(linear_attention.SPEC.program)
    assert ml.log_decay is None and ml.decay is None
    # retnet and linear attention are cores as written; mamba2 is cut into pre and core (its post, o + D x,
    # taken into the core: x is its v as given)
    assert core_form(retnet.SPEC.program) is not None and chunk_stages(retnet.SPEC.program) is None
    fused = chunk_stages(mamba2.SPEC.program)
    assert [s.kind for s in fused.stages] == ["pre", "core"]
    assert core_form(fused.stages[1].program) is not None
    # SSD's injection softplus(dt) x ⊗ B: v is x itself, β = softplus(dt) apart; pre writes β and ℓ (per
    # step and head), not v (a pass over x): the core reads x as given
    ml = matrix_linear(mamba2.SPEC.program)
    assert ml.v.arg == "x" and ml.beta is not None and ml.beta.axes == ("b", "g", "r")
    assert sorted(fused.stages[0].writes) == ["mamba2_beta", "mamba2_ell"]
    core = core_form(fused.stages[1].program)
    assert core.v.arg == "x" and core.beta.arg == "mamba2_beta" and core.k.arg == "B" and core.q.arg == "C"
    assert core.skip.arg == "D" and fused.stages[1].program.outputs[0][0] == "y"
    assert matrix_linear(retnet.SPEC.program).beta is None and matrix_linear(linear_attention.SPEC.program).beta is None
    gated_stages = chunk_stages(gated.program)  # its post, o + v, in the core too (a skip of 1)
    assert [s.kind for s in gated_stages.stages] == ["pre", "core"]
    assert core_form(gated_stages.stages[1].program).skip.op.name == "CONST"
    gated_stages = chunk_stages(gated_output.program)  # a post other than o + s v stays a stage
    assert [s.kind for s in gated_stages.stages] == ["core", "post"]
    assert chunk_stages(constant_decay.program) is None and core_form(constant_decay.program) is not None


@pytest.mark.parametrize("spec, reason", [
    (lstm.SPEC, "2 states"),
    (mamba1.SPEC, "diagonal linear"),
    (exclusive, "contracts the state"),
    (per_value, "the decay varies along the value axis v"),
    (two_queries, "two contractions"),
])
def test_refusals_say_why(spec, reason):
    got = matrix_linear(spec.program)
    assert isinstance(got, str) and reason in got, got


def test_a_sum_of_two_outer_products_is_taken_as_rank_two():
    """classify calls it diagonal linear (no one outer product); the chunked path takes it as two terms
    (tests/test_rank_chunked.py)."""
    ml = matrix_linear(rank_two.program)
    assert not isinstance(ml, str) and ml.rank({}) == 2 and core_form(rank_two.program) is not None


def test_per_key_decays_are_taken():
    """GLA's decay along the key axis: ℓ has k, the core is the spec itself; `describe` (and so `ssmc inspect`)
    says per key; a gate in the spec goes to pre (ℓ written with its key axis), a decay as is kept as a."""
    ml = matrix_linear(gla.SPEC.program)
    assert (ml.key, ml.value, ml.heads) == ("k", "v", ("b", "h"))
    assert ml.per_key and ml.log_decay.arg == "g" and ml.log_decay.axes == ("b", "h", "k") and ml.decay is None
    assert "ℓ [b h k], per key k" in ml.describe()
    assert core_form(gla.SPEC.program) is not None and chunk_stages(gla.SPEC.program) is None
    assert matrix_linear(per_key.program).per_key and not matrix_linear(simple_gla.SPEC.program).per_key
    fused = chunk_stages(gla_gate.program)
    assert [s.kind for s in fused.stages] == ["pre", "core"]
    core = core_form(fused.stages[1].program)
    assert core.per_key and core.log_decay.axes == ("b", "h", "k") and fused.stages[0].writes == (core.log_decay.arg,)
    assert core.v.arg == "v" and core.beta.arg == 2.0
    sig = core_form(chunk_stages(gla_sigmoid.program).stages[1].program)
    assert sig.per_key and sig.log_decay is None and sig.decay.axes == ("b", "h", "k")
    grouped = matrix_linear(gla_grouped.program)
    assert grouped.per_key and grouped.q.axes == ("b", "k") and grouped.heads == ("b", "h")


def test_inspect_shows_the_per_key_decay(capsys):
    from pathlib import Path

    from ssmc.cli import main

    path = Path(gla.__file__).resolve()
    assert main(["inspect", str(path), "--sizes", "b=2,h=4,k=64,v=64", "--length", "1024", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "chunked: gla (matrix linear S [b h k v]" in out and "per key k" in out
    assert "its forward and its VJP as the per-key tensor-core kernels" in out


def test_per_key_cores_take_the_per_key_kernels(monkeypatch):
    """A per-key core asks for the per-key kernels (mma.forward_per_key, chunks of mma.PER_KEY_CHUNK) where q is
    16-bit at sizes they take (chunk size, the 16-bit operands), never for the scalar-decay kernels (chunk.cu.j2
    takes one decay per head and step: `_kernels_apply`); SSMC_CUDA_CHUNK_PER_KEY=0 turns them off. The prepared
    path runs `forward` each call for it (no plan)."""
    from ssmc.backends.cuda.kernels import chunk

    monkeypatch.delenv("SSMC_CUDA_CHUNK_PER_KEY", raising=False)
    monkeypatch.delenv("SSMC_CUDA_CHUNK", raising=False)
    sizes = {"b": 2, "h": 4, "k": 64, "v": 64}
    per = chunk.chunked_core(gla.SPEC.program)
    scalar = chunk.chunked_core(simple_gla.SPEC.program)
    assert per.kernels_wanted(torch.bfloat16, sizes) and scalar.kernels_wanted(torch.bfloat16, sizes)
    assert not per.kernels_wanted(torch.float32, sizes)
    assert per.operand_dtypes({"q": torch.zeros(1, dtype=torch.bfloat16)}, sizes) == {
        "k": torch.bfloat16, "v": torch.bfloat16}
    assert chunk.chunk_size(per.ml, sizes, 1000, torch.bfloat16) == chunk.mma.PER_KEY_CHUNK
    x = chunk.Chunks(*(torch.zeros(2, 1, 64, 64, dtype=torch.bfloat16) for _ in range(3)),
                     ell=torch.zeros(2, 1, 64, 64), s0=torch.zeros(2, 64, 64))
    assert x.per_key and not chunk._kernels_apply(x)
    monkeypatch.setenv("SSMC_CUDA_CHUNK_PER_KEY", "0")
    assert not per.kernels_wanted(torch.bfloat16, sizes) and scalar.kernels_wanted(torch.bfloat16, sizes)
    assert per.operand_dtypes({"q": torch.zeros(1, dtype=torch.bfloat16)}, sizes) == {}
    wide = {**sizes, "k": 128, "v": 128}  # (the torch path's rule: 128 steps at K·V ≥ 8192)
    assert chunk.chunk_size(per.ml, wide, 1000, torch.bfloat16) == 128


# -- against the interpreter ---------------------------------------------------------------------------

CASES = {
    "mamba2": (mamba2.SPEC, mamba2.LAYOUT, lambda rng, L: mamba2.make_inputs(rng, L)),
    "retnet": (retnet.SPEC, retnet.LAYOUT, lambda rng, L: retnet.make_inputs(rng, L)),
    "simple_gla": (simple_gla.SPEC, simple_gla.LAYOUT, lambda rng, L: simple_gla.make_inputs(rng, L)),
    "linear_attention": (linear_attention.SPEC, linear_attention.LAYOUT,
                         lambda rng, L: linear_attention.make_inputs(rng, L)),
    "gated": (gated, "b t ...", lambda rng, L: _inputs(gated, SIZES["gated"], L, rng)),
    "gated_output": (gated_output, "b t ...", lambda rng, L: _inputs(gated_output, SIZES["gated_output"], L, rng)),
    "constant_decay": (constant_decay, "b t ...",
                       lambda rng, L: _inputs(constant_decay, SIZES["constant_decay"], L, rng)),
    "gla": (gla.SPEC, gla.LAYOUT, lambda rng, L: gla.make_inputs(rng, L)),
    **{name: (spec, "b t ...", lambda rng, L, spec=spec, name=name: _inputs(spec, SIZES[name], L, rng))
       for name, spec in (("gla_gate", gla_gate), ("gla_grouped", gla_grouped), ("gla_sigmoid", gla_sigmoid),
                          ("gla_param", gla_param))},
}


def _host(x) -> np.ndarray:
    return np.asarray(x.detach().double().cpu() if hasattr(x, "detach") else x, dtype=np.float64)


def _relative(a, b) -> float:
    a, b = _host(a), _host(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _check(name: str, length: int, dtype: str, tol: float, seed: int = 0):
    spec, layout, make = CASES[name]
    rng = np.random.default_rng(seed)
    inputs = make(rng, length)
    if name in ("gated", "gla_sigmoid"):
        inputs["g"] = inputs["g"] + 2.0  # decays near 1 keep the state alive over many steps
    if name == "gla_grouped":
        inputs["g"] = -np.abs(inputs["g"])  # log decays <= 0
    if name == "gla_param":
        inputs["w"] = -0.2 * np.abs(inputs["w"])
    state = spec.program.states[0].name
    output = spec.program.outputs[0][0]
    ref = ssmc.compile(spec, layout=layout, backend="interpreter")(**inputs, return_final_states=True)
    got = ssmc.compile(spec, layout=layout, backend="cuda", dtype=dtype)(**inputs, return_final_states=True)
    assert _relative(got[0], ref[0]) < tol and _relative(got[1], ref[1]) < tol
    cot = {output: rng.standard_normal(np.shape(ref[0]))}
    lam = {state: rng.standard_normal(np.shape(ref[1]))}
    want = ssmc.grad(spec, backend="interpreter", layout=layout)(**inputs, grad_outputs=cot, grad_final_states=lam)
    grads = ssmc.grad(spec, backend="cuda", layout=layout, dtype=dtype)(**inputs, grad_outputs=cot,
                                                                        grad_final_states=lam)
    assert set(grads) == set(want)
    for k in want:
        assert _relative(grads[k], want[k]) < tol, (name, length, k, _relative(grads[k], want[k]))


@pytest.fixture
def counted(monkeypatch):
    """The chunked core's forward and backward calls, counted (the path must be the one tested)."""
    from ssmc.backends.cuda.kernels import chunk

    calls = {"forward": 0, "backward": 0}
    for what in calls:
        original = getattr(chunk.ChunkedCore, what)

        def wrapped(self, *a, _original=original, _what=what, **k):
            calls[_what] += 1
            return _original(self, *a, **k)
        monkeypatch.setattr(chunk.ChunkedCore, what, wrapped)
    return calls


@settings(max_examples=examples(12, ci=4), deadline=None)
@given(name=st.sampled_from(sorted(CASES)), length=st.sampled_from([1, 7, 64, 65, 180, 1000]),
       chunk=st.sampled_from([None, 4, 16]))
def test_chunked_matches_the_interpreter(name, length, chunk):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SSMC_CUDA_EMULATE", "1")
        if chunk is not None:
            mp.setenv("SSMC_CUDA_CHUNK", str(chunk))
        _check(name, length, "float64", 1e-10)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_example_takes_the_chunked_path(name, emulated_cuda, counted):
    _check(name, 33, "float64", 1e-10)
    assert counted["forward"] >= 2 and counted["backward"] == 1


def test_long_sequence_many_chunks_and_the_chunk_loop(emulated_cuda, monkeypatch):
    """L = 4097 in chunks of 16 (257 chunks, one ragged), through the [NC, NC] product and the loop; in CI
    L = 1025 (65 chunks, one ragged: the same two paths, a quarter of the interpreter's steps)."""
    from ssmc.backends.cuda.kernels.chunk import algorithm

    length = 1025 if in_ci() else 4097
    emulated_cuda.setenv("SSMC_CUDA_CHUNK", "16")
    _check("mamba2", length, "float64", 1e-9)
    monkeypatch.setattr(algorithm, "SCAN_MATRIX_CHUNKS", 8)
    _check("retnet", length, "float64", 1e-9)


def test_float32(emulated_cuda):
    _check("mamba2", 180, "float32", 2e-4)
    _check("gated", 180, "float32", 2e-4)


# -- the VJP on its own ------------------------------------------------------------------------------

def _random_chunks(seed: int, heads=(2, 1, 3), nc=3, c=5, kd=4, vd=3):
    from ssmc.backends.cuda.kernels.chunk.algorithm import Chunks

    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    # q, k lack the last head axis (shared across it), v and the decays have all of them
    return Chunks(q=r(*heads[:2], 1, nc, c, kd), k=r(*heads[:2], 1, nc, c, kd), v=r(*heads, nc, c, vd),
                  ell=-torch.rand(*heads, nc, c, generator=g, dtype=torch.float64), s0=r(*heads, kd, vd))


def _summed_to(grad, shape):
    """`grad` summed over the axes where `shape` has 1 (a broadcast operand); torch's sum over an empty
    list of axes would sum over all of them."""
    axes = [i for i in range(grad.dim()) if shape[i] == 1 and grad.shape[i] != 1]
    return grad.sum(axes, keepdim=True) if axes else grad


def test_vjp_matches_torch_autograd_of_the_forward():
    from ssmc.backends.cuda.kernels.chunk.algorithm import Chunks, forward, vjp

    x = _random_chunks(0)
    leaves = {k: getattr(x, k).clone().requires_grad_(True) for k in ("q", "k", "v", "ell", "s0")}
    out, entering, final = forward(Chunks(**leaves))
    d_out, d_final = torch.randn_like(out), torch.randn_like(final)
    want = torch.autograd.grad((out * d_out).sum() + (final * d_final).sum(), list(leaves.values()))
    got = vjp(x, entering.detach(), final.detach(), d_out, d_final)
    for name, w, g in zip(leaves, want, got):
        g = _summed_to(g, w.shape)
        assert torch.allclose(g, w, rtol=1e-10, atol=1e-12), name


def test_vjp_matches_finite_differences():
    from ssmc.backends.cuda.kernels.chunk.algorithm import Chunks, forward, vjp

    x = _random_chunks(1, heads=(1, 1, 2), nc=2, c=3, kd=2, vd=2)
    out, entering, final = forward(x)
    d_out, d_final = torch.randn_like(out), torch.randn_like(final)
    grads = dict(zip(("q", "k", "v", "ell", "s0"), vjp(x, entering, final, d_out, d_final)))

    def loss(**changed):
        o, _, f = forward(Chunks(**{**vars(x), **changed}))
        return float((o * d_out).sum() + (f * d_final).sum())
    eps = 1e-6
    for name in ("q", "k", "v", "ell", "s0"):
        base = getattr(x, name)
        for index in [(0,) * base.dim(), tuple(s - 1 for s in base.shape)]:
            plus, minus = base.clone(), base.clone()
            plus[index] += eps
            minus[index] -= eps
            numeric = (loss(**{name: plus}) - loss(**{name: minus})) / (2 * eps)
            g = _summed_to(grads[name], base.shape)
            assert abs(float(g[index]) - numeric) < 1e-6 * max(1.0, abs(numeric)), (name, index)


def _plain_loop(q, k, v, ell, s0):
    """The per-key core as a plain loop over the steps (torch, differentiable): Chunks' arrays flattened
    over (chunk, step); (O as [*H, NC, C, V], the final state)."""
    def steps(a):
        return a.reshape(*a.shape[:-3], -1, a.shape[-1])
    qs, ks, vs, ls = map(steps, (q, k, v, ell))
    state, outs = s0, []
    for t in range(qs.shape[-2]):
        state = torch.exp(ls[..., t, :])[..., None] * state + ks[..., t, :, None] * vs[..., t, None, :]
        outs.append((qs[..., t, :, None] * state).sum(-2))
    out = torch.stack(outs, -2)
    return out.reshape(*out.shape[:-2], *q.shape[-3:-1], -1), state


@pytest.mark.parametrize("nc, c, strength, matrix", [(3, 5, 1.0, True), (4, 40, 1.0, False), (2, 33, 20.0, True),
                                                     (5, 16, 3.0, False), (1, 1, 1.0, True)])
def test_per_key_forward_and_vjp_against_a_plain_loop(nc, c, strength, matrix, monkeypatch):
    """The per-key algorithm (sub-blocks of `SUB` steps: C = 33, 40 leave a partial one) against torch autograd
    of the plain loop, float64, q and k lacking the last head axis; ℓ in [-strength, 0] per step and key
    (strength 20: exp(-Λ) over a chunk would overflow); the carry across chunks as the matrix product or
    the loop (`matrix`)."""
    from ssmc.backends.cuda.kernels.chunk import algorithm
    from ssmc.backends.cuda.kernels.chunk.algorithm import Chunks, forward, vjp

    monkeypatch.setattr(algorithm, "SCAN_MATRIX_CHUNKS", 512 if matrix else 0)
    g = torch.Generator().manual_seed(nc * 100 + c)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    heads, kd, vd = (2, 1, 3), 4, 6
    x = Chunks(q=r(2, 1, 1, nc, c, kd), k=r(2, 1, 1, nc, c, kd), v=r(*heads, nc, c, vd),
               ell=-strength * torch.rand(*heads, nc, c, kd, generator=g, dtype=torch.float64), s0=r(*heads, kd, vd))
    assert x.per_key
    leaves = {n: getattr(x, n).clone().requires_grad_(True) for n in ("q", "k", "v", "ell", "s0")}
    want_out, want_final = _plain_loop(**leaves)
    out, entering, final = forward(x)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    assert torch.allclose(out, want_out, rtol=1e-10, atol=1e-11) and torch.allclose(final, want_final, rtol=1e-10,
                                                                                     atol=1e-11)
    d_out, d_final = r(*out.shape), r(*final.shape)
    want = torch.autograd.grad((want_out * d_out).sum() + (want_final * d_final).sum(), list(leaves.values()))
    got = vjp(x, entering, final, d_out, d_final)
    for name, w, gr in zip(leaves, want, got):
        gr = _summed_to(gr, w.shape)
        assert torch.isfinite(gr).all(), name
        assert float((gr - w).abs().max()) <= 1e-10 * max(1.0, float(w.abs().max())), name


def test_per_key_memory_stays_linear_in_the_chunk():
    """No array of the per-key forward and VJP holds [C, C, K] values per chunk (L·C·K a head): the largest is
    an element-wise sub-block position's [NC, SUB, SUB, K], the scores' [NC, C, C] or an operand's [NC, C, K]
    (every op's outputs watched by a dispatch mode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ssmc.backends.cuda.kernels.chunk.algorithm import SUB, Chunks, forward, vjp

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out
    nc, c, kd, vd = 4, 64, 32, 16
    g = torch.Generator().manual_seed(2)
    x = Chunks(*(torch.randn(2, nc, c, d, generator=g) for d in (kd, kd, vd)),
               ell=-torch.rand(2, nc, c, kd, generator=g), s0=torch.randn(2, kd, vd, generator=g))
    with Largest():
        out, entering, final = forward(x)
        vjp(x, entering, final, torch.randn_like(out), torch.randn_like(final))
    bound = 2 * nc * max(c * c, c * kd, SUB * SUB * kd, kd * vd)
    assert 0 < Largest.numel <= bound < 2 * nc * c * c * kd // 4, (Largest.numel, bound)


def test_per_key_vjp_matches_finite_differences():
    from ssmc.backends.cuda.kernels.chunk.algorithm import Chunks, forward, vjp

    g = torch.Generator().manual_seed(5)
    x = Chunks(q=torch.randn(2, 2, 18, 3, generator=g, dtype=torch.float64),
               k=torch.randn(2, 2, 18, 3, generator=g, dtype=torch.float64),
               v=torch.randn(2, 2, 18, 2, generator=g, dtype=torch.float64),
               ell=-2 * torch.rand(2, 2, 18, 3, generator=g, dtype=torch.float64),
               s0=torch.randn(2, 3, 2, generator=g, dtype=torch.float64))
    out, entering, final = forward(x)
    d_out, d_final = torch.randn_like(out), torch.randn_like(final)
    grads = dict(zip(("q", "k", "v", "ell", "s0"), vjp(x, entering, final, d_out, d_final)))

    def loss(**changed):
        o, _, f = forward(Chunks(**{**vars(x), **changed}))
        return float((o * d_out).sum() + (f * d_final).sum())
    eps = 1e-6
    for name in ("q", "k", "v", "ell", "s0"):
        base = getattr(x, name)
        # the first and last entries, and one in the second sub-block of the first chunk (an off-diagonal term)
        for index in [(0,) * base.dim(), tuple(s - 1 for s in base.shape), (1,) * (base.dim() - 2) + (17, 1)][
                :3 if name != "s0" else 2]:
            plus, minus = base.clone(), base.clone()
            plus[index] += eps
            minus[index] -= eps
            numeric = (loss(**{name: plus}) - loss(**{name: minus})) / (2 * eps)
            assert abs(float(grads[name][index]) - numeric) < 1e-6 * max(1.0, abs(numeric)), (name, index)


@pytest.mark.parametrize("length", [1, 7, 65, 180])
@pytest.mark.parametrize("strength", [1.0, 20.0])
def test_gla_matches_the_interpreter(length, strength, emulated_cuda, counted):
    """examples/gla.py through the CUDA backend (its chunked core on torch CPU, float64) against the interpreter:
    output, final state and every gradient (q, k, v, g, the initial state), the log decays in [-strength, 0] per
    step and key (20: the state forgets within a step or two; no inf or NaN), chunks of 64 and of 16 (with a
    partial last one where they do not divide L)."""
    for chunk in (None, "16"):
        if chunk is not None:
            emulated_cuda.setenv("SSMC_CUDA_CHUNK", chunk)
        rng = np.random.default_rng(length)
        inputs = gla.make_inputs(rng, length)
        inputs["g"] = -strength * rng.uniform(0.0, 1.0, inputs["g"].shape)
        ref = ssmc.compile(gla.SPEC, layout=gla.LAYOUT, backend="interpreter")(**inputs, return_final_states=True)
        got = ssmc.compile(gla.SPEC, layout=gla.LAYOUT, backend="cuda", dtype="float64")(**inputs,
                                                                                         return_final_states=True)
        assert _relative(got[0], ref[0]) < 1e-10 and _relative(got[1], ref[1]) < 1e-10
        cot, lam = {"y": rng.standard_normal(ref[0].shape)}, {"S": rng.standard_normal(ref[1].shape)}
        want = ssmc.grad(gla.SPEC, backend="interpreter", layout=gla.LAYOUT)(**inputs, grad_outputs=cot,
                                                                            grad_final_states=lam)
        grads = ssmc.grad(gla.SPEC, backend="cuda", layout=gla.LAYOUT, dtype="float64")(**inputs, grad_outputs=cot,
                                                                                     grad_final_states=lam)
        assert set(grads) == set(want) == {"q", "k", "v", "g", "S"}
        for k in want:
            assert np.isfinite(_host(grads[k])).all(), k
            assert _relative(grads[k], want[k]) < 1e-10, (length, strength, chunk, k, _relative(grads[k], want[k]))
    assert counted["forward"] >= 4 and counted["backward"] == 2


def test_gla_float32_and_bfloat16_operands(emulated_cuda):
    """fp32 (the compute dtype) through the whole path; bf16 operands through the algorithm itself (the products
    before the diagonal in bf16, as on a GPU): both against float64, strong decays among them."""
    from ssmc.backends.cuda.kernels.chunk.algorithm import Chunks, forward

    _check("gla", 180, "float32", 2e-4)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 3, 64, 32, generator=g), torch.randn(2, 3, 64, 32, generator=g) / 32 ** 0.5
    v, s0 = torch.randn(2, 3, 64, 16, generator=g), torch.randn(2, 32, 16, generator=g)
    ell = -torch.rand(2, 3, 64, 32, generator=g) * torch.tensor([0.05, 20.0]).repeat(16)
    want = forward(Chunks(q.double(), k.double(), v.double(), ell.double(), s0.double()))
    got = forward(Chunks(q.bfloat16(), k.bfloat16(), v.bfloat16(), ell, s0))
    for a, b in zip(got, want):
        assert torch.isfinite(a).all()
        assert float((a.double() - b).norm() / b.norm()) < 2e-2


# -- decays as given, and the switch -------------------------------------------------------------------

def test_non_positive_decay_runs_the_scan_forward_and_refuses_gradients(emulated_cuda):
    rng = np.random.default_rng(3)
    inputs = retnet.make_inputs(rng, 20)
    inputs["gamma"] = np.array([0.9, -0.5, 0.0])
    ref = ssmc.compile(retnet.SPEC, layout=retnet.LAYOUT, backend="interpreter")(**inputs)
    got = ssmc.compile(retnet.SPEC, layout=retnet.LAYOUT, backend="cuda", dtype="float64")(**inputs)
    assert _relative(got, ref) < 1e-10
    with pytest.raises(ValueError, match="gamma"):
        ssmc.grad(retnet.SPEC, backend="cuda", layout=retnet.LAYOUT, dtype="float64")(
            **inputs, grad_outputs={"y": np.ones_like(ref)})


def test_a_decay_is_checked_once_per_array_and_again_after_a_write(emulated_cuda, monkeypatch):
    """The positivity check of a decay given as is syncs the host: a param's is made at its first call only,
    though binding hands the core a new tensor object every call; an in-place write (a new version) or
    another array is checked again, so a decay made non-positive still runs the scan, not log(<= 0)."""
    import torch

    from ssmc.backends.cuda.kernels import chunk

    checks = []
    found = chunk._found_positive
    monkeypatch.setattr(chunk, "_found_positive", lambda x: (checks.append(x.data_ptr()), found(x)))
    monkeypatch.setattr(chunk, "_POSITIVE", {})
    inputs = {k: torch.as_tensor(v) for k, v in retnet.make_inputs(np.random.default_rng(4), 9).items()}
    fn = ssmc.compile(retnet.SPEC, layout=retnet.LAYOUT, backend="cuda", dtype="float64")
    ref = ssmc.compile(retnet.SPEC, layout=retnet.LAYOUT, backend="interpreter")
    for _ in range(3):
        fn(**inputs)
    assert len(checks) == 1   # a cache hit after the first call (an id-keyed cache missed every call)
    inputs["gamma"].mul_(-1.0)   # in place: the same memory, a new version
    got = fn(**inputs)
    assert len(checks) == 1 and torch.isfinite(torch.as_tensor(got)).all()
    assert _relative(got, ref(**{k: v.numpy() for k, v in inputs.items()})) < 1e-10
    inputs["gamma"] = inputs["gamma"].abs()   # another array
    fn(**inputs)
    assert len(checks) == 2
    x = torch.ones(3, dtype=torch.float64)
    chunk._found_positive(x)
    entry = chunk._POSITIVE[chunk._positive_key(x)]
    assert chunk._positive_before(x.detach()) and not entry[0].expired()
    del x
    assert entry[0].expired()   # freed memory that another array may take: no hit for it


def test_chunked_off_runs_the_element_wise_scan(emulated_cuda, counted):
    emulated_cuda.setenv("SSMC_CUDA_CHUNKED", "0")
    _check("mamba2", 20, "float64", 1e-10)
    assert counted == {"forward": 0, "backward": 0}


def test_malformed_chunk_option(emulated_cuda):
    emulated_cuda.setenv("SSMC_CUDA_CHUNK", "big")
    with pytest.raises(ValueError, match="SSMC_CUDA_CHUNK"):
        _check("retnet", 5, "float64", 1e-10)


# -- on a GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mamba2", "retnet", "gated", "gla"])
@pytest.mark.parametrize("length", [1, 7, 180, 1000, 4097])
def test_gpu_float32_and_bfloat16(name, length):
    """fp32 through the ops as written (products in fp32), bf16 inputs (products on tensor cores):
    relative RMS error against float64."""
    _check(name, length, "float32", 1e-4)
    spec, layout, make = CASES[name]
    rng = np.random.default_rng(7)
    inputs = make(rng, length)
    ref = ssmc.compile(spec, layout=layout, backend="cuda", dtype="float64")(**inputs)
    bf = {k: torch.as_tensor(v, device="cuda").to(torch.bfloat16 if np.ndim(v) > 1 else torch.float32)
          for k, v in inputs.items()}
    got = ssmc.compile(spec, layout=layout, backend="cuda")(**bf)
    ref = torch.as_tensor(ref, device="cuda")
    err = float((got.double() - ref).norm() / ref.norm())
    assert err < 2e-2, err
