#!/usr/bin/env python3
"""Measure the benchmark peers of ssmc on a GPU (see ../shared/TARGETS.md).

The peers come as downloaded packages in the git-ignored folder ``peers/`` at the repository root
(see ``peers/README.txt``): wheels of ``accelerated-scan``, ``fla-core`` and ``einops`` and the
``mamba-ssm`` sdist. On the GPU machine (no internet) this script installs the wheels into a
private folder with ``pip install --no-index --no-deps --target`` (unless they are importable
already, e.g. because the device command installed them and set ``PYTHONPATH``), unpacks the
mamba-ssm sdist and, with ``--build-mamba``, builds its CUDA extension ``csrc/selective_scan``
for the GPU present (sm_90 on H100/H200, about 100 s on 16 cores).

Workloads (``--only``):

* ``scan1``        first-order scan h = a*h + x, B8 D2048 L4096 fp32
* ``mamba1``       Mamba-1 selective scan B8 D1536 L2048 N16 fp32, softplus(delta + bias), D, z
* ``mamba1_small`` the same, B32 D512 L180 N16

Every implementation is first checked against a float64 PyTorch reference computed on the GPU
(forward output and, where it has a backward, all input gradients; relative error
||out - ref|| / ||ref|| below 1e-3), then timed on fresh random inputs with
``triton.testing.do_bench`` (median; CUDA events as fallback). A peer that cannot be imported,
built or run is reported as ``unavailable: <reason>`` and the script goes on.

ssmc kernels plug in through :func:`ssmc_candidates` (returns [] for now).

Output: a markdown table printed last and written to ``$OUT/gpu_peers.md`` (plus
``gpu_peers.json``) when ``$OUT`` is set or ``--out`` is given.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import traceback
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from overrides import overriding  # bench/ is the script's folder, on sys.path

REPO = Path(__file__).resolve().parent.parent
TOL_FP32 = 1e-3
# Where workloads put their tensors; only a self-test of this script's logic sets it to "cpu".
DEVICE = "cuda"
# device-to-device copy rate measured on an H200 in TARGETS.md (bytes read + written)
TARGETS_COPY_TBPS_H200 = 4.22

# Numbers from TARGETS.md (H200, torch 2.11, triton 3.6), shown beside ours as a sanity check.
TARGETS_MS: dict[tuple[str, str], tuple[float | None, float | None]] = {
    ("scan1", "accelerated_scan.scalar"): (0.197, 0.544),
    ("scan1", "accelerated_scan.warp"): (0.261, 0.598),
    ("scan1", "fla.chunk_hgrn"): (0.467, 1.273),
    ("scan1", "torch.loop"): (86.0, None),
    ("mamba1", "mamba_ssm.selective_scan_cuda"): (0.878, 2.92),
    ("mamba1_small", "mamba_ssm.selective_scan_cuda"): (0.138, 0.557),
}

MAMBA_SOURCES = [
    "selective_scan.cpp",
    "selective_scan_fwd_fp32.cu",
    "selective_scan_fwd_fp16.cu",
    "selective_scan_fwd_bf16.cu",
    "selective_scan_bwd_fp32_real.cu",
    "selective_scan_bwd_fp32_complex.cu",
    "selective_scan_bwd_fp16_real.cu",
    "selective_scan_bwd_fp16_complex.cu",
    "selective_scan_bwd_bf16_real.cu",
    "selective_scan_bwd_bf16_complex.cu",
]
# nvcc flags of mamba-ssm's setup.py (CUDA build), less its multi-arch -gencode list, its
# --ptxas-options=-v and its -std (left to torch's default for its own headers).
MAMBA_NVCC_FLAGS = [
    "-O3",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT162_OPERATORS__",
    "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "--use_fast_math",
    "-lineinfo",
]


def log(*args: Any) -> None:
    print(*args, flush=True)


def short_reason(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    if len(first) > 240:
        first = first[:240] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


class Unavailable(Exception):
    """An implementation cannot run here; the message says why."""


# --------------------------------------------------------------------------------------------
# Peers: installation and loading
# --------------------------------------------------------------------------------------------

WHEEL_MODULES = {"accelerated_scan": "accelerated_scan", "fla_core": "fla", "einops": "einops"}


@dataclass
class PeerEnv:
    peers_dir: Path
    site_dir: Path
    src_dir: Path
    ext_dir: Path
    notes: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    mamba_src: Path | None = None
    mamba_error: str | None = None
    ext: dict[str, Any] = field(default_factory=dict)  # "warp" / "mamba": module or Unavailable


def _wheel_dist(whl: Path) -> str:
    return whl.name.split("-")[0].lower()


def setup_peers(env: PeerEnv) -> None:
    """Make the wheels in peers/ importable and unpack the mamba-ssm sdist."""
    wheels = sorted(env.peers_dir.glob("*.whl"))
    if not env.peers_dir.is_dir():
        env.notes.append(f"peers folder {env.peers_dir} not found: peers are unavailable")
    missing = [
        w for w in wheels
        if importlib.util.find_spec(WHEEL_MODULES.get(_wheel_dist(w), _wheel_dist(w))) is None
    ]
    if missing:
        env.site_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
               "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(env.site_dir),
               *map(str, missing)]
        log("installing peers:", " ".join(w.name for w in missing), "->", env.site_dir)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            env.notes.append("pip install of peers failed: "
                             + (proc.stderr.strip().splitlines() or ["?"])[-1])
    if env.site_dir.is_dir() and str(env.site_dir) not in sys.path:
        sys.path.insert(0, str(env.site_dir))
    importlib.invalidate_caches()
    for dist in ("accelerated-scan", "fla-core", "einops", "triton"):
        try:
            env.versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env.versions[dist] = "not installed"

    sdists = sorted(env.peers_dir.glob("mamba_ssm-*.tar.gz"))
    if not sdists:
        env.mamba_error = "mamba-ssm sdist not found in peers/"
        return
    sdist = sdists[-1]
    version = sdist.name[len("mamba_ssm-"):-len(".tar.gz")]
    env.versions["mamba-ssm"] = version
    root = env.src_dir / f"mamba_ssm-{version}"
    try:
        if not (root / "csrc" / "selective_scan" / "selective_scan.cpp").is_file():
            env.src_dir.mkdir(parents=True, exist_ok=True)
            with tarfile.open(sdist) as tar:
                if sys.version_info >= (3, 12) or hasattr(tarfile, "data_filter"):
                    tar.extractall(env.src_dir, filter="data")
                else:  # pragma: no cover - old Pythons
                    tar.extractall(env.src_dir)
        env.mamba_src = root
    except Exception as exc:
        env.mamba_error = f"unpacking {sdist.name} failed: {short_reason(exc)}"


def arch_tag() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}"


def load_warp(env: PeerEnv) -> Any:
    """Import accelerated_scan.warp, which JIT-builds its CUDA kernel (load_inline) at import."""
    if importlib.util.find_spec("accelerated_scan") is None:
        raise Unavailable("accelerated_scan not importable")
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        raise Unavailable("no CUDA toolkit (nvcc) found")
    return importlib.import_module("accelerated_scan.warp")


def load_mamba_ext(env: PeerEnv, so_path: str | None, build: bool, out_dir: Path | None,
                   cxx_std: str | None = None) -> Any:
    """Load mamba-ssm's selective_scan_cuda: a prebuilt .so, or build it from the sdist."""
    if so_path:
        spec = importlib.util.spec_from_file_location("selective_scan_cuda", so_path)
        if spec is None or spec.loader is None:
            raise Unavailable(f"cannot load {so_path}")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["selective_scan_cuda"] = mod
        return mod
    if not build:
        raise Unavailable("selective_scan_cuda not built (pass --build-mamba, ~100 s, "
                          "or --mamba-so PATH)")
    if env.mamba_src is None:
        raise Unavailable(env.mamba_error or "mamba-ssm sources missing")
    from torch.utils.cpp_extension import CUDA_HOME, load

    if CUDA_HOME is None:
        raise Unavailable("no CUDA toolkit (nvcc) found")
    csrc = env.mamba_src / "csrc" / "selective_scan"
    tag = arch_tag()
    build_dir = env.ext_dir / f"selective_scan_cuda_sm{tag}"
    build_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
    log(f"building mamba-ssm selective_scan_cuda for sm_{tag} in {build_dir} "
        f"(MAX_JOBS={os.environ['MAX_JOBS']}) ...")
    std = [f"-std={cxx_std}"] if cxx_std else []
    t0 = datetime.datetime.now()
    try:
        mod = load(
            name="selective_scan_cuda",
            sources=[str(csrc / s) for s in MAMBA_SOURCES],
            extra_cflags=["-O3", *std],
            extra_cuda_cflags=[f"-gencode=arch=compute_{tag},code=sm_{tag}", *std,
                               *MAMBA_NVCC_FLAGS],
            extra_include_paths=[str(csrc)],
            build_directory=str(build_dir),
            verbose=False,
        )
    except RuntimeError as exc:
        text = str(exc)
        errors = [ln.strip() for ln in text.splitlines() if "error" in ln.lower()]
        if out_dir is not None:
            (out_dir / "mamba_build_error.log").write_text(text)
        log("mamba-ssm build failed; first error lines:\n  " + "\n  ".join(errors[:15]))
        first = next((e for e in errors if not e.startswith("Error building")), text[:200])
        raise Unavailable(f"build failed ({first[:200]})") from exc
    secs = (datetime.datetime.now() - t0).total_seconds()
    env.notes.append(f"selective_scan_cuda built (or loaded from cache) in {secs:.0f} s")
    sys.modules["selective_scan_cuda"] = mod
    so = Path(mod.__file__) if getattr(mod, "__file__", None) else None
    if out_dir is not None and so is not None and so.is_file():
        size = so.stat().st_size
        if size < 16 * 2**20:
            dest = out_dir / f"selective_scan_cuda_sm{tag}.so"
            shutil.copy2(so, dest)
            env.notes.append(f"copied the built extension to {dest} ({size / 2**20:.1f} MiB); "
                             "carry it and pass --mamba-so to skip the build")
        else:
            env.notes.append(f"built extension is {size / 2**20:.1f} MiB, too large for $OUT")
    return mod


def import_mamba_triton(env: PeerEnv, module: str = "mamba_ssm.ops.triton.ssd_combined") -> Any:
    """Import a module of mamba-ssm's Triton ops without running mamba_ssm/__init__.py.

    (That __init__ imports the CUDA extension and the whole model zoo.) A bare package module
    stands in for ``mamba_ssm``; the subpackages' own (empty) __init__ files run as usual.
    """
    if env.mamba_src is None:
        raise Unavailable(env.mamba_error or "mamba-ssm sources missing")
    pkg = sys.modules.get("mamba_ssm")
    if pkg is None:
        pkg = types.ModuleType("mamba_ssm")
        pkg.__path__ = [str(env.mamba_src / "mamba_ssm")]
        sys.modules["mamba_ssm"] = pkg
    return importlib.import_module(module)


def prebuild(env: PeerEnv, args: argparse.Namespace, workloads: list[str],
             out_dir: Path | None) -> None:
    """Build the CUDA extensions needed, the two builds side by side."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(env.ext_dir))
    env.ext_dir.mkdir(parents=True, exist_ok=True)
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    jobs: dict[str, Callable[[], Any]] = {}
    if "scan1" in workloads:
        if args.no_warp:
            env.ext["warp"] = Unavailable("skipped (--no-warp)")
        else:
            jobs["warp"] = lambda: load_warp(env)
    if any(w.startswith("mamba1") for w in workloads):
        jobs["mamba"] = lambda: load_mamba_ext(env, args.mamba_so, args.build_mamba, out_dir,
                                               args.mamba_std)
    if not jobs:
        return
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {k: pool.submit(fn) for k, fn in jobs.items()}
        for key, fut in futures.items():
            try:
                env.ext[key] = fut.result()
            except Unavailable as exc:
                env.ext[key] = exc
            except BaseException as exc:  # report and go on
                if args.verbose:
                    traceback.print_exc()
                env.ext[key] = Unavailable(f"build/load failed: {short_reason(exc)}")


# --------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------


@dataclass
class Workload:
    key: str
    title: str
    dims: dict[str, int]
    layout: str
    input_keys: list[str]
    grad_keys: list[str]
    make_inputs: Callable[[int], dict[str, torch.Tensor]]
    reference: Callable[[dict[str, torch.Tensor], torch.Tensor],
                        tuple[torch.Tensor, dict[str, torch.Tensor]]]
    out_shape: tuple[int, ...]
    fwd_bytes: int
    fwdbwd_bytes: int
    tiny: bool


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator(device=DEVICE)
    g.manual_seed(seed)
    return g


def scan1_workload(B: int, D: int, L: int, tiny: bool) -> Workload:
    def make_inputs(seed: int) -> dict[str, torch.Tensor]:
        g = _gen(seed)
        a = 0.5 + 0.5 * torch.rand((B, D, L), generator=g, device=DEVICE)
        x = torch.randn((B, D, L), generator=g, device=DEVICE)
        return {"a": a, "x": x}

    def reference(inp: dict[str, torch.Tensor], dout: torch.Tensor):
        a = inp["a"].double().requires_grad_()
        x = inp["x"].double().requires_grad_()
        with torch.enable_grad():
            h = torch.zeros((B, D), dtype=torch.float64, device=DEVICE)
            hs = []
            for t in range(L):
                h = a[:, :, t] * h + x[:, :, t]
                hs.append(h)
            out = torch.stack(hs, dim=-1)
            ga, gx = torch.autograd.grad(out, (a, x), dout.double())
        return out.detach(), {"a": ga, "x": gx}

    n = B * D * L
    return Workload(
        key="scan1",
        title=f"first-order scan h=a*h+x B{B} D{D} L{L} fp32",
        dims={"B": B, "D": D, "L": L},
        layout="a, x, h: (B, D, L) contiguous (time fastest)",
        input_keys=["a", "x"],
        grad_keys=["a", "x"],
        make_inputs=make_inputs,
        reference=reference,
        out_shape=(B, D, L),
        # fwd: read a, x, write h. bwd: read a, h (or x), dh, write da, dx.
        fwd_bytes=3 * n * 4,
        fwdbwd_bytes=8 * n * 4,
        tiny=tiny,
    )


def mamba1_workload(key: str, B: int, D: int, L: int, N: int, tiny: bool) -> Workload:
    def make_inputs(seed: int) -> dict[str, torch.Tensor]:
        g = _gen(seed)
        dev = DEVICE
        dt = torch.exp(torch.rand(D, generator=g, device=dev) * (math.log(0.1) - math.log(1e-3))
                       + math.log(1e-3))
        return {
            "u": torch.randn((B, D, L), generator=g, device=dev),
            "delta": 0.5 * torch.randn((B, D, L), generator=g, device=dev),
            "A": -torch.exp(0.5 * torch.randn((D, N), generator=g, device=dev)),
            "B": torch.randn((B, N, L), generator=g, device=dev),
            "C": torch.randn((B, N, L), generator=g, device=dev),
            "D": torch.randn(D, generator=g, device=dev),
            "z": torch.randn((B, D, L), generator=g, device=dev),
            # inverse softplus of dt in [1e-3, 1e-1], as Mamba initialises its dt bias
            "delta_bias": dt + torch.log(-torch.expm1(-dt)),
        }

    def reference(inp: dict[str, torch.Tensor], dout: torch.Tensor):
        v = {k: t.double().requires_grad_() for k, t in inp.items()}
        with torch.enable_grad():
            dsp = F.softplus(v["delta"] + v["delta_bias"][:, None])  # (B, D, L)
            du = dsp * v["u"]
            h = torch.zeros((B, D, N), dtype=torch.float64, device=DEVICE)
            ys = []
            for t in range(L):
                h = torch.exp(dsp[:, :, t, None] * v["A"]) * h \
                    + du[:, :, t, None] * v["B"][:, None, :, t]
                ys.append((h * v["C"][:, None, :, t]).sum(-1))
            y = torch.stack(ys, dim=-1) + v["u"] * v["D"][:, None]
            out = y * F.silu(v["z"])
            keys = list(v)
            grads = torch.autograd.grad(out, [v[k] for k in keys], dout.double())
        return out.detach(), dict(zip(keys, grads))

    bdl, bnl = B * D * L, B * N * L
    small = 2 * D + D * N  # D, delta_bias, A
    return Workload(
        key=key,
        title=f"Mamba-1 selective scan B{B} D{D} L{L} N{N} fp32 (softplus(delta+bias), D, z)",
        dims={"B": B, "D": D, "L": L, "N": N},
        layout="u, delta, z, out: (B, D, L); B, C: (B, N, L); A: (D, N); D, delta_bias: (D,)",
        input_keys=["u", "delta", "A", "B", "C", "D", "z", "delta_bias"],
        grad_keys=["u", "delta", "A", "B", "C", "D", "z", "delta_bias"],
        make_inputs=make_inputs,
        reference=reference,
        out_shape=(B, D, L),
        # fwd: read u, delta, z, B, C, write out. bwd: read u, delta, z, B, C, dout; write du,
        # ddelta, dz, dB, dC (states recomputed, not stored).
        fwd_bytes=(4 * bdl + 2 * bnl + small) * 4,
        fwdbwd_bytes=(11 * bdl + 6 * bnl + 3 * small) * 4,
        tiny=tiny,
    )


def make_workloads(quick: bool) -> dict[str, Workload]:
    if quick:
        return {
            "scan1": scan1_workload(2, 64, 256, tiny=True),
            "mamba1": mamba1_workload("mamba1", 2, 64, 256, 16, tiny=True),
            "mamba1_small": mamba1_workload("mamba1_small", 2, 32, 180, 16, tiny=True),
        }
    return {
        "scan1": scan1_workload(8, 2048, 4096, tiny=False),
        "mamba1": mamba1_workload("mamba1", 8, 1536, 2048, 16, tiny=False),
        "mamba1_small": mamba1_workload("mamba1_small", 32, 512, 180, 16, tiny=False),
    }


# --------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------


@dataclass
class Impl:
    """One implementation of a workload.

    ``prepare(inputs, dout)`` turns the canonical inputs (the workload's layout; the tensors of
    ``grad_keys`` require grad) and the output gradient into whatever the implementation takes,
    e.g. another layout; it is not timed (default: ``{"inp": inputs, "dout": dout}``).
    ``fwd(prep)`` runs the forward (timed, under ``torch.no_grad``) and returns the
    output; ``fwdbwd(prep)`` runs forward and backward (timed) and returns the gradients.
    ``out_to_canon(out, prep)`` / ``grads_to_canon(grads, prep)`` (not timed) map results back to
    the canonical layout for the check (grads: dict keyed like ``grad_keys``).
    """

    name: str
    label: str
    fwd: Callable[[Any], torch.Tensor] | None = None
    fwdbwd: Callable[[Any], Any] | None = None
    prepare: Callable[[dict[str, torch.Tensor], torch.Tensor], Any] | None = None
    out_to_canon: Callable[[torch.Tensor, Any], torch.Tensor] | None = None
    grads_to_canon: Callable[[Any, Any], dict[str, torch.Tensor]] | None = None
    unavailable: str | None = None
    kind: str = "peer"  # or "ssmc"
    note: str = ""


def _default_prepare(inp: dict[str, torch.Tensor], dout: torch.Tensor) -> Any:
    return {"inp": inp, "dout": dout}


def ssmc_candidates(workload: Workload, variants: bool = True) -> list:
    """ssmc's kernels for a workload: ``(name, fwd_fn, fwdbwd_fn)`` triples (see `Impl`).

    Each reads the workload's canonical (B, D, L) tensors in place (layout "b d t"); the scan also
    runs on a time-major copy ("b t d", made untimed in `prepare`) to show what coalescing buys.
    `variants`: also the rows with a strategy or a steps-per-lane setting forced.
    """
    import ssmc
    import ssmc.torch

    if workload.key == "scan1":
        spec = _first_order_scan()
        names = ["a", "x"]
    elif workload.key.startswith("mamba1"):
        from ssmc.examples import mamba1

        spec = mamba1.SPEC
        names = workload.input_keys
    else:
        return []
    fwd = ssmc.compile(spec, "cuda", layout="b d t")
    grad = ssmc.grad(spec, "cuda", layout="b d t")

    def run_fwd(inp):
        return fwd(**{k: inp[k] for k in names})

    def run_fwdbwd(inp, dout):
        g = grad(**{k: inp[k].detach() for k in names}, grad_outputs=dout)
        return {k: g[k] for k in workload.grad_keys}

    op = ssmc.torch.function(spec, layout="b d t")

    def run_op(inp, dout):  # what a PyTorch user runs, through autograd as mamba-ssm's wrapper is
        args = [inp[k] for k in names]
        grads = torch.autograd.grad(op(*args), args, dout)
        return {k: g for k, g in zip(names, grads) if k in workload.grad_keys}

    cands: list = [("cuda (b d t in place)", run_fwd, run_fwdbwd), ("ssmc.torch op (autograd.grad)", None, run_op)]
    if not variants:
        return cands
    # the strategy heuristic against each strategy forced (forward only)
    variants = [{"SSMC_CUDA_STRATEGY": "fused"}, {"SSMC_CUDA_STRATEGY": "time blocks"},
                *({"SSMC_CUDA_STRATEGY": "warp", "SSMC_CUDA_STEPS_PER_LANE": str(k)} for k in (4, 8, 16))]
    for env in variants:
        text = ", ".join(f"{k}={v}" for k, v in env.items())
        cands.append(Impl(name="cuda " + text, label=f"ssmc: cuda, {text}", fwd=_with_env(env, run_fwd)))
    # the backward: the fused kernel's steps per lane forced, and the unfused (chunked) backward
    for env in [{"SSMC_CUDA_BACKWARD_STEPS_PER_LANE": str(k)} for k in (1, 2, 4, 8)] + [
            {"SSMC_CUDA_FUSED_BACKWARD": "0"}]:
        text = ", ".join(f"{k}={v}" for k, v in env.items())
        cands.append(Impl(name="cuda " + text, label=f"ssmc: cuda, {text}", prepare=_default_prepare,
                          fwdbwd=_with_env(env, run_fwdbwd, grad=True)))
    if workload.key == "scan1":  # warps of a block sharing each channel (default: 8 at L4096)
        for w in ("1", "2", "4"):
            env = {"SSMC_CUDA_RECURRENCE_WARPS": w}
            cands.append(Impl(name=f"cuda SSMC_CUDA_RECURRENCE_WARPS={w}",
                              label=f"ssmc: cuda, {w} warp(s) a channel", prepare=_default_prepare,
                              fwd=_with_env(env, run_fwd), fwdbwd=_with_env(env, run_fwdbwd, grad=True)))
        fwd_tm = ssmc.compile(spec, "cuda", layout="b t d")
        cands.append(Impl(
            name="cuda-time-major", label="ssmc: cuda (b t d, transposed untimed)",
            prepare=lambda inp, dout: {k: inp[k].detach().transpose(1, 2).contiguous() for k in names},
            fwd=lambda p: fwd_tm(**p),
            out_to_canon=lambda out, p: out.transpose(1, 2)))
    return cands


def _with_env(env: dict[str, str], run, grad: bool = False):
    def call(prep):
        with overriding(**env):
            return run(prep["inp"], prep["dout"]) if grad else run(prep["inp"])
    return call


def _first_order_scan():
    global ssmc  # the step's annotations are evaluated in this module's globals
    import ssmc

    @ssmc.recurrence
    def scan(h: ssmc.State["b d"], a: ssmc.Seq["b d"], x: ssmc.Seq["b d"]):  # noqa: F722
        h = a * h + x
        return h, h

    return scan


def _wrap_ssmc(workload: Workload, cand: Any) -> Impl:
    if isinstance(cand, Impl):
        cand.kind = "ssmc"
        return cand
    name, fwd_fn, fwdbwd_fn = cand
    return Impl(
        name=name,
        label=f"ssmc: {name}",
        kind="ssmc",
        prepare=_default_prepare,
        fwd=(lambda p: fwd_fn(p["inp"])) if fwd_fn is not None else None,
        fwdbwd=(lambda p: fwdbwd_fn(p["inp"], p["dout"])) if fwdbwd_fn is not None else None,
    )


def _try_import(module: str) -> tuple[Any, str | None]:
    try:
        return importlib.import_module(module), None
    except BaseException as exc:  # triton/CUDA import errors vary
        return None, f"import {module} failed: {short_reason(exc)}"


def scan_impls(env: PeerEnv, wl: Workload) -> list[Impl]:
    impls: list[Impl] = []
    L = wl.dims["L"]

    # accelerated_scan.scalar (Triton); layout (B, D, L)
    mod, err = _try_import("accelerated_scan.scalar")
    if mod is None:
        impls.append(Impl("accelerated_scan.scalar", "accelerated-scan scalar (Triton)",
                          unavailable=err))
    else:
        impls.append(_scan_bdl_impl("accelerated_scan.scalar", "accelerated-scan scalar (Triton)",
                                    mod.scan))

    # accelerated_scan.warp (CUDA, built by load_inline at import); L a power of 2, 32..65536
    warp = env.ext.get("warp")
    if isinstance(warp, Exception) or warp is None:
        impls.append(Impl("accelerated_scan.warp", "accelerated-scan warp (CUDA)",
                          unavailable=str(warp) if warp is not None else "not loaded"))
    elif L < 32 or L > 65536 or L & (L - 1):
        impls.append(Impl("accelerated_scan.warp", "accelerated-scan warp (CUDA)",
                          unavailable=f"L={L}: needs a power of 2 in [32, 65536]"))
    else:
        impls.append(_scan_bdl_impl("accelerated_scan.warp", "accelerated-scan warp (CUDA)",
                                    warp.scan))

    # fla chunk_hgrn (Triton): x, g of shape (B, T, D), h_t = exp(g_t) * h_{t-1} + x_t
    mod, err = _try_import("fla.ops.hgrn")
    if mod is None:
        impls.append(Impl("fla.chunk_hgrn", "fla chunk_hgrn (Triton; B,L,D; log gate)",
                          unavailable=err))
    else:
        chunk_hgrn = mod.chunk_hgrn

        def prepare(inp: dict[str, torch.Tensor], dout: torch.Tensor) -> Any:
            with torch.no_grad():
                x = inp["x"].transpose(1, 2).contiguous()
                g = inp["a"].log().transpose(1, 2).contiguous()
            return {"x": x.requires_grad_(), "g": g.requires_grad_(),
                    "a": inp["a"].detach(), "dout": dout.transpose(1, 2).contiguous()}

        def fwd(p: Any) -> torch.Tensor:
            return chunk_hgrn(p["x"], p["g"])[0]

        def fwdbwd(p: Any) -> Any:
            o = chunk_hgrn(p["x"], p["g"])[0]
            return torch.autograd.grad(o, (p["x"], p["g"]), p["dout"])

        impls.append(Impl(
            "fla.chunk_hgrn", "fla chunk_hgrn (Triton; B,L,D; log gate)",
            prepare=prepare, fwd=fwd, fwdbwd=fwdbwd,
            out_to_canon=lambda o, p: o.transpose(1, 2),
            # dL/dg = dL/da * a
            grads_to_canon=lambda gr, p: {"x": gr[0].transpose(1, 2),
                                          "a": gr[1].transpose(1, 2) / p["a"]},
            note="inputs given as (B, L, D) and g = log a (conversion not timed)",
        ))

    # PyTorch loop over time, fp32: only at tiny sizes (it takes ~86 ms at the benchmark size)
    if not wl.tiny:
        impls.append(Impl("torch.loop", "PyTorch loop over time (fp32)",
                          unavailable="skipped at benchmark size (runs with --quick)"))
    else:
        def loop_scan(a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            h = torch.zeros_like(x[:, :, 0])
            hs = []
            for t in range(x.shape[-1]):
                h = a[:, :, t] * h + x[:, :, t]
                hs.append(h)
            return torch.stack(hs, dim=-1)

        impls.append(_scan_bdl_impl("torch.loop", "PyTorch loop over time (fp32)", loop_scan))
    return impls


def _scan_bdl_impl(name: str, label: str, scan: Callable[..., torch.Tensor]) -> Impl:
    def fwd(p: Any) -> torch.Tensor:
        return scan(p["inp"]["a"], p["inp"]["x"])

    def fwdbwd(p: Any) -> Any:
        a, x = p["inp"]["a"], p["inp"]["x"]
        return torch.autograd.grad(scan(a, x), (a, x), p["dout"])

    return Impl(name, label, prepare=_default_prepare, fwd=fwd, fwdbwd=fwdbwd,
                grads_to_canon=lambda gr, p: {"a": gr[0], "x": gr[1]})


class _MambaSelectiveScan(torch.autograd.Function):
    """Autograd wrapper around mamba-ssm's selective_scan_cuda.fwd/bwd (variable B and C,
    one group, z gate, D skip, delta bias; delta_softplus fixed on)."""

    @staticmethod
    def forward(ctx, ext, u, delta, A, B, C, D, z, delta_bias):  # type: ignore[override]
        B4, C4 = B.unsqueeze(1), C.unsqueeze(1)  # (b, groups=1, n, l)
        out, states, out_z = ext.fwd(u, delta, A, B4, C4, D, z, delta_bias, True)[:3]
        ctx.ext = ext
        ctx.save_for_backward(u, delta, A, B4, C4, D, z, delta_bias, states, out)
        return out_z

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        u, delta, A, B4, C4, D, z, delta_bias, states, out = ctx.saved_tensors
        res = ctx.ext.bwd(u, delta, A, B4, C4, D, z, delta_bias, dout.contiguous(), states, out,
                          None, True, False)
        du, ddelta, dA, dB, dC, dD, ddelta_bias, dz = res[:8]
        return None, du, ddelta, dA, dB.squeeze(1), dC.squeeze(1), dD, dz, ddelta_bias


def mamba1_impls(env: PeerEnv, wl: Workload) -> list[Impl]:
    label = "mamba-ssm selective_scan_cuda (CUDA)"
    ext = env.ext.get("mamba")
    if isinstance(ext, Exception) or ext is None:
        return [Impl("mamba_ssm.selective_scan_cuda", label,
                     unavailable=str(ext) if ext is not None else "not loaded")]
    keys = wl.input_keys

    def fwd(p: Any) -> torch.Tensor:
        i = p["inp"]
        return ext.fwd(i["u"], i["delta"], i["A"], i["B"].unsqueeze(1), i["C"].unsqueeze(1),
                       i["D"], i["z"], i["delta_bias"], True)[2]

    def fwdbwd(p: Any) -> Any:
        i = p["inp"]
        args = [i[k] for k in keys]
        out = _MambaSelectiveScan.apply(ext, *args)
        return torch.autograd.grad(out, args, p["dout"])

    return [Impl("mamba_ssm.selective_scan_cuda", label, prepare=_default_prepare, fwd=fwd,
                 fwdbwd=fwdbwd, grads_to_canon=lambda gr, p: dict(zip(keys, gr)))]


def peer_impls(env: PeerEnv, wl: Workload) -> list[Impl]:
    if wl.key == "scan1":
        return scan_impls(env, wl)
    if wl.key.startswith("mamba1"):
        return mamba1_impls(env, wl)
    return []


# --------------------------------------------------------------------------------------------
# Checking and timing
# --------------------------------------------------------------------------------------------


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"shape {tuple(x.shape)} != reference {tuple(ref.shape)}")
    x64 = x.detach().double()
    if not bool(torch.isfinite(x64).all()):
        return math.inf
    denom = ref.norm().item()
    return (x64 - ref).norm().item() / (denom if denom > 0 else 1.0)


class Timer:
    def __init__(self, warmup_ms: float, rep_ms: float) -> None:
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        try:
            from triton.testing import do_bench

            self._do_bench = do_bench
            self.method = "triton.testing.do_bench, median"
        except Exception:
            self._do_bench = None
            self.method = "CUDA events, median (triton not importable)"
        self._flush: torch.Tensor | None = None

    def __call__(self, fn: Callable[[], Any]) -> float:
        if self._do_bench is not None:
            return float(self._do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms,
                                        return_mode="median"))
        return self._events(fn)

    def _events(self, fn: Callable[[], Any]) -> float:
        if self._flush is None:
            self._flush = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        torch.cuda.synchronize()
        est = max(start.elapsed_time(end) / 3, 1e-3)
        n_warm = max(1, int(self.warmup_ms / est))
        n_rep = max(5, min(10000, int(self.rep_ms / est)))
        for _ in range(n_warm):
            fn()
        times = []
        for _ in range(n_rep):
            self._flush.zero_()  # flush L2 between repetitions, as do_bench does
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times)


@dataclass
class Row:
    workload: str
    impl: str
    label: str
    kind: str
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    fwd_err: float | None = None
    bwd_err: float | None = None
    status: str = "ok"
    note: str = ""
    fwd_floor_ms: float | None = None
    fwdbwd_floor_ms: float | None = None


def _with_grad_leaves(wl: Workload, inp: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v.detach().clone().requires_grad_() if k in wl.grad_keys else v)
            for k, v in inp.items()}


def run_workload(wl: Workload, impls: list[Impl], timer: Timer, bw_bytes_per_ms: float | None,
                 seed: int, verbose: bool) -> list[Row]:
    rows: list[Row] = []
    fwd_floor = wl.fwd_bytes / bw_bytes_per_ms if bw_bytes_per_ms else None
    fwdbwd_floor = wl.fwdbwd_bytes / bw_bytes_per_ms if bw_bytes_per_ms else None
    runnable = [im for im in impls if im.unavailable is None]
    ref_out = ref_grads = inp_check = dout_check = None
    if runnable:
        log(f"[{wl.key}] float64 reference ...")
        inp_check = wl.make_inputs(seed)
        dout_check = torch.randn(wl.out_shape, generator=_gen(seed + 1), device=DEVICE)
        try:
            ref_out, ref_grads = wl.reference(inp_check, dout_check)
        except Exception as exc:
            if verbose:
                traceback.print_exc()
            for im in runnable:
                im.unavailable = f"reference failed: {short_reason(exc)}"
        _sync()

    for k, im in enumerate(impls):
        row = Row(wl.key, im.name, im.label, im.kind, note=im.note,
                  fwd_floor_ms=fwd_floor, fwdbwd_floor_ms=fwdbwd_floor)
        rows.append(row)
        if im.unavailable is not None:
            row.status = f"unavailable: {im.unavailable}"
            log(f"[{wl.key}] {im.name}: {row.status}")
            continue
        assert ref_out is not None and ref_grads is not None
        assert inp_check is not None and dout_check is not None
        prepare = im.prepare or _default_prepare
        stage = "check"
        try:
            # ---- check (fresh inputs of the reference) ----
            prep = prepare(_with_grad_leaves(wl, inp_check), dout_check)
            fwd_ok = bwd_ok = False
            if im.fwd is not None:
                with torch.no_grad():
                    out = im.fwd(prep)
                _sync()
                if im.out_to_canon is not None:
                    out = im.out_to_canon(out, prep)
                row.fwd_err = rel_err(out, ref_out)
                fwd_ok = row.fwd_err < TOL_FP32
                del out
            if im.fwdbwd is not None:
                grads = im.fwdbwd(prep)
                _sync()
                if im.grads_to_canon is not None:
                    grads = im.grads_to_canon(grads, prep)
                missing = [g for g in wl.grad_keys if g not in grads]
                if missing:
                    raise ValueError(f"fwdbwd returned no gradient for {missing}")
                row.bwd_err = max(rel_err(grads[g], ref_grads[g]) for g in wl.grad_keys)
                bwd_ok = row.bwd_err < TOL_FP32
                del grads
            del prep
            failed = []
            if im.fwd is not None and not fwd_ok:
                failed.append(f"fwd rel err {row.fwd_err:.2e}")
            if im.fwdbwd is not None and not bwd_ok:
                failed.append(f"grad rel err {row.bwd_err:.2e}")
            if failed:
                row.status = "CHECK FAILED: " + ", ".join(failed) + f" (tol {TOL_FP32:g})"
            # ---- timing (fresh random inputs) ----
            stage = "timing"
            tin = wl.make_inputs(seed + 100 + k)
            tdout = torch.randn(wl.out_shape, generator=_gen(seed + 200 + k), device=DEVICE)
            prep = prepare(_with_grad_leaves(wl, tin), tdout)
            if im.fwd is not None and fwd_ok:
                fwd_fn = im.fwd

                def run_fwd(p: Any = prep, f: Callable = fwd_fn) -> None:
                    with torch.no_grad():
                        f(p)

                row.fwd_ms = timer(run_fwd)
            if im.fwdbwd is not None and bwd_ok:
                fb_fn = im.fwdbwd
                row.fwdbwd_ms = timer(lambda p=prep, f=fb_fn: f(p))
            del prep, tin, tdout
        except Exception as exc:  # one broken implementation must not stop us
            if verbose:
                traceback.print_exc()
            row.status = f"unavailable: {stage} raised {short_reason(exc)}"
        log(f"[{wl.key}] {im.name}: fwd {fmt_ms(row.fwd_ms)} ms, fwd+bwd {fmt_ms(row.fwdbwd_ms)} ms,"
            f" err {fmt_err(row.fwd_err)}/{fmt_err(row.bwd_err)} {row.status}")
        _empty_cache()
    return rows


def measure_copy_bandwidth(timer: Timer) -> float:
    """Device-to-device copy rate in bytes per ms, counting bytes read plus bytes written."""
    n = 2**28  # 1 GiB of fp32
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)

    def copy() -> None:
        dst.copy_(src)

    ms = timer(copy)
    return 2 * n * 4 / ms


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def fmt_ms(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}"


def fmt_err(v: float | None) -> str:
    return "–" if v is None else f"{v:.1e}"


def fmt_frac(floor: float | None, ms: float | None) -> str:
    if floor is None or ms is None or ms <= 0:
        return "–"
    return f"{floor / ms:.2f}"


def render(rows: list[Row], workloads: dict[str, Workload], header: list[str]) -> str:
    lines = ["# ssmc peers on the GPU", ""]
    lines += [f"- {h}" for h in header]
    lines += ["", "Workloads:", ""]
    for key in dict.fromkeys(r.workload for r in rows):
        wl = workloads[key]
        lines.append(f"- `{key}`: {wl.title}; layout {wl.layout}; least bytes fwd "
                     f"{wl.fwd_bytes / 1e6:.1f} MB, fwd+bwd {wl.fwdbwd_bytes / 1e6:.1f} MB")
    lines += [
        "",
        "| workload | implementation | fwd ms | fwd+bwd ms | floor/fwd | floor/fwd+bwd "
        "| vs best peer fwd | vs best peer fwd+bwd | rel err fwd / grads | TARGETS.md (H200) "
        "fwd / fwd+bwd | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    best: dict[str, tuple[float | None, float | None]] = {}
    for key in dict.fromkeys(r.workload for r in rows):
        peers = [r for r in rows if r.workload == key and r.kind == "peer"]
        f = [r.fwd_ms for r in peers if r.fwd_ms is not None and r.impl != "torch.loop"]
        b = [r.fwdbwd_ms for r in peers if r.fwdbwd_ms is not None and r.impl != "torch.loop"]
        best[key] = (min(f) if f else None, min(b) if b else None)
    for r in rows:
        tf, tb = (None, None) if workloads[r.workload].tiny else \
            TARGETS_MS.get((r.workload, r.impl), (None, None))
        bf, bb = best[r.workload]
        vs_f = f"{bf / r.fwd_ms:.2f}x" if bf and r.fwd_ms else "–"
        vs_b = f"{bb / r.fwdbwd_ms:.2f}x" if bb and r.fwdbwd_ms else "–"
        status = r.status + (f"; {r.note}" if r.note and r.status == "ok" else "")
        status = status.replace("|", "/")
        lines.append(
            f"| {r.workload} | {r.label} | {fmt_ms(r.fwd_ms)} | {fmt_ms(r.fwdbwd_ms)} "
            f"| {fmt_frac(r.fwd_floor_ms, r.fwd_ms)} | {fmt_frac(r.fwdbwd_floor_ms, r.fwdbwd_ms)} "
            f"| {vs_f} | {vs_b} | {fmt_err(r.fwd_err)} / {fmt_err(r.bwd_err)} "
            f"| {fmt_ms(tf)} / {fmt_ms(tb)} | {status} |"
        )
    lines += [
        "",
        "floor = least bytes ÷ the device-to-device copy rate measured in this run; "
        "floor/time = fraction of that bandwidth floor reached (1.00 = at the floor). The fwd "
        "floors are TARGETS.md's; the fwd+bwd byte counts are this script's (states recomputed, "
        "not stored). 'vs best peer' = best peer time ÷ this time (torch.loop excluded). "
        f"rel err = ||out − ref|| / ||ref|| against float64, tolerance {TOL_FP32:g}; "
        "for grads the largest over all inputs.",
    ]
    return "\n".join(lines) + "\n"


def env_header(env: PeerEnv, timer: Timer | None, bw: float | None, args: argparse.Namespace
               ) -> list[str]:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        gpu += f" (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, " \
               f"{p.total_memory / 2**30:.0f} GiB)"
    hdr = [
        f"date: {now}",
        f"GPU: {gpu}",
        f"host: {platform.node()}, Python {platform.python_version()}, torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), triton {env.versions.get('triton', '?')}",
        "peers: " + ", ".join(f"{k} {v}" for k, v in env.versions.items() if k != "triton"),
        f"mode: {'--quick (tiny sizes)' if args.quick else 'benchmark sizes'}",
    ]
    if timer is not None:
        hdr.append(f"timing: {timer.method}, warmup {args.warmup_ms:g} ms, rep {args.rep_ms:g} "
                   "ms, L2 flushed between repetitions, fresh random inputs")
    if bw is not None:
        hdr.append(f"device-to-device copy measured: {bw / 1e9:.2f} TB/s (bytes read + written;"
                   f" TARGETS.md: {TARGETS_COPY_TBPS_H200} TB/s on an H200)")
    hdr += env.notes
    return hdr


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Check and time ssmc's benchmark peers on a CUDA GPU (see TARGETS.md).")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    ap.add_argument("--build-mamba", action="store_true",
                    help="build mamba-ssm's selective_scan_cuda from the sdist (~100 s)")
    ap.add_argument("--mamba-so", metavar="PATH",
                    help="load a prebuilt selective_scan_cuda .so (from an earlier --build-mamba "
                         "run's $OUT) instead of building")
    ap.add_argument("--mamba-std", metavar="STD", default=None,
                    help="C++ standard for the mamba build, e.g. c++17 as in its setup.py "
                         "(default: torch's own)")
    ap.add_argument("--no-warp", action="store_true",
                    help="skip accelerated_scan.warp (its import JIT-builds a CUDA kernel)")
    ap.add_argument("--no-variants", action="store_true",
                    help="time ssmc's default configuration only (no forced strategies or steps per lane)")
    ap.add_argument("--only", metavar="WORKLOAD",
                    help="comma-separated subset of: scan1, mamba1, mamba1_small")
    ap.add_argument("--peers", type=Path, default=REPO / "peers", help="folder of the peers")
    ap.add_argument("--site", type=Path, default=Path("/tmp/ssmc_peers_site"),
                    help="where wheels not already importable are installed")
    ap.add_argument("--src", type=Path, default=Path("/tmp/ssmc_peers_src"),
                    help="where the mamba-ssm sdist is unpacked")
    ap.add_argument("--ext-dir", type=Path, default=Path("/tmp/ssmc_peers_ext"),
                    help="build cache of the CUDA extensions (TORCH_EXTENSIONS_DIR)")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for gpu_peers.md/.json (default: $OUT if set)")
    ap.add_argument("--warmup-ms", type=float, default=50.0)
    ap.add_argument("--rep-ms", type=float, default=200.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--verbose", action="store_true", help="print tracebacks")
    args = ap.parse_args(argv)
    all_keys = ["scan1", "mamba1", "mamba1_small"]
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        bad = [k for k in keys if k not in all_keys]
        if bad:
            ap.error(f"unknown workload(s) {bad}; choose from {all_keys}")
        args.workloads = keys
    else:
        args.workloads = all_keys
    if args.out is None and os.environ.get("OUT"):
        args.out = Path(os.environ["OUT"])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir: Path | None = args.out
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    env = PeerEnv(peers_dir=args.peers, site_dir=args.site, src_dir=args.src,
                  ext_dir=args.ext_dir)
    setup_peers(env)
    workloads = make_workloads(args.quick)
    selected = {k: workloads[k] for k in args.workloads}
    cuda = torch.cuda.is_available()
    rows: list[Row] = []
    timer: Timer | None = None
    bw: float | None = None

    if not cuda:
        env.notes.append("no CUDA device: nothing was built, checked or timed")
        for wl in selected.values():
            for im in _offline_impls(wl):
                rows.append(Row(wl.key, im.name, im.label, im.kind,
                                status="unavailable: no CUDA device"))
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        prebuild(env, args, list(selected), out_dir)
        if any(k.startswith("mamba1") for k in selected):
            try:
                import_mamba_triton(env)
                env.notes.append("mamba-ssm Triton ops (ssd_combined) import without its "
                                 "package __init__: yes")
            except BaseException as exc:
                env.notes.append(f"mamba-ssm Triton ops import failed: {short_reason(exc)}")
        timer = Timer(args.warmup_ms, args.rep_ms)
        try:
            bw = measure_copy_bandwidth(timer)
        except Exception as exc:
            env.notes.append(f"copy bandwidth not measured: {short_reason(exc)}")
        for wl in selected.values():
            impls = peer_impls(env, wl)
            try:
                impls += [_wrap_ssmc(wl, c) for c in ssmc_candidates(wl, variants=not args.no_variants)]
            except Exception as exc:
                env.notes.append(f"ssmc_candidates({wl.key}) raised {short_reason(exc)}")
            rows += run_workload(wl, impls, timer, bw, args.seed, args.verbose)

    text = render(rows, selected, env_header(env, timer, bw, args))
    log("")
    log(text)
    if out_dir is not None:
        (out_dir / "gpu_peers.md").write_text(text)
        (out_dir / "gpu_peers.json").write_text(json.dumps(
            {"header": env_header(env, timer, bw, args),
             "rows": [r.__dict__ for r in rows]}, indent=1, default=str))
        log(f"wrote {out_dir / 'gpu_peers.md'}")
    return 0 if cuda else 1


def _offline_impls(wl: Workload) -> list[Impl]:
    """The rows a run would have, for a machine without CUDA (names only)."""
    if wl.key == "scan1":
        return [Impl("accelerated_scan.scalar", "accelerated-scan scalar (Triton)"),
                Impl("accelerated_scan.warp", "accelerated-scan warp (CUDA)"),
                Impl("fla.chunk_hgrn", "fla chunk_hgrn (Triton; B,L,D; log gate)"),
                Impl("torch.loop", "PyTorch loop over time (fp32)")]
    return [Impl("mamba_ssm.selective_scan_cuda", "mamba-ssm selective_scan_cuda (CUDA)")]


if __name__ == "__main__":
    sys.exit(main())
