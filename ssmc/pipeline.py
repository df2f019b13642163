"""The compiler pipeline as a list of named stages, each a function of the traced program.

    ir        the traced IR, one line per node
    classify  the recurrence family of each state (decides the lowering)
    backward  the derived backward: adjoint IR, its family, memory plan and C expressions
    fused     the fusion stage: the kernels of the forward and of the adjoint, what each fuses
    cuda      the generated CUDA source of the forward's kernels (at default sizes)
    numba     the generated Numba source of the forward's kernels (float32)

`ssmc show --stage NAME` prints one stage.
"""

from __future__ import annotations

from collections.abc import Callable

from .ir.printer import format_attention, format_nodes, format_program, format_recurrence
from .ir.program import Attention, Recurrence
from .lowering.stages import fuse
from .passes.attention_grad import derive_attention_backward
from .passes.autodiff import derive_backward
from .passes.c_printer import c_statements
from .passes.classify import classify


def _classify(program) -> str:
    if isinstance(program, Attention):
        return "family: softmax over keys (online-softmax monoid over key blocks)"
    return classify(program).describe()


def _backward(program) -> str:
    if isinstance(program, Attention):
        return _attention_backward(program)
    bw = derive_backward(program)
    adj = bw.adjoint
    named = [(f"{s.name}_next", u) for s, u in zip(adj.states, adj.updates)] + list(adj.outputs)
    return "\n\n".join([
        format_recurrence(adj),
        classify(adj).describe(),
        bw.plan.describe(),
        "// per element of each value, after common-subexpression elimination\n" + c_statements(named),
    ])


def _attention_backward(program: Attention) -> str:
    bw = derive_attention_backward(program)
    roots = [(f"d_{name}", node) for name, node in bw.param_grads] + [("d_score", bw.d_score)]
    lines, _ = format_nodes([n for _, n in roots])
    return "\n\n".join([
        format_attention(program),
        "backward (FlashAttention style): recompute P = exp(score_mod(S) - lse) from the saved log-sum-exp;\n"
        "  dV = P^T dO;  dP = dO V^T;  dS = P * (dP - rowsum(dO * O));  then through score_mod:\n"
        + "\n".join(lines),
        "// per (query, key) element, grad_score = dS\n" + c_statements(roots),
    ])


_TILED = "// attention runs the tiled torch path on numba and cuda (backends/tiled_attention.py)"


def _fused(program) -> str:
    if isinstance(program, Attention):
        return _TILED + ": no kernels to fuse yet"
    return "\n".join([f"forward ({program.name}):", fuse(program).describe(),
                      "backward (the adjoint; the recompute of the carries is one more kernel):",
                      fuse(derive_backward(program).adjoint).describe()])


def _cuda(program) -> str:
    if isinstance(program, Attention):
        return _TILED + ": no CUDA kernels are generated yet"
    from .backends.cuda.report import forward_source

    return forward_source(program)


def _numba(program) -> str:
    if isinstance(program, Attention):
        return _TILED + ": no Numba kernels are generated yet"
    from .backends.numba.runner import NumbaRunner

    fused = fuse(program)
    programs = [st.program for st in fused.stages] if fused.staged else [program]
    return "\n\n".join(NumbaRunner(p, "float32").source for p in programs)


# name -> (description, function from program to printable text)
STAGES: dict[str, tuple[str, Callable[[Recurrence | Attention], str]]] = {
    "ir": ("the traced IR, one line per node", format_program),
    "classify": ("the recurrence family of each state, which decides the lowering", _classify),
    "backward": ("the derived backward: adjoint IR, family, memory plan, C expressions", _backward),
    "fused": ("the fusion stage: kernels of the forward and the adjoint, what each fuses", _fused),
    "cuda": ("the generated CUDA source of the forward's kernels, at default sizes", _cuda),
    "numba": ("the generated Numba source of the forward's kernels, float32", _numba),
}


def show(program, stage: str = "ir") -> str:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    return STAGES[stage][1](program)
