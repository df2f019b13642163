"""Host time of ssmc's torch op per call, apart from the GPU's: is a small training step kernel-bound?

    python bench/host_time.py [--out DIR] [--calls 50] [--only mamba1,scan,ssd,ssd_short,retnet,attention]
    python bench/host_time.py --cpu-stub [--calls 200] [--profile] [--only ...]   # no GPU: the host path alone

For Mamba-1 at the seed size (`examples/mamba1.py`, "b d t", B32 D512 L180 N16 fp32, gradients of the 8
inputs) and the first-order scan h = a * h + x (bench/workloads/diagonal.py, B32 D512 L180): the host
milliseconds of a forward call and of a backward call (into the leaves' gradients, which torch adds to: a
launch a leaf; and with the gradients set to None before each, as after ``zero_grad(set_to_none=True)``),
`--calls` of each back to back (`torch.cuda._sleep`
keeps the GPU busy meanwhile, so the Python returns before any kernel runs: the wall time is host time alone,
and a call that waits for the GPU shows as the sleep's length), the GPU kernels' time of one training step
(the torch profiler's sum), and the step's time back to back (CUDA events around `--calls` steps). Prints a
markdown table; with --out, writes DIR/host_time.md.

"ssd": Mamba-2 / SSD (`examples/mamba2.py`, "b t ...", bf16), a layer run in stages around a chunked core
(passes/matrix_linear.py), at B4 L4096 G1 R32 P64 N128 on the GPU: the torch op's training step as above, and
`ssmc.compile`'s forward alone (host milliseconds per call, its kernels' time, its time back to back). Before
timing, the GPU run checks that calls after the first of a signature (the prepared paths: cuda/staged.py,
autograd/stages.py `PreparedStages`) give the first call's outputs and gradients (relative error printed, at
most 1e-3), and the same after a call of another shape. "ssd_short": the same layer at B32 L180 G1 R16 P64 N64, a
short call whose last chunk is partial (180 steps: a chunk of 128 and one of 52, padded), rows as "ssd"'s
(B1 L180 G1 R1 P64 N64 with --cpu-stub). "retnet": RetNet (`examples/retnet.py`, bf16 q, k, v and
an fp32 param gamma, whose positivity the chunked core checks once per array) at B4 L4096 H16 K128 V128, rows
as SSD's.
"lstm" / "gru": `ssmc.torch.function` of examples/lstm.py / gru.py (fp32, the persistent kernels) at
B16 L180 I128 H256, every input a leaf, rows as Mamba-1's.
"attention": `ssmc.torch.function` of causal attention and of causal ALiBi with a fixed slope (bench/flash_check.py's
specs; the flash kernels), q, k, v [b h t d] bf16 at B2 H4 L1000 d64 (B1 H2 L16 d64 with --cpu-stub), rows as
Mamba-1's.
"attention_doc" (not in the default set): causal attention within documents from sorted ids [b, t] int32
(bench/flash_check.py's "doc" spec, 3 documents a row), the same shapes and rows as "attention".

--cpu-stub runs the same Python path on a machine without a GPU: the CUDA backend emulated
(SSMC_CUDA_EMULATE=1, CPU tensors stand for device memory), every kernel launch and memset running its
host code down to the driver's call, which does nothing (`_stub_launches`). The kernels are compiled for
the emulator at the first call, then never run (outputs and gradients are garbage). A call's time is
then the host code alone, counted as this thread's CPU time (`time.thread_time_ns`: on a machine shared
with other work, the time the thread waits for a core is left out). Each backward is timed alone, the
leaves' gradients set to None before it (torch then keeps the gradient given, where on the CPU an
accumulation would be a real add over the tensor; on the GPU it is one more launch a leaf). The median
and least of the forward and backward calls are printed beside those of a bare `torch.autograd.Function`
of the same tensors (one allocation and views each way): the floor torch's own machinery sets on this
machine. --profile prints cProfile's top functions of each (on the GPU too: the torch op's forward and backward
calls). The SSD rows there run at B1 L128 G1 R1 P64 N64
(ssd_short's at L180: a partial last chunk; the kernels' smallest key and value sizes; a stub moves no data,
but the torch ops between the launches still compute on the CPU, so small sizes keep them from counting as
host time), and add `ssmc.compile`'s
forward (no tape) as its own row. The kernels of 16-bit programs do not compile for the emulator (no
cuda_fp16.h there): with launches stubbed nothing is compiled at all (`_stub_launches`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ssmc.torch
from ssmc.examples import mamba1, mamba2, retnet

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads.diagonal import scan as scan1  # h = a * h + x

SLEEP_CYCLES = 400_000_000  # ~0.2 s of GPU time: longer than all the host calls queued behind it


DEVICE = "cuda"  # "cpu" with --cpu-stub


def mamba1_inputs(b=32, d=512, n=16, t=180) -> dict:
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g, device=DEVICE) * scale + shift).requires_grad_(True)
    return {"u": randn(b, d, t), "delta": randn(b, d, t, shift=-1.0), "A": randn(d, n, scale=0.5),
            "B": randn(b, n, t), "C": randn(b, n, t), "D": randn(d), "z": randn(b, d, t),
            "delta_bias": randn(d, scale=0.1)}


def scan1_inputs(b=32, d=512, t=180) -> dict:
    g = torch.Generator(device=DEVICE).manual_seed(1)
    a = torch.rand(b, d, t, generator=g, device=DEVICE).requires_grad_(True)
    return {"a": a, "x": torch.randn(b, d, t, generator=g, device=DEVICE).requires_grad_(True)}


SSD = {"b": 4, "t": 4096, "g": 1, "r": 32, "p": 64, "n": 128}     # bench/chunk_check.py's
SSD_STUB = {"b": 1, "t": 128, "g": 1, "r": 1, "p": 64, "n": 64}   # --cpu-stub's (module docstring)
SSD_SHORT = {"b": 32, "t": 180, "g": 1, "r": 16, "p": 64, "n": 64}   # a partial last chunk (180 = 128 + 52)
SSD_SHORT_STUB = {"b": 1, "t": 180, "g": 1, "r": 1, "p": 64, "n": 64}


def ssd_inputs(s: dict, seed: int = 2) -> dict:
    """Mamba-2 / SSD's inputs as bench/chunk_check.py draws them (bf16 sequences, fp32 params)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    b, t, gr, r, p, n = s["b"], s["t"], s["g"], s["r"], s["p"], s["n"]

    def randn(*shape, shift=0.0):
        return (torch.randn(*shape, generator=g, device=DEVICE) + shift).to(torch.bfloat16).requires_grad_(True)
    return {"x": randn(b, t, gr, r, p), "dt": randn(b, t, gr, r, shift=-1.0),
            "A": (-torch.exp(torch.rand(gr, r, generator=g, device=DEVICE) * 2 - 1)).requires_grad_(True),
            "B": randn(b, t, gr, n), "C": randn(b, t, gr, n),
            "D": torch.randn(gr, r, generator=g, device=DEVICE).requires_grad_(True)}


RETNET = {"b": 4, "t": 4096, "h": 16, "k": 128, "v": 128}   # bench/chunk_check.py's
RETNET_STUB = {"b": 1, "t": 128, "h": 1, "k": 64, "v": 64}


def retnet_inputs(s: dict, seed: int = 4) -> dict:
    """RetNet's inputs as bench/chunk_check.py draws them (bf16 q, k, v; fla's decays, fp32)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    b, t, h, k, v = s["b"], s["t"], s["h"], s["k"], s["v"]

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(torch.bfloat16).requires_grad_(True)
    gamma = 1 - 2.0 ** (-5.0 - torch.arange(h, device=DEVICE, dtype=torch.float32))
    return {"q": randn(b, t, h, k, scale=k ** -0.5), "k": randn(b, t, h, k, scale=k ** -0.5), "v": randn(b, t, h, v),
            "gamma": gamma.requires_grad_(True)}


ATTENTION = {"b": 2, "h": 4, "t": 1000, "d": 64}   # flash_check's small shape
ATTENTION_STUB = {"b": 1, "h": 2, "t": 16, "d": 64}


def attention_inputs(s: dict, alibi: bool, seed: int = 6) -> dict:
    """Causal attention's q, k, v [b h t d] bf16 (leaves), and for ALiBi a fixed slope per head (no gradient)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (s["b"], s["h"], s["t"], s["d"])
    out = {n: torch.randn(shape, device=DEVICE, generator=g).to(torch.bfloat16).requires_grad_(True) for n in "qkv"}
    if alibi:
        out["slope"] = 2.0 ** (-8.0 * torch.arange(1, s["h"] + 1, device=DEVICE, dtype=torch.float32) / s["h"])
    return out


def doc_inputs(s: dict, documents: int = 3, seed: int = 7) -> dict:
    """Causal attention within documents: q, k, v as `attention_inputs`, and sorted document ids [b, t] int32
    (`documents` a row, random lengths; bench/flash_check.py's "doc" spec)."""
    out = attention_inputs(s, False, seed)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    starts = torch.sort(torch.randint(1, s["t"], (s["b"], documents - 1), generator=g, device=DEVICE), dim=1).values
    out["doc"] = (torch.arange(s["t"], device=DEVICE)[None, :, None] >= starts[:, None, :]).sum(-1).to(torch.int32)
    return out


def doc_rows(shape: dict, measure_fn, *extra) -> list[dict]:
    """Host time of the attention op of document ids (bench/flash_check.py's "doc" spec), the ids fixed."""
    from flash_check import GATHER_SPECS

    title = "attention doc B{b} H{h} L{t} d{d} bf16 (ids int32)"
    return [measure_fn(title.format(**shape), ssmc.torch.function(GATHER_SPECS["doc"], layout="b h t ..."),
                       doc_inputs(shape), *extra)]


def attention_rows(shape: dict, measure_fn, *extra) -> list[dict]:
    """Host time of the attention op (`ssmc.torch.function` of a causal and a causal ALiBi spec, the slope fixed)."""
    from flash_check import SPECS

    title = "attention {} B{b} H{h} L{t} d{d} bf16"
    return [measure_fn(title.format(name, **shape), ssmc.torch.function(SPECS[name], layout="b h t ..."),
                       attention_inputs(shape, name == "alibi"), *extra) for name in ("causal", "alibi")]


def rel(got, want) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def check_repeated(compiled, fn, inputs: dict, other: dict) -> float:
    """The largest relative error, over outputs and gradients, of later calls of `compiled` (`ssmc.compile`)
    and `fn` (the torch op) against their first call on `inputs`, after a call on `other` (another shape)
    too; raises where it is above 1e-3."""
    detached = {k: v.detach() for k, v in inputs.items()}

    def step(values):
        for v in values.values():
            v.grad = None
        y = fn(**values)
        y.backward(torch.ones_like(y) * 0.01 + y.detach() * 0.001)
        return [y.detach().clone()] + [v.grad.detach().clone() for v in values.values()]
    first_y, first = compiled(**detached).clone(), step(inputs)
    worst = 0.0
    for i in range(4):
        if i == 2:
            compiled(**{k: v.detach() for k, v in other.items()})
            step(other)
        worst = max(worst, rel(compiled(**detached), first_y), *(rel(a, b) for a, b in zip(step(inputs), first)))
    if not worst <= 1e-3:
        raise SystemExit(f"repeated calls differ from the first: relative error {worst:.3g}")
    return worst


PROFILE = False  # --profile on the GPU: `measure` prints cProfile's top functions (`_profile_calls`)


def host_ms(fns) -> float:
    """Host milliseconds per call of the calls `fns`, made back to back (steady state) while the GPU works
    through a long sleep queued before them."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    for fn in fns:
        fn()
    ms = (time.perf_counter() - t0) * 1e3 / len(fns)
    torch.cuda.synchronize()
    return ms


def measure(name: str, fn, inputs: dict, calls: int) -> dict:
    leaves = [t for t in inputs.values() if t.requires_grad]

    def forward():
        return fn(**inputs)

    def step():
        fn(**inputs).backward(cotangent)
    cotangent = torch.randn_like(forward())
    for _ in range(5):
        step()
    fwd = host_ms([forward] * calls)
    outs = [forward() for _ in range(calls)]
    bwd = host_ms([lambda y=y: y.backward(cotangent) for y in outs])

    def fresh_backward(y):  # as after `zero_grad(set_to_none=True)`: torch keeps the gradients, adds none
        for t in leaves:
            t.grad = None
        y.backward(cotangent)
    outs = [forward() for _ in range(calls)]
    bwd_fresh = host_ms([lambda y=y: fresh_backward(y) for y in outs])
    del outs
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        step()
    end.record()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sum(e.self_device_time_total for e in prof.key_averages()
                  if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3  # kernels alone, not the ops above them
    for t in leaves:
        t.grad = None
    if PROFILE:
        _profile_calls(forward, fresh_backward, calls)
    return {"name": name, "fwd_host": fwd, "bwd_host": bwd, "bwd_fresh": bwd_fresh,
            "step": start.elapsed_time(end) / calls, "kernels": kernels}


def _profile_calls(forward, backward, calls: int) -> None:
    """cProfile's top functions of `calls` forward calls and of as many backward calls (each of a forward's output),
    the backward in this thread (`set_multithreading_enabled(False)`: torch's engine runs a CUDA backward in a thread
    of its own, which cProfile does not see), while the GPU sleeps as in `host_ms`."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    with cProfile.Profile() as prof:
        outs = [forward() for _ in range(calls)]
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    with torch.autograd.set_multithreading_enabled(False), cProfile.Profile() as prof:
        for y in outs:
            backward(y)
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    torch.cuda.synchronize()


def chunked_rows(title: str, example, inputs: dict, other: dict, calls: int) -> list[dict]:
    """A chunked layer's rows (SSD, RetNet): later calls checked against the first (`check_repeated`, `other` of
    another shape between), then `ssmc.compile`'s forward and the torch op's step. At most 15 calls a batch: a
    training step is some fifty launches (kernels and torch's ops), and a launch waits once about a thousand are
    queued (the GPU asleep): that wait is no host time."""
    compiled = ssmc.compile(example.SPEC, "cuda", layout=example.LAYOUT)
    op = ssmc.torch.function(example.SPEC, "cuda", layout=example.LAYOUT)
    err = check_repeated(compiled, op, inputs, other)
    print(f"{title}: later calls against the first, outputs and gradients: relative error {err:.2e}")
    calls = min(calls, 15)
    return [measure_forward(f"{title}, ssmc.compile forward", compiled, inputs, calls),
            measure(f"{title}, torch op", op, inputs, calls)]


def measure_forward(name: str, compiled, inputs: dict, calls: int) -> dict:
    """`ssmc.compile`'s forward alone (no tape): host ms per call, its kernels' ms, its ms back to back."""
    inputs = {k: v.detach() for k, v in inputs.items()}

    def forward():
        return compiled(**inputs)
    for _ in range(5):
        forward()
    fwd = host_ms([forward] * calls)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        forward()
    end.record()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    kernels = sum(e.self_device_time_total for e in prof.key_averages()
                  if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
    return {"name": name, "fwd_host": fwd, "kernels": kernels, "step": start.elapsed_time(end) / calls}


def _stub_launches() -> None:
    """Every kernel launch and device memset of ssmc runs its host code as on the GPU, down to the
    driver's call, which is a C function that does nothing (libc's ``labs``, called through ctypes with
    the driver's argument types: the arguments' conversion is counted) on a kernel handle of 0."""
    import ctypes

    from ssmc.backends.cuda import launch
    from ssmc.backends.cuda.kernels.chunk import mma  # noqa: F401  (imported: patched below)

    def c_function(argtypes):
        fn = ctypes.CDLL(None).labs
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        return fn
    u = ctypes.c_uint
    launch._driver = c_function([ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p])
    memset = c_function([ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p])
    launch._raw_stream = lambda device: 0
    real = launch.launch_kernel

    class Kernel:  # not emulated: the driver's path; its handle 0 (``labs(0)``: success)
        ptr = 0

    kernel = Kernel()

    from ssmc.backends.cuda import emulator

    def emulated(source, name):  # nothing compiled: no launch reaches it
        return None
    emulator.emulated = emulated

    def launched(function, grid, length, nblk, pointers, shared=0):
        real(kernel, grid, length, nblk, pointers, shared)

    def zeroed(pointer, nbytes, fallback):
        memset(0, 0, nbytes // 4, launch.current_stream())

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("ssmc"):
            for name, fn in (("launch_kernel", launched), ("zero_bytes", zeroed)):
                if getattr(module, name, None) is not None:
                    setattr(module, name, fn)


class _Floor(torch.autograd.Function):
    """torch's own cost of a call like ssmc's: the tensors in and saved, one allocation and a view out;
    backward: one allocation and a view per gradient."""

    @staticmethod
    def forward(ctx, fn, lean, *tensors):
        ctx.save_for_backward(*tensors)
        ctx.set_materialize_grads(False)
        return torch.as_strided(torch.empty(fn.numel(), dtype=fn.dtype, device=fn.device), fn.shape, fn.stride())

    @staticmethod
    def backward(ctx, *cotangents):
        tensors = ctx.saved_tensors
        buffer = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
        offset, grads = 0, []
        for t in tensors:  # contiguous views: torch keeps them as the gradients (no copy)
            grads.append(torch.as_strided(buffer, t.shape, t.stride(), offset))
            offset += t.numel()
        return (None, None, *grads)


def _stub_forward(name: str, compiled, inputs: dict, calls: int, profile_calls: bool) -> dict:
    """Host microseconds (median, least) of `ssmc.compile`'s forward, launches stubbed."""
    inputs = {k: v.detach() for k, v in inputs.items()}
    times = []
    for i in range(calls + 5):
        t0 = time.thread_time_ns()
        compiled(**inputs)
        if i >= 5:
            times.append(time.thread_time_ns() - t0)
    if profile_calls:
        import cProfile
        import pstats

        with cProfile.Profile() as prof:
            for _ in range(calls):
                compiled(**inputs)
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return {"name": name, "fwd": (statistics.median(times) / 1e3, min(times) / 1e3)}


def _stub_measure(name: str, fn, inputs: dict, calls: int, profile_calls: bool) -> dict:
    """Host microseconds (median, least) of a forward and of a backward call, launches stubbed (module docstring)."""
    leaves = [t for t in inputs.values() if t.requires_grad]
    y = fn(**inputs)
    cotangent = torch.randn_like(y)
    like = y.detach()
    floor = lambda: _Floor.apply(like, None, *leaves)  # noqa: E731

    def medians(forward) -> tuple[float, float]:
        fwd, bwd = [], []
        for _ in range(calls):
            t0 = time.thread_time_ns()
            out = forward()
            fwd.append(time.thread_time_ns() - t0)
            for t in leaves:
                t.grad = None
            t0 = time.thread_time_ns()
            out.backward(cotangent)
            bwd.append(time.thread_time_ns() - t0)
        return (statistics.median(fwd) / 1e3, min(fwd) / 1e3), (statistics.median(bwd) / 1e3, min(bwd) / 1e3)

    for _ in range(5):
        medians(lambda: fn(**inputs))
    fwd, bwd = medians(lambda: fn(**inputs))
    floor_fwd, floor_bwd = medians(floor)
    if profile_calls:
        import cProfile
        import pstats

        outs = []
        with cProfile.Profile() as prof:
            for _ in range(calls):
                outs.append(fn(**inputs))
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        with cProfile.Profile() as prof:
            for out in outs:
                for t in leaves:
                    t.grad = None
                out.backward(cotangent)
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return {"name": name, "fwd": fwd, "bwd": bwd, "floor_fwd": floor_fwd, "floor_bwd": floor_bwd}


def stub_main(args) -> None:
    global DEVICE
    DEVICE = "cpu"
    os.environ["SSMC_CUDA_EMULATE"] = "1"
    _stub_launches()
    torch.set_num_threads(1)
    rows = []
    if "mamba1" in args.only:
        rows.append(_stub_measure("Mamba-1 B32 D512 L180 N16 fp32",
                                  ssmc.torch.function(mamba1.SPEC, "cuda", layout=mamba1.LAYOUT), mamba1_inputs(),
                                  args.calls, args.profile))
    if "scan" in args.only:
        rows.append(_stub_measure("scan h = a h + x B32 D512 L180 fp32",
                                  ssmc.torch.function(scan1, "cuda", layout="b d t"), scan1_inputs(), args.calls,
                                  args.profile))
    for only, shape in (("ssd", SSD_STUB), ("ssd_short", SSD_SHORT_STUB)):
        if only not in args.only:
            continue
        title = "SSD B{b} L{t} G{g} R{r} P{p} N{n} bf16".format(**shape)
        compiled = ssmc.compile(mamba2.SPEC, "cuda", layout=mamba2.LAYOUT)
        op = ssmc.torch.function(mamba2.SPEC, "cuda", layout=mamba2.LAYOUT)
        rows.append(_stub_forward(f"{title}, ssmc.compile forward", compiled, ssd_inputs(shape), args.calls,
                                  args.profile))
        rows.append(_stub_measure(f"{title}, torch op", op, ssd_inputs(shape), args.calls, args.profile))
    if "retnet" in args.only:
        title = "RetNet B{b} L{t} H{h} K{k} V{v} bf16".format(**RETNET_STUB)
        compiled = ssmc.compile(retnet.SPEC, "cuda", layout=retnet.LAYOUT)
        op = ssmc.torch.function(retnet.SPEC, "cuda", layout=retnet.LAYOUT)
        rows.append(_stub_forward(f"{title}, ssmc.compile forward", compiled, retnet_inputs(RETNET_STUB),
                                  args.calls, args.profile))
        rows.append(_stub_measure(f"{title}, torch op", op, retnet_inputs(RETNET_STUB), args.calls, args.profile))
    if "attention" in args.only:
        rows += attention_rows(ATTENTION_STUB, _stub_measure, args.calls, args.profile)
    if "attention_doc" in args.only:
        rows += doc_rows(ATTENTION_STUB, _stub_measure, args.calls, args.profile)
    lines = ["| workload (CPU, launches stubbed; median / least of the calls) | host us forward | host us backward "
             "| bare autograd.Function forward | bare backward |", "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | " + " | ".join(f"{r[k][0]:.1f} / {r[k][1]:.1f}" if k in r else "-"
                                            for k in ("fwd", "bwd", "floor_fwd", "floor_bwd")) + " |" for r in rows]
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--calls", type=int, default=None, help="calls of each kind (default 50; 200 with --cpu-stub)")
    ap.add_argument("--cpu-stub", action="store_true", help="no GPU: the host path with launches stubbed")
    ap.add_argument("--profile", action="store_true", help="cProfile's top functions of the torch op's calls")
    ap.add_argument("--only", default="mamba1,scan,ssd,retnet,attention",
                    help="workloads, comma-separated: mamba1, scan, ssd, ssd_short, retnet, attention, "
                         "attention_doc, lstm, gru")
    args = ap.parse_args()
    args.only = set(args.only.split(","))
    global PROFILE
    PROFILE = args.profile
    if args.cpu_stub:
        args.calls = args.calls or 200
        stub_main(args)
        return
    args.calls = args.calls or 50
    rows = []
    if "mamba1" in args.only:
        op = ssmc.torch.function(mamba1.SPEC, "cuda", layout=mamba1.LAYOUT)
        inputs = mamba1_inputs()
        rows.append(measure("Mamba-1 B32 D512 L180 N16 fp32", op, inputs, args.calls))
        like = op(**inputs).detach()  # torch's own floor on the GPU: a bare autograd.Function of the same tensors
        rows.append(measure("bare autograd.Function, the same tensors (torch's floor)",
                            lambda **kw: _Floor.apply(like, None, *kw.values()), inputs, args.calls))
    if "scan" in args.only:
        rows.append(measure("scan h = a h + x B32 D512 L180 fp32", ssmc.torch.function(scan1, "cuda", layout="b d t"),
                            scan1_inputs(), args.calls))
    for only, shape in (("ssd", SSD), ("ssd_short", SSD_SHORT)):
        if only in args.only:
            rows += chunked_rows("SSD B{b} L{t} G{g} R{r} P{p} N{n} bf16".format(**shape), mamba2, ssd_inputs(shape),
                                 ssd_inputs({**shape, "t": shape["t"] // 2}, seed=3), args.calls)
    if "retnet" in args.only:
        rows += chunked_rows("RetNet B{b} L{t} H{h} K{k} V{v} bf16".format(**RETNET), retnet, retnet_inputs(RETNET),
                             retnet_inputs({**RETNET, "t": RETNET["t"] // 2}, seed=5), args.calls)
    if "attention" in args.only:
        rows += attention_rows(ATTENTION, measure, args.calls)
    if "attention_doc" in args.only:
        rows += doc_rows(ATTENTION, measure, args.calls)
    for kind in ("lstm", "gru"):
        if kind in args.only:
            import persistent_check as pc
            example = pc.KINDS[kind.upper()][0]
            inputs = {k: v.detach().clone().requires_grad_(True) for k, v in
                      pc.make_inputs(kind.upper(), 16, 180, 128, 256).items()}
            rows.append(measure(f"{kind.upper()} B16 L180 I128 H256 fp32 (the persistent kernels)",
                                ssmc.torch.function(example.SPEC, "cuda", layout=example.LAYOUT), inputs, args.calls))
    lines = ["| workload | host ms forward | host ms backward | host ms backward, grads None before | kernels ms "
             "(step) | step ms back to back |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['fwd_host']:.4f} | " + " | ".join(f"{r[k]:.4f}" if k in r else "-" for k in (
        "bwd_host", "bwd_fresh", "kernels", "step")) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_time.md").write_text(text)


if __name__ == "__main__":
    main()
