#!/usr/bin/env python3
"""ssmc against its peers, one family at a time: check each peer's output against ssmc's, then time both.

    python bench/harness.py --list                      # the workloads (bench/workloads/<family>.py)
    python bench/harness.py --dry-run                   # tiny sizes on the CPU, checks only (no GPU needed)
    python bench/harness.py --out $OUT/harness.md       # on a GPU: every family, a markdown table
    python bench/harness.py --family diagonal --only mamba1,mamba1_small

The peers come from the git-ignored folder ``peers/``, filled where pip reaches a package index:

    pip download --no-deps -d peers accelerated-scan==0.3.1 fla-core==0.6.0 einops
    MAMBA_SKIP_CUDA_BUILD=TRUE pip download --no-deps --no-build-isolation -d peers mamba-ssm==2.3.2.post1

On the machine that runs it (no internet needed), wheels that do not import are installed into
``--work``/site (``pip install --no-index --no-deps --target``), the sdist is unpacked there and
mamba-ssm's CUDA extension (csrc/selective_scan) is built for the GPU present on first use (100-140 s
on 16 cores; cached in ``--work``/ext). The peers' Triton kernels autotune on their first call: a
matrix workload's first call can take minutes. A peer that cannot be installed, built or run is
reported as unavailable and the rest goes on.

Check: every side's output and the gradients of the workload's ``compare`` inputs (one cotangent for
all), relative error ||got - want|| / ||want||, within the workload's tolerance: ssmc against the
peer, and against ssmc's float64 interpreter where there is no peer, where the two disagree, in the
dry run and with ``--reference``. On a GPU at full size the interpreter referees at the tiny sizes
instead (at full size it can take many minutes); a full-size disagreement stays in the status. Only
sides that pass are timed.

Timing (CUDA): each call between two CUDA events with the L2 cache flushed before it (a 256 MB write,
as triton's do_bench does), warm-up calls first, the median of the calls that fit ``--rep-ms`` (at
least 5; a call over a second is timed once). Host time is included, as a training loop sees it.
On the CPU: wall-clock medians. The table: workload, peer ms, ssmc ms, their ratio, device, date.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path[:0] = [str(BENCH)] + ([str(REPO)] if importlib.util.find_spec("ssmc") is None else [])

import workloads as wl  # noqa: E402  (bench/workloads/, on the path just set)
from workloads import Unavailable  # noqa: E402

SLOW_MS = 1000.0  # a call longer than this is timed once
MODULES = {"fla_core": "fla"}  # a wheel's distribution name -> its module, where they differ


# -- peers ----------------------------------------------------------------------------------------------------------

class Peers:
    """The peers of a folder of downloads, installed and built on first use (module docstring)."""

    def __init__(self, folder: Path, work: Path, build: bool = True):
        self.folder, self.work, self.build = folder, work, build
        self.versions: dict[str, str] = {}
        self.notes: list[str] = []
        self._ready = False
        self._mamba: Path | None = None
        self._extension: object = None

    def _setup(self) -> None:
        if self._ready:
            return
        self._ready = True
        if not self.folder.is_dir():
            self.notes.append(f"no peers folder {self.folder}: pip download --no-deps puts the peers there")
            return
        wheels = sorted(self.folder.glob("*.whl"))
        for w in wheels:
            dist, version = w.name.split("-")[:2]
            self.versions[dist.replace("_", "-")] = version
        missing = [w for w in wheels if importlib.util.find_spec(_module(w.name)) is None]
        site = self.work / "site"
        if missing:
            site.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--upgrade", "--target", str(site), *map(str, missing)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                self.notes.append("pip install of the peers failed: " + (done.stderr.strip().splitlines() or ["?"])[-1])
        if site.is_dir() and str(site) not in sys.path:
            sys.path.insert(0, str(site))
            importlib.invalidate_caches()
        sdists = sorted(self.folder.glob("mamba_ssm-*.tar.gz"))
        if sdists:
            name = sdists[-1].name.removesuffix(".tar.gz")
            self.versions["mamba-ssm"] = name.removeprefix("mamba_ssm-")
            root = self.work / "src" / name
            if not (root / "mamba_ssm").is_dir():
                root.parent.mkdir(parents=True, exist_ok=True)
                with tarfile.open(sdists[-1]) as tar:
                    tar.extractall(root.parent, filter="data")
            self._mamba = root

    def module(self, name: str):
        """A peer's module, or `Unavailable` saying why not."""
        self._setup()
        try:
            return importlib.import_module(name)
        except Exception as err:
            raise Unavailable(f"import {name}: {_reason(err)}") from None

    def mamba(self, name: str, extension: bool = False):
        """A module of the mamba-ssm sdist, imported without its package __init__ (which imports the CUDA
        extension and the model zoo); `extension`: build and register ``selective_scan_cuda`` first."""
        self._setup()
        if self._mamba is None:
            raise Unavailable(f"no mamba-ssm sdist in {self.folder}")
        if "mamba_ssm" not in sys.modules:
            package = types.ModuleType("mamba_ssm")
            package.__path__ = [str(self._mamba / "mamba_ssm")]
            sys.modules["mamba_ssm"] = package
        if extension:
            self._selective_scan()
        return self.module(name)

    def _selective_scan(self) -> None:
        if isinstance(self._extension, Unavailable):
            raise self._extension
        if self._extension is None:
            try:
                self._extension = self._build()
            except Unavailable as err:
                self._extension = err
                raise
            sys.modules["selective_scan_cuda"] = self._extension

    def _build(self):
        """mamba-ssm's csrc/selective_scan for the GPU present, with its setup.py's nvcc flags."""
        if not torch.cuda.is_available():
            raise Unavailable("selective_scan_cuda needs a CUDA GPU")
        if not self.build:
            raise Unavailable("selective_scan_cuda not built (--no-build)")
        from torch.utils.cpp_extension import CUDA_HOME, load

        if CUDA_HOME is None:
            raise Unavailable("no CUDA toolkit (nvcc) to build selective_scan_cuda")
        major, minor = torch.cuda.get_device_capability()
        csrc = self._mamba / "csrc" / "selective_scan"
        out = self.work / "ext" / f"selective_scan_sm{major}{minor}"
        out.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
        flags = ["-O3", "--use_fast_math", "--expt-relaxed-constexpr", "--expt-extended-lambda", "-lineinfo",
                 f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]
        flags += [f"-U__CUDA_NO_{t}_{what}__" for t in ("HALF", "BFLOAT16", "BFLOAT162")
                  for what in ("OPERATORS", "CONVERSIONS")]
        print(f"building mamba-ssm's selective_scan_cuda for sm_{major}{minor} in {out} ...", flush=True)
        start = time.perf_counter()
        try:
            module = load(name="selective_scan_cuda", sources=[str(csrc / "selective_scan.cpp"),
                                                                *map(str, sorted(csrc.glob("selective_scan_*.cu")))],
                          extra_cflags=["-O3"], extra_cuda_cflags=flags, extra_include_paths=[str(csrc)],
                          build_directory=str(out), verbose=False)
        except Exception as err:
            errors = [line.strip() for line in str(err).splitlines() if "error" in line.lower()]
            raise Unavailable(f"building selective_scan_cuda failed: {(errors or [_reason(err)])[0][:200]}") from None
        seconds = time.perf_counter() - start
        self.notes.append(f"mamba-ssm's selective_scan_cuda built (or found built) in {seconds:.0f} s")
        return module


def _module(wheel: str) -> str:
    dist = wheel.split("-")[0]
    return MODULES.get(dist, dist)


def _reason(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0][:240]}" if lines else type(err).__name__


# -- checking and timing --------------------------------------------------------------------------------------------

def relative_error(got: torch.Tensor, want) -> float:
    """||got - want|| / ||want|| in float64 (inf where shapes differ or `got` is not finite)."""
    want = torch.as_tensor(want).to(device=got.device, dtype=torch.float64)
    got = got.detach().to(torch.float64)
    if got.shape != want.shape or not bool(torch.isfinite(got).all()):
        return float("inf")
    scale = float(want.norm())
    return float((got - want).norm()) / (scale if scale > 0 else 1.0)


def evaluate(side: wl.Side, inputs: dict, dout: torch.Tensor, compare, out=None) -> dict[str, torch.Tensor]:
    """A side's output ("out": `out` where given, else its forward's) and gradients of `compare`,
    canonical and detached."""
    prep = side.prepare(inputs, dout)
    found = {} if out is None else {"out": out}
    if side.forward is not None and out is None:
        with torch.no_grad():
            found["out"] = side.output(side.forward(prep), prep).detach()
    if side.step is not None:
        grads = side.grads(side.step(prep), prep)
        found |= {f"grad {k}": grads[k].detach() for k in compare}
    return found


def probe(side: wl.Side, inputs: dict) -> torch.Tensor:
    """A side's output (canonical, detached), which also shapes the cotangent."""
    prep = side.prepare(inputs, torch.zeros(()))
    with torch.no_grad():
        return side.output(side.forward(prep), prep).detach()


def disagreement(a: dict, b: dict) -> tuple[float, str]:
    """The largest relative error of `a` against `b` over what both have, and where."""
    errors = {k: relative_error(a[k], b[k]) for k in a if k in b}
    if not errors:
        return float("nan"), "nothing in common"
    worst = max(errors, key=errors.get)
    return errors[worst], worst


class Timer:
    """Median milliseconds of a call (module docstring)."""

    def __init__(self, device: str, warmup_ms: float, rep_ms: float):
        self.cuda = device == "cuda"
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda") if self.cuda else None

    def _calls(self, fn, n: int) -> list[float]:
        if not self.cuda:
            times = []
            for _ in range(n):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return times
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for start, end in events:
            self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]

    def __call__(self, fn, warm: bool = True) -> tuple[float, int]:
        """(median ms, calls timed); `warm` False: one call first, untimed (plans, autotuning)."""
        if not warm:
            self._calls(fn, 1)
        first = self._calls(fn, 1)[0]
        if first > SLOW_MS:
            return first, 1
        self._calls(fn, min(100, max(1, int(self.warmup_ms / max(first, 1e-3)))))
        n = min(1000, max(5, int(self.rep_ms / max(first, 1e-3))))
        return statistics.median(self._calls(fn, n)), n


@dataclass
class Row:
    family: str
    workload: str
    peer: str
    side: str
    device: str
    date: str
    peer_ms: tuple[float | None, float | None] = (None, None)
    ssmc_ms: tuple[float | None, float | None] = (None, None)
    check: str = ""
    status: str = "ok"


@dataclass
class Context:
    device: str
    device_name: str
    date: str
    tiny: bool
    dry_run: bool
    backend: str
    reference: bool
    seed: int
    peers: Peers
    timer: Timer | None
    verbose: bool
    no_op: bool = False


def _attempt(what: str, fn, verbose: bool):
    """(fn(), None), or (None, the reason it raised)."""
    try:
        return fn(), None
    except Unavailable as err:
        return None, f"unavailable: {err}"
    except Exception as err:
        if verbose:
            traceback.print_exc()
        return None, f"{what} failed: {_reason(err)}"


def check(w: wl.Workload, ctx: Context, device: str, sizes: dict, dtype, ssmc_backend: str, referee: bool = False):
    """Build `w`'s inputs and sides on `device`, evaluate and compare them (module docstring). Where the
    interpreter must referee at a GPU's full sizes (where it can take many minutes), it does so at the
    tiny sizes (`referee`: this is that check) and the full-size disagreement stays in the status.

    Returns (inputs, dout, ssmc sides, peer side, {label: status}, {label: check text})."""
    gen = wl.generator(device, ctx.seed)
    inputs = w.build(sizes, device, dtype, gen)
    sides, err = _attempt("ssmc", lambda: w.ssmc(ssmc_backend), ctx.verbose)
    sides = [s for s in sides or [] if not (ctx.no_op and s.label.startswith("ssmc.torch"))]
    status = {s.label: "ok" for s in sides}
    peer, peer_err = _attempt("peer", lambda: w.peer(ctx.peers, device), ctx.verbose)
    runs = [*sides, *([peer] if peer else [])]
    outs = {}
    for side in (s for s in runs if s.forward is not None):
        outs[side.label], why = _attempt(side.label, lambda s=side: probe(s, inputs), ctx.verbose)
        status[side.label] = why or "ok"
    out = next((o for o in outs.values() if o is not None), None)
    if out is None:
        return inputs, None, sides, peer, {**status, "ssmc": err or "no side ran", "peer": peer_err or "failed"}, {}
    dout = torch.randn(out.shape, generator=gen, device=device).to(out.dtype)
    found = {}
    for side in runs:
        if side.forward is not None and outs[side.label] is None:
            continue
        found[side.label], why = _attempt(
            side.label, lambda s=side: evaluate(s, inputs, dout, w.compare, outs.get(s.label)), ctx.verbose)
        status[side.label] = why or status.get(side.label, "ok")
    ok = [s for s in sides if found.get(s.label)]
    peer_found = found.get(peer.label) if peer else None
    texts, verdict = {}, {}
    for s in ok:
        if peer_found is not None:
            e, where = disagreement(found[s.label], peer_found)
            texts[s.label] = f"vs peer {e:.1e} ({where})"
            verdict[s.label] = verdict[peer.label] = e <= w.tolerance
    need_reference = referee or ctx.dry_run or ctx.reference or not all(verdict.values()) or not verdict
    if need_reference and ok and device == "cuda" and not (referee or ctx.reference or ctx.tiny):
        *_, small, small_texts = check(w, ctx, device, w.tiny, dtype, ssmc_backend, referee=True)
        for label in [*(s.label for s in ok), *([peer.label] if peer_found is not None else [])]:
            key = "peer" if peer is not None and label == peer.label else label
            texts[label] = (texts[label] + "; " if label in texts else "") + \
                f"at {w.describe(w.tiny, dtype)}: {small_texts.get(key, '')}"
            if not verdict.get(label, True) and small.get(key) == "ok":
                status[label] = "ok (disagrees at full size, right at the tiny sizes)"
            verdict[label] = small.get(key) == "ok"
    elif need_reference and ok:
        ref_inputs = {k: v.detach().double().cpu() for k, v in inputs.items()}
        ref_side = w.ssmc("interpreter")[0]
        ref, why = _attempt("interpreter", lambda: evaluate(ref_side, ref_inputs, dout.double().cpu(), w.compare),
                            ctx.verbose)
        for label in [*(s.label for s in ok), *([peer.label] if peer_found is not None else [])]:
            if ref is None:
                texts[label] = texts.get(label, "") + f"; interpreter {why}"
                continue
            e, where = disagreement(found[label], ref)
            who = "peer " if peer is not None and label == peer.label else ""
            texts[label] = (texts[label] + "; " if label in texts else "") + f"{who}vs interpreter {e:.1e} ({where})"
            verdict[label] = e <= w.tolerance
    for label, good in verdict.items():
        if not good:
            status[label] = f"CHECK FAILED (tolerance {w.tolerance:g})"
    for label, text in texts.items():
        print(f"  {label}: {status.get(label)}; {text}", flush=True)
    if peer is None:
        status["peer"] = peer_err or "unavailable"
    elif peer_found is None:
        status["peer"] = status.get(peer.label, "")
    else:
        status["peer"] = status.get(peer.label, "ok")
        texts["peer"] = texts.pop(peer.label, "")
    return inputs, dout, sides, peer, status, texts


def time_side(side: wl.Side, inputs: dict, dout, timer: Timer, warm: bool = True
              ) -> tuple[float | None, float | None]:
    """(forward ms, forward + backward ms) of a side (`warm`: its check ran it already)."""
    prep = side.prepare(inputs, dout)

    def forward():
        with torch.no_grad():
            side.forward(prep)

    fwd = timer(forward, warm)[0] if side.forward is not None else None
    step = timer(lambda: side.step(prep), warm)[0] if side.step is not None else None
    return fwd, step


def run_workload(w: wl.Workload, ctx: Context) -> list[Row]:
    """Check (and unless a dry run, time) one workload: a row per ssmc side."""
    sizes = w.tiny if ctx.tiny else w.sizes
    dtype = w.dtype if ctx.device == "cuda" else torch.float32
    host_check = ctx.device == "cuda" and not w.ssmc_gpu
    if host_check:  # ssmc has no GPU kernels for it: check on the CPU at tiny sizes, time the peer alone
        *_, sides, peer, status, texts = check(w, ctx, "cpu", w.tiny, torch.float32, "interpreter")
        inputs = w.build(sizes, ctx.device, dtype, wl.generator(ctx.device, ctx.seed))
        peer, why = _attempt("peer", lambda: w.peer(ctx.peers, ctx.device), ctx.verbose)
        status["peer"] = why or status["peer"]
        dout = None
    else:
        inputs, dout, sides, peer, status, texts = check(w, ctx, ctx.device, sizes, dtype, ctx.backend)
    peer_ms = (None, None)
    timed = not ctx.dry_run and ctx.timer is not None
    if timed and peer is not None and status["peer"].startswith("ok"):
        if dout is None:
            out = probe(peer, inputs)
            dout = torch.randn(out.shape, generator=wl.generator(ctx.device, ctx.seed + 1), device=ctx.device
                               ).to(out.dtype)
        peer_ms, why = _attempt("timing", lambda: time_side(peer, inputs, dout, ctx.timer, not host_check),
                                ctx.verbose)
        peer_ms = peer_ms or (None, None)
        status["peer"] = why or status["peer"]
    rows = []
    for side in sides or [wl.Side(label="ssmc")]:
        row = Row(w.family, w.describe(sizes, dtype), f"{peer.label if peer else w.peer_name} ({status['peer']})"
                  if status["peer"] != "ok" else peer.label, side.label, ctx.device_name, ctx.date,
                  peer_ms=peer_ms, check="; ".join(t for t in (texts.get(side.label), texts.get("peer")) if t),
                  status=status.get(side.label, status.get("ssmc", "")))
        if host_check:
            row.status = "no GPU path (checked on the CPU at " + w.describe(w.tiny) + ")" if row.status == "ok" \
                else row.status
        elif timed and row.status.startswith("ok"):
            ms, why = _attempt("timing", lambda s=side: time_side(s, inputs, dout, ctx.timer), ctx.verbose)
            row.ssmc_ms, row.status = ms or (None, None), why or row.status
        rows.append(row)
    return rows


# -- report ---------------------------------------------------------------------------------------------------------

def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}" if v < 10 else f"{v:.1f}"


def _ratio(peer: float | None, ours: float | None) -> str:
    if not (peer and ours):
        return "–"
    return f"{peer / ours:.2f}x" if peer / ours >= 0.1 else f"{peer / ours:.2g}x"


def render(rows: list[Row], header: list[str]) -> str:
    """The markdown report: header lines, then one table row per ssmc side."""
    lines = ["# ssmc against its peers", "", *(f"- {h}" for h in header), "",
             "| family | workload | peer | peer fwd / fwd+bwd ms | ssmc | ssmc fwd / fwd+bwd ms "
             "| peer ÷ ssmc fwd / fwd+bwd | check (relative error) | status | device | date |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r.family, r.workload, r.peer, f"{_ms(r.peer_ms[0])} / {_ms(r.peer_ms[1])}", r.side,
                 f"{_ms(r.ssmc_ms[0])} / {_ms(r.ssmc_ms[1])}",
                 f"{_ratio(r.peer_ms[0], r.ssmc_ms[0])} / {_ratio(r.peer_ms[1], r.ssmc_ms[1])}", r.check, r.status,
                 r.device, r.date]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model and core count."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    return f"{model}, {os.cpu_count()} cores"


def short_device(name: str) -> str:
    """h100 / h200 / cpu / gpu: the device part of a bench/results/ file name."""
    for tag in ("H100", "H200"):
        if tag in name:
            return tag.lower()
    return "gpu" if "NVIDIA" in name else "cpu"


def header(ctx: Context, argv: list[str], chosen: list[wl.Workload]) -> list[str]:
    lines = [f"command: `python bench/harness.py {shlex.join(argv)}`",
             f"device: {ctx.device_name}; date: {ctx.date}",
             f"torch {torch.__version__} (CUDA {torch.version.cuda}), Python {platform.python_version()}"]
    if importlib.util.find_spec("triton") is not None:
        lines[-1] += f", triton {importlib.import_module('triton').__version__}"
    if ctx.peers.versions:
        lines.append("peers: " + ", ".join(f"{k} {v}" for k, v in sorted(ctx.peers.versions.items())))
    lines += ctx.peers.notes
    lines += [f"{w.name}: {note}" for w in chosen for note in w.notes]
    if ctx.dry_run:
        lines.append(f"dry run: tiny sizes, ssmc's {ctx.backend} backend checked against its interpreter and the CPU "
                     "peers; nothing timed")
    elif ctx.device == "cuda":
        lines.append("timing: CUDA events around each call, L2 flushed before it, median (module docstring); "
                     f"save as bench/results/{ctx.date[:10]}-{short_device(ctx.device_name)}-peers.md")
    else:
        lines.append("timing: wall-clock medians on the CPU")
    return lines


def list_workloads(chosen: list[wl.Workload]) -> str:
    lines = ["| family | name | workload | tiny (dry run) | peer |", "|---|---|---|---|---|"]
    lines += [f"| {w.family} | {w.name} | {w.describe()} | {w.describe(w.tiny, torch.float32)} | {w.peer_name} |"
              for w in chosen]
    return "\n".join(lines) + "\n"


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the workloads and exit")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU, checks only")
    ap.add_argument("--family", help=f"comma-separated families (default: all of {', '.join(wl.FAMILIES)})")
    ap.add_argument("--only", help="comma-separated workload names")
    ap.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda where there is a GPU")
    ap.add_argument("--tiny", action="store_true", help="the dry run's sizes (a smoke test of the timing)")
    ap.add_argument("--backend", help="ssmc's backend (default: cuda on a GPU, numba on the CPU)")
    ap.add_argument("--reference", action="store_true", help="also check against the interpreter on a GPU")
    ap.add_argument("--no-op", action="store_true", help="leave out the ssmc.torch op's rows")
    ap.add_argument("--peers", type=Path, default=REPO / "peers", help="the downloaded peers (default: peers/)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ssmc_peers"), help="where peers are installed and built")
    ap.add_argument("--no-build", action="store_true", help="do not build mamba-ssm's CUDA extension")
    ap.add_argument("--out", type=Path, help="write the markdown table there (rewritten after each workload)")
    ap.add_argument("--warmup-ms", type=float, default=50.0)
    ap.add_argument("--rep-ms", type=float, default=200.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true", help="print tracebacks")
    args = ap.parse_args(argv)
    families = args.family.split(",") if args.family else list(wl.FAMILIES)
    if bad := sorted(set(families) - set(wl.FAMILIES)):
        ap.error(f"no families {bad}; choose from {list(wl.FAMILIES)}")
    args.chosen = wl.workloads(families)
    if args.only:
        names = args.only.split(",")
        if bad := sorted(set(names) - {w.name for w in wl.workloads()}):
            ap.error(f"no workloads {bad}; see --list")
        args.chosen = [w for w in args.chosen if w.name in names]
    if args.dry_run:
        args.device, args.tiny = "cpu", True
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: use --dry-run or --device cpu")
    args.backend = args.backend or ("cuda" if args.device == "cuda" else "numba")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.list:
        print(list_workloads(args.chosen), end="")
        return 0
    if args.device == "cuda":  # fp32 peers in fp32, as ssmc computes
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    name = device_name(args.device)
    ctx = Context(args.device, name, datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                  args.tiny, args.dry_run, args.backend, args.reference, args.seed,
                  Peers(args.peers, args.work, not args.no_build),
                  None if args.dry_run else Timer(args.device, args.warmup_ms, args.rep_ms), args.verbose, args.no_op)
    rows: list[Row] = []
    for w in args.chosen:
        title = w.describe(w.tiny if args.tiny else w.sizes, None if args.device == "cuda" else torch.float32)
        print(f"[{w.family}] {w.name}: {title} ...", flush=True)
        start = time.perf_counter()
        rows += run_workload(w, ctx)
        print(f"[{w.family}] {w.name}: done in {time.perf_counter() - start:.1f} s", flush=True)
        text = render(rows, header(ctx, argv, args.chosen))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(text, end="")
    failed = [r for r in rows if "FAILED" in r.status or "failed" in r.status or "FAILED" in r.peer]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
