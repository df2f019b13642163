"""ssmc: a compiler for recurrent sequence layers.

Write the step of a recurrence over named-axis tensors; ssmc gives a float64 reference
interpreter, derived backward passes and compiled kernels. Start with `recurrence`, `compile`.
"""

from .api import compile, default_backend
from .autograd import grad
from .errors import SpecError
from .frontend.attention import attention, causal, sliding_window
from .frontend.functions import (
    abs,
    dot,
    erf,
    exp,
    gelu,
    layernorm,
    log,
    max,
    maximum,
    mean,
    minimum,
    relu,
    rmsnorm,
    rsqrt,
    sigmoid,
    silu,
    softplus,
    sqrt,
    sum,
    tanh,
    where,
)
from .frontend.spec import Param, Seq, State, recurrence
from .frontend.tensor import Tensor
from .version import __version__ as __version__

__all__ = [
    "Param",
    "Seq",
    "SpecError",
    "State",
    "Tensor",
    "abs",
    "attention",
    "causal",
    "compile",
    "default_backend",
    "dot",
    "erf",
    "exp",
    "gelu",
    "grad",
    "layernorm",
    "log",
    "max",
    "maximum",
    "mean",
    "minimum",
    "recurrence",
    "relu",
    "rmsnorm",
    "rsqrt",
    "sigmoid",
    "silu",
    "sliding_window",
    "softplus",
    "sqrt",
    "sum",
    "tanh",
    "where",
]
