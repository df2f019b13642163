"""``cu_seqlens=`` for `ssmc.attention` (#43 item 5, ssmc/packed.py): q, k, v packed along time in a batch of
1, each query attending to the keys of its own sequence, positions counted from the sequence's start.

A packed call equals each sequence's call alone, stacked along time (and differs from the unpacked call of
the whole: the boundaries matter), on the interpreter and the tiled torch path, through `ssmc.compile`,
`ssmc.grad` and `ssmc.torch.function`'s autograd: q's, k's and v's gradients the sequences' packed, the
ALiBi slope's their sum. Malformed offsets are a ValueError naming them, raised before any compute. On the
CUDA emulator the flash forward runs every sequence of a packed bf16 call from one compiled kernel; on a GPU
(``-m gpu``) bf16 packed calls match torch's SDPA per sequence, forward and gradients.
"""

from __future__ import annotations

import numpy as np
import pytest

import ssmc
from ssmc.examples import alibi_attention

torch = pytest.importorskip("torch")

from profiles import nightly_case  # noqa: E402

import ssmc.torch  # noqa: E402

ALIBI = alibi_attention.SPEC  # causal + ALiBi, a slope per head
WINDOW = ssmc.attention(mask_mod=ssmc.sliding_window(5), batch="b h", head_dim="d")
SPECS = {"alibi": ALIBI, "window": WINDOW}
LAYOUTS = {"b h t ...": 2, "b t h ...": 1}  # layout -> the time position of q, k, v, out
LENGTHS = [1, 7, 65]
F64_TOL = 1e-10  # float64 both ways: rounding only
# backend -> what it runs: the interpreter, and "numba" the tiled torch path (float64 on the CPU)
BACKENDS = ["interpreter", "numba"]


def _cu(lengths) -> np.ndarray:
    return np.cumsum([0, *lengths])


def _inputs(spec, layout, lengths, seed=0, heads=2, d=8):
    """Packed float64 q, k, v [1, ...] in `layout` (time = sum of lengths), and the spec's params."""
    rng = np.random.default_rng(seed)
    shape = [1, heads, sum(lengths), d] if LAYOUTS[layout] == 2 else [1, sum(lengths), heads, d]
    x = {n: rng.standard_normal(shape) for n in "qkv"}
    if spec is ALIBI:
        x["slope"] = rng.uniform(0.1, 1.0, heads)
    return x


def _pieces(x, layout, lengths):
    """Each sequence's slices of q, k, v (copies), with the params as they are."""
    cu, t = _cu(lengths), LAYOUTS[layout]
    return [{n: np.take(a, range(cu[i], cu[i + 1]), axis=t) if n in "qkv" else a for n, a in x.items()}
            for i in range(len(lengths))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", SPECS)
def test_packed_forward_equals_the_sequences_alone(name, layout, backend):
    spec, t = SPECS[name], LAYOUTS[layout]
    x = _inputs(spec, layout, LENGTHS, seed=len(name) + t)
    f = ssmc.compile(spec, backend, layout=layout)
    out, lse = f(**x, cu_seqlens=_cu(LENGTHS), return_lse=True)
    alone = [f(**one, return_lse=True) for one in _pieces(x, layout, LENGTHS)]
    np.testing.assert_allclose(out, np.concatenate([o for o, _ in alone], axis=t), rtol=0, atol=F64_TOL)
    lse_t = 2 if t == 2 else 1  # lse: the batch axes and time, in the layout's order
    np.testing.assert_allclose(lse, np.concatenate([s for _, s in alone], axis=lse_t), rtol=0, atol=F64_TOL)
    assert out.shape == x["q"].shape
    # the sequences' boundaries change the result (this test can tell a packed call from a plain one)
    assert np.abs(out - f(**x)).max() > 1e-2
    if name == "alibi" and t == 2:  # and against the NumPy reference written without ssmc
        want = [alibi_attention.reference(**one) for one in _pieces(x, layout, LENGTHS)]
        np.testing.assert_allclose(out, np.concatenate(want, axis=2), rtol=0, atol=F64_TOL)


def test_the_spec_itself_and_a_torch_tensor_of_offsets():
    """`ALIBI(...)` (the default backend) and offsets as an int32 torch tensor, as fla and flash-attn take them."""
    x = _inputs(ALIBI, "b h t ...", [3, 4])
    out = ALIBI(**x, layout="b h t ...", cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int32))
    want = [ALIBI(**one, layout="b h t ...") for one in _pieces(x, "b h t ...", [3, 4])]
    np.testing.assert_allclose(out, np.concatenate(want, axis=2), rtol=0, atol=F64_TOL)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", SPECS)
def test_torch_function_gradients_equal_the_sequences_alone(name, layout):
    """Autograd through the packed call: q's, k's and v's gradients those of each sequence alone, packed;
    the slope's their sum over the sequences."""
    spec, t = SPECS[name], LAYOUTS[layout]
    x = _inputs(spec, layout, LENGTHS, seed=3 + t)
    f = ssmc.torch.function(spec, layout=layout)
    weights = torch.from_numpy(np.random.default_rng(7).standard_normal(x["q"].shape))
    leaves = {n: torch.tensor(a, requires_grad=True) for n, a in x.items()}
    out = f(**leaves, cu_seqlens=torch.tensor(_cu(LENGTHS)))
    (out * weights).sum().backward()

    cu = _cu(LENGTHS)
    outs, grads = [], {n: [] for n in x}
    for i, one in enumerate(_pieces(x, layout, LENGTHS)):
        mine = {n: torch.tensor(a, requires_grad=True) for n, a in one.items()}
        y = f(**mine)
        (y * weights.narrow(t, int(cu[i]), int(cu[i + 1] - cu[i]))).sum().backward()
        outs.append(y.detach())
        for n, leaf in mine.items():
            grads[n].append(leaf.grad)
    torch.testing.assert_close(out.detach(), torch.cat(outs, dim=t), rtol=0, atol=F64_TOL)
    for n in "qkv":
        torch.testing.assert_close(leaves[n].grad, torch.cat(grads[n], dim=t), rtol=0, atol=F64_TOL)
    if spec is ALIBI:
        torch.testing.assert_close(leaves["slope"].grad, sum(grads["slope"]), rtol=0, atol=F64_TOL)
        assert leaves["slope"].grad.abs().min() > 1e-3  # a gradient that tells


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_grad_of_a_packed_call_equals_the_sequences_alone(layout, backend):
    """`ssmc.grad` with `cu_seqlens`: each sequence's gradients, q, k, v packed, the slope summed; and the
    same as the torch function's autograd (the tiled path) on the same call."""
    t = LAYOUTS[layout]
    x = _inputs(ALIBI, layout, LENGTHS, seed=11 + t)
    cot = np.random.default_rng(5).standard_normal(x["q"].shape)
    g = ssmc.grad(ALIBI, backend, layout=layout)
    got = g(**x, grad_outputs=cot, cu_seqlens=_cu(LENGTHS))
    cu = _cu(LENGTHS)
    alone = [g(**one, grad_outputs=np.take(cot, range(cu[i], cu[i + 1]), axis=t))
             for i, one in enumerate(_pieces(x, layout, LENGTHS))]
    for n in "qkv":
        np.testing.assert_allclose(got[n], np.concatenate([a[n] for a in alone], axis=t), rtol=0, atol=F64_TOL)
    np.testing.assert_allclose(got["slope"], sum(a["slope"] for a in alone), rtol=0, atol=F64_TOL)
    zero = g(**x, cu_seqlens=_cu(LENGTHS))  # no cotangent: zeros
    assert all(np.abs(zero[n]).max() == 0 for n in (*"qkv", "slope"))
    leaves = {n: torch.tensor(a, requires_grad=True) for n, a in x.items()}
    (ssmc.torch.function(ALIBI, layout=layout)(**leaves, cu_seqlens=cu) * torch.from_numpy(cot)).sum().backward()
    for n, leaf in leaves.items():
        np.testing.assert_allclose(leaf.grad.numpy(), got[n], rtol=1e-9, atol=F64_TOL)


def test_keys_packed_apart_with_cu_seqlens_k():
    """`cu_seqlens_k`: sequence i's queries [cu[i], cu[i+1]) attend to its keys [cu_k[i], cu_k[i+1])."""
    rng = np.random.default_rng(2)
    lq, lk = [2, 9, 4], [5, 3, 12]
    x = {"q": rng.standard_normal((1, 2, sum(lq), 8)), "k": rng.standard_normal((1, 2, sum(lk), 8)),
         "v": rng.standard_normal((1, 2, sum(lk), 8)), "slope": rng.uniform(0.1, 1.0, 2)}
    f = ssmc.compile(ALIBI, "numba", layout="b h t ...")
    got = f(**x, cu_seqlens=_cu(lq), cu_seqlens_k=_cu(lk))
    cq, ck = _cu(lq), _cu(lk)
    want = [f(x["q"][:, :, cq[i]:cq[i + 1]], x["k"][:, :, ck[i]:ck[i + 1]], x["v"][:, :, ck[i]:ck[i + 1]],
              slope=x["slope"]) for i in range(3)]
    np.testing.assert_allclose(got, np.concatenate(want, axis=2), rtol=0, atol=F64_TOL)
    # positions count from 0 on both sides (the causal mask lines a sequence's queries up with its first keys, not
    # its last as flash-attn's causal varlen does where the lengths differ): query 0 of sequence 0 sees key 0 alone
    lone = f(x["q"][:, :, :1], x["k"][:, :, :1], x["v"][:, :, :1], slope=x["slope"])
    np.testing.assert_allclose(got[:, :, :1], lone, rtol=0, atol=F64_TOL)
    g = ssmc.grad(ALIBI, "interpreter", layout="b h t ...")
    dy = rng.standard_normal(got.shape)
    grads = g(**x, grad_outputs=dy, cu_seqlens=cq, cu_seqlens_k=ck)
    alone = [g(x["q"][:, :, cq[i]:cq[i + 1]], x["k"][:, :, ck[i]:ck[i + 1]], x["v"][:, :, ck[i]:ck[i + 1]],
               slope=x["slope"], grad_outputs=dy[:, :, cq[i]:cq[i + 1]]) for i in range(3)]
    for n in "qkv":
        assert grads[n].shape == x[n].shape
        np.testing.assert_allclose(grads[n], np.concatenate([a[n] for a in alone], axis=2), rtol=0, atol=F64_TOL)
    np.testing.assert_allclose(grads["slope"], sum(a["slope"] for a in alone), rtol=0, atol=F64_TOL)


def test_heads_alone_as_the_batch_in_flash_attns_varlen_layout():
    """`batch="h"` (no batch axis but the heads) in layout "t h ...", flash-attn's varlen [T, H, d]: no size of 1
    asked of the heads; the packed call equals the sequences alone."""
    spec = ssmc.attention(mask_mod=ssmc.causal, batch="h", head_dim="d")
    rng = np.random.default_rng(3)
    x = {n: rng.standard_normal((12, 2, 8)) for n in "qkv"}
    f = ssmc.compile(spec, "numba", layout="t h ...")
    got = f(**x, cu_seqlens=[0, 5, 12])
    want = [f(**{n: a[lo:hi] for n, a in x.items()}) for lo, hi in ((0, 5), (5, 12))]
    np.testing.assert_allclose(got, np.concatenate(want, axis=0), rtol=0, atol=F64_TOL)


def test_grouped_query_attention_packs_too():
    """k and v with fewer heads (`kv_heads="h"`): the batch axis is still b, the sequences cut along time."""
    gqa = ssmc.attention(score_mod=alibi_attention.alibi, mask_mod=ssmc.causal, batch="b h", head_dim="d",
                         kv_heads="h")
    rng = np.random.default_rng(9)
    x = {"q": rng.standard_normal((1, 4, 12, 8)), "k": rng.standard_normal((1, 2, 12, 8)),
         "v": rng.standard_normal((1, 2, 12, 8)), "slope": rng.uniform(0.1, 1.0, 4)}
    f = ssmc.compile(gqa, "numba", layout="b h t ...")
    got = f(**x, cu_seqlens=[0, 5, 12])
    want = [f(**one) for one in _pieces(x, "b h t ...", [5, 7])]
    np.testing.assert_allclose(got, np.concatenate(want, axis=2), rtol=0, atol=F64_TOL)


BAD = [
    ([0, 7, 7, 73], "strictly increasing"),
    ([0, 9, 4, 73], "strictly increasing"),
    ([1, 8, 73], "first offset is 0"),
    ([0, 8, 72], "last offset is the packed length 73"),
    ([0.0, 8.0, 73.0], "integer offsets"),
    ([[0, 73]], "1-D array"),
    ([0], "1-D array"),
]


def _no_compute(monkeypatch):
    """Any attention compute fails the test: the checks come first."""
    from ssmc.backends import interpreter, tiled_attention

    def refuse(*args, **kwargs):
        raise AssertionError("computed before checking cu_seqlens")
    monkeypatch.setattr(tiled_attention.TiledAttention, "forward", refuse)
    monkeypatch.setattr(interpreter, "run_attention", refuse)
    monkeypatch.setattr(interpreter, "run_attention_backward", refuse)


@pytest.mark.parametrize("cu, message", BAD)
def test_malformed_offsets_are_a_value_error_naming_them(cu, message, monkeypatch):
    x = _inputs(ALIBI, "b h t ...", [8, 65])
    _no_compute(monkeypatch)
    calls = [lambda **kw: ssmc.compile(ALIBI, "numba", layout="b h t ...")(**x, **kw),
             lambda **kw: ssmc.compile(ALIBI, "interpreter", layout="b h t ...")(**x, **kw),
             lambda **kw: ssmc.grad(ALIBI, "numba", layout="b h t ...")(**x, **kw),
             lambda **kw: ssmc.torch.function(ALIBI, layout="b h t ...")(
                 **{n: torch.tensor(a, requires_grad=True) for n, a in x.items()}, **kw)]
    for call in calls:
        with pytest.raises(ValueError, match=f"cu_seqlens: .*{message}"):
            call(cu_seqlens=np.asarray(cu))


def test_calls_that_do_not_pack_are_a_value_error(monkeypatch):
    """A batch of more than 1, keys of another length without `cu_seqlens_k`, offsets that do not fit them,
    `cu_seqlens_k` alone, a wrong rank: each a ValueError naming the argument, before compute."""
    _no_compute(monkeypatch)
    f = ssmc.compile(ALIBI, "numba", layout="b h t ...")
    g = ssmc.grad(ALIBI, "interpreter", layout="b h t ...")
    x = _inputs(ALIBI, "b h t ...", [3, 4])
    two = {n: np.concatenate([a, a]) if n in "qkv" else a for n, a in x.items()}
    with pytest.raises(ValueError, match="cu_seqlens: sequences are packed along time in a batch of 1; 'q' has 2"):
        f(**two, cu_seqlens=[0, 3, 7])
    longer = {**x, "k": np.concatenate([x["k"]] * 2, axis=2), "v": np.concatenate([x["v"]] * 2, axis=2)}
    with pytest.raises(ValueError, match="cu_seqlens: q has 7 steps but 'k' 14; give cu_seqlens_k"):
        f(**longer, cu_seqlens=[0, 3, 7])
    with pytest.raises(ValueError, match="cu_seqlens_k: the last offset is the packed length 14, not 7"):
        f(**longer, cu_seqlens=[0, 3, 7], cu_seqlens_k=[0, 3, 7])
    with pytest.raises(ValueError, match=r"cu_seqlens_k: 2 query sequences .* but 1 key sequences"):
        f(**longer, cu_seqlens=[0, 3, 7], cu_seqlens_k=[0, 14])
    with pytest.raises(ValueError, match="cu_seqlens_k is given without cu_seqlens"):
        f(**x, cu_seqlens_k=[0, 3, 7])
    with pytest.raises(ValueError, match="argument 'q' has shape \\(2, 7, 8\\), expected 4 axes"):
        f(x["q"][0], x["k"], x["v"], x["slope"], cu_seqlens=[0, 3, 7])
    with pytest.raises(ValueError, match="grad_outputs has shape"):
        g(**x, grad_outputs=np.ones((1, 2, 6, 8)), cu_seqlens=[0, 3, 7])


# -- the flash kernel: emulated, and on a GPU ---------------------------------------------------------------

def _needs_emulator():
    from ssmc.backends.cuda import emulator

    if not emulator.available():
        pytest.skip("no C++ compiler for the CUDA emulator")


@pytest.mark.parametrize("backward", [False, nightly_case(True, reason="the flash backward's emulator builds")])
def test_emulated_flash_kernels_run_every_sequence_from_one_compiled_kernel(backward, monkeypatch):
    """SSMC_CUDA_EMULATE=1, CPU bf16 tensors, `ssmc.torch.function`: the packed forward launches the flash
    forward once per sequence, every launch the same compiled function (the lengths are launch arguments,
    not compiled in); out (and with `backward` every gradient, the flash backward's) within bf16's tolerance
    of the float64 tiled path's packed call of the same rounded inputs and cotangent."""
    _needs_emulator()
    from ssmc.backends.cuda import launch

    lengths = [1, 7, 65]
    rng = np.random.default_rng(4)
    x = {n: torch.from_numpy(rng.standard_normal((1, 2, sum(lengths), 64))).to(torch.bfloat16) for n in "qkv"}
    x["slope"] = torch.tensor([0.25, 0.0625])
    cot = torch.from_numpy(rng.standard_normal(x["q"].shape)).to(torch.bfloat16)
    f = ssmc.torch.function(ALIBI, layout="b h t ...")
    launched = []
    real = launch.launch_kernel
    monkeypatch.setattr(launch, "launch_kernel", lambda fn, *rest, **kw: (launched.append(fn), real(fn, *rest, **kw)))
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    leaves = {n: t.clone().requires_grad_(backward) for n, t in x.items()}
    got = f(**leaves, cu_seqlens=_cu(lengths))
    assert f.tiled.flash_reason is None, f.tiled.flash_reason
    assert len(launched) == len(lengths) and all(fn is launched[0] for fn in launched)
    if not backward:
        monkeypatch.setenv("SSMC_CUDA_EMULATE", "0")
        want = f(*(x[n].double() for n in "qkv"), x["slope"].double(), cu_seqlens=_cu(lengths))
        torch.testing.assert_close(got.double(), want, atol=1.5e-2, rtol=0)
        return
    got.backward(cot)
    assert f.tiled.flash_backward_reason is None, f.tiled.flash_backward_reason
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "0")
    wide = {n: t.double().requires_grad_(True) for n, t in x.items()}
    want = f(**wide, cu_seqlens=_cu(lengths))
    want.backward(cot.double())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want.detach(), atol=1.5e-2, rtol=0)
    for n, w in wide.items():
        g, w = leaves[n].grad.double(), w.grad
        assert g.shape == w.shape
        assert (g - w).abs().max().item() <= (2e-2 if n in "qkv" else 1e-2) * w.abs().max().item(), n


GPU_LENGTHS = [1, 100, 1000, 33]


def _sdpa_math():
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:  # an older torch: its default choice
        import contextlib

        return contextlib.nullcontext()
    return sdpa_kernel(SDPBackend.MATH)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", ["causal", "alibi"])
def test_gpu_packed_bf16_matches_sdpa_per_sequence(name, d):
    """bf16 packed attention on the GPU (the flash kernels) against SDPA per sequence in fp32 from the same
    bf16 inputs (ALiBi as an additive bias with the causal mask's -inf), forward and gradients of q, k, v
    (and the slope: SDPA's gradient of the bias, summed over the sequences)."""
    from ssmc.backends.cuda.kernels import loaded

    heads, dev = 4, "cuda"
    spec = ALIBI if name == "alibi" else ssmc.attention(mask_mod=ssmc.causal, batch="b h", head_dim="d")
    gen = torch.Generator(device="cpu").manual_seed(d)
    total = sum(GPU_LENGTHS)
    x = {n: torch.randn((1, heads, total, d), generator=gen).to(dev, torch.bfloat16) for n in "qkv"}
    slope = (2.0 ** (-8.0 * torch.arange(1, heads + 1) / heads)).to(dev)
    cot = torch.randn((1, heads, total, d), generator=gen).to(dev, torch.bfloat16)
    cu = torch.tensor(_cu(GPU_LENGTHS), dtype=torch.int32, device=dev)

    f = ssmc.torch.function(spec, layout="b h t ...")
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    params = {"slope": slope.clone().requires_grad_(True)} if name == "alibi" else {}
    out = f(**leaves, **params, cu_seqlens=cu)
    out.backward(cot)
    assert f.tiled.flash_reason is None and f.tiled.flash_backward_reason is None
    # other lengths of the same sizes load no new kernel: the lengths are launch arguments (the slope's gradient
    # asked again: a fixed slope is a backward build of its own)
    before = len(loaded._functions)
    other = _cu([2, 99, 1001, 32])
    again = {n: t.detach().clone().requires_grad_(True) for n, t in (*x.items(), *params.items())}
    f(**again, cu_seqlens=other).backward(cot)
    assert len(loaded._functions) == before

    outs, grads = [], {n: [] for n in (*"qkv", *params)}
    want_slope = torch.zeros_like(slope)
    for a, b in zip(_cu(GPU_LENGTHS)[:-1], _cu(GPU_LENGTHS)[1:]):
        mine = {n: t[:, :, a:b].float().clone().requires_grad_(True) for n, t in x.items()}
        s = slope.clone().requires_grad_(True)
        pos = torch.arange(b - a, device=dev, dtype=torch.float32)
        rel = pos[:, None] - pos[None, :]
        bias = torch.where(rel >= 0, 0.0, -torch.inf)
        if name == "alibi":
            bias = bias - s[:, None, None] * rel
        with _sdpa_math():  # the one SDPA backend that differentiates any float mask
            y = torch.nn.functional.scaled_dot_product_attention(mine["q"], mine["k"], mine["v"],
                                                                 attn_mask=bias.expand(1, heads, b - a, b - a))
        y.backward(cot[:, :, a:b].float())
        outs.append(y.detach())
        for n in "qkv":
            grads[n].append(mine[n].grad)
        if name == "alibi":
            want_slope += s.grad
    torch.testing.assert_close(out.float(), torch.cat(outs, dim=2), atol=1.6e-2, rtol=1.6e-2)
    for n in "qkv":
        want = torch.cat(grads[n], dim=2)
        err = (leaves[n].grad.float() - want).abs().max().item()
        assert err <= 2e-2 * want.abs().max().item(), (n, err)
    if name == "alibi":
        err = (params["slope"].grad.float() - want_slope).abs().max().item()
        assert err <= 2e-2 * want_slope.abs().max().item(), ("slope", err)
