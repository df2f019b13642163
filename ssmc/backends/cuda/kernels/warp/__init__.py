"""The warp strategy: a diagonal-linear scan with a warp per recurrence, each lane a block of
consecutive steps whose summaries the lanes combine by shuffles; its fused backward recomputes the
forward's carries round by round from the last.

    analysis.py           the step split into per-step values and a state-major loop (`StateMajor`)
    forward.py            the forward's template context and source (forward.cu.j2)
    backward_analysis.py  the fused backward's plan from the adjoint (`FusedBackward`)
    backward.py           the fused backward's template context and source (backward.cu.j2)
"""
