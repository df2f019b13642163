"""The tiled torch path of `ssmc.attention` (backends/tiled_attention.py) against the interpreter.

Forward and every gradient (q, k, v, the score modifier's params) at awkward sizes (Lq, Lk in 1, 7,
180, 1000, blocks of 7 and 64 rows and the default), both layouts, masks that leave rows without a
key; gradients against torch autograd of a dense float64 reference and against finite differences
(gradcheck); bf16 inputs on the CPU; the key spans the mask analysis proves; errors before compute.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples

import ssmc
from ssmc.backends import interpreter
from ssmc.passes.attention_grad import derive_attention_backward
from ssmc.passes.mask_blocks import key_spans

torch = pytest.importorskip("torch")

import ssmc.torch  # noqa: E402
from ssmc.backends import torch_eval  # noqa: E402
from ssmc.backends.tiled_attention import TiledAttention  # noqa: E402
from ssmc.ir.ops import ELEMENTWISE, Op  # noqa: E402

F64_TOL = 1e-9  # float64 against the interpreter: rounding only
# bf16 inputs on the CPU: scores and softmax in fp32 from the bf16 values, results rounded to bf16
# (8 bits of mantissa): ||got - want|| / ||want|| within this, want computed in float64 from the same
# bf16-rounded inputs and cotangent (autograd hands the backward a bf16 one: a param's gradient, a sum
# over every (query, key) pair in which each row's terms cancel, is sensitive to its rounding)
BF16_TOL = 1.5e-2


# -- modifiers: score_mods and mask_mods the properties draw from --------------------------------------

def alibi(score, q_idx, kv_idx, slope: ssmc.Param["h"]):
    return score - slope * (q_idx - kv_idx)


def softcap(score, q_idx, kv_idx, cap: ssmc.Param["h"]):
    return cap * ssmc.tanh(score / cap)


def head_bias(score, q_idx, kv_idx, bias: ssmc.Param["b h"], temp: ssmc.Param[""]):
    return score * temp + bias * ssmc.sigmoid(kv_idx - 0.5 * q_idx)


def plain(score, q_idx, kv_idx):
    return 2.0 * score


def prefix_lm(q_idx, kv_idx):
    return (kv_idx < 5) | (kv_idx <= q_idx)


def per_head_window(q_idx, kv_idx, width: ssmc.Param["h"]):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < width)


def never_late(q_idx, kv_idx):
    """Queries past 8 see no key: rows without a key."""
    return (kv_idx <= q_idx) & (q_idx < 8)


SCORE_MODS = [None, alibi, softcap, head_bias, plain]
MASK_MODS = [None, ssmc.causal, ssmc.sliding_window(3), ssmc.sliding_window(100), prefix_lm, per_head_window,
             never_late]
LAYOUTS = ["b h t ...", "b t h ..."]
LENGTHS = [1, 7, 180, 1000]


def _spec(score_mod, mask_mod):
    return ssmc.attention(score_mod=score_mod, mask_mod=mask_mod, batch="b h", head_dim="d", value_dim="e")


def _params(program, sizes, rng) -> dict:
    values = {}
    for d in program.params:
        shape = [sizes[a] for a in d.axes]
        if d.name == "cap":
            values[d.name] = 1.0 + rng.random(shape)
        elif d.name == "slope":  # ALiBi's: positive (a negative slope favours far keys, scores grow with
            # the distance, and float32's rounding of them dominates the slope's gradient at L = 1000)
            values[d.name] = 2.0 ** (-8.0 * rng.random(shape))
        elif d.name == "width":
            values[d.name] = rng.integers(1, 12, shape).astype(np.float64)
        else:
            values[d.name] = rng.standard_normal(shape)
    return values


def _inputs(program, lq, lk, sizes, layout, rng) -> dict:
    """q, k, v in `layout` (float64) and the params."""
    def arr(length, last):
        canonical = rng.standard_normal((sizes["b"], sizes["h"], length, sizes[last]))
        return canonical if layout == "b h t ..." else np.ascontiguousarray(canonical.transpose(0, 2, 1, 3))
    return {"q": arr(lq, "d"), "k": arr(lk, "d"), "v": arr(lk, "e"), **_params(program, sizes, rng)}


def _time_first(x, layout):
    return np.moveaxis(x, 2 if layout == "b h t ..." else 1, 0)


def _reference(program, x, layout, d_out):
    """The interpreter's out, lse and gradients, in `layout`."""
    q, k, v = (_time_first(x[n], layout) for n in "qkv")
    sizes = {"b": q.shape[1], "h": q.shape[2], "d": q.shape[3], "e": v.shape[3]}
    params = {d.name: x[d.name] for d in program.params}
    out, lse = interpreter.run_attention(program, q, k, v, params, sizes)
    grads = interpreter.run_attention_backward(derive_attention_backward(program), q, k, v, params, sizes,
                                               _time_first(d_out, layout))
    back = 2 if layout == "b h t ..." else 1
    for n in "qkv":
        grads[n] = np.moveaxis(grads[n], 0, back)
    return np.moveaxis(out, 0, back), np.moveaxis(lse, 0, 2), grads


def rel(got, want) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    return float(np.abs(got - want).max(initial=0.0) / max(np.abs(want).max(initial=0.0), 1.0))


def _check_tiled(spec, x, layout, block, d_out, tol=F64_TOL, device="cpu"):
    """The tiled path's out, lse and gradients (block rows `block`) against the interpreter's."""
    program = spec.program
    tiled = TiledAttention(program)
    as_t = {n: torch.from_numpy(np.require(a, requirements="C")).to(device) for n, a in x.items()}
    params = {d.name: as_t[d.name] for d in program.params}
    call = tiled.bind(as_t["q"], as_t["k"], as_t["v"], layout, params)
    out, lse = tiled.forward(call, block)
    d = tiled.from_layout(call, torch.from_numpy(d_out).to(device), "grad_outputs", layout)
    grads = tiled.backward(call, lse, d, block)
    want_out, want_lse, want = _reference(program, x, layout, d_out)
    got_out = tiled.to_layout(call, out, "out", program.v_axes, layout).cpu().numpy()
    got_lse = tiled.to_layout(call, lse, "lse", program.batch_axes, "b h t ...").cpu().numpy()
    assert rel(got_out, want_out) <= tol
    finite = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(got_lse), finite)
    assert rel(got_lse[finite], want_lse[finite]) <= tol
    for n, axes in (("q", program.q_axes), ("k", program.q_axes), ("v", program.v_axes)):
        got = tiled.to_layout(call, grads[n], n, axes, layout).cpu().numpy()
        assert np.isfinite(got).all(), n
        assert rel(got, want[n]) <= tol, n
    for dcl in program.params:
        assert rel(grads[dcl.name].cpu().numpy(), want[dcl.name]) <= tol, dcl.name


# -- the property ------------------------------------------------------------------------------------

@settings(max_examples=examples(12, ci=4), deadline=None)
@given(st.data())
def test_tiled_matches_interpreter(data):
    score_mod = data.draw(st.sampled_from(SCORE_MODS), "score_mod")
    mask_mod = data.draw(st.sampled_from(MASK_MODS), "mask_mod")
    lq = data.draw(st.sampled_from(LENGTHS), "Lq")
    lk = data.draw(st.sampled_from(LENGTHS), "Lk")
    layout = data.draw(st.sampled_from(LAYOUTS), "layout")
    block = data.draw(st.sampled_from([7, 64, None]), "block")
    sizes = {a: data.draw(st.integers(1, hi), a) for a, hi in (("b", 2), ("h", 3), ("d", 5), ("e", 4))}
    seed = data.draw(st.integers(0, 2**31 - 1), "seed")
    if lq * lk >= 180 * 1000 and block == 7:
        block = 64  # keep an example under a second
    rng = np.random.default_rng(seed)
    spec = _spec(score_mod, mask_mod)
    x = _inputs(spec.program, lq, lk, sizes, layout, rng)
    shape = list(x["q"].shape)
    shape[-1] = sizes["e"]
    _check_tiled(spec, x, layout, block, rng.standard_normal(shape))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("lq", "lk"), [(1, 1), (7, 180), (180, 7), (1000, 1000)])
def test_alibi_causal_at_awkward_sizes(lq, lk, layout):
    rng = np.random.default_rng(lq + lk)
    spec = _spec(alibi, ssmc.causal)
    x = _inputs(spec.program, lq, lk, {"b": 2, "h": 3, "d": 5, "e": 4}, layout, rng)
    shape = list(x["q"].shape)
    shape[-1] = 4
    _check_tiled(spec, x, layout, 64 if lq < 1000 else None, rng.standard_normal(shape))


def test_rows_without_a_key_give_zeros_and_finite_gradients():
    spec = _spec(alibi, never_late)
    rng = np.random.default_rng(3)
    x = _inputs(spec.program, 20, 20, {"b": 1, "h": 2, "d": 3, "e": 2}, "b h t ...", rng)
    d_out = rng.standard_normal((1, 2, 20, 2))
    _check_tiled(spec, x, "b h t ...", 4, d_out)
    f = ssmc.torch.function(spec, layout="b h t ...")
    t = {n: torch.tensor(a, requires_grad=True) for n, a in x.items()}
    out = f(**t)
    assert torch.equal(out[:, :, 8:], torch.zeros_like(out[:, :, 8:]))
    (out * torch.from_numpy(d_out)).sum().backward()
    assert torch.equal(t["q"].grad[:, :, 8:], torch.zeros_like(t["q"].grad[:, :, 8:]))
    assert all(torch.isfinite(t[n].grad).all() for n in t)
    _, lse = ssmc.compile(spec, "numba", layout="b h t ...")(**x, return_lse=True)
    assert np.isneginf(lse[:, :, 8:]).all() and np.isfinite(lse[:, :, :8]).all()


# -- the torch function: autograd of a dense reference, finite differences -------------------------------

def _dense_alibi(q, k, v, slope):
    """Causal ALiBi attention written densely in torch ([b h t d]), for autograd."""
    t = q.shape[2]
    pos = torch.arange(t, dtype=q.dtype)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) - slope[:, None, None] * (pos[:, None] - pos[None, :])
    s = s.masked_fill(pos[None, :] > pos[:, None], -math.inf)
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("length", [1, 7, 180])
def test_torch_function_gradients_match_autograd_of_a_dense_reference(length):
    from ssmc.examples import alibi_attention as ex

    rng = np.random.default_rng(length)
    x = ex.make_inputs(rng, length)
    mine = {n: torch.tensor(a, requires_grad=True) for n, a in x.items()}
    dense = {n: torch.tensor(a, requires_grad=True) for n, a in x.items()}
    d_out = torch.from_numpy(rng.standard_normal(x["v"].shape))
    out = ssmc.torch.function(ex.SPEC, layout=ex.LAYOUT)(mine["q"], mine["k"], mine["v"], mine["slope"])
    want = _dense_alibi(**dense)
    assert rel(out.detach(), want.detach()) <= F64_TOL
    (out * d_out).sum().backward()
    (want * d_out).sum().backward()
    for n in x:
        assert rel(mine[n].grad, dense[n].grad) <= F64_TOL, n


@pytest.mark.parametrize("layout", LAYOUTS)
def test_torch_function_gradcheck(layout):
    spec = _spec(head_bias, ssmc.sliding_window(3))
    rng = np.random.default_rng(0)
    x = _inputs(spec.program, 6, 5, {"b": 2, "h": 2, "d": 3, "e": 2}, layout, rng)
    f = ssmc.torch.function(spec, layout=layout)
    names = ["q", "k", "v", "bias", "temp"]
    args = tuple(torch.tensor(x[n], requires_grad=True) for n in names)
    assert torch.autograd.gradcheck(lambda *a: f(*a), args, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_layouts_agree_and_numpy_in_numpy_out():
    spec = _spec(alibi, ssmc.causal)
    rng = np.random.default_rng(1)
    x = _inputs(spec.program, 30, 30, {"b": 2, "h": 3, "d": 4, "e": 5}, "b h t ...", rng)
    by_head = ssmc.compile(spec, "numba", layout="b h t ...")
    assert by_head.path == "torch tiled"
    out = by_head(**x)
    assert isinstance(out, np.ndarray) and out.dtype == np.float64
    swapped = {**x, **{n: np.ascontiguousarray(x[n].transpose(0, 2, 1, 3)) for n in "qkv"}}
    out2 = ssmc.compile(spec, "cuda", layout="b t h ...")(**swapped)
    assert rel(out2.transpose(0, 2, 1, 3), out) <= F64_TOL
    f32 = by_head(**{n: a.astype(np.float32) for n, a in x.items()})
    assert f32.dtype == np.float32 and rel(f32, out) <= 1e-5
    assert ssmc.compile(spec, "interpreter").path == "interpreter"
    grads = ssmc.grad(spec, "numba", layout="b h t ...")(x["q"], x["k"], x["v"], grad_outputs=np.ones_like(out),
                                                          slope=x["slope"])
    ref = ssmc.grad(spec, "interpreter", layout="b h t ...")(x["q"], x["k"], x["v"], grad_outputs=np.ones_like(out),
                                                             slope=x["slope"])
    for n in ref:
        assert isinstance(grads[n], np.ndarray) and rel(grads[n], ref[n]) <= F64_TOL, n


def _rounded(x: np.ndarray, dtype) -> np.ndarray:
    """`x` rounded to a torch dtype, in float64."""
    return torch.from_numpy(x).to(dtype).double().numpy()


def test_bf16_on_the_cpu_within_its_tolerance():
    spec = _spec(alibi, ssmc.causal)
    rng = np.random.default_rng(2)
    x = _inputs(spec.program, 200, 200, {"b": 1, "h": 2, "d": 16, "e": 8}, "b h t ...", rng)
    t = {n: torch.tensor(a).to(torch.bfloat16).requires_grad_() for n, a in x.items()}
    exact = {n: a.detach().double().numpy() for n, a in t.items()}  # the bf16 values, exactly
    d_out = rng.standard_normal((1, 2, 200, 8))
    out = ssmc.torch.function(spec, layout="b h t ...")(**t)
    assert out.dtype == torch.bfloat16
    (out.float() * torch.from_numpy(d_out).float()).sum().backward()
    # the cotangent as the function receives it: autograd rounds it to the output's dtype
    want_out, _, want = _reference(spec.program, exact, "b h t ...", _rounded(d_out, torch.bfloat16))

    def norm_rel(got, want):
        got = got.detach().double().numpy()
        return np.linalg.norm(got - want) / np.linalg.norm(want)

    assert norm_rel(out, want_out) <= BF16_TOL
    for n in t:
        assert t[n].grad.dtype == torch.bfloat16
        assert norm_rel(t[n].grad, want[n]) <= BF16_TOL, n


def test_calls_of_a_bound_signature_view_their_own_arguments():
    """`TiledAttention.bind` remembers how a signature's canonical tensors view the arguments: a second call
    of the signature computes on its own values, a call with other strides (a transposed view of the same
    shape) or another dtype binds anew, and each equals a fresh function's result."""
    spec = _spec(alibi, ssmc.causal)
    rng = np.random.default_rng(3)
    x = _inputs(spec.program, 9, 9, {"b": 2, "h": 3, "d": 4, "e": 5}, "b h t ...", rng)
    y = _inputs(spec.program, 9, 9, {"b": 2, "h": 3, "d": 4, "e": 5}, "b h t ...", rng)
    f = ssmc.torch.function(spec, layout="b h t ...")

    def fresh(**t):
        return ssmc.torch.function(spec, layout="b h t ...")(**t)

    tx = {n: torch.tensor(a) for n, a in x.items()}
    ty = {n: torch.tensor(a) for n, a in y.items()}
    first = f(**tx)
    assert len(f.tiled._binds) == 1
    (_, template), = f.tiled._binds.values()
    assert template.q is None and all(t is None for t in template.params.values())  # no tensor kept alive
    assert rel(f(**ty), fresh(**ty)) <= F64_TOL  # the remembered views, of ty's tensors
    assert rel(f(**tx), first) <= F64_TOL
    strided = {**ty, **{n: torch.tensor(np.ascontiguousarray(y[n].transpose(0, 2, 1, 3))).transpose(1, 2)
                        for n in "qkv"}}
    assert strided["q"].stride() != ty["q"].stride()
    assert rel(f(**strided), fresh(**ty)) <= F64_TOL
    assert len(f.tiled._binds) == 2
    by_array = ssmc.torch.function(spec, layout={"*": "b h t ..."})  # per-array layouts: a key of their items
    assert rel(by_array(**ty), fresh(**ty)) <= F64_TOL and rel(by_array(**ty), fresh(**ty)) <= F64_TOL
    f32 = {n: t.float() for n, t in ty.items()}
    assert rel(f(**f32).double(), fresh(**ty)) <= 1e-5
    leaves = {n: t.clone().requires_grad_(True) for n, t in ty.items()}
    f(**leaves).sum().backward()
    want = {n: t.clone().requires_grad_(True) for n, t in ty.items()}
    fresh(**want).sum().backward()
    for n in leaves:
        assert rel(leaves[n].grad, want[n].grad) <= F64_TOL, n


def test_inference_needs_no_graph_and_errors_name_the_argument():
    spec = _spec(alibi, ssmc.causal)
    f = ssmc.torch.function(spec, layout="b h t ...")
    q = torch.randn(1, 2, 5, 3)
    v = torch.randn(1, 2, 5, 4)
    slope = torch.ones(2)
    assert not f(q, q, v, slope).requires_grad
    with pytest.raises(ValueError, match="axis 'd' has size 2 in 'q' but 3"):
        f(q[..., :2], q, v, slope)
    with pytest.raises(ValueError, match="argument 'slope' has 2 dimensions"):
        f(q, q, v, torch.ones(2, 2))
    with pytest.raises(ValueError, match="argument 'k' has dtype"):
        ssmc.compile(spec, "numba", layout="b h t ...")(q.numpy(), q.numpy().astype(np.complex64), v.numpy(),
                                                        slope.numpy())
    with pytest.raises(ValueError, match="argument 'v' is on meta"):
        f(q, q, v.to("meta"), slope)
    with pytest.raises(ValueError, match="grad_outputs has shape"):
        ssmc.grad(spec, "numba", layout="b h t ...")(q, q, v, grad_outputs=torch.ones(3), slope=slope)
    with pytest.raises(ValueError, match="attention has no final states"):
        ssmc.torch.function(spec, return_final_states=True)


# -- the pieces ----------------------------------------------------------------------------------------

def test_every_elementwise_op_has_a_torch_function():
    missing = [op for op in ELEMENTWISE if op not in torch_eval.UNARY and op not in torch_eval.BINARY
               and op is not Op.WHERE]
    assert not missing


def test_key_spans_skip_what_causal_and_window_masks_hide():
    causal = _spec(None, ssmc.causal).program.mask
    assert key_spans(causal, 300, 300, 128, 64, {}) == [(0, 128), (0, 256), (0, 300)]
    assert key_spans(causal, 100, 40, 64, 64, {}) == [(0, 40), (0, 40)]
    window = _spec(None, ssmc.sliding_window(10)).program.mask
    assert key_spans(window, 256, 256, 64, 16, {}) == [(0, 64), (48, 128), (112, 192), (176, 256)]
    late = _spec(None, never_late).program.mask
    assert key_spans(late, 40, 40, 16, 16, {}) == [(0, 16), (0, 0), (0, 0)]
    by_param = _spec(None, per_head_window).program.mask
    assert key_spans(by_param, 40, 40, 16, 16, {"h": 2}) == [(0, 16), (0, 32), (0, 40)]  # causal part only


@settings(max_examples=examples(30, ci=10), deadline=None)
@given(st.sampled_from(MASK_MODS[1:]), st.integers(1, 200), st.integers(1, 200), st.integers(1, 70),
       st.integers(1, 70))
def test_key_spans_are_sound(mask_mod, lq, lk, block, tile):
    """Every key outside a block's span is masked for every query of the block (the interpreter's mask)."""
    program = _spec(None, mask_mod).program
    sizes = {"b": 1, "h": 2, "d": 1, "e": 1}
    params = _params(program, sizes, np.random.default_rng(0))
    ev = interpreter.Evaluator(sizes, {"~q": lq, "~k": lk})
    env = {"q_idx": (np.arange(lq, dtype=np.float64), ("~q",)),
           "kv_idx": (np.arange(lk, dtype=np.float64), ("~k",)),
           **{d.name: (params[d.name], d.axes) for d in program.params}}
    (visible,) = ev.run([program.mask], env)
    visible = np.broadcast_to(interpreter.align(visible, ("~q", "~k", "b", "h")), (lq, lk, 1, 2)).any(axis=(2, 3))
    for b, (lo, hi) in enumerate(key_spans(program.mask, lq, lk, block, tile, sizes)):
        rows = visible[b * block:(b + 1) * block]
        assert not rows[:, :lo].any() and not rows[:, hi:].any()


# -- on a GPU ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_cuda_tensors(dtype):
    """The same checks on CUDA tensors: float64 at the float64 tolerance, float32 and bf16 the torch function
    against the interpreter (fp32: 1e-4, products of fp32 operands; bf16: BF16_TOL)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rng = np.random.default_rng(5)
    for score_mod, mask_mod, lq, lk in ((alibi, ssmc.causal, 1000, 1000), (softcap, ssmc.sliding_window(100), 180, 7),
                                        (head_bias, never_late, 7, 180), (None, None, 1, 1000)):
        spec = _spec(score_mod, mask_mod)
        for layout in LAYOUTS:
            x = _inputs(spec.program, lq, lk, {"b": 2, "h": 3, "d": 64, "e": 32}, layout, rng)
            shape = list(x["q"].shape)
            shape[-1] = 32
            d_out = rng.standard_normal(shape)
            _check_tiled(spec, x, layout, 64, d_out, device="cuda")
            t = {n: torch.tensor(a, device="cuda").to(getattr(torch, dtype)).requires_grad_() for n, a in x.items()}
            exact = {n: a.detach().double().cpu().numpy() for n, a in t.items()}
            out = ssmc.torch.function(spec, layout=layout)(**t)
            assert out.dtype == t["q"].dtype and out.is_cuda
            (out.float() * torch.from_numpy(d_out).float().cuda()).sum().backward()
            want_out, _, want = _reference(spec.program, exact, layout, _rounded(d_out, t["q"].dtype))
            tol = 1e-4 if dtype == "float32" else BF16_TOL

            def norm_rel(got, want):
                got = got.detach().double().cpu().numpy()
                return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)

            assert norm_rel(out, want_out) <= tol
            for n in t:
                assert torch.isfinite(t[n].grad).all(), n
                assert norm_rel(t[n].grad, want[n]) <= tol, n
