"""Timing a recurrence on a backend, as ``ssmc bench`` does: checked against the interpreter first.

    check: the same sizes and steps (or the first `check_length`: quicker, but a length can pick
           other kernels), inputs of `scale` N(0, 1) (the recurrence must not grow on them:
           `GROWTH_LIMIT`); outputs, final states and every gradient against the float64
           interpreter, by relative error (max |got - want| / max |want| per array) within
           `TOLERANCE` of the compute dtype; a spec that fails is not timed
    time:  for each of `repeat` fresh random inputs (drawn and moved to the device before the clock
           starts):
               start; compiled(inputs); wait for the device; stop                  # forward
               start; grad(inputs, grad_outputs=dy); wait for the device; stop     # forward + backward
           after one call of each not timed (the check compiled them; caches and allocators warm
           up), the medians

Times are wall-clock times of whole calls, host time included, as a training loop sees them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from ..backends.registry import check_backend, get_backend
from ..ir.axes import TIME
from ..ir.program import Recurrence
from .binding import layout_of
from .progress import progress
from .random_inputs import default_sizes, random_recurrence_inputs

TOLERANCE = {"float32": 1e-3, "float64": 1e-9}  # largest relative error the check accepts
# Where the reference's outputs pass this, random inputs have made the recurrence grow (a decay
# above one): float32 would overflow and the check would measure that, not the backend
GROWTH_LIMIT = 1e20


@dataclass(frozen=True)
class BenchResult:
    """One spec's check and times (milliseconds; None where not measured)."""

    sizes: dict[str, int]
    length: int
    check_length: int
    error: float                      # the check's largest relative error over every array
    ok: bool                          # error within the tolerance
    forward_ms: float | None = None   # median of `repeat` forward calls
    grad_ms: float | None = None      # median of `repeat` forward + backward calls
    worst: str = ""                   # the array with the largest error
    finite: bool = True               # the timed calls' last outputs were finite (else inputs made it grow)


def bench_sizes(program: Recurrence, given: dict[str, int]) -> dict[str, int]:
    """`given` sizes, static ones as declared, every other axis as `default_sizes` gives it; ValueError for a
    given axis the program does not have."""
    axes = {a for d in program.decls for a in d.axes}
    unknown = sorted(set(given) - axes)
    if unknown:
        raise ValueError(f"--sizes: no axes {unknown} (its axes: {' '.join(sorted(axes))})")
    return default_sizes(program, given)


class _Arrays:
    """Random inputs and cotangents in the call's layout, as the backend takes them."""

    def __init__(self, program: Recurrence, backend: str, layout, dtype: str, scale: float):
        self.program, self.backend, self.layout, self.dtype, self.scale = program, backend, layout, dtype, scale

    def _in_layout(self, name: str, axes: tuple[str, ...], arr: np.ndarray) -> np.ndarray:
        canonical = (TIME, *axes)
        order = layout_of(self.layout, name, axes)
        return np.ascontiguousarray(arr.transpose([canonical.index(a) for a in order]))

    def inputs(self, sizes: dict[str, int], length: int, rng) -> dict[str, np.ndarray]:
        """Sequences, params and initial states (float64 NumPy, the call's layout)."""
        values = random_recurrence_inputs(self.program, length, rng, sizes, scale=self.scale)
        for d in self.program.seqs:
            values[d.name] = self._in_layout(d.name, d.axes, values[d.name])
        return values

    def cotangents(self, sizes: dict[str, int], length: int, rng) -> tuple[dict, dict]:
        """(grad_outputs, grad_final_states), float64 NumPy, the outputs in the call's layout."""
        outs = {name: self._in_layout(name, y.axes, rng.standard_normal((length, *(sizes[a] for a in y.axes))))
                for name, y in self.program.outputs}
        finals = {s.name: rng.standard_normal(tuple(sizes[a] for a in s.axes)) for s in self.program.states}
        return outs, finals

    def to_backend(self, values: dict) -> dict:
        """`values` as the backend reads them (`Backend.from_host`): torch CUDA tensors for cuda, else
        NumPy in the dtype."""
        return get_backend(self.backend).from_host(values, self.dtype)

    def wait(self) -> None:
        """Until the device has done what was asked of it (the clock stops after)."""
        get_backend(self.backend).synchronize()


def _numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().double().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _flat(value) -> list:
    if value is None:
        return []
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in _flat(v)]
    return [value]


def relative_error(got, want) -> float:
    """max |got - want| / max |want| (0 where both are zero; inf where shapes differ or got is not finite)."""
    got, want = _numpy(got), _numpy(want)
    if got.shape != want.shape or not np.isfinite(got).all():
        return float("inf")
    scale = np.abs(want).max(initial=0.0)
    diff = np.abs(got - want).max(initial=0.0)
    return 0.0 if diff == 0 else float(diff / scale) if scale > 0 else float("inf")


def check(spec, backend: str, layout, dtype: str, sizes: dict[str, int], length: int, seed: int,
          with_grad: bool, scale: float = 0.5) -> tuple[float, str]:
    """The largest relative error of `backend` against the interpreter over outputs, final states
    and (`with_grad`) every gradient, and the name of the array that has it. ValueError where the
    reference itself grows past `GROWTH_LIMIT` on these random inputs (inputs ~ `scale` N(0, 1))."""
    from ..api import compile as compile_spec
    from ..autograd import grad

    program = spec.program
    arrays = _Arrays(program, backend, layout, dtype, scale)
    rng = np.random.default_rng(seed)
    inputs = arrays.inputs(sizes, length, rng)
    names = [n for n, _ in program.outputs] + [f"final {s.name}" for s in program.states]
    want = compile_spec(spec, "interpreter", layout=layout)(**inputs, return_final_states=True)
    peak = max((np.abs(_numpy(a)).max(initial=0.0) for a in _flat(want)), default=0.0)
    if not peak <= GROWTH_LIMIT:
        raise ValueError(f"on random inputs of scale {scale:g} its outputs reach {peak:.1e} "
                         f"within {length} steps (the recurrence grows for them); give a smaller --scale or "
                         "--check-length")
    got = compile_spec(spec, backend, layout=layout)(**arrays.to_backend(inputs), return_final_states=True)
    errors = dict(zip(names, map(relative_error, _flat(got), _flat(want))))
    if with_grad:
        dy, dh = arrays.cotangents(sizes, length, rng)
        want = grad(spec, "interpreter", layout=layout)(**inputs, grad_outputs=dy, grad_final_states=dh)
        got = grad(spec, backend, layout=layout)(**arrays.to_backend(inputs), grad_outputs=arrays.to_backend(dy),
                                                 grad_final_states=arrays.to_backend(dh))
        errors |= {f"grad {k}": relative_error(got[k], want[k]) for k in want}
    worst = max(errors, key=errors.get)
    return errors[worst], worst


def check_tolerance(backend: str, dtype: str) -> float:
    """The largest relative error the check accepts of `backend` asked to compute in `dtype`: that of
    the dtype it computes in (the interpreter's float64 whatever is asked)."""
    return TOLERANCE[get_backend(backend).compute_dtype(np.dtype(dtype)).name]


def _quiet():
    """Values that grow past float32 are reported (`BenchResult.finite`), not warned of by NumPy."""
    return np.errstate(over="ignore", invalid="ignore")


def _timed(call, wait) -> tuple[float, object]:
    """(milliseconds, result) of one call."""
    start = time.perf_counter()
    result = call()
    wait()
    return (time.perf_counter() - start) * 1e3, result


def bench(spec, backend: str, *, sizes: dict[str, int] | None = None, length: int = 1024, layout="t ...",
          dtype: str = "float32", repeat: int = 10, with_grad: bool = True, check_length: int | None = None,
          seed: int = 0, scale: float = 0.5, label: str = "") -> BenchResult:
    """Check `spec` on `backend` against the interpreter, then time it (module docstring); a note
    on stderr says so where either takes more than a moment (`label` names the spec in it)."""
    from ..api import compile as compile_spec
    from ..autograd import grad

    backend = check_backend(backend)
    if dtype not in TOLERANCE:
        raise ValueError(f"dtype must be one of {sorted(TOLERANCE)}, not {dtype!r}")
    if length < 1 or repeat < 1 or (check_length is not None and check_length < 1):
        raise ValueError("length, repeat and check length must be at least 1")
    program = spec.program
    sizes = bench_sizes(program, sizes or {})
    checked = length if check_length is None else min(length, check_length)
    label = label or program.name
    with _quiet(), progress(f"{label}: checking {backend} against the interpreter over {checked} steps"):
        error, worst = check(spec, backend, layout, dtype, sizes, checked, seed, with_grad, scale)
    tolerance = check_tolerance(backend, dtype)
    result = BenchResult(sizes, length, checked, error, error <= tolerance, worst=worst)
    if not result.ok:
        return result
    arrays = _Arrays(program, backend, layout, dtype, scale)
    rng = np.random.default_rng(seed + 1)
    forward = compile_spec(spec, backend, layout=layout)
    gradient = grad(spec, backend, layout=layout) if with_grad else None
    forward_ms, grad_ms = [], []
    with _quiet(), progress(f"{label}: timing {repeat} calls after a first one"):
        for i in range(repeat + 1):  # the first call of each warms up, and is not in the medians
            inputs = arrays.to_backend(arrays.inputs(sizes, length, rng))
            ms, ys = _timed(lambda inputs=inputs: forward(**inputs), arrays.wait)
            if i > 0:
                forward_ms.append(ms)
            if gradient is not None:
                dy, dh = (arrays.to_backend(c) for c in arrays.cotangents(sizes, length, rng))
                ms, _ = _timed(lambda inputs=inputs, dy=dy, dh=dh: gradient(**inputs, grad_outputs=dy,
                                                                            grad_final_states=dh), arrays.wait)
                if i > 0:
                    grad_ms.append(ms)
    finite = all(np.isfinite(_numpy(y)).all() for y in _flat(ys))
    return BenchResult(sizes, length, checked, error, True, statistics.median(forward_ms),
                       statistics.median(grad_ms) if grad_ms else None, worst, finite)
