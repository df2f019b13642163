"""The IR: interning, axis inference by name, the printer, the verifier, graph helpers."""

import math
import re

import pytest

import ssmc
from ssmc.ir.node import BOOL, FLOAT, AxisError, Node, input_names, substitute, toposort
from ssmc.ir.ops import Op
from ssmc.ir.printer import format_program
from ssmc.ir.program import Decl, Recurrence, Role
from ssmc.ir.verify import verify


def leaf(name: str, axes: str) -> Node:
    return Node.make(Op.INPUT, (), name, tuple(axes.split()))


def const(value: float) -> Node:
    return Node.make(Op.CONST, (), value, ())


def node(op: Op, *args: Node, arg=None) -> Node:
    return Node.make(op, args, arg)


# -- structural hashing ----------------------------------------------------------------------------

def test_same_expression_is_the_same_node():
    h, x = leaf("h", "b d"), leaf("x", "b d")
    first = node(Op.ADD, node(Op.MUL, h, x), const(1.0))
    second = node(Op.ADD, node(Op.MUL, h, x), const(1.0))
    assert first is second
    assert first.args[0] is second.args[0]
    assert node(Op.SUM, first, arg="d") is node(Op.SUM, second, arg="d")


def test_different_constants_args_or_axes_are_different_nodes():
    h = leaf("h", "b d")
    assert node(Op.MUL, h, const(2.0)) is not node(Op.MUL, h, const(3.0))
    assert const(0.0) is not const(-0.0)
    assert const(2) is const(2.0)
    assert const(math.nan) is const(math.nan)
    assert node(Op.SUM, h, arg="b") is not node(Op.SUM, h, arg="d")
    assert leaf("h", "b d") is not leaf("h", "d b")
    assert node(Op.SUB, h, leaf("x", "b d")) is not node(Op.SUB, leaf("x", "b d"), h)


def test_tracing_interns_repeated_subexpressions():
    @ssmc.recurrence
    def step(h: ssmc.State["b d"], x: ssmc.Seq["b d"]):
        a = ssmc.sigmoid(x) * h
        b = ssmc.sigmoid(x) * h
        return a, b

    p = step.program
    assert p.updates[0] is p.outputs[0][1]
    assert sum(n.op is Op.SIGMOID for n in p.nodes()) == 1


# -- axis inference by name ------------------------------------------------------------------------

def test_broadcast_orders_axes_by_first_appearance():
    a, c = leaf("a", "b d"), leaf("c", "d n")
    assert node(Op.ADD, a, c).axes == ("b", "d", "n")
    assert node(Op.MUL, c, a).axes == ("d", "n", "b")
    assert node(Op.MUL, a, const(2.0)).axes == ("b", "d")
    w = node(Op.WHERE, node(Op.GT, c, const(0.0)), a, leaf("s", ""))
    assert w.axes == ("d", "n", "b")


def test_dtypes():
    a = leaf("a", "b")
    assert node(Op.LT, a, const(0.0)).dtype == BOOL
    assert node(Op.NOT, node(Op.LT, a, const(0.0))).dtype == BOOL
    assert node(Op.ADD, a, a).dtype == FLOAT
    w = node(Op.WHERE, node(Op.LT, a, const(0.0)), a, const(1.0))
    assert w.dtype == FLOAT


def test_reductions_drop_the_named_axis():
    x = leaf("x", "b d n")
    assert node(Op.SUM, x, arg="d").axes == ("b", "n")
    assert node(Op.REDUCE_MAX, x, arg="b").axes == ("d", "n")
    with pytest.raises(AxisError, match="'q'"):
        node(Op.SUM, x, arg="q")


def test_rename():
    x = leaf("x", "b d")
    assert node(Op.RENAME, x, arg=(("d", "k"),)).axes == ("b", "k")
    assert node(Op.RENAME, x, arg=(("b", "d"), ("d", "b"))).axes == ("d", "b")
    with pytest.raises(AxisError, match="repeated"):
        node(Op.RENAME, x, arg=(("b", "d"),))
    with pytest.raises(AxisError, match="'q'"):
        node(Op.RENAME, x, arg=(("q", "r"),))


def test_select_and_slice():
    z = leaf("z", "b g d")
    assert node(Op.SELECT, z, arg=("g", 1)).axes == ("b", "d")
    assert node(Op.SLICE, z, arg=("d", "e", ("e", "e"), 1)).axes == ("b", "g", "e")
    assert node(Op.SLICE, z, arg=("d", "d", ("d", "f"), 0)).axes == ("b", "g", "d")
    with pytest.raises(AxisError, match="already has axis 'g'"):
        node(Op.SLICE, z, arg=("d", "g", ("g", "g"), 0))
    # broadcast: the named axes first, in their order, then the operand's others
    assert node(Op.EXPAND, leaf("x", "d"), arg=("b", "d")).axes == ("b", "d")
    assert node(Op.EXPAND, leaf("x", "d n"), arg=("b",)).axes == ("b", "d", "n")


def test_spec_language_axes():
    """The same rules seen through the spec language."""
    seen = {}

    @ssmc.recurrence
    def step(h: ssmc.State["b n"], x: ssmc.Seq["b d"], A: ssmc.Param["d n"], z: ssmc.Seq["b g=3 e"]):
        seen["prod"] = (x * A).axes
        seen["dot"] = ssmc.dot(x, A, over="d").axes
        seen["mean"] = (x * A).mean("b d").axes
        i, f, o = z.unbind("g")
        seen["unbind"] = (i.axes, f.axes, o.axes)
        left, right = z.split("e", into="e1 e2")
        seen["split"] = (left.axes, right.axes)
        seen["rename"] = x.rename(d="n").axes
        seen["max"] = ssmc.max(x).axes
        return h * ssmc.dot(x, A, over="d"), h

    assert seen == {
        "prod": ("b", "d", "n"), "dot": ("b", "n"), "mean": ("n",),
        "unbind": (("b", "e"),) * 3, "split": (("b", "g", "e1"), ("b", "g", "e2")),
        "rename": ("b", "n"), "max": (),
    }
    assert step.program.static_sizes == {"g": 3}


def test_a_state_update_with_fewer_axes_is_broadcast_when_asked():
    @ssmc.recurrence
    def step(h: ssmc.State["b d"], x: ssmc.Seq["b"]):
        return (x * 2.0).broadcast("d"), h

    (update,) = step.program.updates
    assert update.op is Op.EXPAND and set(update.axes) == {"b", "d"}

    @ssmc.recurrence
    def reset(h: ssmc.State["b d"], x: ssmc.Seq["b"]):
        return 0.0, h + x  # a plain number fills the state

    (update,) = reset.program.updates
    assert update.op is Op.EXPAND and set(update.axes) == {"b", "d"}


# -- the printer -------------------------------------------------------------------------------------

def test_printer():
    @ssmc.recurrence
    def gated(h: ssmc.State["b d"], x: ssmc.Seq["b d"], f: ssmc.Seq["b d"], w: ssmc.Param["d"]):
        a = ssmc.sigmoid(f)
        h = a * h + (1 - a) * x
        return h, {"y": (h * w).sum("d")}

    text = format_program(gated.program)
    lines = [line.strip() for line in text.splitlines()]
    assert lines[0].startswith("recurrence gated")
    assert "test_ir.py" in lines[0]
    assert "state h [b d]" in lines
    assert "seq   x [b d], f [b d]" in lines
    assert "param w [d]" in lines
    body = "\n".join(lines)
    assert "= sigmoid f" in body
    assert "= 1 - %0" in body
    assert "over d" in body
    assert any(line.startswith("h <- %") for line in lines)
    assert any(line.startswith("y = %") for line in lines)
    assert len([line for line in lines if line.startswith("%")]) == 7
    reverse = format_program(Recurrence(**{**vars(gated.program), "reverse": True}))
    assert "(reverse time)" in reverse.splitlines()[0]


def test_printer_shows_static_sizes_and_structural_ops():
    @ssmc.recurrence
    def step(h: ssmc.State["b"], z: ssmc.Seq["b g=2"], k: ssmc.Param["k"]):
        i, f = z.unbind("g")
        return f * h + i, i.rename(b="k") * k

    text = format_program(step.program)
    assert "sizes g=2" in text
    assert "z[g=0]" in text and "z[g=1]" in text
    assert re.search(r"%\d+ \[k\] += rename %\d+ b->k", text)


# -- the verifier ------------------------------------------------------------------------------------

def _program(updates, outputs=(), decls=None, sizes=()):
    decls = decls or (Decl("h", Role.STATE, ("b",)), Decl("x", Role.SEQ, ("b",)))
    return Recurrence(name="hand", decls=tuple(decls), updates=tuple(updates), outputs=tuple(outputs),
                      sizes=sizes)


def test_verifier_accepts_a_good_program():
    h, x = leaf("h", "b"), leaf("x", "b")
    verify(_program([node(Op.ADD, h, x)], [("y", h)]))


def test_verifier_rejects_an_undeclared_input():
    h, u = leaf("h", "b"), leaf("u", "b")
    with pytest.raises(ssmc.SpecError, match="input 'u' is not declared"):
        verify(_program([node(Op.ADD, h, u)]))


def test_verifier_rejects_an_input_with_other_axes():
    h, x = leaf("h", "b"), leaf("x", "b d")
    with pytest.raises(ssmc.SpecError, match="input 'x' used with axes"):
        verify(_program([h], [("y", x)]))


def test_verifier_rejects_an_unbound_axis():
    h, x = leaf("h", "b"), leaf("x", "b")
    y = node(Op.EXPAND, x, arg=("b", "z"))
    with pytest.raises(ssmc.SpecError, match="axis 'z' is not an axis of any input"):
        verify(_program([h], [("y", y)]))
    # a static size binds it
    verify(_program([h], [("y", y)], sizes=(("z", 4),)))


def test_verifier_rejects_miscounted_updates_and_bad_types():
    h, x = leaf("h", "b"), leaf("x", "b")
    with pytest.raises(ssmc.SpecError, match="2 updates for 1 states"):
        verify(_program([h, x]))
    with pytest.raises(ssmc.SpecError, match="two outputs share a name"):
        verify(_program([h], [("y", h), ("y", x)]))
    with pytest.raises(ssmc.SpecError, match="outside"):
        verify(_program([leaf("x2", "b d")], decls=(Decl("h", Role.STATE, ("b",)),
                                                     Decl("x2", Role.SEQ, ("b", "d")))))
    with pytest.raises(ssmc.SpecError, match="power by a tensor"):
        verify(_program([node(Op.POW, h, x)]))
    with pytest.raises(ssmc.SpecError, match="must be boolean"):
        verify(_program([node(Op.WHERE, x, h, x)]))
    with pytest.raises(ssmc.SpecError, match="boolean operands"):
        verify(_program([h], [("y", node(Op.AND, x, node(Op.LT, h, x)))]))


def test_verifier_error_is_one_line_at_the_program():
    from ssmc.errors import Loc

    h, u = leaf("h", "b"), leaf("u", "b")
    p = Recurrence(name="hand", decls=(Decl("h", Role.STATE, ("b",)),), updates=(node(Op.ADD, h, u),),
                   outputs=(), loc=Loc(__file__, 1))
    with pytest.raises(ssmc.SpecError) as err:
        verify(p)
    assert "\n" not in str(err.value) and str(err.value).split(":")[1] == "1"


# -- substitute and toposort ---------------------------------------------------------------------------

def test_substitute_replaces_leaves_and_rebuilds_interned():
    h, x, y = leaf("h", "b"), leaf("x", "b"), leaf("y", "b")
    root = node(Op.ADD, node(Op.MUL, h, x), node(Op.EXP, x))
    (new,) = substitute((root,), {x: y})
    assert new is node(Op.ADD, node(Op.MUL, h, y), node(Op.EXP, y))
    (same,) = substitute((root,), {})
    assert same is root
    assert input_names([new]) == {"h", "y"}


def test_substitute_replaces_interior_nodes_and_applies_rewrite_bottom_up():
    h, x = leaf("h", "b"), leaf("x", "b")
    inner = node(Op.MUL, h, x)
    root = node(Op.SUB, inner, node(Op.NEG, inner))
    (new,) = substitute((root,), {inner: x})
    assert new is node(Op.SUB, x, node(Op.NEG, x))

    def neg_to_mul(n: Node) -> Node:
        return node(Op.MUL, n.args[0], const(-1.0)) if n.op is Op.NEG else n

    (rewritten,) = substitute((root,), {}, neg_to_mul)
    assert rewritten is node(Op.SUB, inner, node(Op.MUL, inner, const(-1.0)))
    # several roots share the rebuilt subgraph
    a, b = substitute((inner, root), {x: h})
    assert a is node(Op.MUL, h, h) and b.args[0] is a


def test_toposort_orders_arguments_first_and_visits_shared_nodes_once():
    h, x = leaf("h", "b"), leaf("x", "b")
    shared = node(Op.MUL, h, x)
    r1 = node(Op.ADD, shared, node(Op.EXP, shared))
    r2 = node(Op.SUB, shared, x)
    order = toposort([r1, r2])
    assert len(order) == len(set(map(id, order)))
    assert set(order) == {h, x, shared, node(Op.EXP, shared), r1, r2}
    position = {id(n): i for i, n in enumerate(order)}
    for n in order:
        assert all(position[id(a)] < position[id(n)] for a in n.args)


def test_toposort_handles_deep_graphs():
    x = leaf("x", "b")
    deep = x
    for i in range(20_000):
        deep = node(Op.ADD, deep, const(float(i % 7)))
    order = toposort([deep])
    assert order[-1] is deep and order[0] is x
    assert len(order) == 20_000 + 1 + 7
