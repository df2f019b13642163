"""CPU benchmark: ssmc against PyTorch and a hand-written Numba loop, in one run.

    python bench/cpu.py                                  # full sizes, ssmc backend "numba"
    python bench/cpu.py --backend interpreter            # the float64 interpreter (quick sizes, see below)
    python bench/cpu.py --quick --backend interpreter    # small smoke run (tests/test_bench_smoke.py)

Workloads (fp32 inputs):

- Mamba-1 selective scan, B=2 D=256 L=1024 N=16, layout "b d t": softplus(delta + delta_bias), D skip,
  silu(z) gate -- exactly `ssmc.examples.mamba1`.
    peer "torch loop": a Python loop over time doing torch ops on (B, D, N) tensors, in the style of
      mamba-ssm's reference scan (per-step tensors split with unbind; see torch_selective_scan); forward
      (under no_grad) and forward+backward through autograd.
    peer "numba loop": a plain @numba.njit(parallel=True) loop (prange over b*d, time loop, inner loop over
      n; fastmath off), forward only.
    peer "mamba-ssm selective_scan_ref": the issue's baseline, mamba-ssm's own reference scan (torch ops,
      autograd for the backward), loaded at run time from the mamba-ssm sdist in --peers (default
      <repo>/peers; git-ignored): only that function's source is taken from the archive and executed
      with torch and einops (einops from the peers folder's wheel if not installed), so neither the
      package nor its CUDA extension is imported. Without the sdist the row is left out with a note.
- LSTM, B=16 L=180 I=256 H=256: peer torch.nn.LSTM (weights mapped onto `ssmc.examples.lstm`'s W, U, bias).

ssmc runs `ssmc.compile(SPEC, backend=...)` (forward) and, for forward+backward, a training step through
`ssmc.torch.function(SPEC, backend)` (its forward keeps the tape its backward reads; torch tensors that
require grad, then torch.autograd.grad), with the same cotangent dy (loss = sum(y * dy)), as the torch
peers are measured. If the requested backend does not exist (ValueError from
ssmc.compile) the run falls back to "interpreter". The interpreter computes in float64 and is slow at the
full sizes (the LSTM takes ~40 s per forward+backward), so whenever ssmc runs on the interpreter the quick
sizes are used; the output says so.

Before any timing every output is checked against a float64 reference: forwards against the examples'
NumPy `reference`, gradients against torch autograd run in float64 on the same inputs (relative error
max|got - want| / max|want|; fp32 results: 1e-4 forward, 1e-3 gradients). A failed check exits with
status 1 and no timings.

Timing: the first call (compilation, caches) is reported separately; then the median of N calls, N chosen
so that one measurement takes about --target-seconds (at least 5 calls), each call on fresh seeded random
inputs created outside the timed region; torch and numba both use --threads threads. The output records how
much of the cores other processes used during the run and warns when that is more than a few percent: on a
shared machine torch's OpenMP threads (default, spinning wait policy) slow down many times over, so such
timings say nothing about the implementations.
"""

from __future__ import annotations

import argparse
import ast
import copy
import datetime
import gc
import importlib
import math
import os
import platform
import shlex
import statistics
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numba
import numpy as np
import torch
import torch.nn.functional as F

import ssmc
import ssmc.torch as ssmc_torch

# the repository's examples/, installed as ssmc.examples
mamba1_example = importlib.import_module("ssmc.examples.mamba1")
lstm_example = importlib.import_module("ssmc.examples.lstm")

FULL_SIZES = {"mamba1": {"B": 2, "D": 256, "L": 1024, "N": 16}, "lstm": {"B": 16, "L": 180, "I": 256, "H": 256}}
QUICK_SIZES = {"mamba1": {"B": 2, "D": 16, "L": 48, "N": 4}, "lstm": {"B": 2, "L": 16, "I": 16, "H": 16}}
QUICK_TARGET_SECONDS = 0.05
MIN_REPEATS = 5
MAX_REPEATS = 10_000
FWD_TOL = {np.float32: 1e-4, np.float64: 1e-9}    # relative, by the dtype the implementation returns
GRAD_TOL = {np.float32: 1e-3, np.float64: 1e-8}
MAMBA_LAYOUT = "b d t"
MAMBA_INPUTS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
LSTM_LAYOUT = "b t ..."
BUSY_SHARE = 0.05                                  # other processes' share of the cores above which we warn
ENV_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS", "NUMBA_THREADING_LAYER")


# -- peers: Mamba-1 ----------------------------------------------------------------------------

def torch_selective_scan(u, delta, A, B, C, D, z, delta_bias):
    """Mamba-1 scan as a time loop of torch ops. u, delta, z [b d l]; A [d n]; B, C [b n l]; D, delta_bias [d].

    The per-step factors are computed for all steps at once and split with `unbind`, not indexed as
    `decay[:, :, t]` inside the loop: autograd's backward of such an index writes a zero tensor of the whole
    [b d l n] input per step, which makes the backward quadratic in l (~100x slower at l = 1024).
    """
    dt = F.softplus(delta + delta_bias[:, None])                                      # [b d l]
    decay = torch.exp(dt.unsqueeze(-1) * A[None, :, None, :]).unbind(2)              # l x [b d n]
    drive = ((dt * u).unsqueeze(-1) * B.transpose(1, 2).unsqueeze(1)).unbind(2)      # l x [b d n]
    c_steps = C.unbind(2)                                                             # l x [b n]
    h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])                               # [b d n]
    steps = []
    for t in range(u.shape[2]):
        h = decay[t] * h + drive[t]
        steps.append(torch.einsum("bdn,bn->bd", h, c_steps[t]))
    y = torch.stack(steps, dim=2) + D[:, None] * u
    return y * F.silu(z)


@numba.njit(parallel=True, fastmath=False)
def numba_selective_scan(u, delta, A, B, C, D, z, delta_bias):
    """The same scan, fp32 throughout: one (b, d) channel per prange iteration, its n states in a local array."""
    nb, nd, nt = u.shape
    ns = A.shape[1]
    one = np.float32(1.0)
    y = np.empty_like(u)
    for bd in numba.prange(nb * nd):
        b = bd // nd
        d = bd - b * nd
        h = np.zeros(ns, dtype=np.float32)
        for t in range(nt):
            x = delta[b, d, t] + delta_bias[d]
            dt = math.log1p(math.exp(-abs(x)))               # softplus(x) = max(x, 0) + log1p(exp(-|x|))
            if x > 0:
                dt += x
            dtu = dt * u[b, d, t]
            acc = np.float32(0.0)
            for n in range(ns):
                h[n] = math.exp(dt * A[d, n]) * h[n] + dtu * B[b, n, t]
                acc += h[n] * C[b, n, t]
            zt = z[b, d, t]
            y[b, d, t] = (acc + D[d] * u[b, d, t]) * (zt / (one + math.exp(-zt)))
    return y


def load_selective_scan_ref(peers: Path) -> tuple[Callable | None, str]:
    """mamba-ssm's `selective_scan_ref` from the sdist in `peers` (see the module docstring), or None and why.

    The module it lives in imports mamba-ssm's CUDA extension at its top, so only the function's own
    source is compiled (its globals: torch, F, rearrange, repeat)."""
    archives = sorted(peers.glob("mamba_ssm-*.tar.gz"))
    if not archives:
        return None, f"mamba-ssm sdist not found in {peers}: mamba-ssm's selective_scan_ref not measured"
    try:
        import einops
    except ImportError:
        wheels = sorted(peers.glob("einops-*.whl"))
        if not wheels:
            return None, "einops is not installed and not in the peers folder: selective_scan_ref not measured"
        sys.path.append(str(wheels[-1]))  # a pure-Python wheel imports from the zip
        import einops
    with tarfile.open(archives[-1]) as tar:
        member = next((m for m in tar.getmembers()
                       if m.name.endswith("mamba_ssm/ops/selective_scan_interface.py")), None)
        if member is None:
            return None, f"{archives[-1].name} has no selective_scan_interface.py: selective_scan_ref not measured"
        source = tar.extractfile(member).read().decode()
    fn = next((n for n in ast.parse(source).body
               if isinstance(n, ast.FunctionDef) and n.name == "selective_scan_ref"), None)
    if fn is None:
        return None, f"{archives[-1].name} defines no selective_scan_ref: not measured"
    namespace = {"torch": torch, "F": F, "rearrange": einops.rearrange, "repeat": einops.repeat}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), f"{archives[-1].name}:{member.name}", "exec"), namespace)
    return namespace["selective_scan_ref"], f"mamba-ssm selective_scan_ref from {archives[-1].name}"


def mamba_ssm_ref(ref):
    """`ref` (mamba-ssm's selective_scan_ref) with this bench's argument order."""

    def call(u, delta, A, B, C, D, z, delta_bias):
        return ref(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True)

    return call


# -- measuring -----------------------------------------------------------------------------------

@dataclass
class Timing:
    first_s: float            # the warm-up call: compilation and first-touch costs included
    median_s: float
    repeats: int
    iqr_s: float              # interquartile range of the timed calls


def measure(call: Callable[[object], object], make_args: Callable[[int], object], target_s: float,
            min_repeats: int = MIN_REPEATS) -> Timing:
    """The first call, up to 3 calibration calls, then the median of N calls (N for ~target_s in all, at
    least min_repeats; cut short past 3 * target_s). make_args(i) makes call i's inputs outside the timer."""

    def timed(i: int) -> float:
        args = make_args(i)
        start = time.perf_counter()
        call(args)
        return time.perf_counter() - start

    first = timed(0)
    calibration = []
    while len(calibration) < 3 and sum(calibration) < target_s / 2:
        calibration.append(timed(1 + len(calibration)))
    one = statistics.median(calibration)
    repeats = min(MAX_REPEATS, max(min_repeats, round(target_s / max(one, 1e-9))))
    times: list[float] = []
    gc.collect()
    for i in range(repeats):
        times.append(timed(4 + i))
        if len(times) >= min_repeats and sum(times) > 3 * target_s:
            break
    q1, _, q3 = statistics.quantiles(times, n=4)
    return Timing(first, statistics.median(times), len(times), q3 - q1)


def _cpu_busy_seconds() -> float | None:
    """Seconds all cores together spent busy since boot (/proc/stat; None where there is none)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)        # idle + iowait
    busy = sum(fields[:8]) - idle                                     # up to steal; guest time is inside user
    return busy / os.sysconf("SC_CLK_TCK")


@dataclass
class Load:
    """How much of the machine other processes took while this run went: the benchmark shares the cores."""

    load_avg: float = field(default_factory=lambda: os.getloadavg()[0])
    wall: float = field(default_factory=time.perf_counter)
    busy: float | None = field(default_factory=_cpu_busy_seconds)
    own: float = field(default_factory=lambda: sum(os.times()[:2]))

    def others_share(self) -> float | None:
        """Share of all cores' time that other processes used since this snapshot (0 to 1)."""
        busy = _cpu_busy_seconds()
        if busy is None or self.busy is None:
            return None
        wall = time.perf_counter() - self.wall
        others = (busy - self.busy) - (sum(os.times()[:2]) - self.own)
        return max(0.0, others / (wall * (os.cpu_count() or 1)))


@dataclass
class Row:
    workload: str
    implementation: str
    dtype: str
    fwd: Timing | None = None
    fwd_bwd: Timing | None = None
    build_s: float | None = None  # ssmc.compile + ssmc.torch.function construction


@dataclass
class Check:
    what: str
    err: float
    tol: float

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.err)) and self.err <= self.tol


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    load: Load = field(default_factory=Load)

    def check(self, what: str, got, want, tols: dict) -> None:
        got = _numpy(got)
        want = np.asarray(want, dtype=np.float64)
        if got.shape != want.shape:
            self.checks.append(Check(f"{what} (shape {got.shape} != {want.shape})", math.inf, 0.0))
            return
        tol = tols.get(got.dtype.type, tols[np.float32])
        err = float(np.abs(got.astype(np.float64) - want).max() / max(float(np.abs(want).max()), 1e-30))
        self.checks.append(Check(f"{what} [{got.dtype}]", err, tol))


def _numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _rng(seed: int, workload: str, i: int) -> np.random.Generator:
    return np.random.default_rng([seed, sum(map(ord, workload)), i])


# -- Mamba-1 -------------------------------------------------------------------------------------

def mamba_inputs(rng: np.random.Generator, s: dict) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """fp32 inputs (the example's distributions; zero initial state) and a cotangent dy [b d l]."""
    inputs = mamba1_example.make_inputs(rng, s["L"], batch=s["B"], dim=s["D"], state=s["N"])
    inputs.pop("h")
    inputs = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in inputs.items()}
    dy = rng.standard_normal((s["B"], s["D"], s["L"]), dtype=np.float32)
    return inputs, dy


def bench_mamba(report: Report, fwd, grad, backend: str, build_s: float, s: dict, seed: int, target: float,
                ref=None):
    """`ref`: mamba-ssm's selective_scan_ref in this bench's argument order (None: not measured)."""
    name = f"mamba1 B={s['B']} D={s['D']} L={s['L']} N={s['N']}"
    inputs, dy = mamba_inputs(_rng(seed, "mamba1-check", 0), s)
    as64 = {k: v.astype(np.float64) for k, v in inputs.items()}

    # checks: forwards against the example's float64 NumPy reference, gradients against float64 autograd
    y_ref, _ = mamba1_example.reference(**as64)
    t64 = {k: torch.from_numpy(v).requires_grad_() for k, v in as64.items()}
    y64 = torch_selective_scan(*(t64[k] for k in MAMBA_INPUTS))
    report.check("mamba1 torch loop fp64 fwd vs numpy reference", y64, y_ref, FWD_TOL)
    g_ref = torch.autograd.grad((y64 * torch.from_numpy(dy.astype(np.float64))).sum(),
                                [t64[k] for k in MAMBA_INPUTS])
    g_ref = dict(zip(MAMBA_INPUTS, (g.numpy() for g in g_ref)))

    t32 = {k: torch.from_numpy(v).requires_grad_() for k, v in inputs.items()}
    y32 = torch_selective_scan(*(t32[k] for k in MAMBA_INPUTS))
    report.check("mamba1 torch loop fwd", y32, y_ref, FWD_TOL)
    g32 = torch.autograd.grad((y32 * torch.from_numpy(dy)).sum(), [t32[k] for k in MAMBA_INPUTS])
    for k, g in zip(MAMBA_INPUTS, g32):
        report.check(f"mamba1 torch loop d{k}", g, g_ref[k], GRAD_TOL)

    report.check("mamba1 numba loop fwd", numba_selective_scan(*(inputs[k] for k in MAMBA_INPUTS)), y_ref, FWD_TOL)
    if ref is not None:
        r32 = {k: torch.from_numpy(v).requires_grad_() for k, v in inputs.items()}
        yr = ref(*(r32[k] for k in MAMBA_INPUTS))
        report.check("mamba1 mamba-ssm selective_scan_ref fwd", yr, y_ref, FWD_TOL)
        gr = torch.autograd.grad((yr * torch.from_numpy(dy)).sum(), [r32[k] for k in MAMBA_INPUTS])
        for k, g in zip(MAMBA_INPUTS, gr):
            report.check(f"mamba1 mamba-ssm selective_scan_ref d{k}", g, g_ref[k], GRAD_TOL)

    y_ssmc = _numpy(fwd(**inputs))
    report.check(f"mamba1 ssmc[{backend}] fwd", y_ssmc, y_ref, FWD_TOL)
    g_ssmc = train_step(grad, inputs, dy)
    for k in MAMBA_INPUTS:
        report.check(f"mamba1 ssmc[{backend}] d{k}", g_ssmc[k], g_ref[k], GRAD_TOL)
    if not all(c.ok for c in report.checks):
        return  # main() reports the failure before any timing

    # timings, each call on fresh inputs
    def fresh(i):
        return mamba_inputs(_rng(seed, "mamba1", i), s)

    def torch_args(i, requires_grad):
        arrays, cot = fresh(i)
        return [torch.from_numpy(arrays[k]).requires_grad_(requires_grad) for k in MAMBA_INPUTS], torch.from_numpy(cot)

    def torch_fwd(a):
        with torch.no_grad():
            torch_selective_scan(*a[0])

    def torch_fwd_bwd(a):
        leaves, cot = a
        torch.autograd.grad((torch_selective_scan(*leaves) * cot).sum(), leaves)

    def ssmc_fwd_bwd(a):
        train_step(grad, *a)

    report.rows.append(Row(name, "torch loop (autograd)", "float32",
                           measure(torch_fwd, lambda i: torch_args(i, False), target),
                           measure(torch_fwd_bwd, lambda i: torch_args(i, True), target)))
    if ref is not None:
        def ref_fwd(a):
            with torch.no_grad():
                ref(*a[0])

        def ref_fwd_bwd(a):
            leaves, cot = a
            torch.autograd.grad((ref(*leaves) * cot).sum(), leaves)

        # its backward takes ~20 s per call at the full sizes: the median of 2 calls after a warm-up
        report.rows.append(Row(name, "mamba-ssm selective_scan_ref (autograd)", "float32",
                               measure(ref_fwd, lambda i: torch_args(i, False), target),
                               measure(ref_fwd_bwd, lambda i: torch_args(i, True), target, min_repeats=2)))
    report.rows.append(Row(name, "numba loop (prange b*d)", "float32",
                           measure(lambda a: numba_selective_scan(*(a[0][k] for k in MAMBA_INPUTS)), fresh, target)))
    report.rows.append(Row(name, f"ssmc [{backend}]", str(y_ssmc.dtype),
                           measure(lambda a: fwd(**a[0]), fresh, target),
                           measure(ssmc_fwd_bwd, fresh, target), build_s))


# -- LSTM ----------------------------------------------------------------------------------------

def lstm_weights(net: torch.nn.LSTM) -> dict[str, np.ndarray]:
    """torch.nn.LSTM's weights as the example's params: W [i 4 k], U [j 4 k], bias [4 k] (rows g * k + k')."""
    inp, hidden = net.input_size, net.hidden_size
    w = {k: v.detach().numpy() for k, v in net.named_parameters()}
    return {"W": np.ascontiguousarray(w["weight_ih_l0"].T.reshape(inp, 4, hidden)),
            "U": np.ascontiguousarray(w["weight_hh_l0"].T.reshape(hidden, 4, hidden)),
            "bias": (w["bias_ih_l0"] + w["bias_hh_l0"]).reshape(4, hidden)}


def lstm_grads_as_params(net: torch.nn.LSTM, grads) -> dict[str, np.ndarray]:
    """Gradients of (weight_ih, weight_hh, bias_ih, bias_hh) in the example's param layout."""
    g_ih, g_hh, g_bih, _ = (g.detach().numpy() for g in grads)
    inp, hidden = net.input_size, net.hidden_size
    # bias = bias_ih + bias_hh, so both torch biases get the same gradient as the example's bias
    return {"W": g_ih.T.reshape(inp, 4, hidden), "U": g_hh.T.reshape(hidden, 4, hidden),
            "bias": g_bih.reshape(4, hidden)}


def lstm_data(rng: np.random.Generator, s: dict) -> tuple[np.ndarray, np.ndarray]:
    x = rng.standard_normal((s["B"], s["L"], s["I"]), dtype=np.float32)
    dy = rng.standard_normal((s["B"], s["L"], s["H"]), dtype=np.float32)
    return x, dy


def bench_lstm(report: Report, fwd, grad, backend: str, build_s: float, s: dict, seed: int, target: float):
    name = f"lstm B={s['B']} L={s['L']} I={s['I']} H={s['H']}"
    torch.manual_seed(seed)
    net = torch.nn.LSTM(s["I"], s["H"], batch_first=True)       # fp32, torch's default init
    params = list(net.parameters())                               # weight_ih, weight_hh, bias_ih, bias_hh
    weights = lstm_weights(net)
    x, dy = lstm_data(_rng(seed, "lstm-check", 0), s)

    y_ref, _ = lstm_example.reference(x.astype(np.float64), **{k: v.astype(np.float64) for k, v in weights.items()})
    net64 = copy.deepcopy(net).double()
    with torch.no_grad():  # the example's bias is b_ih + b_hh rounded to fp32: give the fp64 net exactly that
        net64.bias_ih_l0.copy_(torch.from_numpy(weights["bias"].reshape(-1)))
        net64.bias_hh_l0.zero_()
    x64 = torch.from_numpy(x.astype(np.float64)).requires_grad_()
    y64, _ = net64(x64)
    report.check("lstm torch.nn.LSTM fp64 fwd vs numpy reference", y64, y_ref, FWD_TOL)
    g = torch.autograd.grad((y64 * torch.from_numpy(dy.astype(np.float64))).sum(), [x64, *net64.parameters()])
    g_ref = {"x": g[0].numpy(), **lstm_grads_as_params(net64, g[1:])}

    x32 = torch.from_numpy(x).requires_grad_()
    y32, _ = net(x32)
    report.check("lstm torch.nn.LSTM fwd", y32, y_ref, FWD_TOL)
    g = torch.autograd.grad((y32 * torch.from_numpy(dy)).sum(), [x32, *params])
    for k, v in {"x": g[0].numpy(), **lstm_grads_as_params(net, g[1:])}.items():
        report.check(f"lstm torch.nn.LSTM d{k}", v, g_ref[k], GRAD_TOL)

    y_ssmc = _numpy(fwd(x=x, **weights))
    report.check(f"lstm ssmc[{backend}] fwd", y_ssmc, y_ref, FWD_TOL)
    g_ssmc = train_step(grad, {"x": x, **weights}, dy)
    for k in ("x", "W", "U", "bias"):
        report.check(f"lstm ssmc[{backend}] d{k}", g_ssmc[k], g_ref[k], GRAD_TOL)
    if not all(c.ok for c in report.checks):
        return

    def fresh(i):
        return lstm_data(_rng(seed, "lstm", i), s)

    def torch_args(i, requires_grad):
        xi, dyi = fresh(i)
        return torch.from_numpy(xi).requires_grad_(requires_grad), torch.from_numpy(dyi)

    def torch_fwd(a):
        with torch.no_grad():
            net(a[0])

    def torch_fwd_bwd(a):
        xi, dyi = a
        torch.autograd.grad((net(xi)[0] * dyi).sum(), [xi, *params])

    def ssmc_fwd_bwd(a):
        xi, dyi = a
        train_step(grad, {"x": xi, **weights}, dyi)

    report.rows.append(Row(name, "torch.nn.LSTM", "float32",
                           measure(torch_fwd, lambda i: torch_args(i, False), target),
                           measure(torch_fwd_bwd, lambda i: torch_args(i, True), target)))
    report.rows.append(Row(name, f"ssmc [{backend}]", str(y_ssmc.dtype),
                           measure(lambda a: fwd(x=a[0], **weights), fresh, target),
                           measure(ssmc_fwd_bwd, fresh, target), build_s))


# -- ssmc ----------------------------------------------------------------------------------------

def build(spec, backend: str, layout: str):
    """ssmc.compile (the forward) and ssmc.torch.function (a training step) for a backend, and the
    seconds they took."""
    start = time.perf_counter()
    fwd = ssmc.compile(spec, backend=backend, layout=layout)
    train = ssmc_torch.function(spec, backend, layout=layout)
    return fwd, train, time.perf_counter() - start


def train_step(train, arrays: dict, cot: np.ndarray) -> dict:
    """A training step through `ssmc.torch` (its forward keeps the tape the backward reads):
    y = f(**arrays); gradients of sum(y * cot) by input name, as NumPy arrays."""
    leaves = {k: torch.from_numpy(v).requires_grad_() for k, v in arrays.items()}
    grads = torch.autograd.grad((train(**leaves) * torch.from_numpy(cot)).sum(), list(leaves.values()))
    return {k: g.numpy() for k, g in zip(leaves, grads)}


# -- output --------------------------------------------------------------------------------------

def _ms(t: Timing | None) -> str:
    return "—" if t is None else f"{t.median_s * 1e3:.3f} ±{100 * t.iqr_s / t.median_s:.0f}% (n={t.repeats})"


def _ratio(peer: Timing | None, ours: Timing | None) -> str:
    return "—" if peer is None or ours is None else f"{peer.median_s / ours.median_s:.2f}×"


def _share(x: float | None) -> str:
    return "an unknown share" if x is None else f"{100 * x:.0f}%"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _environment() -> str:
    env = ", ".join(f"{k}={os.environ[k]}" for k in ENV_VARS if k in os.environ) or "none of " + " ".join(ENV_VARS)
    return f"numba threading layer {numba.threading_layer()}; env: {env}"


def render(report: Report, args, backend: str, sizes: dict, target: float) -> str:
    model = _cpu_model()
    others = report.load.others_share()
    if others is not None and others > BUSY_SHARE:
        report.notes.append(f"other processes used {_share(others)} of the cores during the run: the timings are "
                            "NOT reliable (torch's OpenMP threads in particular slow down many times over when "
                            "they compete for cores); rerun on an idle machine")
    out = [
        "# ssmc CPU benchmark",
        "",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: processor {platform.processor() or platform.machine()!r}"
        + (f" ({model})" if model else "") + f", {os.cpu_count()} cores; torch/numba threads: {args.threads}",
        f"- versions: python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, "
        f"numba {numba.__version__}, ssmc {getattr(ssmc, '__version__', '?')}",
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        f"- threading: {_environment()}",
        f"- machine load: 1-min load average {report.load.load_avg:.2f} before the run; other processes used "
        f"{_share(others)} of the {os.cpu_count()} cores' time during it",
        f"- ssmc backend: {backend}",
        f"- sizes: {'quick' if sizes is QUICK_SIZES else 'full'}; inputs fp32, zero initial states",
        f"- timing: median of n calls (n chosen for ~{target:g} s per measurement, at least {MIN_REPEATS}), "
        "fresh seeded inputs per call made outside the timer; torch fwd under no_grad; "
        "fwd+bwd = forward + gradients of sum(y * dy) w.r.t. every input and param; ±: interquartile range "
        "as a share of the median",
    ]
    out += [f"- NOTE: {n}" for n in report.notes]
    out += ["", "| workload | implementation | dtype | fwd ms | fwd+bwd ms | fwd ratio vs ssmc "
                "| fwd+bwd ratio vs ssmc |", "|---|---|---|---|---|---|---|"]
    for r in report.rows:
        ours = next(o for o in report.rows if o.workload == r.workload and o.build_s is not None)
        out.append(f"| {r.workload} | {r.implementation} | {r.dtype} | {_ms(r.fwd)} | {_ms(r.fwd_bwd)} | "
                   f"{_ratio(r.fwd, ours.fwd)} | {_ratio(r.fwd_bwd, ours.fwd_bwd)} |")
    out += ["", "ratio = peer time / ssmc time: above 1 means ssmc is faster.", "",
            "First calls (compilation included; not part of the medians above):", "",
            "| workload | implementation | ssmc.compile + ssmc.torch.function s | first fwd call s "
            "| first fwd+bwd call s |",
            "|---|---|---|---|---|"]
    for r in report.rows:
        build_s = "—" if r.build_s is None else f"{r.build_s:.3f}"
        first_fb = "—" if r.fwd_bwd is None else f"{r.fwd_bwd.first_s:.3f}"
        out.append(f"| {r.workload} | {r.implementation} | {build_s} | {r.fwd.first_s:.3f} | {first_fb} |")
    out += ["", render_checks(report)]
    return "\n".join(out)


def render_checks(report: Report) -> str:
    out = ["Checks (relative error max|got - want| / max|want| against float64):", "",
           "| check | rel err | tol | ok |", "|---|---|---|---|"]
    out += [f"| {c.what} | {c.err:.2e} | {c.tol:.0e} | {'ok' if c.ok else 'FAIL'} |" for c in report.checks]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="numba", help="ssmc backend (default numba; falls back to interpreter)")
    ap.add_argument("--quick", action="store_true", help="small sizes and short measurements (smoke run)")
    ap.add_argument("--threads", type=int, default=2, help="torch and numba threads (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peers", type=Path, default=Path(__file__).resolve().parent.parent / "peers",
                    help="folder with the mamba-ssm sdist (default <repo>/peers)")
    ap.add_argument("--no-mamba-ref", action="store_true", help="leave out mamba-ssm's selective_scan_ref")
    ap.add_argument("--target-seconds", type=float, default=None,
                    help=f"time per measurement (default 2; {QUICK_TARGET_SECONDS} with --quick)")
    args = ap.parse_args(argv)

    report = Report()
    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))

    backend = args.backend
    try:
        mamba_fwd, mamba_grad, mamba_build = build(mamba1_example.SPEC, backend, MAMBA_LAYOUT)
    except ValueError as err:
        report.notes.append(f"backend {backend!r} is not available ({err}); FELL BACK to 'interpreter'")
        backend = "interpreter"
        mamba_fwd, mamba_grad, mamba_build = build(mamba1_example.SPEC, backend, MAMBA_LAYOUT)
    lstm_fwd, lstm_grad, lstm_build = build(lstm_example.SPEC, backend, LSTM_LAYOUT)

    quick = args.quick
    if backend == "interpreter" and not quick:
        quick = True
        report.notes.append("the interpreter (float64 NumPy) is slow at the full sizes: using the --quick sizes")
    sizes = QUICK_SIZES if quick else FULL_SIZES
    target = args.target_seconds if args.target_seconds is not None else (QUICK_TARGET_SECONDS if quick else 2.0)

    ref = None
    if not args.no_mamba_ref:
        found, why = load_selective_scan_ref(args.peers)
        ref = None if found is None else mamba_ssm_ref(found)
        report.notes.append(why)
    bench_mamba(report, mamba_fwd, mamba_grad, backend, mamba_build, sizes["mamba1"], args.seed, target, ref)
    if all(c.ok for c in report.checks):
        bench_lstm(report, lstm_fwd, lstm_grad, backend, lstm_build, sizes["lstm"], args.seed, target)
    failed = [c for c in report.checks if not c.ok]
    if failed:
        lines = [f"  {c.what}: rel err {c.err:.2e} > tol {c.tol:.0e}" for c in failed]
        print(render_checks(report), file=sys.stderr)
        print("\nCHECK FAILED (no timings taken):\n" + "\n".join(lines), file=sys.stderr)
        return 1
    print(render(report, args, backend, sizes, target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
