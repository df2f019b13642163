"""A small training step eager and under a CUDA graph: Mamba-1 at the seed size, ssmc against mamba-ssm.

    python bench/graph_step.py [--out DIR] [--no-peer] [--peers peers] [--work /tmp/ssmc-peers]

Mamba-1 (`examples/mamba1.py`, "b d t", B32 D512 L180 N16 fp32; issue 43's seed size): one training step is
the forward, the loss `(y * dy).sum()` and `torch.autograd.grad` of it into all 8 inputs. Timed four ways per
side, each the median of CUDA events around 20 steps back to back (after warm-up):

- eager: the step as Python runs it (host time counts where it is longer than the kernels' time);
- graph: the same step captured once with `torch.cuda.graph` (on a side stream, after warm-up there, as torch
  asks) and replayed on the same input buffers: no host time beyond one replay a step;
- kernels: the torch profiler's sum of the GPU kernels of one eager step (the floor both could reach).

Before timing, the two sides' outputs and gradients are compared (relative error, max |a - b| / max |b|), and a
replay after new values are copied into the captured inputs must equal an eager step on those values. The peer,
mamba-ssm's `selective_scan_fn`, needs its CUDA extension, built from the sdist in `--peers` by nvcc (about
2 minutes; bench/harness.py's `Peers`); `--no-peer` times ssmc alone. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ssmc.torch
from ssmc.examples import mamba1

KEYS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
SIZES = {"b": 32, "d": 512, "n": 16, "t": 180}


def inputs(seed: int = 0) -> dict:
    """Mamba-1's inputs at SIZES (as bench/workloads/diagonal.py builds them), leaves needing gradients."""
    from workloads import diagonal

    g = torch.Generator(device="cuda").manual_seed(seed)
    values = diagonal._mamba1_inputs(SIZES, "cuda", torch.float32, g)
    return {k: values[k].requires_grad_(True) for k in KEYS}


def step_of(fn, values: dict, dy: torch.Tensor):
    """A training step of `fn` on `values`: (the output, the gradients of every input), detached, so that no
    autograd graph outlives the step (a leaf's gradient accumulator made on one stream and kept alive would
    tie a later capture to the legacy stream)."""
    def step():
        y = fn(values)
        grads = torch.autograd.grad((y * dy).sum(), [values[k] for k in KEYS])
        return (y.detach(), *grads)
    return step


def events_ms(run, steps: int = 20, reps: int = 5) -> float:
    """Median over `reps` of the milliseconds a step of `steps` run back to back."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def kernels_ms(run) -> float:
    """The GPU kernels' time of one step (the profiler's sum)."""
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events() if e.device_type.name == "CUDA") / 1e3


def graphed(step):
    """(replay, outputs): `step` captured in a CUDA graph after warm-up on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph.replay, outputs


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def measure(name: str, fn) -> dict:
    values, other = inputs(0), inputs(1)
    # the same cotangent for both sides (a draw of the global generator per side gave each its own)
    dy = torch.randn(values["u"].shape, generator=torch.Generator(device="cuda").manual_seed(7), device="cuda")
    step = step_of(fn, values, dy)
    replay, outputs = graphed(step)  # before any step on the default stream: torch's order for a capture
    eager = step()
    with torch.no_grad():  # new values into the captured buffers: a replay must compute on them
        for k in KEYS:
            values[k].copy_(other[k])
    replay()
    want = step()
    replay_err = max(rel(g, w) for g, w in zip(outputs, want))
    with torch.no_grad():
        for k in KEYS:
            values[k].copy_(inputs(0)[k])
    return {"name": name, "result": [t.detach().clone() for t in eager], "replay_err": replay_err,
            "eager": events_ms(step), "graph": events_ms(replay), "kernels": kernels_ms(step)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--peers", type=Path, default=Path("peers"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/ssmc-peers"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    op = ssmc.torch.function(mamba1.SPEC, "cuda", layout=mamba1.LAYOUT)
    rows = [measure("ssmc.torch.function", lambda v: op(**v))]
    if not args.no_peer:
        from harness import Peers

        fn = Peers(args.peers, args.work).mamba("mamba_ssm.ops.selective_scan_interface",
                                                 extension=True).selective_scan_fn
        rows.append(measure("mamba-ssm selective_scan_fn",
                            lambda v: fn(*(v[k] for k in KEYS), delta_softplus=True)))
        errs = [rel(a, b) for a, b in zip(rows[0]["result"], rows[1]["result"])]
        print(f"ssmc against mamba-ssm: output {errs[0]:.2e}, gradients up to {max(errs[1:]):.2e}")
        if max(errs) > 1e-3:
            raise SystemExit("ssmc and mamba-ssm disagree")
    lines = [f"# Mamba-1 training step B32 D512 L180 N16 fp32, eager and CUDA graph ({torch.cuda.get_device_name()})",
             "", "| side | eager ms | graph ms | kernels ms | replay on new values, rel err |", "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['eager']:.3f} | {r['graph']:.3f} | {r['kernels']:.3f} | {r['replay_err']:.1e} |"
              for r in rows]
    if len(rows) == 2:
        peer, ours = rows[1], rows[0]
        lines += ["", f"ratio (mamba-ssm ÷ ssmc): eager {peer['eager'] / ours['eager']:.2f}x, graph "
                      f"{peer['graph'] / ours['graph']:.2f}x, kernels {peer['kernels'] / ours['kernels']:.2f}x"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "graph_step.md").write_text(text)
    if any(r["replay_err"] > 1e-5 for r in rows):
        raise SystemExit("a replay on new values differs from the eager step")


if __name__ == "__main__":
    main()
