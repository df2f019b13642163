"""Bad specs fail when they are defined, with one line that names the user's file and line.

Each offending line below ends with a marker comment ``# <- NAME``; `expect` finds that line in
this file's own source, so the tests check the exact line number the error reports.
"""

import os
import runpy
from pathlib import Path

import numpy as np
import pytest

import ssmc

FILE = os.path.basename(__file__)
_SOURCE = Path(__file__).read_text().splitlines()


def line_of(marker: str) -> int:
    """The line number of the line of this file that ends with ``# <- marker``."""
    hits = [i for i, text in enumerate(_SOURCE, 1) if text.rstrip().endswith(f"# <- {marker}")]
    assert len(hits) == 1, f"marker {marker!r} found {len(hits)} times"
    return hits[0]


def expect(excinfo, marker: str, *words: str) -> str:
    """The SpecError is one line, at this file's line `marker`, and mentions every word."""
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    path, line = msg.split(":")[:2]
    assert path.endswith(FILE), msg
    assert int(line) == line_of(marker), msg
    for word in words:
        assert word.lower() in msg.lower(), f"{word!r} not in {msg!r}"
    return msg


# -- axes ---------------------------------------------------------------------------------------

def test_unknown_axis():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            y = h.sum("q")  # <- unknown-axis
            return h + x, y
    expect(err, "unknown-axis", "'q'", "[b]")


def test_unknown_axis_in_rename_and_dot():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            return h, x.rename(q="r")  # <- rename-unknown
    expect(err, "rename-unknown", "'q'")
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step2(h: ssmc.State["b"], x: ssmc.Seq["b d"]):
            return h, ssmc.dot(x, h, over="d")  # <- dot-unknown
    expect(err, "dot-unknown", "'d'", "second")


def test_static_size_clash():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b g=4"],
                 z: ssmc.Seq["b g=3"]):  # <- size-clash
            return h, h
    expect(err, "size-clash", "'g'", "3", "4")


def test_axis_name_t_is_reserved():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"],
                 x: ssmc.Seq["t b"]):  # <- t-declared
            return h, h
    expect(err, "t-declared", "'t'", "reserved")


@pytest.mark.parametrize("how", ["rename", "broadcast", "split"])
def test_axis_name_t_is_reserved_in_ops(how):
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b e"]):
            y = {"rename": lambda: x.rename(b="t"),  # <- t-rename
                 "broadcast": lambda: x.broadcast("t"),  # <- t-broadcast
                 "split": lambda: x.split("e", into="t t")[0]}[how]()  # <- t-split
            return h, y
    expect(err, f"t-{how}", "'t'", "reserved", how)


def test_unbind_needs_static_size():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], z: ssmc.Seq["b g"]):
            i, f = z.unbind("g")  # <- unbind-size
            return i * h + f, h
    expect(err, "unbind-size", "unbind", "'g'", "g=N")


def test_state_value_with_undeclared_axis():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b d"]):
            h = h * 0.5 + x  # <- extra-axis
            return h, h.sum("d")
    expect(err, "extra-axis", "state 'h'", "[b d]", "declared [b]")


def test_state_value_that_lacks_an_axis():
    """An output returned as the carry: `y` [b d] is not the state `h` [b d n], however it broadcasts."""
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b d n"], x: ssmc.Seq["b d"], B: ssmc.Seq["b n"], C: ssmc.Seq["b n"]):
            h = 0.5 * h + x * B
            y = (h * C).sum("n")  # <- lost-axis
            return y, h  # <- lost-axis-return
    msg = expect(err, "lost-axis", "state 'h'", "has axes [b d]", "declared [b d n]", "lacks axis 'n'",
                 'value.broadcast("n")')
    assert f"returned at line {line_of('lost-axis-return')}" in msg


def test_state_value_that_lacks_axes_made_by_no_line_of_the_step():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], c: ssmc.State["b d n"], x: ssmc.Seq["b"], w: ssmc.Param["d n"]):
            return {"h": h + x, "c": x}, h  # <- lost-axes
    msg = expect(err, "lost-axes", "state 'c'", "has axes [b]", "lacks axes 'd', 'n'", 'value.broadcast("d n")')
    assert "returned at line" not in msg  # the value is an input: its line is the return


@ssmc.recurrence
def _broadcast_state(h: ssmc.State["b d"], x: ssmc.Seq["b"], w: ssmc.Param["d"]):
    new = 0.5 * h.mean("d") + x  # [b]: the same value for every d, on purpose
    return new.broadcast("d"), h * w


@ssmc.recurrence
def _reset_state(h: ssmc.State["b d"], x: ssmc.Seq["b d"]):
    return 0.0, h + x  # a plain number fills the state: no broadcast needed


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
def test_an_explicit_broadcast_of_a_state_value(backend):
    """`value.broadcast(axes)` gives a state a value constant along axes it lacks: the numbers of the
    implicit broadcast it replaces (h[b, d] = 0.5 * mean_d h[b, :] + x[b] for every d)."""
    rng = np.random.default_rng(0)
    x, w, h0 = rng.standard_normal((7, 2)), rng.standard_normal(3), rng.standard_normal((2, 3))
    y, h_last = ssmc.compile(_broadcast_state, backend)(x, w, h=h0, return_final_states=True)
    h, want = h0, []
    for t in range(7):
        want.append(h * w)
        h = np.broadcast_to((0.5 * h.mean(1) + x[t])[:, None], (2, 3))
    np.testing.assert_allclose(y, np.stack(want), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(h_last, h, rtol=1e-12, atol=1e-12)
    xs = rng.standard_normal((4, 2, 3))
    y, h_last = ssmc.compile(_reset_state, backend)(xs, h=h0, return_final_states=True)
    np.testing.assert_allclose(y, np.concatenate([h0[None], np.zeros((3, 2, 3))]) + xs, rtol=1e-12)
    assert np.array_equal(h_last, np.zeros((2, 3)))


@ssmc.recurrence
def _earlier(h: ssmc.State["b"], x: ssmc.Seq["b d"]):
    return h, h * 0.5 + x  # builds, and keeps alive, the node the next test builds again


def test_location_is_this_specs_line_even_for_a_node_built_before():
    assert _earlier.program.outputs  # the equal node of another spec is alive
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b d"]):
            new = h * 0.5 + x  # <- stale-loc
            return new, new
    expect(err, "stale-loc", "state 'h'")


def test_unbound_axis_from_broadcast():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            y = x.broadcast("z")  # <- unbound-axis
            return h, y
    expect(err, "unbound-axis", "'z'", "size is unknown")


# -- the step's signature and its returns --------------------------------------------------------

def test_unannotated_argument():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"],
                 x):  # <- unannotated
            return h, h
    expect(err, "unannotated", "'x'", "annotation")


def test_state_not_returned():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], c: ssmc.State["b"], x: ssmc.Seq["b"]):
            h = h + x
            return h, h  # <- one-of-two
    expect(err, "one-of-two", "state 'c' is not returned")
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step2(h: ssmc.State["b"], c: ssmc.State["b"], x: ssmc.Seq["b"]):
            return (h + x,), h  # <- one-tuple-of-two
    expect(err, "one-tuple-of-two", "state 'c' is not returned")


def test_returns_only_the_carry():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            h = h + x
            return h  # <- only-h
    expect(err, "only-h", "(new_carry, outputs)", "Tensor")


def test_returns_three_values():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            h = h + x
            return h, h, x  # <- three
    expect(err, "three", "(new_carry, outputs)", "tuple of 3")


def test_boolean_state_value():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            h = x > h  # <- bool-state
            return h, x
    expect(err, "bool-state", "boolean", "ssmc.where")


def test_seq_where_a_param_must_be():
    def bias_mod(score, q_idx, kv_idx,
                 bias: ssmc.Seq["h"]):  # <- seq-param
        return score + bias

    with pytest.raises(ssmc.SpecError) as err:
        ssmc.attention(score_mod=bias_mod, batch="b h")
    expect(err, "seq-param", "'bias'", "ssmc.Seq", "ssmc.Param")


def test_mask_mod_must_return_a_boolean():
    def mask(q_idx, kv_idx):
        return kv_idx - q_idx  # <- float-mask

    with pytest.raises(ssmc.SpecError) as err:
        ssmc.attention(mask_mod=mask)
    expect(err, "float-mask", "mask_mod", "boolean")


# -- Python control flow on traced values --------------------------------------------------------

def test_if_on_a_tensor():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            if h > 0:  # <- if
                h = h + x
            return h, h
    expect(err, "if", "control flow", "ssmc.where")


@pytest.mark.parametrize("op", ["and", "or", "not"])
def test_and_or_not_on_a_tensor(op):
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            y = {"and": lambda: (h > 0) and (x > 0),  # <- and
                 "or": lambda: h or x,  # <- or
                 "not": lambda: not h}[op]()  # <- not
            return h, ssmc.where(y, x, h)
    expect(err, op, "control flow", "&")


def test_float_of_a_tensor():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            scale = float(x)  # <- float
            return h * scale, h
    expect(err, "float", "Python number")


def test_iterating_a_tensor():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            for v in x:  # <- iterate
                h = h + v
            return h, h
    expect(err, "iterate", "iterating", "unbind")


# -- unsupported ops and dtypes ------------------------------------------------------------------

def test_power_by_a_tensor():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            return h ** x, h  # <- pow
    expect(err, "pow", "power by a tensor")
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step2(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            return 2.0 ** x, h  # <- rpow
    expect(err, "rpow", "exponent")
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step3(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            return np.power(h, x), h  # <- np-pow
    expect(err, "np-pow", "power by a tensor")


def test_numpy_ufunc_without_an_ssmc_equivalent():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            return h + np.arcsin(x), h  # <- np-arcsin
    expect(err, "np-arcsin", "arcsin", "ssmc")


def test_numpy_ufuncs_with_an_ssmc_equivalent_work():
    @ssmc.recurrence
    def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
        h = np.exp(-np.abs(x)) * h + np.tanh(x)
        return h, np.maximum(h, 0.0)

    x = np.random.default_rng(0).standard_normal((6, 3))
    y = ssmc.compile(step, backend="interpreter")(x)
    h = np.zeros(3)
    for t in range(6):
        h = np.exp(-np.abs(x[t])) * h + np.tanh(x[t])
        np.testing.assert_allclose(y[t], np.maximum(h, 0.0), rtol=1e-14)


def test_complex_constant():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            return h * (1 + 2j), h  # <- complex
    expect(err, "complex", "complex", "real")


_CAPTURED = np.ones(3)


def test_numpy_array_captured_as_a_constant():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            return h + x * _CAPTURED, h  # <- ndarray
    expect(err, "ndarray", "NumPy array", "ssmc.Param")
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step2(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            return h + _CAPTURED * x, h  # <- ndarray-left
    expect(err, "ndarray-left", "NumPy array", "ssmc.Param")


def test_other_python_objects():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            return h + "1", h  # <- str
    expect(err, "str", "str")


# -- exceptions raised by user code while tracing -------------------------------------------------

def test_exception_in_user_code_names_its_line():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], z: ssmc.Seq["b g=4"]):
            i, f = z.unbind("g")  # <- unpack
            return f * h + i, h
    expect(err, "unpack", "ValueError", "unpack")


def _helper_that_fails(x):
    raise RuntimeError("first line\n  second line")  # <- helper


def test_exception_in_a_helper_names_the_helpers_line_on_one_line():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            return _helper_that_fails(x), h
    expect(err, "helper", "RuntimeError", "first line second line")


def test_the_spec_error_does_not_drag_ssmc_frames():
    with pytest.raises(ssmc.SpecError) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["b"], x: ssmc.Seq["b"]):
            return h.sum("q"), h
    assert err.value.__cause__ is None and err.value.__suppress_context__


# -- call-time errors: ValueError naming the argument ---------------------------------------------

@ssmc.recurrence
def _gated(h: ssmc.State["b d"], x: ssmc.Seq["b d"], f: ssmc.Seq["b d"], w: ssmc.Param["d"]):
    a = ssmc.sigmoid(f)
    h = a * h + (1 - a) * x * w
    return h, h


def _inputs(length=5, b=2, d=3):
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((length, b, d)), "f": rng.standard_normal((length, b, d)),
            "w": rng.standard_normal(d)}


def _call(**changes):
    kwargs = {**_inputs(), **changes}
    return ssmc.compile(_gated, backend="interpreter")(**{k: v for k, v in kwargs.items() if v is not None})


def test_call_ok():
    assert _call().shape == (5, 2, 3)


def test_call_axis_size_clash_names_both_arguments():
    with pytest.raises(ValueError, match=r"'d'.*'f'.*'x'|'d'.*'x'.*'f'"):
        _call(f=np.zeros((5, 2, 4)))
    with pytest.raises(ValueError, match=r"'w'"):
        _call(w=np.zeros(4))


def test_call_length_clash():
    with pytest.raises(ValueError, match=r"'f'.*time steps"):
        _call(f=np.zeros((6, 2, 3)))


def test_call_wrong_ndim():
    with pytest.raises(ValueError, match=r"'x'.*2 dimensions.*expected 3"):
        _call(x=np.zeros((5, 3)))
    with pytest.raises(ValueError, match=r"'w'.*no time axis"):
        _call(w=np.zeros((5, 3)))


def test_call_missing_input():
    with pytest.raises(ValueError, match=r"missing input 'f'"):
        _call(f=None)


def test_call_unknown_keyword():
    with pytest.raises(ValueError, match=r"unexpected argument 'z'"):
        _call(z=np.zeros(3))


def test_call_too_many_positional():
    x, f, w = _inputs().values()
    with pytest.raises(ValueError, match=r"4 positional"):
        ssmc.compile(_gated, backend="interpreter")(x, f, w, w)


def test_call_length_zero():
    with pytest.raises(ValueError, match=r"'x'.*0 time steps"):
        _call(x=np.zeros((0, 2, 3)), f=np.zeros((0, 2, 3)))


def test_call_complex_input():
    with pytest.raises(ValueError, match=r"'f'.*complex"):
        _call(f=np.zeros((5, 2, 3), dtype=complex))


def test_call_bad_initial_state():
    with pytest.raises(ValueError, match=r"'h'"):
        _call(h=np.zeros((2, 4)))


def test_call_layout_with_a_misspelled_name():
    """A layout dict's key that names no array would leave that array in the default layout."""
    with pytest.raises(ValueError, match=r"layout: _gated has no arrays \['X'\] \(its arrays: x, f, w, h, y"):
        ssmc.compile(_gated, backend="interpreter", layout={"X": "b t d"})(**_inputs())
    with pytest.raises(ValueError, match=r"layout must be a template"):
        ssmc.compile(_gated, backend="interpreter")(**_inputs(), layout=3)
    with pytest.raises(ValueError, match=r"layout\['x'\] must be a template"):
        ssmc.grad(_gated, backend="interpreter", layout={"x": 3})(**_inputs())
    y = ssmc.compile(_gated, backend="interpreter", layout={"x": "b t d", "*": "t ..."})(
        **{**_inputs(), "x": np.ascontiguousarray(np.moveaxis(_inputs()["x"], 0, 1))})
    assert y.shape == (5, 2, 3)


def test_call_bfloat16_torch_tensor_computes_in_float32():
    torch = pytest.importorskip("torch")
    inputs = _inputs()
    got = ssmc.compile(_gated, backend="interpreter")(**{**inputs, "f": torch.tensor(inputs["f"]).bfloat16()})
    want = ssmc.compile(_gated, backend="interpreter")(**{**inputs, "f": torch.tensor(inputs["f"]).bfloat16().float()})
    assert np.array_equal(got, want)


def test_an_error_inside_numpy_names_the_users_line(tmp_path):
    """np.sum(x) on a tensor raises inside NumPy: the error names the spec's line, not NumPy's file."""
    path = tmp_path / "numpy_in_step.py"
    path.write_text("import numpy as np\nimport ssmc\n\n@ssmc.recurrence\n"
                    "def bad(h: ssmc.State[\"b d\"], x: ssmc.Seq[\"b d\"]):\n"
                    "    h = h + np.sum(x)\n    return h, h\n")
    with pytest.raises(ssmc.SpecError) as info:
        runpy.run_path(str(path))
    assert "numpy_in_step.py:6" in str(info.value) and "np.sum(x)" in str(info.value)


def test_a_spec_without_sequences_is_refused_where_it_is_defined():
    with pytest.raises(ssmc.SpecError, match="declares no sequence: the number of steps comes from"):
        @ssmc.recurrence
        def params_only(h: ssmc.State["d"], w: ssmc.Param["d"]):
            return h * w, h


def test_recurrence_of_something_else_than_a_function():
    with pytest.raises(TypeError, match=r"@ssmc.recurrence takes a step function .* not int"):
        ssmc.recurrence(3)


def test_call_initial_state_none_starts_at_zeros():
    scan = ssmc.compile(_gated, backend="interpreter")
    assert np.array_equal(scan(**_inputs(), h=None), scan(**_inputs()))


def test_attention_params_positionally_and_bad_modifier_arguments():
    from ssmc.examples import alibi_attention as ex

    x = ex.make_inputs(np.random.default_rng(0), 9)
    run = ex.SPEC.compile(layout=ex.LAYOUT)
    assert np.array_equal(run(x["q"], x["k"], x["v"], x["slope"]), run(**x))
    with pytest.raises(ValueError, match="argument 'slope' given twice"):
        run(x["q"], x["k"], x["v"], x["slope"], slope=x["slope"])
    with pytest.raises(ValueError, match="sliding_window takes a whole number of keys >= 1, got 0"):
        ssmc.sliding_window(0)
    with pytest.raises(ValueError, match=r"got 1\.5"):
        ssmc.sliding_window(1.5)
    with pytest.raises(ssmc.SpecError, match="attention scale must be a number, got 'x'"):
        ssmc.attention(scale="x")


@pytest.mark.parametrize("chunk", [2.5, "x", 0, True])
def test_grad_chunk_that_is_no_whole_number_of_steps(chunk):
    with pytest.raises(ValueError, match="chunk must be a whole number of steps >= 1"):
        ssmc.grad(_gated, "interpreter", chunk=chunk)


def test_call_ragged_list_names_the_argument():
    with pytest.raises(ValueError, match="argument 'x' is not an array"):
        _call(x=[[[1.0, 2.0, 3.0]], [[1.0]]])

