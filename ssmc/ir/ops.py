"""The op vocabulary: every node of every ssmc program has one of these ops.

Ops fall in four groups, which passes dispatch on:

- leaves: INPUT (a declared state / sequence / param, `arg` = its name), CONST (`arg` = a float),
  IOTA (position along axis `arg`), SIZE (the length of axis `arg`, a scalar);
- elementwise: a pointwise function of broadcast arguments (broadcast by axis name);
- reductions: SUM / MAX over the axis `arg`;
- structural: RENAME (`arg` = ((old, new), ...)), SELECT (`arg` = (axis, index): drop an axis
  by taking one position), SLICE (`arg` = (axis, new_axis, parts, index): the `index`-th block
  of `axis` cut into blocks named `parts`, renamed `new_axis`), PAD (the transpose of SLICE),
  EXPAND (`arg` = axes to broadcast to; they come first, in that order);
- indexed: GATHER (`arg` = axis; args (source, index)): the source at position index along `axis`, the
  index clamped to [0, size(axis) - 1]; the result has the source's other axes, then the index's. Only
  attention's modifiers make it (``table[q_idx - kv_idx]``, ``doc[q_idx]``; frontend/attention.py).
"""

from __future__ import annotations

from enum import Enum


class Op(Enum):
    # leaves
    INPUT = "input"
    CONST = "const"
    IOTA = "iota"
    SIZE = "size"
    # elementwise, unary
    NEG = "neg"
    EXP = "exp"
    LOG = "log"
    SQRT = "sqrt"
    RSQRT = "rsqrt"
    ABS = "abs"
    SIGMOID = "sigmoid"
    TANH = "tanh"
    SOFTPLUS = "softplus"
    SILU = "silu"
    GELU = "gelu"
    RELU = "relu"
    ERF = "erf"
    SIN = "sin"
    COS = "cos"
    TAN = "tan"
    LOG1P = "log1p"
    EXPM1 = "expm1"
    SIGN = "sign"
    NOT = "not"
    # elementwise, binary
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"
    POW = "pow"
    MAX = "max"
    MIN = "min"
    LT = "lt"
    LE = "le"
    GT = "gt"
    GE = "ge"
    EQ = "eq"
    NE = "ne"
    AND = "and"
    OR = "or"
    ATAN2 = "atan2"
    # elementwise, ternary
    WHERE = "where"
    # reductions over one named axis
    SUM = "sum"
    REDUCE_MAX = "reduce_max"
    # structural
    RENAME = "rename"
    SELECT = "select"
    SLICE = "slice"
    PAD = "pad"
    EXPAND = "expand"
    # indexed read
    GATHER = "gather"

    def __repr__(self) -> str:
        return f"Op.{self.name}"


LEAVES = frozenset({Op.INPUT, Op.CONST, Op.IOTA, Op.SIZE})
UNARY = frozenset({
    Op.NEG, Op.EXP, Op.LOG, Op.SQRT, Op.RSQRT, Op.ABS, Op.SIGMOID, Op.TANH, Op.SOFTPLUS,
    Op.SILU, Op.GELU, Op.RELU, Op.ERF, Op.SIN, Op.COS, Op.TAN, Op.LOG1P, Op.EXPM1, Op.SIGN, Op.NOT,
})
COMPARISONS = frozenset({Op.LT, Op.LE, Op.GT, Op.GE, Op.EQ, Op.NE})
LOGICAL = frozenset({Op.AND, Op.OR, Op.NOT})
BINARY = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.POW, Op.MAX, Op.MIN, Op.ATAN2, Op.AND, Op.OR}) | COMPARISONS
BOOL_RESULT = COMPARISONS | LOGICAL
ELEMENTWISE = UNARY | BINARY | {Op.WHERE}
REDUCTIONS = frozenset({Op.SUM, Op.REDUCE_MAX})
STRUCTURAL = frozenset({Op.RENAME, Op.SELECT, Op.SLICE, Op.PAD, Op.EXPAND})

# Infix spelling for the printer and for error messages.
INFIX = {Op.ADD: "+", Op.SUB: "-", Op.MUL: "*", Op.DIV: "/", Op.POW: "**", Op.LT: "<", Op.LE: "<=",
         Op.GT: ">", Op.GE: ">=", Op.EQ: "==", Op.NE: "!=", Op.AND: "&", Op.OR: "|"}
