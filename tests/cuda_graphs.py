"""A step captured in a CUDA graph, as the GPU tests of training steps replay it."""

from __future__ import annotations


def captured(step):
    """(graph, outputs): `step()` run 3 times on a side stream (warm-up outside the capture: kernels compiled,
    caches filled, as torch asks), then captured once with `torch.cuda.graph`; `graph.replay()` reruns it on
    whatever the captured inputs hold, writing into `outputs`."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs
