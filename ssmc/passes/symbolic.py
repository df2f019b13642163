"""IR <-> SymPy for elementwise expressions.

Elementwise regions of the IR are pointwise functions of their (broadcast) leaves, so each is a
scalar SymPy expression of one symbol per leaf. Functions whose derivative SymPy would write in
an unstable form (softplus' = exp(x)/(1+exp(x)) overflows) are opaque SymPy functions here with
their derivative given (`fdiff`), so derived code stays stable.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy as sp

from ..ir import build
from ..ir.node import Node
from ..ir.ops import Op


class _Opaque(sp.Function):
    """An activation SymPy keeps unexpanded. It is real for real arguments and evaluates to a
    number at a number, so that SymPy can compare it (Min, Max and Piecewise fold at constants)."""

    @staticmethod
    def definition(x: sp.Expr) -> sp.Expr:
        raise NotImplementedError

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real

    def _eval_evalf(self, prec):
        if self.args[0].is_number:
            return self.definition(self.args[0])._eval_evalf(prec)
        return None


class sigmoid(_Opaque):
    definition = staticmethod(lambda x: 1 / (1 + sp.exp(-x)))

    def fdiff(self, argindex=1):
        s = sigmoid(self.args[0])
        return s * (1 - s)


class softplus(_Opaque):
    definition = staticmethod(lambda x: sp.log(1 + sp.exp(x)))

    def fdiff(self, argindex=1):
        return sigmoid(self.args[0])


class silu(_Opaque):
    definition = staticmethod(lambda x: x / (1 + sp.exp(-x)))

    def fdiff(self, argindex=1):
        x = self.args[0]
        s = sigmoid(x)
        return s * (1 + x * (1 - s))


class gelu(_Opaque):
    definition = staticmethod(lambda x: x * (1 + sp.erf(x / sp.sqrt(2))) / 2)

    def fdiff(self, argindex=1):
        x = self.args[0]
        return (1 + sp.erf(x / sp.sqrt(2))) / 2 + x * sp.exp(-x**2 / 2) / sp.sqrt(2 * sp.pi)


class tanh(_Opaque):
    definition = staticmethod(sp.tanh)

    def fdiff(self, argindex=1):
        return 1 - tanh(self.args[0]) ** 2


class relu(_Opaque):
    definition = staticmethod(lambda x: sp.Max(x, 0))

    def fdiff(self, argindex=1):
        return sp.Heaviside(self.args[0], 0)  # relu'(0) = 0, as in PyTorch


class log1p(_Opaque):
    definition = staticmethod(lambda x: sp.log(1 + x))

    def fdiff(self, argindex=1):
        return 1 / (1 + self.args[0])


class expm1(_Opaque):
    definition = staticmethod(lambda x: sp.exp(x) - 1)

    def fdiff(self, argindex=1):
        return sp.exp(self.args[0])


class tan(_Opaque):
    definition = staticmethod(sp.tan)

    def fdiff(self, argindex=1):
        return 1 + tan(self.args[0]) ** 2


class sign(_Opaque):
    definition = staticmethod(sp.sign)

    def fdiff(self, argindex=1):
        return sp.Integer(0)  # zero everywhere, as torch.sign's (SymPy's would be 2 DiracDelta(x))


_UNARY_TO_SYMPY: dict[Op, Callable] = {
    Op.NEG: lambda x: -x, Op.EXP: sp.exp, Op.LOG: sp.log, Op.SQRT: sp.sqrt, Op.RSQRT: lambda x: 1 / sp.sqrt(x),
    Op.ABS: sp.Abs, Op.SIGMOID: sigmoid, Op.TANH: tanh, Op.SOFTPLUS: softplus, Op.SILU: silu,
    Op.GELU: gelu, Op.RELU: relu, Op.ERF: sp.erf, Op.SIN: sp.sin, Op.COS: sp.cos, Op.TAN: tan,
    Op.LOG1P: log1p, Op.EXPM1: expm1, Op.SIGN: sign, Op.NOT: sp.Not,
}
_BINARY_TO_SYMPY: dict[Op, Callable] = {
    Op.ADD: lambda a, b: a + b, Op.SUB: lambda a, b: a - b, Op.MUL: lambda a, b: a * b,
    Op.DIV: lambda a, b: a / b, Op.POW: lambda a, b: a**b, Op.MAX: sp.Max, Op.MIN: sp.Min,
    Op.LT: sp.Lt, Op.LE: sp.Le, Op.GT: sp.Gt, Op.GE: sp.Ge, Op.EQ: sp.Eq, Op.NE: sp.Ne,
    Op.ATAN2: sp.atan2, Op.AND: sp.And, Op.OR: sp.Or,
}


def to_sympy(roots: list[Node], leaf: Callable[[Node], sp.Basic | None]) -> list[sp.Basic]:
    """SymPy expressions of `roots`; `leaf(node)` gives the symbol standing for a node, or None
    to convert the node itself (it must then be elementwise or a constant)."""
    memo: dict[Node, sp.Basic] = {}

    def conv(node: Node) -> sp.Basic:
        hit = memo.get(node)
        if hit is not None:
            return hit
        sym = leaf(node)
        if sym is not None:
            out = sym
        elif node.op is Op.CONST:
            v = node.arg
            out = sp.Integer(int(v)) if float(v).is_integer() and abs(v) < 2**53 else sp.Float(v)
        elif node.op in _UNARY_TO_SYMPY:
            out = _UNARY_TO_SYMPY[node.op](conv(node.args[0]))
        elif node.op in _BINARY_TO_SYMPY:
            out = _BINARY_TO_SYMPY[node.op](conv(node.args[0]), conv(node.args[1]))
        elif node.op is Op.EXPAND:  # broadcasting: the same value at every element
            out = conv(node.args[0])
        elif node.op is Op.WHERE:
            c, a, b = (conv(x) for x in node.args)
            out = sp.Piecewise((a, c), (b, True))
        else:
            raise TypeError(f"to_sympy: {node.op} is not elementwise")
        memo[node] = out
        return out

    return [conv(r) for r in roots]


# -- SymPy -> IR --------------------------------------------------------------------------------

_SYMPY_FUNCS: dict[type, Op] = {
    sp.exp: Op.EXP, sp.log: Op.LOG, tanh: Op.TANH, sp.tanh: Op.TANH, sp.erf: Op.ERF, sp.Abs: Op.ABS,
    sigmoid: Op.SIGMOID, softplus: Op.SOFTPLUS, silu: Op.SILU, gelu: Op.GELU, relu: Op.RELU,
    sp.sin: Op.SIN, sp.cos: Op.COS, tan: Op.TAN, sp.tan: Op.TAN, log1p: Op.LOG1P, expm1: Op.EXPM1,
    sign: Op.SIGN,
}
_RELATIONS = {sp.StrictLessThan: Op.LT, sp.LessThan: Op.LE, sp.StrictGreaterThan: Op.GT,
              sp.GreaterThan: Op.GE, sp.Equality: Op.EQ, sp.Unequality: Op.NE}


def from_sympy(expr: sp.Basic, symbols: dict[sp.Symbol, Node]) -> Node:
    """Build the IR for `expr`, with `symbols` mapping each free symbol to a node."""
    memo: dict[sp.Basic, Node] = {}

    def conv(e: sp.Basic) -> Node:
        hit = memo.get(e)
        if hit is None:
            hit = memo[e] = _convert(e, conv, symbols)
        return hit

    return conv(sp.sympify(expr))


def _convert(e: sp.Basic, conv: Callable, symbols: dict) -> Node:
    if e in symbols:
        return symbols[e]
    if e.is_Number or e in (sp.pi, sp.E):
        return build.const(float(e))
    if isinstance(e, sp.Add):
        terms = list(e.args)
        acc = conv(terms[0])
        for t in terms[1:]:
            acc = build.sub(acc, conv(-t)) if t.could_extract_minus_sign() else build.add(acc, conv(t))
        return acc
    if isinstance(e, sp.Mul):
        num, den = build.ONE, build.ONE
        sign = 1.0
        for f in e.args:
            if f.is_Number and f < 0:
                sign = -sign
                f = -f
            if isinstance(f, sp.Pow) and f.exp.is_Number and f.exp < 0:
                den = build.mul(den, conv(f.base ** (-f.exp)))
            else:
                num = build.mul(num, conv(f))
        out = build.div(num, den)
        return build.neg(out) if sign < 0 else out
    if isinstance(e, sp.Pow):
        base, ex = e.args
        if ex == sp.Rational(1, 2):
            return build.unary(Op.SQRT, conv(base))
        if ex == -sp.Rational(1, 2):
            return build.unary(Op.RSQRT, conv(base))
        if ex.is_Number and ex < 0:
            return build.div(build.ONE, conv(base ** (-ex)))
        if ex == 2:
            b = conv(base)
            return build.mul(b, b)
        if ex.is_Number:
            return Node.make(Op.POW, (conv(base), build.const(float(ex))))
        return build.unary(Op.EXP, build.mul(conv(ex), build.unary(Op.LOG, conv(base))))
    if type(e) in _SYMPY_FUNCS:
        return build.unary(_SYMPY_FUNCS[type(e)], conv(e.args[0]))
    if isinstance(e, sp.atan2):
        return Node.make(Op.ATAN2, (conv(e.args[0]), conv(e.args[1])))
    if isinstance(e, sp.atan):  # SymPy's atan2(y, x) for x > 0 a number: atan(y / x)
        return Node.make(Op.ATAN2, (conv(e.args[0]), build.ONE))
    if isinstance(e, (sp.Max, sp.Min)):
        op = Op.MAX if isinstance(e, sp.Max) else Op.MIN
        acc = conv(e.args[0])
        for a in e.args[1:]:
            acc = Node.make(op, (acc, conv(a)))
        return acc
    if isinstance(e, sp.sign):
        x = conv(e.args[0])
        gt = Node.make(Op.GT, (x, build.ZERO))
        lt = Node.make(Op.LT, (x, build.ZERO))
        return build.where(gt, build.ONE, build.where(lt, build.const(-1.0), build.ZERO))
    if isinstance(e, sp.Heaviside):
        x = conv(e.args[0])
        at_zero = float(e.args[1]) if len(e.args) > 1 else 0.5
        gt = Node.make(Op.GT, (x, build.ZERO))
        eq = Node.make(Op.EQ, (x, build.ZERO))
        return build.where(gt, build.ONE, build.where(eq, build.const(at_zero), build.ZERO))
    if isinstance(e, sp.Piecewise):
        *cases, (last, cond) = e.args
        acc = conv(last) if cond == sp.true else build.where(conv(cond), conv(last), build.ZERO)
        for value, cond in reversed(cases):
            acc = build.where(conv(cond), conv(value), acc)
        return acc
    if type(e) in _RELATIONS:
        return Node.make(_RELATIONS[type(e)], (conv(e.args[0]), conv(e.args[1])))
    if isinstance(e, (sp.And, sp.Or)):
        op = Op.AND if isinstance(e, sp.And) else Op.OR
        acc = conv(e.args[0])
        for a in e.args[1:]:
            acc = Node.make(op, (acc, conv(a)))
        return acc
    if isinstance(e, sp.ITE):  # boolean if-then-else: (c & a) | (~c & b)
        c, a, b = (conv(x) for x in e.args)
        not_c = Node.make(Op.NOT, (c,))
        return Node.make(Op.OR, (Node.make(Op.AND, (c, a)), Node.make(Op.AND, (not_c, b))))
    if e in (sp.true, sp.false):
        return Node.make(Op.EQ, (build.ZERO, build.ZERO if e == sp.true else build.ONE))
    if isinstance(e, sp.Not):
        return Node.make(Op.NOT, (conv(e.args[0]),))
    raise TypeError(f"from_sympy: cannot translate {e!r} ({type(e).__name__})")
