"""Layers with row statistics: a norm or a softmax over d after a scan (their fusion stages have row
kernels; on CUDA the layer may also run as one kernel, a block of threads per row), and a norm
inside the state update (the recurrence itself shares each row). For the row tests
(tests/test_map_reduce.py, tests/test_row_recurrence.py on the CPU, tests/test_cuda.py on the GPU)."""

from __future__ import annotations

import ssmc


@ssmc.recurrence
def softmax_layer(h: ssmc.State["b d"], x: ssmc.Seq["b d"], a: ssmc.Seq["b d"], D: ssmc.Param["d"]):
    """A gated scan, then a softmax over d: two row statistics, a max and a sum of what it shifts."""
    h = ssmc.sigmoid(a) * h + x
    y = h + D * x
    e = ssmc.exp(y - y.max("d"))
    return h, e / e.sum("d")


@ssmc.recurrence
def layernorm_layer(h: ssmc.State["b d"], x: ssmc.Seq["b d"], a: ssmc.Seq["b d"], res: ssmc.Seq["b d"],
                    w: ssmc.Param["d"], beta: ssmc.Param["d"]):
    """A gated scan, LayerNorm over d (the variance reads the mean: two sums in turn), a residual."""
    h = ssmc.sigmoid(a) * h + x
    return h, res + ssmc.layernorm(h, over="d", weight=w, bias=beta)


@ssmc.recurrence
def norm_inside(h: ssmc.State["b d"], x: ssmc.Seq["b d"], a: ssmc.Seq["b d"], w: ssmc.Param["d"]):
    """An RMSNorm inside the state update: the recurrence needs the whole row of d every step."""
    h = ssmc.rmsnorm(ssmc.sigmoid(a) * h + x, over="d", weight=w)
    return h, h * ssmc.silu(x)


LAYERS = {"softmax_layer": softmax_layer, "layernorm_layer": layernorm_layer, "norm_inside": norm_inside}
