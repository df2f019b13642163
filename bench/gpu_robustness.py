#!/usr/bin/env python3
"""GPU robustness of the CUDA backend (issue 38): sanitizers, long sequences, inputs past 2^31 elements.

Three modes, all run by default (or pick with ``--sanitize``, ``--long``, ``--overflow``):

1. ``--sanitize``: every CUDA strategy's kernels under ``compute-sanitizer`` (memcheck, racecheck,
   initcheck, synccheck). The workloads are the recurrences of examples/ (forward, and ``ssmc.grad``
   called ``--grad-calls`` times so that the prepared and lean steps run too) at awkward sizes (dims
   not multiples of 32, L in {1, 7, 180, 1000}), in the example's own layout and in "b t ..." /
   "b d t", fp32 (and bf16), with ``SSMC_CUDA_STRATEGY`` unset ("auto") and forced to each strategy
   of ``options.STRATEGIES``. The plan is worked out on the host first (``kernel_reports``, no GPU):
   a forced strategy that does not apply is "n/a", one that gives the same kernels as a strategy
   before it is not run again. The plan is ordered so that a cut by the time budget drops the least
   important workloads: every example at L = 180 in its own layout first, then L = 1000, the other
   layouts, the short lengths, bf16.
   First a plain pass (no sanitizer, ``--plain-workers`` processes in parallel) runs the plan
   against the float64 interpreter (outputs, final states, every gradient) and fills the kernel
   cache; then the four tools run concurrently, each as
   ``compute-sanitizer --tool TOOL --error-exitcode 99 ... python bench/gpu_robustness.py
   --sanitize-worker TOOL ...``, each until the time budget ends. Logs: ``$OUT/sanitizer-<tool>.log``
   (the worker prints a marker before and after each workload, so each error is put down to the
   workload that ran it).
2. ``--long``: L = 1,000,000 forward in fp32 and bf16 for Mamba-1 (b1 d64 n16), HGRN (b1 d64),
   RetNet retention with RetNet's own decays gamma = 1 - 2^(-5 - h) (a decaying linear attention), and at the
   chunked kernels' sizes (bf16 on the tensor-core kernels, fp32 on the chunked torch path) Mamba-2 / SSD
   (b1 g1 r2 p64 n64) and simple GLA (b1 h2 k64 v64):
   every output and final state finite, and the relative error against the same kernels run in
   float64 on the inputs rounded to the dtype; each example's NumPy reference (float64, written
   without ssmc) against ssmc's float64 and float32 runs at L = 100,000; gradients at L = 200,000,
   finite and against float64.
3. ``--overflow``: sequences of more than 2^31 elements (B1 D65536 L32775): HGRN and Mamba-1
   forward in bf16 in both layouts, an HGRN gradient, HGRN in fp32, each only where
   ``torch.cuda.mem_get_info`` says it fits. A few channels (first, last, some between) are compared
   over all their steps and final states with the example's NumPy reference (the gradient: with
   the interpreter) run on just those channels: "right", "wrong", or the error raised; a silent
   wrong answer or a crash is a finding.

Every workload runs in a worker process; an exception is recorded and the next workload goes on,
and a worker that dies (a crash, a lost CUDA context) is started again on the rest. Everything is
written to ``$OUT/robustness.md`` (plus ``robustness.json``) as each part ends, and a summary is
printed. The exit status is 0 unless the script itself fails.

    python bench/gpu_robustness.py [--out DIR] [--quick] [--budget-s 450]    # all modes
    python bench/gpu_robustness.py --sanitize --tools memcheck --examples hgrn --lengths 7,180
    python bench/gpu_robustness.py --list [--quick]                            # the plans, no GPU

``--budget-s`` bounds the whole run: about a third goes to the long and overflow modes and the plain
pass (concurrently), the rest to the sanitizers (concurrently). The CUDA emulator
(``SSMC_CUDA_EMULATE=1``) runs the workers on the CPU, which tests/test_gpu_robustness_script.py uses.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import importlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

SCRIPT = Path(__file__).resolve()
REPO = SCRIPT.parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing ssmc
    sys.path.insert(0, str(REPO))

MARK = "@@gpu-robustness"
TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
TOOL_WEIGHT = {"memcheck": 1.0, "racecheck": 1.0, "initcheck": 1.0, "synccheck": 1.0}
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float64": "fp64"}
# largest relative error (max |got - want| / max |want| per array) taken as right, by input dtype
TOL = {"float32": 1e-3, "bfloat16": 2e-2, "float64": 1e-9}
STICKY = re.compile(r"illegal (memory )?(access|address|instruction)|launch failure|misaligned|"
                    r"CUDA_ERROR_(LAUNCH|ILLEGAL|MISALIGNED|HARDWARE)|cudaErrorLaunch|cudaErrorIllegal|"
                    r"device-side assert|uncorrectable ECC", re.I)
GRACE_S = 20.0      # a worker past its deadline by this much is killed
MIN_START_S = 15.0  # a worker is not started with less time than this left

# Awkward sizes for the sanitizers (keyword arguments of each example's make_inputs): dims not
# multiples of 32, one above 32 so that a block has a partial warp.
SANITIZE_SIZES: dict[str, dict[str, int]] = {
    "hgrn": {"batch": 3, "dim": 37},
    "mingru": {"batch": 3, "inp": 5, "dim": 37},
    "mamba1": {"batch": 2, "dim": 37, "state": 16},
    "mamba1_block": {"batch": 2, "dim": 37, "state": 5},
    "mamba2": {"batch": 2, "groups": 3, "heads": 2, "headdim": 5, "state": 7},
    "retnet": {"batch": 2, "heads": 3, "dk": 5, "dv": 7},
    "linear_attention": {"batch": 2, "heads": 3, "dk": 5, "dv": 7},
    "lstm": {"batch": 3, "inp": 5, "hidden": 7},
    "gru": {"batch": 3, "inp": 5, "hidden": 7},
}
SANITIZE_EXAMPLES = tuple(SANITIZE_SIZES)
QUICK_EXAMPLES = ("hgrn", "mamba1", "retnet", "lstm")
ALT_LAYOUTS = ("b t ...", "b d t")
# (tier, layout: the example's own or the others, L, dtype), most important first
FULL_TIERS = (
    (0, "native", 180, "float32"),
    (1, "native", 1000, "float32"),
    (2, "other", 180, "float32"),
    (3, "native", 7, "float32"),
    (3, "native", 1, "float32"),
    (4, "native", 180, "bfloat16"),
    (5, "other", 1000, "float32"),
    (5, "other", 7, "float32"),
    (5, "other", 1, "float32"),
    (5, "other", 180, "bfloat16"),
)
QUICK_TIERS = ((0, "native", 180, "float32"), (1, "native", 7, "float32"))

LONG_SIZES: dict[str, dict[str, int]] = {
    "mamba1": {"batch": 1, "dim": 64, "state": 16},
    "hgrn": {"batch": 1, "dim": 64},
    "retnet": {"batch": 1, "heads": 4, "dk": 16, "dv": 16},
    "mamba2": {"batch": 1, "groups": 1, "heads": 2, "headdim": 64, "state": 64},
    "simple_gla": {"batch": 1, "heads": 2, "dk": 64, "dv": 64},
    "gla": {"batch": 1, "heads": 2, "dk": 64, "dv": 64},
}
LONG_LENGTHS = {"forward": 1_000_000, "gradient": 200_000, "reference": 100_000}
QUICK_LONG_LENGTHS = {"forward": 200_000, "gradient": 50_000, "reference": 20_000}
QUICK_LONG_EXAMPLES = ("mamba1", "hgrn")
LONG_SIZES_ORDER = tuple(LONG_SIZES)

OVERFLOW_DIM = 1 << 16
OVERFLOW_LENGTH = (1 << 15) + 7  # B1 x D65536 x L32775 = 2^31 + 7 * 2^16 elements a sequence
OVERFLOW_ITEMS = (
    ("hgrn", "bfloat16", "b t ...", "forward"),
    ("hgrn", "bfloat16", "b d t", "forward"),
    ("mamba1", "bfloat16", "b d t", "forward"),
    ("hgrn", "bfloat16", "b t ...", "gradient"),
    ("mamba1", "bfloat16", "b t ...", "forward"),
    ("hgrn", "float32", "b t ...", "forward"),
)


def log(*args: Any) -> None:
    print(*args, flush=True)


def short_reason(exc: BaseException, limit: int = 300) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    if len(first) > limit:
        first = first[:limit] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def example(name: str):
    """The module of example `name` (examples/); where a copy of the checkout lost the link
    ssmc/examples -> ../examples and ssmc is not installed, the checkout's examples/ stands in for it."""
    try:
        return importlib.import_module(f"ssmc.examples.{name}")
    except ModuleNotFoundError as err:
        if err.name not in ("ssmc.examples", f"ssmc.examples.{name}"):
            raise
        sys.modules["ssmc.examples"] = importlib.import_module("examples")
        return importlib.import_module(f"ssmc.examples.{name}")


@contextlib.contextmanager
def strategy_forced(strategy: str):
    """``SSMC_CUDA_STRATEGY`` set to `strategy` ("auto": unset) while the block runs."""
    old = os.environ.get("SSMC_CUDA_STRATEGY")
    if strategy == "auto":
        os.environ.pop("SSMC_CUDA_STRATEGY", None)
    else:
        os.environ["SSMC_CUDA_STRATEGY"] = strategy
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SSMC_CUDA_STRATEGY", None)
        else:
            os.environ["SSMC_CUDA_STRATEGY"] = old


def relayout(arr, name: str, axes, src: str, dst: str):
    """A sequence (or per-step output) `arr` in layout `src` as layout `dst` (a transposed view)."""
    from ssmc.runtime.binding import layout_of

    a, b = layout_of(src, name, tuple(axes)), layout_of(dst, name, tuple(axes))
    if a == b:
        return arr
    perm = [a.index(x) for x in b]
    return arr.permute(*perm) if hasattr(arr, "permute") else arr.transpose(perm)


def time_last(program, layout: str) -> bool:
    """Whether every sequence has time innermost in `layout` (what the runner calls time contiguous)."""
    from ssmc.ir.axes import TIME
    from ssmc.runtime.binding import layout_of

    return all(layout_of(layout, d.name, tuple(d.axes))[-1] == TIME for d in program.seqs)


def example_sizes(name: str, kwargs: dict[str, int] | None = None) -> dict[str, int]:
    """Axis sizes of example `name`'s inputs for make_inputs(**kwargs) (time left out)."""
    from ssmc.ir.axes import TIME
    from ssmc.runtime.binding import layout_of

    m = example(name)
    program = m.SPEC.program
    inputs = m.make_inputs(np.random.default_rng(0), 2, **(SANITIZE_SIZES[name] if kwargs is None else kwargs))
    seqs = {d.name for d in program.seqs}
    sizes: dict[str, int] = {}
    for d in (*program.inputs, *program.states):
        if d.name not in inputs:
            continue
        order = layout_of(m.LAYOUT, d.name, tuple(d.axes)) if d.name in seqs else tuple(d.axes)
        sizes.update((a, n) for a, n in zip(order, np.shape(inputs[d.name])) if a != TIME)
    return sizes


def layouts_of(name: str, kind: str) -> list[str]:
    native = example(name).LAYOUT
    return [native] if kind == "native" else [x for x in ALT_LAYOUTS if x != native]


def workload_id(e: dict) -> str:
    return f"{e['example']} [{e['layout']}] L={e['length']} {SHORT[e['dtype']]} {e['strategy']}"


# ------------------------------------------------------------------------------------------------
# Plans (host only: no GPU)
# ------------------------------------------------------------------------------------------------

def kernel_plan(name: str, layout: str, length: int, dtype: str, strategy: str) -> tuple[tuple, list[str], list[str]]:
    """(signature, kernel names, strategy labels) of what the CUDA backend generates for the forward and
    gradient of example `name` at its sanitizer sizes; ValueError where a forced strategy does not apply."""
    from ssmc.backends.cuda.report import kernel_reports

    program = example(name).SPEC.program
    with strategy_forced(strategy):
        reports = kernel_reports(program, example_sizes(name), length, dtype=dtype, compile_kernels=False,
                                 time_contiguous=time_last(program, layout))
    signature = tuple((r.program, r.strategy, r.name, tuple(r.launch.grid), r.launch.nblk,
                       hashlib.sha1(r.source.encode()).hexdigest()[:12]) for r in reports)
    return signature, sorted({r.name for r in reports}), list(dict.fromkeys(r.strategy for r in reports))


def sanitize_plan(examples=None, quick: bool = False, lengths=None, strategies=None, max_tier: int | None = None,
                  planner=kernel_plan) -> list[dict]:
    """The sanitizer workloads in the order they run, each a dict: example, layout, length, dtype,
    strategy, tier, status ("run"; "n/a" where the forced strategy does not apply; "same" where it
    gives the kernels of a strategy before it), note, kernels, labels, index, id."""
    from ssmc.backends.cuda.options import STRATEGIES

    examples = list(examples or (QUICK_EXAMPLES if quick else SANITIZE_EXAMPLES))
    unknown = sorted(set(examples) - set(SANITIZE_SIZES))
    if unknown:
        raise ValueError(f"no sanitizer workloads for {unknown}; examples: {', '.join(SANITIZE_SIZES)}")
    every = ("auto", *STRATEGIES)
    strategies = [s for s in every if strategies is None or s in strategies]
    tiers = [t for t in (QUICK_TIERS if quick else FULL_TIERS) if max_tier is None or t[0] <= max_tier]
    entries: list[dict] = []
    for tier in sorted({t[0] for t in tiers}):
        runnable, idle = [], []
        for _, kind, length, dtype in (t for t in tiers if t[0] == tier):
            if lengths is not None and length not in lengths:
                continue
            for ex_rank, name in enumerate(examples):
                for lay_rank, layout in enumerate(layouts_of(name, kind)):
                    seen: dict[tuple, str] = {}
                    rank = 0
                    for strategy in strategies:
                        e = {"example": name, "layout": layout, "length": length, "dtype": dtype,
                             "strategy": strategy, "tier": tier, "status": "run", "note": "", "kernels": [],
                             "labels": []}
                        try:
                            signature, e["kernels"], e["labels"] = planner(name, layout, length, dtype, strategy)
                        except ValueError as err:
                            e.update(status="n/a", note=short_reason(err, 160))
                            idle.append(e)
                            continue
                        except Exception as err:  # the plan failed: let the run decide
                            signature = ("unplanned", strategy)
                            e["note"] = f"not planned ({short_reason(err, 120)})"
                        if signature in seen:
                            e.update(status="same", note=f"same kernels as {seen[signature]}")
                            idle.append(e)
                            continue
                        seen[signature] = strategy
                        runnable.append(((rank, ex_rank, lay_rank, length == 1, length), e))
                        rank += 1
        runnable.sort(key=lambda pair: pair[0])
        entries += [e for _, e in runnable] + idle
    for i, e in enumerate(entries):
        e["index"], e["id"] = i, workload_id(e)
    return entries


def long_plan(quick: bool = False, examples=None, lengths: dict[str, int] | None = None) -> list[dict]:
    """The long-sequence items, most important first: forwards (fp32, then bf16), the NumPy references,
    the gradients."""
    lengths = lengths or (QUICK_LONG_LENGTHS if quick else LONG_LENGTHS)
    examples = list(examples or (QUICK_LONG_EXAMPLES if quick else LONG_SIZES))
    items = [{"kind": "forward", "example": x, "dtype": dt} for dt in ("float32", "bfloat16") for x in examples]
    items += [{"kind": "reference", "example": x, "dtype": "float32"} for x in examples]
    items += [{"kind": "gradient", "example": x, "dtype": dt} for dt in ("float32", "bfloat16") for x in examples]
    for i, item in enumerate(items):
        item.update(index=i, length=lengths[item["kind"]], sizes=dict(LONG_SIZES[item["example"]]), status="run")
        item["id"] = f"{item['kind']} {item['example']} {SHORT[item['dtype']]} L={item['length']:,}"
    return items


def overflow_plan(quick: bool = False, dim: int = OVERFLOW_DIM, length: int = OVERFLOW_LENGTH) -> list[dict]:
    """The index-overflow items (B1 x `dim` channels x `length` steps a sequence)."""
    items = []
    for i, (name, dtype, layout, kind) in enumerate(OVERFLOW_ITEMS[:1] if quick else OVERFLOW_ITEMS):
        item = {"index": i, "example": name, "dtype": dtype, "layout": layout, "kind": kind, "batch": 1, "dim": dim,
                "length": length, "state": 16, "status": "run"}
        item["elements"] = item["batch"] * dim * length
        item["id"] = f"{kind} {name} [{layout}] {SHORT[dtype]}"
        items.append(item)
    return items


# ------------------------------------------------------------------------------------------------
# Workers (run on the GPU machine, or on the CPU with SSMC_CUDA_EMULATE=1)
# ------------------------------------------------------------------------------------------------

def worker_device() -> str:
    from ssmc.backends.cuda.devices import device_name

    return device_name()


def synchronize(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def describe_device(device: str) -> dict:
    import torch

    info = {"torch": torch.__version__, "python": platform.python_version()}
    with contextlib.suppress(Exception):
        import cupy

        info["cupy"] = cupy.__version__
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), memory_gib=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    else:
        info["device"] = "CPU (SSMC_CUDA_EMULATE=1: the CUDA kernels emulated)"
    return info


def _torch_dtype(dtype: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[dtype]


def round_to(arr: np.ndarray, dtype: str) -> np.ndarray:
    """`arr` rounded to `dtype` and back to float64."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float64)).to(_torch_dtype(dtype)).double().numpy()


def rel_err(got, want) -> float:
    """max |got - want| / max |want| (inf where shapes differ or `got` is not finite)."""
    from ssmc.runtime.benchmark import relative_error

    return relative_error(got, want)


def _flat(value) -> list:
    from ssmc.runtime.benchmark import _flat as flat

    return flat(value)


def _numpy(x) -> np.ndarray:
    from ssmc.runtime.benchmark import _numpy as numpy

    return numpy(x)


def rel_err_torch(got, want) -> float:
    """`rel_err` computed where the tensors are (large ones stay on the GPU)."""
    import torch

    if tuple(got.shape) != tuple(want.shape):
        return float("inf")
    if got.numel() == 0:
        return 0.0
    g, w = got.double(), want.double()
    if not bool(torch.isfinite(g).all()):
        return float("inf")
    diff, scale = float((g - w).abs().max()), float(w.abs().max())
    return 0.0 if diff == 0 else diff / scale if scale > 0 else float("inf")


def all_finite(tensors) -> bool:
    import torch

    return all(bool(torch.isfinite(t).all()) for t in tensors)


_CASES: dict[tuple, dict] = {}


def sanitize_case(name: str, length: int, dtype: str) -> dict:
    """Inputs and cotangents (float64 NumPy, rounded to `dtype`, the example's own layout) for a
    sanitizer workload: the same for every layout and strategy."""
    from ssmc.ir.axes import TIME
    from ssmc.runtime.binding import layout_of

    key = (name, length, dtype)
    if key not in _CASES:
        m = example(name)
        program = m.SPEC.program
        rng = np.random.default_rng([SANITIZE_EXAMPLES.index(name) + 1, length, int(dtype == "bfloat16")])
        inputs = {k: round_to(v, dtype) for k, v in m.make_inputs(rng, length, **SANITIZE_SIZES[name]).items()}
        sizes = example_sizes(name)
        dy = {}
        for out, y in program.outputs:
            shape = [length if a == TIME else sizes[a] for a in layout_of(m.LAYOUT, out, tuple(y.axes))]
            dy[out] = round_to(rng.standard_normal(shape), dtype)
        dh = {s.name: round_to(rng.standard_normal([sizes[a] for a in s.axes]), dtype) for s in program.states}
        _CASES[key] = {"inputs": inputs, "dy": dy, "dh": dh}
    return _CASES[key]


def sanitize_reference(name: str, length: int, dtype: str) -> dict:
    """The interpreter's outputs, final states and gradients for `sanitize_case` (the example's layout)."""
    import ssmc

    case = sanitize_case(name, length, dtype)
    if "want" not in case:
        m = example(name)
        outs, finals = ssmc.compile(m.SPEC, "interpreter", layout=m.LAYOUT)(**case["inputs"], return_final_states=True)
        grads = ssmc.grad(m.SPEC, "interpreter", layout=m.LAYOUT)(**case["inputs"], grad_outputs=case["dy"],
                                                                 grad_final_states=case["dh"])
        case["want"] = {"outputs": _flat(outs), "finals": _flat(finals), "grads": grads}
    return case["want"]


def run_sanitize_workload(entry: dict, device: str, reference: bool = False, grad_calls: int = 3) -> dict:
    """One sanitizer workload: the forward (final states returned) and `grad_calls` calls of ``ssmc.grad``
    on the cuda backend with the entry's strategy forced, inputs moved to `device` in the entry's layout
    and dtype. Status "ok", "NON-FINITE", "MISMATCH" (`reference`: against the interpreter), or "n/a"
    where the forced strategy does not apply at run time."""
    import torch

    import ssmc

    name, layout, length, dtype = entry["example"], entry["layout"], entry["length"], entry["dtype"]
    m = example(name)
    program = m.SPEC.program
    case = sanitize_case(name, length, dtype)
    tdt = _torch_dtype(dtype)
    seq_axes = {d.name: tuple(d.axes) for d in program.seqs}
    out_axes = {n: tuple(y.axes) for n, y in program.outputs}

    def tensor(arr):
        return torch.from_numpy(np.ascontiguousarray(arr)).to(device=device, dtype=tdt)

    inputs = {k: tensor(relayout(v, k, seq_axes[k], m.LAYOUT, layout) if k in seq_axes else v)
              for k, v in case["inputs"].items()}
    dy = {k: tensor(relayout(v, k, out_axes[k], m.LAYOUT, layout)) for k, v in case["dy"].items()}
    dh = {k: tensor(v) for k, v in case["dh"].items()}
    stage = "forward"
    with strategy_forced(entry["strategy"]):
        try:
            outs, finals = ssmc.compile(m.SPEC, "cuda", layout=layout)(**inputs, return_final_states=True)
            stage = "gradient"
            g = ssmc.grad(m.SPEC, "cuda", layout=layout)
            grads = {}
            for _ in range(grad_calls):
                grads = g(**inputs, grad_outputs=dy, grad_final_states=dh)
            synchronize(device)
        except ValueError as err:
            if "SSMC_CUDA_STRATEGY" in str(err):
                return {"status": "n/a", "note": f"{stage}: {short_reason(err, 160)}"}
            raise
    outs, finals = _flat(outs), _flat(finals)
    arrays = [*outs, *finals, *grads.values()]
    if not all_finite(arrays):
        return {"status": "NON-FINITE", "note": "an output, final state or gradient is not finite"}
    record = {"status": "ok", "note": ""}
    if reference:
        want = sanitize_reference(name, length, dtype)
        errors = {}
        for (n, axes), got, w in zip(program.outputs, outs, want["outputs"]):
            errors[n] = rel_err(relayout(_numpy(got), n, tuple(axes.axes), layout, m.LAYOUT), w)
        for s, got, w in zip(program.states, finals, want["finals"]):
            errors[f"final {s.name}"] = rel_err(got, w)
        for k, w in want["grads"].items():
            got = _numpy(grads[k]) if k in grads else np.full(np.shape(w), np.nan)
            errors[f"grad {k}"] = rel_err(relayout(got, k, seq_axes[k], layout, m.LAYOUT) if k in seq_axes else got, w)
        worst = max(errors, key=errors.get)
        record.update(err=errors[worst], worst=worst)
        if not errors[worst] <= TOL[dtype]:
            record.update(status="MISMATCH", note=f"{worst}: relative error {errors[worst]:.2e}")
    return record


_LONG: dict[tuple, dict] = {}


def long_inputs(name: str, length: int, sizes: dict[str, int]) -> dict[str, np.ndarray]:
    """Example `name`'s inputs (float64, its layout) at `length` steps; RetNet with its own slow decays.
    One set kept at a time (they are large)."""
    key = (name, length, tuple(sorted(sizes.items())))
    if key not in _LONG:
        _LONG.clear()
        gc.collect()
        rng = np.random.default_rng([7, LONG_SIZES_ORDER.index(name) if name in LONG_SIZES_ORDER else 99, length])
        inputs = example(name).make_inputs(rng, length, **sizes)
        if name == "retnet":  # RetNet's gamma_h = 1 - 2^(-5 - h): decays close to 1
            inputs["gamma"] = 1.0 - 2.0 ** (-5.0 - np.arange(sizes["heads"]))
        _LONG[key] = inputs
    return _LONG[key]


def run_long_item(item: dict, device: str) -> dict:
    """A long-sequence item: finite outputs and gradients, errors against float64 (module docstring)."""
    import torch

    import ssmc

    name, dtype, kind, length = item["example"], item["dtype"], item["kind"], item["length"]
    m = example(name)
    program = m.SPEC.program
    tdt = _torch_dtype(dtype)
    inputs = long_inputs(name, length, item["sizes"])
    f = ssmc.compile(m.SPEC, "cuda", layout=m.LAYOUT)
    names = [n for n, _ in program.outputs] + [f"final {s.name}" for s in program.states]
    if kind == "reference":
        want = dict(zip(names, _flat(m.reference(**inputs))))
        errs = {}
        for run_dtype in ("float64", "float32"):
            given = {k: torch.from_numpy(v).to(device=device, dtype=_torch_dtype(run_dtype)) for k, v in inputs.items()}
            got = dict(zip(names, _flat(f(**given, return_final_states=True))))
            synchronize(device)
            errs[run_dtype] = max(rel_err_torch(got[k], torch.from_numpy(np.ascontiguousarray(want[k])).to(device))
                                  for k in names)
            del given, got
        finite = all(np.isfinite(v) for v in errs.values())
        status = "finite" if finite else "NON-FINITE"
        if finite and not (errs["float64"] <= 1e-9 and errs["float32"] <= TOL["float32"]):
            status = "MISMATCH"
        return {"status": status, "err": errs["float32"], "worst": "float32 run",
                "note": f"NumPy reference (float64) against ssmc float64: {errs['float64']:.1e}, float32: "
                        f"{errs['float32']:.1e}"}
    x64 = {k: torch.from_numpy(v).to(device) for k, v in inputs.items()}
    given = {k: t.to(tdt) for k, t in x64.items()}
    rounded = {k: t.double() for k, t in given.items()}
    del x64
    if kind == "forward":
        got = dict(zip(names, _flat(f(**given, return_final_states=True))))
        synchronize(device)
        finite = all_finite(got.values())
        want = dict(zip(names, _flat(f(**rounded, return_final_states=True))))
        synchronize(device)
        peak = max(float(t.double().abs().max()) for t in got.values())
    else:
        rng = np.random.default_rng([8, length])
        outs = dict(zip(names, _flat(f(**rounded, return_final_states=True))))
        dy = {n: torch.from_numpy(rng.standard_normal(tuple(outs[n].shape))).to(device=device, dtype=tdt)
              for n, _ in program.outputs}
        dh = {s.name: torch.from_numpy(rng.standard_normal(tuple(outs[f"final {s.name}"].shape))).to(device=device,
                                                                                                   dtype=tdt)
              for s in program.states}
        del outs
        g = ssmc.grad(m.SPEC, "cuda", layout=m.LAYOUT)
        got = g(**given, grad_outputs=dy, grad_final_states=dh)
        synchronize(device)
        finite = all_finite(got.values())
        want = g(**rounded, grad_outputs={k: v.double() for k, v in dy.items()},
                 grad_final_states={k: v.double() for k, v in dh.items()})
        synchronize(device)
        peak = max(float(t.double().abs().max()) for t in got.values())
        got, want = {f"grad {k}": v for k, v in got.items()}, {f"grad {k}": v for k, v in want.items()}
    errs = {k: rel_err_torch(got[k], want[k]) for k in got}
    worst = max(errs, key=errs.get)
    nonfinite = [k for k, v in got.items() if not all_finite([v])]
    status = "finite" if finite else "NON-FINITE"
    if finite and not errs[worst] <= TOL[dtype]:
        status = "MISMATCH"
    out_dtype = str(next(iter(got.values())).dtype).replace("torch.", "")
    note = f"against ssmc float64 on the inputs rounded to {SHORT[dtype]}; results in {out_dtype}"
    if nonfinite:
        note += f"; not finite: {', '.join(nonfinite)}"
    return {"status": status, "err": errs[worst], "worst": worst, "max_abs": peak, "note": note}


def overflow_bytes(item: dict) -> int:
    """Device memory an overflow item needs, roughly (outputs and gradients taken as float32)."""
    elements, size = item["elements"], 2 if item["dtype"] in ("bfloat16", "float16") else 4
    inputs = 2 if item["example"] == "hgrn" else 3
    need = elements * (inputs * size + 4)
    if item["kind"] == "gradient":
        need += elements * (size + inputs * 4 + 4)
    return int(need * 1.15) + (1 << 30)


def _overflow_inputs(item: dict, device: str, gen) -> dict:
    import torch

    b, d, length, layout = item["batch"], item["dim"], item["length"], item["layout"]
    tdt = _torch_dtype(item["dtype"])
    seq = (b, length, d) if layout == "b t ..." else (b, d, length)

    def randn(shape):
        return torch.randn(shape, generator=gen, device=device, dtype=tdt)

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=gen, device=device) * (hi - lo) + lo

    if item["example"] == "hgrn":
        x = randn(seq)
        f = randn(seq)
        f.add_(1.0)
        return {"x": x, "f": f, "h": (0.5 * randn((b, d))).to(tdt)}
    n = item["state"]
    small = (b, length, n) if layout == "b t ..." else (b, n, length)
    return {"u": randn(seq), "delta": randn(seq), "A": (-torch.exp(uniform((d, n), -1.0, 1.0))).to(tdt),
            "B": randn(small), "C": randn(small), "D": randn((d,)), "z": randn(seq),
            "delta_bias": uniform((d,), -2.0, 0.0).to(tdt), "h": (0.5 * randn((b, d, n))).to(tdt)}


def overflow_channels(d: int) -> list[int]:
    return sorted({c for c in (0, 1, 4099 % d, d // 2 + 3, d - 2, d - 1) if 0 <= c < d})


def _rows(t, layout: str, chans: list[int]) -> np.ndarray:
    """Channels `chans` of batch 0 of a [b t d] / [b d t] sequence, as float64 [L, k]."""
    import torch

    idx = torch.tensor(chans, device=t.device)
    r = t[0].index_select(1, idx) if layout == "b t ..." else t[0].index_select(0, idx).T
    return r.double().cpu().numpy()


def _native(rows: np.ndarray, native: str) -> np.ndarray:
    """[L, k] rows as a batch of one in layout `native` ("b t ..." or "b d t")."""
    return np.ascontiguousarray(rows[None] if native == "b t ..." else rows.T[None])


def _from_native(arr: np.ndarray, native: str) -> np.ndarray:
    return arr[0] if native == "b t ..." else arr[0].T


def classify(err: BaseException) -> tuple[str, bool]:
    """(status, whether it is a finding) for an exception an overflow item raised."""
    text = short_reason(err)
    if "out of memory" in text.lower():
        return "skipped (out of memory)", False
    if STICKY.search(text):
        return "CUDA error", True
    if isinstance(err, (ValueError, OverflowError, NotImplementedError)) or type(err).__name__ == "SpecError":
        return "clear error", False
    return "error", True


def run_overflow_item(item: dict, device: str) -> dict:
    """An index-overflow item: the forward (or gradient) of sequences of `elements` values each, a few
    channels of batch 0 compared over all their steps with float64 references of just those channels.
    What the ssmc call raises is classified (`classify`); an error in the checking itself is not caught
    here (the worker records it as an error of the script)."""
    import torch

    import ssmc

    name, layout, kind = item["example"], item["layout"], item["kind"]
    m = example(name)
    record = {"elements": item["elements"], "over_2_31": item["elements"] > 2**31}
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        need = overflow_bytes(item)
        if need > free:
            return {**record, "status": "skipped (memory)", "finding": False,
                    "note": f"needs about {need / 2**30:.0f} GiB, {free / 2**30:.0f} of {total / 2**30:.0f} GiB free"}
    chans = overflow_channels(item["dim"])
    gen = torch.Generator(device=device)
    gen.manual_seed(38)
    try:
        try:
            inputs = _overflow_inputs(item, device, gen)
            if kind == "gradient":
                dy = torch.randn(inputs["x"].shape, generator=gen, device=device, dtype=inputs["x"].dtype)
                dh = torch.randn(inputs["h"].shape, generator=gen, device=device, dtype=inputs["x"].dtype)
        except Exception as err:
            if "out of memory" not in str(err).lower():
                raise
            return {**record, "status": "skipped (out of memory)", "finding": False, "note": short_reason(err)}
        t0 = time.time()
        try:
            if kind == "forward":
                result = ssmc.compile(m.SPEC, "cuda", layout=layout)(**inputs, return_final_states=True)
            else:
                result = ssmc.grad(m.SPEC, "cuda", layout=layout)(**inputs, grad_outputs={"y": dy},
                                                                  grad_final_states={"h": dh})
            synchronize(device)
        except Exception as err:
            if STICKY.search(short_reason(err)):
                raise  # the context is lost: the worker records it and is started again
            status, finding = classify(err)
            return {**record, "status": status, "finding": finding, "note": short_reason(err)}
        seconds = time.time() - t0
        if kind == "forward":
            y, h = _flat(result[0])[0], _flat(result[1])[0]
            finite = all_finite([y, h])
            got = {"y": _rows(y, layout, chans), "final h": h[0, chans].double().cpu().numpy()}
            out_dtype = str(y.dtype).replace("torch.", "")
            del y, h
        else:
            finite = all_finite(result.values())
            got = {f"grad {k}": _rows(result[k], layout, chans) for k in ("x", "f")}
            got["grad h"] = result["h"][0, chans].double().cpu().numpy()
            dy_rows, dh_rows = _rows(dy, layout, chans), dh[:1, chans].double().cpu().numpy()
            out_dtype = str(result["x"].dtype).replace("torch.", "")
            del dy, dh
        del result
        # the chosen channels' inputs, float64, as a batch of one in the example's own layout
        native = m.LAYOUT
        small = {}
        for d in m.SPEC.program.seqs:
            t = inputs[d.name]
            if "d" in d.axes:
                small[d.name] = _native(_rows(t, layout, chans), native)
            else:  # Mamba-1's B and C ([b n] a step): all of batch 0
                small[d.name] = np.ascontiguousarray(relayout(t[:1].double().cpu().numpy(), d.name, d.axes, layout,
                                                              native))
        for d in m.SPEC.program.params:
            small[d.name] = inputs[d.name].double().cpu().numpy()[chans]
        small["h"] = inputs["h"][:1].double().cpu().numpy()[:, chans]
        del inputs
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        if kind == "forward":
            y_ref, h_ref = m.reference(**small)
            want = {"y": _from_native(y_ref, native), "final h": h_ref[0]}
        else:
            grads = ssmc.grad(m.SPEC, "interpreter", layout=native)(
                **small, grad_outputs={"y": _native(dy_rows, native)}, grad_final_states={"h": dh_rows})
            want = {f"grad {k}": _from_native(grads[k], native) for k in ("x", "f")}
            want["grad h"] = grads["h"][0]
        errors = {k: rel_err(got[k], want[k]) for k in want}
        worst = max(errors, key=errors.get)
        tol = TOL["bfloat16"] if out_dtype in ("bfloat16", "float16") else TOL["float32"]
        right = finite and errors[worst] <= tol
        note = (f"channels {chans} of batch 0, all {item['length']} steps; {worst} worst; results in {out_dtype}; "
                f"the call {seconds:.2f} s")
        if not finite:
            note += "; the whole result has values that are not finite"
        return {**record, "status": "right" if right else "wrong", "finding": not right, "err": errors[worst],
                "note": note}
    finally:
        gc.collect()
        if device == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.empty_cache()


def _emit(fh, event: dict) -> None:
    fh.write(json.dumps(event, default=str) + "\n")
    fh.flush()
    with contextlib.suppress(OSError):
        os.fsync(fh.fileno())


def worker_loop(items: list[tuple[int, dict]], run_one, results: Path, deadline: float | None, device: str) -> None:
    """Run `items` in order until `deadline` (epoch seconds): each begins and ends with an event in the
    `results` file (JSON lines) and a marker line on stdout; an exception is recorded as the item's
    result. Where the CUDA context is lost, the worker exits (status 3) for the parent to start anew."""
    durations: list[float] = []
    with open(results, "a") as fh:
        _emit(fh, {"event": "start", "pid": os.getpid(), **describe_device(device)})
        for index, item in items:
            expected = max(durations[-3:]) if durations else 0.0
            if deadline is not None and time.time() + expected > deadline:
                _emit(fh, {"event": "budget", "index": index})
                log(f"{MARK} budget: stopping before {index}")
                return
            _emit(fh, {"event": "begin", "index": index})
            log(f"{MARK} begin {index} {item.get('id', '')}")
            t0 = time.time()
            sticky = False
            try:
                record = run_one(item)
                synchronize(device)
            except Exception as err:
                sticky = bool(STICKY.search(str(err)))
                record = {"status": "CUDA error" if sticky else "error", "note": short_reason(err),
                          "traceback": traceback.format_exc(limit=12), "finding": True}
            record["seconds"] = round(time.time() - t0, 2)
            log(f"{MARK} end {index} {record['status']}")
            _emit(fh, {"event": "end", "index": index, **record})
            durations.append(record["seconds"])
            if sticky:
                _emit(fh, {"event": "abort", "index": index})
                sys.stdout.flush()
                os._exit(3)
        _emit(fh, {"event": "done"})


def worker_main(args) -> int:
    plan = json.loads(Path(args.plan).read_text())
    by_index = {e["index"]: e for e in plan}
    if args.indexes is not None:
        indexes = [int(i) for i in args.indexes.split(",") if i]
    else:
        indexes = [e["index"] for e in plan if e.get("status", "run") == "run"]
    device = worker_device()
    if args.sanitize_worker:
        tool = args.sanitize_worker
        if device == "cuda" and tool != "none":
            with contextlib.suppress(Exception):  # every array its own allocation, as torch's are here
                import cupy

                cupy.cuda.set_allocator(None)

        def run_one(e):
            return run_sanitize_workload(e, device, reference=tool == "none", grad_calls=args.grad_calls)
    elif args.worker == "long":
        def run_one(e):
            return run_long_item(e, device)
    else:
        def run_one(e):
            return run_overflow_item(e, device)
    worker_loop([(i, by_index[i]) for i in indexes], run_one, Path(args.results), args.deadline, device)
    return 0


# ------------------------------------------------------------------------------------------------
# The parent: jobs, sanitizer logs, the report
# ------------------------------------------------------------------------------------------------

def find_sanitizer(given: str | None = None) -> str | None:
    """compute-sanitizer: `given`, on PATH, in a CUDA toolkit, or in pip's nvidia packages."""
    if given:
        return given if Path(given).exists() or shutil.which(given) else None
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if os.path.isdir("/usr/local"):
        roots += sorted((os.path.join("/usr/local", d) for d in os.listdir("/usr/local") if d.startswith("cuda-")),
                        reverse=True)
    for root in filter(None, roots):
        for rel in ("bin/compute-sanitizer", "compute-sanitizer/compute-sanitizer"):
            if os.access(os.path.join(root, rel), os.X_OK):
                return os.path.join(root, rel)
    for base in sys.path:
        path = Path(base) / "nvidia" / "cuda_sanitizer_api" / "compute-sanitizer" / "compute-sanitizer"
        if os.access(path, os.X_OK):
            return str(path)
    return None


def sanitizer_command(sanitizer: str, tool: str) -> list[str]:
    return [sanitizer, "--tool", tool, "--error-exitcode", "99", "--destroy-on-device-error", "kernel",
            "--show-backtrace", "device", "--print-limit", "1000", "--target-processes", "application-only"]


def _version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
        return " / ".join(lines[-2:])[:200]
    except Exception as err:
        return short_reason(err)


class Job:
    """One kind of worker over a list of plan entries, started again on the rest where it dies."""

    def __init__(self, name: str, prefix: list[str], worker_args: list[str], plan: list[dict], indexes: list[int],
                 out: Path, log_name: str, deadline: float, env: dict[str, str], max_attempts: int = 4):
        self.name, self.prefix, self.worker_args, self.deadline, self.env = name, prefix, worker_args, deadline, env
        self.out, self.log_path = out, out / log_name
        text = json.dumps(plan, default=str)
        self.plan_path = out / "work" / f"plan-{hashlib.sha1(text.encode()).hexdigest()[:10]}.json"  # shared
        self.plan_path.parent.mkdir(parents=True, exist_ok=True)
        if not self.plan_path.exists():
            self.plan_path.write_text(text)
        self.pending = list(indexes)
        self.results: dict[int, dict] = {}
        self.runs: list[dict] = []
        self.info: dict = {}
        self.proc: subprocess.Popen | None = None
        self.attempt, self.max_attempts, self.finished = 0, max_attempts, False
        self.failure = ""
        self.after: list[Job] = []
        self.log_path.write_text("")
        ACTIVE_JOBS.append(self)

    def start(self) -> bool:
        """Start a worker on the pending entries; False (and finished) where there is nothing to do or
        too little time."""
        if not self.pending or self.attempt >= self.max_attempts or self.deadline - time.time() < MIN_START_S:
            self.finished = True
            return False
        self.attempt += 1
        self.results_path = self.out / "work" / f"{self.name}.{self.attempt}.jsonl"
        cmd = [*self.prefix, sys.executable, str(SCRIPT), *self.worker_args, "--plan", str(self.plan_path),
               "--results", str(self.results_path), "--deadline", f"{self.deadline:.1f}",
               "--indexes", ",".join(map(str, self.pending))]
        with open(self.log_path, "a") as fh:
            fh.write(f"{MARK} command {shlex.join(cmd)}\n")
            fh.flush()
            self.log_offset = fh.tell()
            self.started = time.time()
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=self.env,
                                         start_new_session=True)
        return True

    def kill(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)  # the worker's own session, started by this script
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def stop(self) -> None:
        """Kill a running worker and collect what it did (its item under way: killed)."""
        if self.proc is not None:
            self.kill()
            rc, self.proc = self.proc.returncode, None
            self._collect(rc, True)
        self.finished = True
        self.finish()

    def poll(self) -> bool:
        """Whether a worker is running (collecting one that ended, and starting the next if needed)."""
        if self.proc is None:
            return False
        rc = self.proc.poll()
        timed_out = False
        if rc is None:
            if time.time() < self.deadline + GRACE_S:
                return True
            self.kill()
            rc, timed_out = self.proc.returncode, True
        self.proc = None
        self._collect(rc, timed_out)
        return self.start() if not self.finished else False

    def _tail(self, lines: int = 6) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                fh.seek(self.log_offset)
                text = fh.read()
        except OSError:
            return ""
        keep = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(MARK)]
        return " | ".join(keep[-lines:])[-600:]

    def _collect(self, rc: int | None, timed_out: bool) -> None:
        events = []
        if self.results_path.exists():
            for line in self.results_path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    events.append(json.loads(line))
        begun, ended, stop = set(), set(), None
        if not events and not timed_out:  # the worker never started (a sanitizer that cannot run, say)
            self.failure = f"the worker did not start (exit {rc}): {self._tail(4)}"
            self.finished = True
        for ev in events:
            kind = ev.get("event")
            if kind == "start":
                self.info = {k: v for k, v in ev.items() if k not in ("event", "pid")}
            elif kind == "begin":
                begun.add(ev["index"])
            elif kind == "end":
                ended.add(ev["index"])
                self.results[ev["index"]] = {k: v for k, v in ev.items() if k not in ("event", "index")}
            elif kind in ("budget", "done", "abort"):
                stop = kind
        for i in begun - ended:
            status = "killed (time budget)" if timed_out else f"crash (exit {rc})"
            self.results[i] = {"status": status, "finding": not timed_out, "note": self._tail()}
        self.runs.append({"attempt": self.attempt, "rc": rc, "timed_out": timed_out, "stop": stop,
                          "seconds": round(time.time() - self.started, 1), "items": len(ended)})
        self.pending = [i for i in self.pending if i not in begun]
        if timed_out or stop in ("budget", "done") or not self.pending:
            self.finished = True

    def finish(self) -> None:
        for i in self.pending:
            self.results.setdefault(i, {"status": "not run (time budget)"})


ACTIVE_JOBS: list[Job] = []
REPORT_EVERY_S = 30.0


class Terminated(BaseException):
    """The script got SIGTERM (an outer timeout): its workers are stopped and the report written."""


def _terminate(signum, frame):
    raise Terminated(f"signal {signum}")


def run_jobs(jobs: list[Job], on_progress=None) -> None:
    """Run `jobs` until all are finished (each restarting its worker where it died): a job starts once
    every job of its `after` has finished (the sanitizers after the plain pass, which fills the kernel
    cache). `on_progress` is called when a job ends and every REPORT_EVERY_S; on the way out of an
    exception (Terminated included) the workers are killed."""
    try:
        reported = time.time()
        while True:
            for job in jobs:
                if job.attempt == 0 and not job.finished and all(a.finished for a in job.after):
                    job.start()
            live = [j for j in jobs if j.proc is not None]
            if not live and all(j.finished for j in jobs):
                break
            time.sleep(0.5)
            ended = [j for j in live if not j.poll()]
            if on_progress and (ended or time.time() - reported > REPORT_EVERY_S):
                on_progress()
                reported = time.time()
    finally:
        for job in jobs:
            job.stop()


BENIGN = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY", "Target application returned",
          "Saved host backtrace", "Host Frame", "Device Frame", "Note:", "Nothing to", "Memory leak")


def _counts() -> dict:
    return {"errors": 0, "warnings": 0, "api": 0, "messages": []}


def parse_sanitizer_log(text: str) -> dict:
    """Errors in a compute-sanitizer log, by workload (the worker's markers; index -> counts) and outside
    any: {"workloads": {index: counts}, "outside": counts, "summaries": [...], "total": N or None}, counts
    being errors, warnings, API errors ("Program hit ...") and the first messages with where they were."""
    per: dict[int, dict] = {}
    outside = _counts()
    current: int | None = None
    summaries: list[str] = []
    last: dict | None = None
    for line in text.splitlines():
        if line.startswith(MARK):
            parts = line.split()
            if len(parts) >= 3 and parts[1] == "begin" and parts[2].isdigit():
                current = int(parts[2])
            elif len(parts) >= 2 and parts[1] in ("end", "budget", "command"):
                current = None
            continue
        if not line.startswith("========="):
            continue
        body = line[len("========="):]
        if body.startswith(" ") and not body.startswith("  "):
            head = body.strip()
            last = None
            if head.startswith(BENIGN):
                if "SUMMARY" in head:
                    summaries.append(head)
                continue
            kind = "warnings" if head.lower().startswith("warning") else "api" if head.startswith("Program hit") \
                else "errors"
            rec = outside if current is None else per.setdefault(current, _counts())
            rec[kind] += 1
            if len(rec["messages"]) < 4:
                rec["messages"].append(head[:220])
                last = rec
        elif last is not None:
            where = re.match(r"\s+at (.+)", body)
            if where:
                last["messages"][-1] += f" (at {where.group(1).strip()[:140]})"
                last = None
    totals = [int(m.group(1)) for s in summaries for m in [re.search(r"ERROR SUMMARY: (\d+) error", s)] if m]
    return {"workloads": per, "outside": outside, "summaries": summaries, "total": sum(totals) if totals else None}


# ------------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------------

def md_table(header: list[str], rows: list[list]) -> str:
    def cell(v) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.1e}" if math.isfinite(x) else str(x)
    return str(x)


def _device(state: dict) -> str:
    for part in ("overflow", "long", "sanitize"):
        for info in state.get(part, {}).get("info", []):
            if info.get("device"):
                extra = ", ".join(f"{k} {info[k]}" for k in ("memory_gib", "cuda", "torch", "cupy") if k in info)
                return f"{info['device']} ({extra})"
    return "unknown (no worker started)"


def tool_cell(rec: dict | None, counts: dict | None) -> str:
    if rec is None:
        return "not run"
    status = rec.get("status", "?")
    if status in ("n/a", "not run (time budget)") or status.startswith(("crash", "killed")):
        return status
    errors = (counts or {}).get("errors", 0)
    text = "clean" if errors == 0 else f"**{errors} error{'s' * (errors != 1)}**"
    if (counts or {}).get("warnings"):
        text += f", {counts['warnings']} warnings"
    if status != "ok":
        text += f" ({status})"
    return text


def plain_cell(rec: dict | None) -> str:
    if rec is None:
        return "not run"
    status = rec.get("status", "?")
    if status == "ok":
        return f"ok {_fmt(rec.get('err'))}" if rec.get("err") is not None else "ok"
    if status == "MISMATCH":
        return f"**MISMATCH** {rec.get('note', '')}"
    if status in ("error", "CUDA error", "NON-FINITE") or status.startswith("crash"):
        return f"**{status}**: {rec.get('note', '')}"
    return status


def sanitize_section(state: dict) -> list[str]:
    s = state.get("sanitize")
    if not s:
        return []
    plan = s["plan"]
    passes = s.get("passes", {})
    out = ["## 1. compute-sanitizer", ""]
    out.append(f"compute-sanitizer: {s.get('sanitizer') or 'not found'} ({s.get('sanitizer_version', '-')}). Options: "
               f"`{' '.join(sanitizer_command('compute-sanitizer', 'TOOL')[1:])}`; workers with "
               "`PYTORCH_NO_CUDA_MEMORY_CACHING=1` (every tensor its own allocation, so memcheck sees past its "
               "end). Each workload: the forward with final states, then `ssmc.grad` "
               f"{s.get('grad_calls', 3)} times (the later calls take the prepared / lean steps), on inputs made on "
               "the host and copied over. The plain pass (no sanitizer) checks the same workloads against the "
               "float64 interpreter (outputs, final states, every gradient: largest relative error).")
    out.append("")
    runnable = [e for e in plan if e["status"] == "run"]
    rows = []
    for tool in ["none", *s.get("tools", [])]:
        p = passes.get(tool)
        label = "plain (no sanitizer)" if tool == "none" else tool
        if p is None:
            rows.append([label, "-", "-", "-", "-", "-", "-", "-", "not run"])
            continue
        if p.get("missing"):
            rows.append([label, "-", "-", "-", "-", "-", "-", "-", p["missing"]])
            continue
        res = p.get("results", {})
        ran = [i for i, r in res.items() if r.get("status") not in ("not run (time budget)",)]
        parsed = p.get("parsed") or {"workloads": {}, "outside": _counts(), "total": None}
        errors = sum(c["errors"] for c in parsed["workloads"].values()) + parsed["outside"]["errors"]
        api = sum(c["api"] for c in parsed["workloads"].values()) + parsed["outside"]["api"]
        warnings = sum(c["warnings"] for c in parsed["workloads"].values()) + parsed["outside"]["warnings"]
        crashes = [i for i, r in res.items() if str(r.get("status", "")).startswith("crash")]
        if tool == "none":
            bad = [i for i, r in res.items() if r.get("status") not in ("ok", "n/a", "not run (time budget)")]
            verdict = f"**{len(bad)} not ok**" if bad else "all ok" if ran else "nothing ran"
        elif errors or crashes:
            verdict = "**no**"
        else:
            verdict = "yes" if ran else "not checked (nothing ran)"
        if p.get("failure"):
            verdict += f" ({p['failure']})"
        exits = ", ".join(str(r["rc"]) + (" (killed)" if r["timed_out"] else "") for r in p.get("runs", []))
        sanitized = tool != "none"
        rows.append([label, f"{len(ran)} / {len(runnable)}", errors if sanitized else "-", api if sanitized else "-",
                     warnings if sanitized else "-", _fmt(parsed.get("total")) if sanitized else "-", exits or "-",
                     p.get("seconds", "-"), verdict])
    out.append(md_table(["pass", "workloads run / planned", "errors", "API errors", "warnings", "ERROR SUMMARY",
                         "exit codes", "seconds", "clean"], rows))
    out.append("")
    out.append("Per workload (`clean`: no error reported while it ran; `n/a`: the forced strategy does not apply at "
               "run time; `not run`: the pass's time ran out first):")
    out.append("")
    tools = [t for t in s.get("tools", []) if t in passes and not passes[t].get("missing")]
    rows = []
    for e in runnable:
        i = e["index"]
        cells = [plain_cell(passes.get("none", {}).get("results", {}).get(i))]
        for tool in tools:
            p = passes[tool]
            cells.append(tool_cell(p.get("results", {}).get(i), (p.get("parsed") or {}).get("workloads", {}).get(i)))
        if all(c.startswith("not run") for c in cells):
            continue
        rows.append([e["id"], ", ".join(e.get("labels", []))[:90] or "-", *cells])
    not_run = len(runnable) - len(rows)
    out.append(md_table(["workload", "kernels (strategy as planned)", "plain vs interpreter", *tools], rows))
    if not_run:
        out.append("")
        out.append(f"{not_run} planned workloads ran in no pass (time budget).")
    details = []
    for tool in tools:
        parsed = passes[tool].get("parsed") or {}
        for i, c in sorted(parsed.get("workloads", {}).items()):
            if c["errors"] or c["api"]:
                details.append(f"- {tool}, {plan[i]['id']}: {c['errors']} errors, {c['api']} API errors; "
                               + "; ".join(c["messages"]))
        o = parsed.get("outside", {})
        if o and (o["errors"] or o["api"]):
            details.append(f"- {tool}, outside any workload (start-up, exit): {o['errors']} errors, {o['api']} API "
                           "errors; " + "; ".join(o["messages"]))
        for i, r in passes[tool].get("results", {}).items():
            if str(r.get("status", "")).startswith(("crash", "killed", "error", "CUDA error")):
                details.append(f"- {tool}, {plan[i]['id']}: {r['status']}: {r.get('note', '')}")
    plain = passes.get("none", {}).get("results", {})
    for i, r in plain.items():
        if r.get("status") not in ("ok", "n/a", "not run (time budget)"):
            details.append(f"- plain, {plan[i]['id']}: {r['status']}: {r.get('note', '')}")
    if details:
        out += ["", "Details (the logs have the rest):", "", *details]
    na: dict[str, list[str]] = {}
    for e in plan:
        if e["status"] == "n/a" and e["strategy"] not in na.setdefault(e["example"], []):
            na[e["example"]].append(e["strategy"])
    if any(na.values()):
        out += ["", "Forced strategies that do not apply (n/a, by plan): "
                + "; ".join(f"{k}: {', '.join(v)}" for k, v in na.items() if v) + "."]
        reasons = sorted({e["note"] for e in plan if e["status"] == "n/a"})
        out += ["", "Why: " + " / ".join(reasons[:10])]
    same = [e for e in plan if e["status"] == "same"]
    if same:
        out += ["", f"{len(same)} forced strategies give the kernels of a strategy before them and are not run again, "
                "e.g. " + "; ".join(f"{e['id']}: {e['note']}" for e in same[:12]) + "."]
    out.append("")
    return out


def long_section(state: dict) -> list[str]:
    s = state.get("long")
    if not s:
        return []
    rows = []
    for item in s["plan"]:
        r = s.get("results", {}).get(item["index"], {"status": "not run"})
        rows.append([item["kind"], item["example"], f"{item['length']:,}", SHORT[item["dtype"]], r.get("status"),
                     _fmt(r.get("err")), r.get("worst", "-"), _fmt(r.get("max_abs")), r.get("seconds", "-"),
                     r.get("note", "")])
    return ["## 2. Long sequences", "",
            "Every output and final state (forward) or gradient must be finite; the error is the largest relative "
            "error (max |got - want| / max |want|, per array, the worst array named) against the same ssmc kernels "
            "run in float64 on the inputs rounded to the dtype (forward, gradient), or of ssmc's float32 run against "
            "the example's own NumPy reference in float64 (reference). Sizes: "
            + "; ".join(f"{k} " + " ".join(f"{a}={n}" for a, n in v.items()) for k, v in LONG_SIZES.items())
            + "; RetNet's decays gamma_h = 1 - 2^(-5 - h).", "",
            md_table(["kind", "example", "L", "dtype", "status", "rel err", "worst", "max abs", "seconds", "note"],
                     rows), "", *_problems(s)]


def _problems(s: dict) -> list[str]:
    """A part's worker failure and the tracebacks of its items that raised, as lines."""
    out = [f"The worker did not run: {s['failure']}", ""] if s.get("failure") else []
    for item in s["plan"]:
        r = s.get("results", {}).get(item["index"], {})
        if r.get("traceback"):
            tail = [ln for ln in r["traceback"].strip().splitlines() if ln.strip()][-4:]
            out += [f"{item['id']}:", "", "```", *tail, "```", ""]
    return out


def overflow_section(state: dict) -> list[str]:
    s = state.get("overflow")
    if not s:
        return []
    rows = []
    for item in s["plan"]:
        r = s.get("results", {}).get(item["index"], {"status": "not run"})
        finding = r.get("finding")
        rows.append([f"{item['kind']} {item['example']}", item["layout"], SHORT[item["dtype"]],
                     f"{item['batch']} x {item['dim']} x {item['length']} = {item['elements']:,}",
                     r.get("status"), _fmt(r.get("err")), "**yes**" if finding else "no" if finding is False else "-",
                     r.get("seconds", "-"), r.get("note", "")])
    return ["## 3. Inputs over 2^31 elements", "",
            f"Each sequence has more than 2^31 = {2**31:,} elements. \"right\": the channels compared (first, last, "
            "some between; all steps and the final state) within the tolerance of the results' dtype of the "
            "example's NumPy reference (forward) or the interpreter (gradient) run on just those channels in float64; "
            "a clear error (ValueError ...) is acceptable; a wrong answer, a CUDA error or a crash is a finding.", "",
            md_table(["workload", "layout", "dtype", "b x d x L = elements", "result", "rel err", "finding",
                      "seconds", "note"], rows), "", *_problems(s)]


def write_report(out: Path, state: dict) -> Path:
    meta = state["meta"]
    lines = ["# GPU robustness (issue 38)", "",
             f"- date: {meta['date']}",
             f"- device: {_device(state)}",
             f"- command: `{meta['command']}`",
             f"- commit: {meta.get('commit', '-')}",
             f"- budget: {meta['budget_s']} s{' (--quick)' if meta.get('quick') else ''}; "
             f"took {meta.get('elapsed_s', '-')} s", ""]
    for err in state.get("errors", []):
        if err["traceback"]:
            lines += [f"**The script failed in {err['part']}**: `{err['error']}`", "", "```", err["traceback"], "```",
                      ""]
        else:
            lines += [f"**Stopped early in {err['part']}**: {err['error']}", ""]
    lines += sanitize_section(state) + long_section(state) + overflow_section(state)
    path = out / "robustness.md"
    path.write_text("\n".join(lines))
    (out / "robustness.json").write_text(json.dumps(state, indent=1, default=str))
    return path


def summary_lines(state: dict) -> list[str]:
    lines = [f"device: {_device(state)}"]
    s = state.get("sanitize")
    if s:
        for tool, p in s.get("passes", {}).items():
            label = "plain" if tool == "none" else tool
            if p.get("missing"):
                lines.append(f"{label}: {p['missing']}")
                continue
            res = p.get("results", {})
            ran = sum(1 for r in res.values() if r.get("status") != "not run (time budget)")
            parsed = p.get("parsed")
            if tool == "none":
                bad = sum(1 for r in res.values() if r.get("status") not in ("ok", "n/a", "not run (time budget)"))
                lines.append(f"plain: {ran} workloads run, {bad} not ok")
            elif parsed is not None:
                errors = sum(c["errors"] for c in parsed["workloads"].values()) + parsed["outside"]["errors"]
                verdict = "NOT clean" if errors else "clean" if ran else "nothing ran"
                lines.append(f"{tool}: {ran} workloads run, {errors} errors ({verdict})"
                             + (f"; {p['failure']}" if p.get("failure") else ""))
    for part in ("long", "overflow"):
        s = state.get(part)
        if s:
            res = s.get("results", {})
            text = ", ".join(f"{item['id']}: {res.get(item['index'], {}).get('status', 'not run')}"
                             + (f" ({_fmt(res[item['index']]['err'])})" if res.get(item["index"], {}).get("err")
                                is not None else "")
                             for item in s["plan"])
            lines.append(f"{part}: {text}")
    return lines


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------

def _csv(text: str | None, cast=str):
    if text is None:
        return None
    return [cast(x.strip()) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Modes run by default: all three (the module docstring says what each checks).")
    p.add_argument("--out", default=os.environ.get("OUT") or "robustness-out",
                   help="folder for robustness.md, robustness.json and the logs (default: $OUT, else ./robustness-out)")
    p.add_argument("--quick", action="store_true", help="a small subset of every mode")
    p.add_argument("--sanitize", action="store_true", help="run the compute-sanitizer mode")
    p.add_argument("--long", action="store_true", help="run the long-sequence mode (L = 1,000,000)")
    p.add_argument("--overflow", action="store_true", help="run the mode with inputs over 2^31 elements")
    p.add_argument("--budget-s", type=float, default=450.0, help="time for the whole run, seconds (default 450)")
    p.add_argument("--tools", default=",".join(TOOLS), help="sanitizer tools, comma-separated ('' for none)")
    p.add_argument("--no-plain", action="store_true", help="skip the plain pass (no sanitizer) before the tools")
    p.add_argument("--plain-workers", type=int, default=6, help="processes of the plain pass (default 6)")
    p.add_argument("--examples", help="sanitizer examples, comma-separated (default: every recurrence)")
    p.add_argument("--lengths", help="sanitizer lengths, comma-separated (default 180,1000,7,1)")
    p.add_argument("--strategies", help="sanitizer strategies, comma-separated: auto and options.STRATEGIES")
    p.add_argument("--max-tier", type=int, help="sanitizer plan tiers up to this one (0: L=180 own layout only)")
    p.add_argument("--grad-calls", type=int, default=3, help="ssmc.grad calls a sanitizer workload (default 3)")
    p.add_argument("--sanitizer", help="path of compute-sanitizer (default: PATH, CUDA_HOME, /usr/local/cuda*)")
    p.add_argument("--list", action="store_true", help="print the plans (worked out on the host) and exit")
    internal = p.add_argument_group("internal (the workers the script starts)")
    internal.add_argument("--sanitize-worker", metavar="TOOL", help="run sanitizer workloads in this process "
                          "(TOOL: the sanitizer it runs under, 'none' for the plain pass)")
    internal.add_argument("--worker", choices=("long", "overflow"), help="run long or overflow items in this process")
    internal.add_argument("--plan", help="the plan file (JSON) a worker reads")
    internal.add_argument("--results", help="the results file (JSON lines) a worker appends to")
    internal.add_argument("--deadline", type=float, help="epoch seconds after which a worker starts nothing new")
    internal.add_argument("--indexes", help="plan indexes a worker runs, in order")
    args = p.parse_args(argv)
    if (args.sanitize_worker or args.worker) and not (args.plan and args.results):
        p.error("a worker needs --plan and --results")
    return args


def _plan_from_args(args) -> list[dict]:
    return sanitize_plan(_csv(args.examples), args.quick, _csv(args.lengths, int), _csv(args.strategies),
                         args.max_tier)


def list_plans(args, modes: list[str]) -> None:
    if "sanitize" in modes:
        plan = _plan_from_args(args)
        runnable = sum(e["status"] == "run" for e in plan)
        log(f"sanitizer plan: {len(plan)} entries, {runnable} to run")
        for e in plan:
            log(f"  {e['index']:4d} tier {e['tier']} {e['status']:4s} {e['id']}: "
                f"{e['note'] or ', '.join(e['labels'])[:100]}")
    if "long" in modes:
        log("long-sequence plan:")
        for item in long_plan(args.quick):
            log(f"  {item['index']:4d} {item['id']}")
    if "overflow" in modes:
        log("overflow plan:")
        for item in overflow_plan(args.quick):
            log(f"  {item['index']:4d} {item['id']} ({item['elements']:,} elements, about "
                f"{overflow_bytes(item) / 2**30:.0f} GiB)")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.sanitize_worker or args.worker:
        return worker_main(args)
    modes = [m for m in ("sanitize", "long", "overflow") if getattr(args, m)] or ["sanitize", "long", "overflow"]
    if args.list:
        list_plans(args, modes)
        return 0
    out = Path(args.out).resolve()
    (out / "work").mkdir(parents=True, exist_ok=True)
    start = time.time()
    commit = "-"
    with contextlib.suppress(Exception):
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or "-"
    state: dict = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                            "command": shlex.join(["python", *sys.argv]) if argv is None
                            else shlex.join(["python", "bench/gpu_robustness.py", *argv]),
                            "commit": commit, "budget_s": args.budget_s, "quick": args.quick},
                   "errors": []}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    broken = False
    previous = None
    with contextlib.suppress(ValueError):  # not the main thread (a test calling main)
        previous = signal.signal(signal.SIGTERM, _terminate)

    def report() -> None:
        state["meta"]["elapsed_s"] = round(time.time() - start, 1)
        write_report(out, state)

    def failed(part: str, err: BaseException) -> None:
        nonlocal broken
        broken = True
        state["errors"].append({"part": part, "error": short_reason(err), "traceback": traceback.format_exc()})
        log(f"{part} failed: {short_reason(err)}")

    end = start + args.budget_s
    first_end = start + (0.35 * args.budget_s if "sanitize" in modes and len(modes) > 1 else
                         0.3 * args.budget_s if "sanitize" in modes else args.budget_s)
    parts: dict[str, list[Job]] = {}

    def gather() -> None:
        """The jobs' results so far into `state`, and the report written."""
        for part in ("overflow", "long"):
            if part in parts:
                job = parts[part][0]
                state[part].update(results=dict(job.results), info=[job.info] if job.info else [], runs=job.runs,
                                   failure=job.failure)
        s = state.get("sanitize")
        if s is not None and "none" in parts:
            jobs = parts["none"]
            s["passes"]["none"] = {
                "results": {i: r for job in jobs for i, r in job.results.items()},
                "runs": [r for job in jobs for r in job.runs],
                "seconds": round(max((sum(r["seconds"] for r in job.runs) for job in jobs), default=0), 1),
                "failure": "; ".join(job.failure for job in jobs if job.failure)}
        for job in parts.get("tools", []):
            tool = job.name.removeprefix("sanitizer-")
            text = job.log_path.read_text(errors="replace") if job.log_path.exists() else ""
            s["passes"][tool] = {"results": dict(job.results), "runs": job.runs, "parsed": parse_sanitizer_log(text),
                                 "failure": job.failure, "seconds": round(sum(r["seconds"] for r in job.runs), 1)}
        if s is not None:
            s["info"] = [job.info for job in parts.get("none", []) + parts.get("tools", []) if job.info][:1]
        report()

    try:
        report()
        for part, plan_fn in (("overflow", overflow_plan), ("long", long_plan)):
            if part in modes:
                plan = plan_fn(args.quick)
                state[part] = {"plan": plan, "results": {}, "info": []}
                job = Job(part, [], ["--worker", part], plan, [e["index"] for e in plan], out, f"{part}.log",
                          first_end, env, max_attempts=len(plan) + 1)
                parts[part] = [job]
                job.start()  # while the sanitizer workloads are planned
        tools = [t for t in (_csv(args.tools) or []) if t]
        if "sanitize" in modes:
            log("planning the sanitizer workloads (host only) ...")
            try:
                plan = _plan_from_args(args)
            except Exception as err:
                failed("planning", err)
                plan = None
            if plan is not None:
                runnable = [e["index"] for e in plan if e["status"] == "run"]
                sanitizer = find_sanitizer(args.sanitizer)
                s = state["sanitize"] = {
                    "plan": plan, "tools": tools, "passes": {}, "sanitizer": sanitizer, "info": [],
                    "grad_calls": args.grad_calls,
                    "sanitizer_version": _version([sanitizer, "--version"]) if sanitizer else "-"}
                log(f"sanitizer plan: {len(runnable)} workloads to run, {len(plan) - len(runnable)} n/a or same "
                    "kernels")
                worker = ["--grad-calls", str(args.grad_calls)]
                if not args.no_plain:
                    k = max(1, args.plain_workers)
                    parts["none"] = [Job(f"plain-{w + 1}", [], ["--sanitize-worker", "none", *worker], plan,
                                         runnable[w::k], out, f"plain-{w + 1}.log" if k > 1 else "plain.log",
                                         first_end, env) for w in range(k)]
                tool_env = {**env, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
                for tool in tools:
                    if not sanitizer:
                        s["passes"][tool] = {"missing": "compute-sanitizer not found (give --sanitizer PATH)"}
                        continue
                    job = Job(f"sanitizer-{tool}", sanitizer_command(sanitizer, tool),
                              ["--sanitize-worker", tool, *worker], plan, runnable, out, f"sanitizer-{tool}.log", end,
                              tool_env)
                    job.after = parts.get("none", [])
                    parts.setdefault("tools", []).append(job)
        log(f"running: {', '.join(sorted({j.name.split('-')[0] for jobs in parts.values() for j in jobs}))}; "
            f"the plain pass, long and overflow until {first_end - start:.0f} s, the sanitizers (after the plain "
            f"pass) until {end - start:.0f} s")
        run_jobs([j for jobs in parts.values() for j in jobs], on_progress=gather)
    except Terminated as err:
        state["errors"].append({"part": "the run", "error": f"terminated ({err}): workers stopped", "traceback": ""})
    except Exception as err:
        failed("the run", err)
    finally:
        for job in ACTIVE_JOBS:
            job.stop()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    try:
        gather()
    except Exception as err:
        failed("the report", err)
    report()
    log("")
    for line in summary_lines(state):
        log(line)
    log(f"report: {out / 'robustness.md'}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
