"""A per-key decay's chunked forward and backward on tensor cores (GLA: backends/cuda/kernels/chunk/per_key.cu.j2,
launched by mma.forward_per_key, mma.backward_per_key).

- emulated on the CPU (SSMC_CUDA_EMULATE=1): the kernels' (output, entering states, final state) against
  algorithm.py's per-key forward in float64 on the same rounded inputs, and against that forward on the 16-bit
  operands themselves (the torch path they replace), at lengths that leave the last chunk partial (1, 7, 65, 180),
  every key / value size, bf16 and fp16, decays down to exp(−20) a step (no inf, no NaN), an initial state in;
- the backward's kernels (emulated) against algorithm.vjp in float64 and on the 16-bit operands: every cotangent
  (q, k, v, the per-key log decays, the initial state), the same lengths and strong decays;
- examples/gla.py through the CUDA backend (emulated, bf16 operands) against the interpreter, forward and a training
  step (ssmc.torch), the per-key kernels taking its core; SSMC_CUDA_CHUNK_PER_KEY=0 (and SSMC_CUDA_CHUNK_BACKWARD=0
  for the backward) running the torch path instead;
- which calls the per-key kernels take;
- on a GPU: the kernels against the torch per-key path in bf16 at L 1 .. 4097, forward and backward.
"""

from __future__ import annotations

import numpy as np
import pytest

import ssmc
from ssmc.backends.cuda import emulator
from ssmc.backends.cuda.kernels.chunk import algorithm, mma
from ssmc.examples import gla

torch = pytest.importorskip("torch")
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

needs_emulator = pytest.mark.skipif(not emulator.available(), reason="no C++ compiler for the CUDA emulator")
C = mma.PER_KEY_CHUNK
# relative RMS errors against float64 on the same rounded inputs: the kernels round q, k (scaled), S_p and the
# scores to 16 bits as the torch path does (measured on the emulator: ≤ 2.2e-3 for O, ≤ 1.6e-3 for the states)
OUT_TOL = 5e-3
STATE_TOL = 4e-3
# the backward's cotangents (dq, dk, dv, dell, ds0) against float64: the kernels round dO, the scaled q and k, the
# states and the scores and their cotangents to 16 bits where the torch path multiplies in fp32 (measured ≤ 2.3e-3)
GRAD_TOL = 6e-3
GRADS = ("dq", "dk", "dv", "dell", "ds0")


def _rel(x, ref) -> float:
    """Relative RMS error ‖x − ref‖ / ‖ref‖."""
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def per_key_chunks(length: int, key: int = 64, value: int = 64, decay: float = 1.0, seed: int = 0,
                   dtype=torch.bfloat16, heads=(1, 2), qk_heads=None, device="cpu") -> algorithm.Chunks:
    """Chunks of C steps of a per-key core as `ChunkedCore` arranges them ([*heads, NC, C, D], zero past
    `length`): q scaled by key ** -0.5, log decays uniform in [−decay, 0] per step and key, an initial state;
    `qk_heads`: q's and k's heads where they lack some (broadcast, as a grouped GLA's)."""
    rng = np.random.default_rng(seed)
    nc = -(-length // C)

    def operand(h, d, scale, dt):
        a = torch.zeros((*h, nc * C, d), dtype=dt)
        a[..., :length, :] = torch.from_numpy(rng.standard_normal((*h, length, d)) * scale).to(dt)
        return a.reshape(*h, nc, C, d).to(device)

    qk = heads if qk_heads is None else qk_heads
    q, k = operand(qk, key, key ** -0.5, dtype), operand(qk, key, 1.0, dtype)
    v = operand(heads, value, 1.0, dtype)
    ell = torch.zeros((*heads, nc * C, key))
    ell[..., :length, :] = -torch.from_numpy(rng.uniform(0.0, decay, (*heads, length, key))).float()
    s0 = torch.from_numpy(rng.standard_normal((*heads, key, value)) * 0.1).float()
    return algorithm.Chunks(q, k, v, ell.reshape(*heads, nc, C, key).to(device), s0.to(device))


def _wide(x: algorithm.Chunks) -> algorithm.Chunks:
    d = torch.float64
    return algorithm.Chunks(*(t.to(d) for t in (x.q, x.k, x.v, x.ell, x.s0)))


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    monkeypatch.delenv("SSMC_CUDA_CHUNK_KERNELS", raising=False)
    monkeypatch.delenv("SSMC_CUDA_CHUNK_PER_KEY", raising=False)


@needs_emulator
@pytest.mark.parametrize("length, key, value, decay, dtype, qk_heads", [
    (1, 64, 64, 1.0, torch.bfloat16, None),
    (7, 64, 128, 1.0, torch.float16, None),
    (65, 128, 64, 20.0, torch.bfloat16, (1, 1)),
    (180, 64, 64, 20.0, torch.bfloat16, None),
    (180, 128, 128, 0.05, torch.bfloat16, None),
    (100, 64, 64, 0.2, torch.float16, None),
])
def test_emulated_per_key_kernels_agree_with_the_torch_forward(emulate, length, key, value, decay, dtype, qk_heads):
    """O, the entering states and the final state within `OUT_TOL` / `STATE_TOL` of algorithm.forward in float64,
    and O within `OUT_TOL` of the torch path on the same 16-bit operands; all finite at decays down to exp(−20) a
    step (an exponent of a product of the chunk's decays that is not anchored would overflow); the initial state
    counts (slow decays: it still weighs at L 180)."""
    x = per_key_chunks(length, key, value, decay, seed=length + key, dtype=dtype, qk_heads=qk_heads)
    assert mma.per_key_applies(x)
    out, entering, final = mma.forward_per_key(x)
    want = algorithm.forward(_wide(x))
    for got in (out, entering, final):
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert _rel(out, want[0]) < OUT_TOL, _rel(out, want[0])
    if length > C:  # (the first chunk's entering state is s0 itself)
        assert _rel(entering, want[1]) < STATE_TOL, _rel(entering, want[1])
    assert torch.equal(entering[..., 0, :, :], x.s0.expand_as(entering[..., 0, :, :]))
    assert _rel(final, want[2]) < STATE_TOL, _rel(final, want[2])
    torch_out = algorithm.forward(x)[0]
    assert _rel(out, torch_out) < OUT_TOL, _rel(out, torch_out)


@needs_emulator
def test_emulated_per_key_kernels_take_the_initial_state(emulate):
    """The initial state's part alone (q, k, v of the steps zero but q): O = (q ⊙ exp(Λ)) s0 and the final state
    exp(Γ) ⊙ s0 row by row, so that a kernel dropping or misplacing s0 fails."""
    x = per_key_chunks(70, 64, 64, decay=0.05, seed=5)
    x = algorithm.Chunks(x.q, torch.zeros_like(x.k), x.v, x.ell, x.s0)
    out, _, final = mma.forward_per_key(x)
    want = algorithm.forward(_wide(x))
    assert float(want[0].norm()) > 1.0
    assert _rel(out, want[0]) < OUT_TOL and _rel(final, want[2]) < 1e-6


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values in a view whose rows start one element past a 16-byte boundary."""
    flat = torch.zeros(t.numel() + 1, dtype=t.dtype)
    flat[1:] = t.reshape(-1)
    return flat[1:].view(t.shape)


@needs_emulator
def test_emulated_per_key_kernels_take_misaligned_operands(emulate):
    """q, k, v and ell whose rows are not 16-byte aligned (the kernels' cp.async copies need them so: mma.py copies
    such operands): the same output and states bit for bit as from the aligned operands, forward and backward."""
    x = per_key_chunks(70, 64, 64, decay=1.0, seed=9)
    y = algorithm.Chunks(*(_misaligned(t) for t in (x.q, x.k, x.v, x.ell)), x.s0)
    assert y.q.data_ptr() % 16 != 0 and y.ell.data_ptr() % 16 != 0
    want, got = mma.forward_per_key(x), mma.forward_per_key(y)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    d_out, d_final = _cotangents(x, 70)
    grads = mma.backward_per_key(x, want[1], d_out, d_final)
    for a, b in zip(grads[:5], mma.backward_per_key(y, got[1], _misaligned(d_out), d_final)[:5]):
        assert torch.equal(a, b)


@needs_emulator
def test_per_key_forward_declines_blocks_past_the_shared_limit(emulate, monkeypatch):
    """A device whose blocks may not opt into per_key_output's shared memory runs the torch path (here a limit
    between K = V = 64's tiles and K = V = 128's); K = V = 128 fits the 99 KiB of sm_86 / sm_89."""
    assert mma.per_key_shared(64, 64) < 64 * 1024 < mma.per_key_shared(128, 128) <= 99 * 1024
    monkeypatch.setattr(mma, "_block_shared_limit", lambda: 64 * 1024)
    assert not mma.per_key_applies(per_key_chunks(7, 128, 128))
    assert mma.per_key_applies(per_key_chunks(7, 64, 64))


def _cotangents(x: algorithm.Chunks, length: int, seed: int = 1):
    """(d_out [*H, NC, C, V] in q's dtype, zero past `length` as ChunkedCore pads it; d_final [*H, K, V] fp32)."""
    g = torch.Generator().manual_seed(seed)
    d_out = torch.randn(*x.v.shape, generator=g)
    d_out.reshape(*x.v.shape[:-3], -1, x.v.shape[-1])[..., length:, :] = 0.0
    return d_out.to(x.q.dtype).to(x.q.device), torch.randn(*x.s0.shape, generator=g).to(x.s0.device)


@needs_emulator
@pytest.mark.parametrize("length, key, value, decay, dtype, qk_heads", [
    (7, 64, 64, 1.0, torch.bfloat16, None),
    (65, 128, 64, 20.0, torch.float16, None),
    (180, 64, 64, 20.0, torch.bfloat16, (1, 1)),
    (100, 128, 128, 0.05, torch.bfloat16, None),
    (70, 64, 128, 0.2, torch.float16, None),
])
def test_emulated_per_key_backward_agrees_with_the_torch_vjp(emulate, length, key, value, decay, dtype, qk_heads):
    """dq, dk, dv, the per-key log decays' cotangent and ds0 from the kernels (on the kernels' forward) within
    `GRAD_TOL` of algorithm.vjp in float64 on the same rounded values (heads of q and k broadcast: each head's
    gradient, as the kernels return them), and of algorithm.vjp on the same operands (the torch path); all finite at
    decays down to exp(−20) a step."""
    x = per_key_chunks(length, key, value, decay, seed=length + 7, dtype=dtype, qk_heads=qk_heads)
    d_out, d_final = _cotangents(x, length)
    assert mma.per_key_backward_applies(x, d_out)
    _, entering, final = mma.forward_per_key(x)
    got = mma.backward_per_key(x, entering, d_out, d_final)
    assert got[5] is None and got[6] is None
    w = _wide(x)
    _, w_entering, w_final = algorithm.forward(w)
    want = algorithm.vjp(w, w_entering, w_final, d_out.double(), d_final.double())
    torch_path = algorithm.vjp(x, entering, final, d_out.float(), d_final)
    for name, g, ref, t in zip(GRADS, got, want, torch_path):
        assert g.dtype == torch.float32 and g.shape == ref.shape and torch.isfinite(g).all(), name
        assert _rel(g, ref) < GRAD_TOL, (name, _rel(g, ref))
        assert _rel(g, t.double()) < GRAD_TOL, (name, _rel(g, t.double()))


# per_key_dell against algorithm.log_decay_grad in float64 on the same fp32 values (its sums are fp32: the reverse sum
# over 64 steps, the dot over V values; measured ≤ 2e-7)
DELL_TOL = 1e-5


@needs_emulator
@pytest.mark.parametrize("key, value, dtype, qk_heads", [
    (64, 64, torch.bfloat16, None),
    (64, 128, torch.float16, (1, 1)),
    (128, 64, torch.bfloat16, (1, 1)),
    (128, 128, torch.float16, None),
])
def test_emulated_per_key_dell_agrees_with_log_decay_grad(emulate, key, value, dtype, qk_heads):
    """per_key_dell (one launch: the per-key log decays' cotangent, per_key_dell.cu.j2) on arbitrary dq, dk, end dots,
    d_end and entering states, q, k broadcast over heads where `qk_heads`, ell a strided view (its step stride not
    its row's size, as the offset tables allow): within `DELL_TOL` of algorithm.log_decay_grad (per_key) in float64,
    the end term weighing as much as the steps' products (a kernel that drops it, or adds it at another step, fails)."""
    x = per_key_chunks(3 * C, key, value, decay=1.0, seed=key + value, dtype=dtype, qk_heads=qk_heads)
    heads, nc = x.v.shape[:-3], x.v.shape[-3]
    g = torch.Generator().manual_seed(key * value)
    dq, dk = (torch.randn(*heads, nc, C, key, generator=g) for _ in range(2))
    ends = torch.randn(*heads, nc, C // 16, key, generator=g) * 4.0
    d_end, entering = (torch.randn(*heads, nc, key, value, generator=g) / value ** 0.25 for _ in range(2))
    wide = torch.zeros(*x.ell.shape[:-1], 2 * key)
    wide[..., :key] = x.ell
    ell = wide[..., :key]  # steps 2K values apart (the offset tables' step stride, not the row's size)
    tables = mma._tables_for(mma._broadcast(x.q.shape[:-3], heads), (x.q, x.k, x.v, ell, dq, x.v), "cpu")[:2]
    got = mma.per_key_dell(x.q, x.k, ell, tables, dq, dk, ends, d_end, entering)
    d = torch.float64
    want = algorithm.log_decay_grad(x.q.to(d), x.k.to(d), dq.to(d), dk.to(d), ends.to(d).sum(-2),
                                    ell.to(d).sum(-2), d_end.to(d), entering.to(d), per_key=True)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert _rel(got, want) < DELL_TOL, _rel(got, want)
    # the end term alone (the products zero): every step of a chunk gets it, the same value
    zero = torch.zeros_like(dq)
    end_only = mma.per_key_dell(x.q, x.k, ell, tables, zero, zero, ends, d_end, entering)
    at_last = ends.to(d).sum(-2) + torch.exp(ell.to(d).sum(-2)) * (d_end.to(d) * entering.to(d)).sum(-1)
    assert _rel(end_only, at_last[..., None, :].expand_as(end_only)) < DELL_TOL
    assert float(at_last.norm()) > 0.5 * float((want - at_last[..., None, :]).norm()) / C ** 0.5


# what torch may dispatch in backward_per_key: allocations and views (no arithmetic, no copies)
_NO_COMPUTE = {"empty", "empty_like", "empty_strided", "expand", "view", "_unsafe_view", "as_strided", "alias",
               "detach", "select", "slice", "permute", "reshape", "unsqueeze", "squeeze", "t", "transpose"}


class _Ops(TorchDispatchMode):
    """A dispatch mode recording the name of every aten op torch runs inside it (`ops`)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@needs_emulator
def test_the_per_key_backward_runs_no_torch_arithmetic(emulate):
    """backward_per_key (a warm call: its offset tables made) dispatches no torch op but allocations and views: the
    log decays' cotangent is per_key_dell's, not torch's products, sums, flips and cumulative sum (which the glue
    before it ran). Checked to see a torch op: the
    recorder does see the glue's ops where algorithm.log_decay_grad runs under it."""
    x = per_key_chunks(70, 64, 64, decay=1.0, seed=2, qk_heads=(1, 1))
    d_out, d_final = _cotangents(x, 70)
    _, entering, _ = mma.forward_per_key(x)
    mma.backward_per_key(x, entering, d_out, d_final)
    with _Ops() as seen:
        grads = mma.backward_per_key(x, entering, d_out, d_final)
    assert "empty" in seen.ops and set(seen.ops) <= _NO_COMPUTE, seen.ops
    with _Ops() as glue:
        algorithm.log_decay_grad(x.q.float(), x.k.float(), grads[0], grads[1], grads[0][..., :4, :].sum(-2),
                                 x.ell.sum(-2), entering, entering, per_key=True)
    assert {"mul", "cumsum", "flip"} <= set(glue.ops), glue.ops


def _gla_inputs(length: int, key: int, value: int, seed: int, strength: float) -> dict:
    rng = np.random.default_rng(seed)
    inputs = gla.make_inputs(rng, length, batch=1, heads=2, dk=key, dv=value)
    inputs["q"] = inputs["q"] * key ** -0.5
    inputs["g"] = -rng.uniform(0.0, strength, inputs["g"].shape)
    return inputs


def _half(inputs: dict) -> dict:
    """q, k, v in bf16 (torch CPU tensors, the emulated backend's), g and the state fp32."""
    return {n: torch.as_tensor(a).to(torch.bfloat16 if n in "qkv" else torch.float32) for n, a in inputs.items()}


@needs_emulator
@pytest.mark.parametrize("length, strength", [(65, 20.0), (180, 0.1)])
def test_emulated_gla_spec_runs_the_per_key_kernels(emulate, monkeypatch, length, strength):
    """examples/gla.py compiled for the CUDA backend (emulated) with bf16 q, k, v at K = V = 64: its core on the
    per-key kernels (one forward_per_key call), output and final state within 1e-2 (relative RMS) of the
    interpreter's float64 on the unrounded inputs (the 16-bit rounding of q, k, v itself is ≈ 4e-3)."""
    calls = []
    launch = mma.forward_per_key
    monkeypatch.setattr(mma, "forward_per_key", lambda x, *a, **k: calls.append(x) or launch(x, *a, **k))
    inputs = _gla_inputs(length, 64, 64, length, strength)
    y_ref, s_ref = ssmc.compile(gla.SPEC, layout=gla.LAYOUT, backend="interpreter")(**inputs,
                                                                                   return_final_states=True)
    y, s = ssmc.compile(gla.SPEC, layout=gla.LAYOUT, backend="cuda")(**_half(inputs), return_final_states=True)
    assert len(calls) == 1 and calls[0].q.shape[-2] == C
    assert torch.isfinite(y.float()).all() and torch.isfinite(s).all()
    assert _rel(y.float(), torch.as_tensor(np.array(y_ref))) < 1e-2
    assert _rel(s, torch.as_tensor(np.array(s_ref))) < 1e-2


@needs_emulator
@pytest.mark.parametrize("backward", [True, False])
def test_emulated_gla_training_step_runs_the_per_key_kernels(emulate, monkeypatch, backward):
    """A training step through ssmc.torch.function on bf16 q, k, v (examples/gla.py, K = V = 64, L 70, decays down to
    exp(−5) a step): one forward_per_key and one backward_per_key (SSMC_CUDA_CHUNK_BACKWARD=0: none, the torch VJP),
    every gradient within 1e-2 (relative RMS) of the interpreter's float64 on the same rounded inputs."""
    import ssmc.torch

    if not backward:
        monkeypatch.setenv("SSMC_CUDA_CHUNK_BACKWARD", "0")
    calls = {"forward": 0, "backward": 0}
    launches = mma.forward_per_key, mma.backward_per_key

    def counted(name, fn):
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or fn(*a, **k)

    monkeypatch.setattr(mma, "forward_per_key", counted("forward", launches[0]))
    monkeypatch.setattr(mma, "backward_per_key", counted("backward", launches[1]))
    inputs = _gla_inputs(70, 64, 64, 3, 5.0)
    bf = _half(inputs)
    leaves = {n: a.clone().requires_grad_(True) for n, a in bf.items()}
    y = ssmc.torch.function(gla.SPEC, "cuda", layout=gla.LAYOUT)(**leaves)
    dy = torch.from_numpy(np.random.default_rng(4).standard_normal(tuple(y.shape))).to(y.dtype)
    y.backward(dy)
    assert calls == {"forward": 1, "backward": int(backward)}
    rounded = {n: a.double().numpy() for n, a in bf.items()}
    want = ssmc.grad(gla.SPEC, backend="interpreter", layout=gla.LAYOUT)(**rounded,
                                                                         grad_outputs={"y": dy.double().numpy()})
    assert set(want) == set(leaves)
    for n, w in want.items():
        got = leaves[n].grad
        assert torch.isfinite(got).all(), n
        assert _rel(got, torch.as_tensor(np.array(w))) < 1e-2, (n, _rel(got, torch.as_tensor(np.array(w))))


# torch ops that compute (arithmetic, reductions, scans) rather than allocate, view or copy
_ARITHMETIC = {"mul", "sub", "add", "add_", "sum", "exp", "flip", "cumsum", "div", "neg"}
_COPIES = {"_to_copy", "copy_", "clone", "contiguous"}


@needs_emulator
def test_a_gla_training_step_runs_no_torch_glue(emulate):
    """A GLA training step through ssmc.torch.function (bf16 q, k, v, B 2: the time-first and the input layouts
    differ), warm (its prepared step): the forward copies its output once (cast to bf16 in the input's layout), the
    backward runs no torch arithmetic (the log decays' cotangent is per_key_dell's) and copies each of the four
    sequences' gradients once (the permute to the input's layout and the cast in one copy; no contiguous time-first
    copy before it); the gradients match an unrecorded step's."""
    import ssmc.torch

    rng = np.random.default_rng(6)
    inputs = gla.make_inputs(rng, 2 * C, batch=2, heads=2, dk=64, dv=64)  # (whole chunks: no padded copies)
    inputs["q"] = inputs["q"] * 64 ** -0.5
    bf = _half(inputs)
    fn = ssmc.torch.function(gla.SPEC, "cuda", layout=gla.LAYOUT)
    dy = torch.from_numpy(rng.standard_normal((2, 2 * C, 2, 64))).to(torch.bfloat16)

    def step(record: bool):
        leaves = {n: a.clone().requires_grad_(True) for n, a in bf.items()}
        forward, backward = _Ops(), _Ops()
        if record:
            with forward:
                y = fn(**leaves)
            with backward:
                y.backward(dy)
        else:
            fn(**leaves).backward(dy)
        return {n: a.grad for n, a in leaves.items()}, forward.ops, backward.ops

    want = step(False)[0]
    step(False)
    got, forward, backward = step(True)
    assert not _ARITHMETIC & set(forward) and sum(op in _COPIES for op in forward) == 1, forward
    assert not _ARITHMETIC & set(backward), backward
    assert sum(op in _COPIES for op in backward) == 4, backward
    for n in want:
        assert torch.equal(got[n], want[n]), n


@needs_emulator
def test_the_per_key_switch_runs_the_torch_path(emulate, monkeypatch):
    """SSMC_CUDA_CHUNK_PER_KEY=0: the same call on algorithm.py (no per-key launch), its result as close."""
    monkeypatch.setenv("SSMC_CUDA_CHUNK_PER_KEY", "0")
    monkeypatch.setattr(mma, "forward_per_key", lambda *a, **k: pytest.fail("the per-key kernels ran"))
    inputs = _gla_inputs(20, 64, 64, 1, 1.0)
    y_ref = ssmc.compile(gla.SPEC, layout=gla.LAYOUT, backend="interpreter")(**inputs)
    y = ssmc.compile(gla.SPEC, layout=gla.LAYOUT, backend="cuda")(**_half(inputs))
    assert _rel(y.float(), torch.as_tensor(np.array(y_ref))) < 1e-2


def test_which_per_key_calls_take_the_kernels(emulate, monkeypatch):
    """16-bit q, k, v of one format, key and value sizes in `mma.SIZES`, chunks of 64, fp32 decays; no β, no skip;
    not a scalar decay; not where SSMC_CUDA_CHUNK_PER_KEY=0 or SSMC_CUDA_CHUNK_KERNELS=0."""
    x = per_key_chunks(64)
    assert mma.per_key_applies(x)
    assert not mma.per_key_applies(algorithm.Chunks(x.q.float(), x.k.float(), x.v.float(), x.ell, x.s0))
    assert not mma.per_key_applies(algorithm.Chunks(x.q, x.k, x.v.half(), x.ell, x.s0))
    assert not mma.per_key_applies(algorithm.Chunks(x.q, x.k, x.v, x.ell[..., 0], x.s0))  # a scalar decay
    assert not mma.per_key_applies(algorithm.Chunks(x.q, x.k, x.v, x.ell, x.s0, beta=x.ell[..., 0]))
    y = per_key_chunks(64, key=32, value=64)
    assert not mma.per_key_applies(y)
    half = algorithm.Chunks(x.q[..., :32, :], x.k[..., :32, :], x.v[..., :32, :], x.ell[..., :32, :], x.s0)
    assert not mma.per_key_applies(half)  # chunks of 32
    for switch in ("SSMC_CUDA_CHUNK_PER_KEY", "SSMC_CUDA_CHUNK_KERNELS"):
        monkeypatch.setenv(switch, "0")
        assert not mma.per_key_applies(x)
        monkeypatch.delenv(switch)
    assert mma.per_key_applies(x)
    # the backward's blocks take more than 99 KiB at K 128: such GPUs (sm_86, sm_89) run the torch VJP
    d_out = torch.zeros(x.v.shape, dtype=x.q.dtype)
    big = per_key_chunks(64, key=128, value=128)
    d_big = torch.zeros(big.v.shape, dtype=big.q.dtype)
    assert mma.per_key_backward_applies(x, d_out) and mma.per_key_backward_applies(big, d_big)
    monkeypatch.setattr(mma, "_block_shared_limit", lambda: 99 * 1024)
    assert mma.per_key_backward_applies(x, d_out) and not mma.per_key_backward_applies(big, d_big)


@pytest.mark.gpu
@pytest.mark.parametrize("length", [1, 7, 180, 1000, 4097])
def test_gpu_per_key_kernels_agree_with_the_torch_path(length, monkeypatch):
    """On a GPU, bf16, K = V = 128, B·H = 8 heads: the kernels' O, entering and final states against the torch
    per-key path (algorithm.forward) in float64 on the same rounded values, and against it on the bf16 operands;
    the backward's cotangents against algorithm.vjp in float64; decays down to exp(−20) a step on some keys, slow on
    the others (the state carried across chunks)."""
    monkeypatch.delenv("SSMC_CUDA_EMULATE", raising=False)
    monkeypatch.delenv("SSMC_CUDA_CHUNK_KERNELS", raising=False)
    monkeypatch.delenv("SSMC_CUDA_CHUNK_PER_KEY", raising=False)
    x = per_key_chunks(length, 128, 128, decay=1.0, seed=length, heads=(2, 4), device="cuda")
    strong = torch.zeros(128, device="cuda")
    strong[::4] = 19.0  # every fourth key down to exp(−20) a step
    ell = x.ell * (1.0 + strong) * 0.05 ** (strong == 0).float()
    x = algorithm.Chunks(x.q, x.k, x.v, ell, x.s0)
    assert mma.per_key_applies(x)
    out, entering, final = mma.forward_per_key(x)
    torch.cuda.synchronize()
    want = algorithm.forward(_wide(x))
    for got in (out, entering, final):
        assert torch.isfinite(got).all()
    assert _rel(out, want[0]) < OUT_TOL, _rel(out, want[0])
    assert _rel(final, want[2]) < STATE_TOL, _rel(final, want[2])
    if length > C:
        assert _rel(entering, want[1]) < STATE_TOL, _rel(entering, want[1])
    assert _rel(out, algorithm.forward(x)[0]) < OUT_TOL
    d_out, d_final = _cotangents(x, length)
    assert mma.per_key_backward_applies(x, d_out)
    got = mma.backward_per_key(x, entering, d_out, d_final)
    torch.cuda.synchronize()
    grads = algorithm.vjp(_wide(x), want[1], want[2], d_out.double(), d_final.double())
    for name, g, ref in zip(GRADS, got, grads):
        assert torch.isfinite(g).all(), name
        assert _rel(g, ref) < GRAD_TOL, (name, _rel(g, ref))


@needs_emulator
def test_a_per_key_backward_the_kernels_decline_runs_the_torch_vjp(emulate, monkeypatch):
    """Where the per-key forward ran on its kernels but `per_key_backward_applies` declines the backward, the VJP
    runs as torch (algorithm.vjp), never on the scalar-decay kernels (`mma.backward`, whose `backward_applies`
    does not look at per_key: it would take the per-key log decays as one per step); the gradients within 1e-2 of
    the interpreter's float64 on the same rounded inputs."""
    import ssmc.torch

    monkeypatch.setattr(mma, "per_key_backward_applies", lambda *a, **k: False)
    monkeypatch.setattr(mma, "backward", lambda *a, **k: pytest.fail("the scalar-decay kernels took a per-key VJP"))
    bf = _half(_gla_inputs(70, 64, 64, 3, 5.0))
    leaves = {n: a.clone().requires_grad_(True) for n, a in bf.items()}
    y = ssmc.torch.function(gla.SPEC, "cuda", layout=gla.LAYOUT)(**leaves)
    dy = torch.from_numpy(np.random.default_rng(4).standard_normal(tuple(y.shape))).to(y.dtype)
    y.backward(dy)
    rounded = {n: a.double().numpy() for n, a in bf.items()}
    want = ssmc.grad(gla.SPEC, backend="interpreter", layout=gla.LAYOUT)(**rounded,
                                                                         grad_outputs={"y": dy.double().numpy()})
    for n, w in want.items():
        assert _rel(leaves[n].grad, torch.as_tensor(np.array(w))) < 1e-2, n
