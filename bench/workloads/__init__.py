"""The workloads of bench/harness.py: one module per family, each with a list ``WORKLOADS``.

A `Workload` names its sizes (``sizes`` for the benchmark, ``tiny`` for the dry run), builds its inputs
as torch tensors in one canonical layout, and gives ssmc's sides and its peer's side. A `Side` is what
one implementation runs:

    prep  = side.prepare(inputs, dout)      # untimed: the canonical inputs as it takes them
    out   = side.forward(prep)              # timed (under torch.no_grad): the output
    grads = side.step(prep)                 # timed: forward and backward, the gradients
    side.output(out, prep), side.grads(grads, prep)   # untimed: back to the canonical layout

ssmc's sides use only ssmc's public API (`ssmc.compile`, `ssmc.grad`, `ssmc.torch.function`), so the
harness does not depend on how the package is laid out inside.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

FAMILIES = ("diagonal", "matrix", "rnn", "attention")


class Unavailable(Exception):
    """An implementation cannot run here; the message says why."""


def _same(value: Any, prep: Any) -> Any:
    return value


def plain_prepare(inputs: dict[str, torch.Tensor], dout: torch.Tensor) -> dict[str, Any]:
    """The inputs as given (detached) and the output's cotangent."""
    return {"inputs": {k: v.detach() for k, v in inputs.items()}, "dout": dout}


def leaves(inputs: dict[str, torch.Tensor], keys) -> dict[str, torch.Tensor]:
    """Fresh copies of `inputs`, those named in `keys` requiring grad (autograd's leaves)."""
    return {k: v.detach().clone().requires_grad_(k in keys) for k, v in inputs.items()}


@dataclass
class Side:
    """One implementation of a workload (module docstring)."""

    label: str
    forward: Callable[[Any], Any] | None = None
    step: Callable[[Any], Any] | None = None
    prepare: Callable[[dict, torch.Tensor], Any] = plain_prepare
    output: Callable[[Any, Any], torch.Tensor] = _same
    grads: Callable[[Any, Any], dict[str, torch.Tensor]] = _same


@dataclass
class Workload:
    """A benchmark case: the inputs, ssmc's sides, the peer's side.

    ``build(sizes, device, dtype, generator)`` returns the inputs by name (canonical layout);
    ``ssmc(backend)`` the list of ssmc's sides; ``peer(peers, device)`` the peer's side, or raises
    `Unavailable` (``peers`` is the harness's `Peers`: ``module``, ``mamba``). ``compare``: the inputs
    whose gradients are compared. ``ssmc_gpu`` False: ssmc has no GPU kernels for it yet, so on a GPU
    the check runs at the ``tiny`` sizes on the CPU and only the peer is timed.
    """

    name: str
    family: str
    title: str                      # str.format'ed with the sizes
    sizes: dict[str, int]
    tiny: dict[str, int]
    build: Callable[[dict, str, torch.dtype, torch.Generator], dict[str, torch.Tensor]]
    ssmc: Callable[[str], list[Side]]
    peer: Callable[[Any, str], Side]
    peer_name: str
    compare: tuple[str, ...]
    dtype: torch.dtype = torch.float32
    tolerance: float = 1e-3
    ssmc_gpu: bool = True
    notes: list[str] = field(default_factory=list)

    def describe(self, sizes: dict[str, int] | None = None, dtype: torch.dtype | None = None) -> str:
        """The title at `sizes` and `dtype` (default: the benchmark's)."""
        kind = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float64: "fp64"}.get(dtype or self.dtype, "")
        return f"{self.title.format(**(sizes or self.sizes))} {kind}"


def cuda_only(device: str, what: str) -> None:
    """`Unavailable` unless `device` is "cuda"."""
    if device != "cuda":
        raise Unavailable(f"{what} needs a CUDA GPU")


def autograd_side(label: str, run, compare, grads=None, prepare=None) -> Side:
    """A side called on autograd leaves: ``run(leaves)`` returns the output; ``prepare(inputs)``
    (untimed) may turn the leaves into other tensors first (default: the leaves as they are)."""
    def setup(inputs, dout):
        made = leaves(inputs, compare)
        return {"leaves": made, "args": prepare(made) if prepare else made, "dout": dout}

    def step(p):
        y = run(p["args"])
        return dict(zip(compare, torch.autograd.grad(y, [p["leaves"][k] for k in compare], p["dout"])))

    return Side(label=label, forward=lambda p: run(p["args"]), step=step, prepare=setup,
                grads=grads or _same)


def as_torch(x: Any, like: torch.Tensor) -> torch.Tensor:
    """`x` (a torch tensor or what NumPy takes) as a tensor on `like`'s device."""
    if isinstance(x, torch.Tensor):
        return x
    return torch.from_numpy(np.array(x)).to(like.device)  # a copy: NumPy's may be read-only


def ssmc_sides(spec, layout: str, backend: str, compare, *, op: bool = True) -> list[Side]:
    """ssmc's sides of a spec: `ssmc.compile` / `ssmc.grad` and (`op`) the `ssmc.torch` function."""
    import ssmc

    forward = ssmc.compile(spec, backend, layout=layout)
    gradient = ssmc.grad(spec, backend, layout=layout)
    sides = [Side(
        label="ssmc" if backend == "cuda" else f"ssmc ({backend})",
        forward=lambda p: forward(**p["inputs"]),
        step=lambda p: gradient(**p["inputs"], grad_outputs=p["dout"]),
        output=lambda out, p: as_torch(out, p["dout"]),
        grads=lambda g, p: {k: as_torch(g[k], p["dout"]) for k in compare},
    )]
    if op:
        import ssmc.torch

        function = ssmc.torch.function(spec, backend, layout=layout)

        def prepare(inputs, dout):
            return {"leaves": leaves(inputs, compare), "dout": dout}

        def step(p):
            y = function(**p["leaves"])
            return torch.autograd.grad(y, [p["leaves"][k] for k in compare], p["dout"])

        sides.append(Side(label="ssmc.torch op" if backend == "cuda" else f"ssmc.torch op ({backend})",
                          step=step, prepare=prepare, grads=lambda g, p: dict(zip(compare, g))))
    return sides


def generator(device: str, seed: int) -> torch.Generator:
    """A seeded generator on `device`."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def randn(shape, device: str, g: torch.Generator, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """Normal values of `shape`, float32, on `device`."""
    return torch.randn(shape, device=device, generator=g) * scale + shift


def uniform(shape, device: str, g: torch.Generator, low: float, high: float) -> torch.Tensor:
    """Uniform values in [low, high) of `shape`, float32, on `device`."""
    return low + (high - low) * torch.rand(shape, device=device, generator=g)


def workloads(families=FAMILIES) -> list[Workload]:
    """Every workload of the given families, in family order."""
    import importlib

    found = []
    for family in families:
        found += importlib.import_module(f"{__name__}.{family}").WORKLOADS
    return found
