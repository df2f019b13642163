"""The lanes strategy: a recurrence whose states have an axis of their own (Mamba-1's n) split among
the lanes of a group, the per-step sums reduced across them; chunks of steps staged in shared memory.

    analysis.py           which states and sums the lanes split (`StateLanes`)
    forward.py            the forward's template context, block shape and source (forward.cu.j2)
    backward_analysis.py  the lanes backward's plan (`LanesBackward`)
    backward.py           the backward's template context, block shape and source (backward.cu.j2)
"""
