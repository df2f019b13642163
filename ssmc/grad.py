"""The former home of the gradient drivers, now `ssmc.autograd`: the names imported from here still are.

`ssmc.grad` is the function (`ssmc/__init__.py` loads this module first, so that the package's
attribute stays the function). Import from `ssmc.autograd`.
"""

from .autograd import AttentionGrad, Grad, StagedGrad, Tape, default_chunk, grad, make_grad

__all__ = ["AttentionGrad", "Grad", "StagedGrad", "Tape", "default_chunk", "grad", "make_grad"]
