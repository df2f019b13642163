"""ssmc: a compiler for recurrent sequence layers.

Write the step of a recurrence over named-axis tensors; ssmc gives a float64 reference
interpreter, derived backward passes and compiled kernels. Start with `recurrence`, `compile`.
"""

from .api import compile, default_backend, step
from .autograd import grad
from .errors import SpecError
from .frontend.attention import attention, causal, sliding_window
from .frontend.functions import (
    abs,
    atan2,
    causal_conv,
    clamp,
    cos,
    dot,
    erf,
    exp,
    expm1,
    gelu,
    layernorm,
    log,
    log1p,
    max,
    maximum,
    mean,
    minimum,
    relu,
    rmsnorm,
    rsqrt,
    sigmoid,
    sign,
    silu,
    sin,
    softmax,
    softplus,
    sqrt,
    sum,
    tan,
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
    "atan2",
    "attention",
    "causal",
    "causal_conv",
    "clamp",
    "compile",
    "cos",
    "default_backend",
    "dot",
    "erf",
    "exp",
    "expm1",
    "gelu",
    "grad",
    "layernorm",
    "log",
    "log1p",
    "max",
    "maximum",
    "mean",
    "minimum",
    "recurrence",
    "relu",
    "rmsnorm",
    "rsqrt",
    "sigmoid",
    "sign",
    "silu",
    "sin",
    "sliding_window",
    "softmax",
    "softplus",
    "sqrt",
    "step",
    "sum",
    "tan",
    "tanh",
    "where",
]
