"""The IR: one interned node type (`Node`), one op vocabulary (`Op`), programs, printer, verifier."""

from .node import Node, toposort
from .ops import Op
from .program import Attention, Decl, Recurrence, Role

__all__ = ["Attention", "Decl", "Node", "Op", "Recurrence", "Role", "toposort"]
