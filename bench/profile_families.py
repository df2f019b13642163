"""Where each new kernel family's time goes: the torch profiler's kernel table of one warm call.

    python bench/profile_families.py [--out DIR] [--only lstm,gru,ssd,retnet,gla_vector,flash,mamba1_small,...]

For the benchmark workloads of bench/persistent_check.py (LSTM / GRU B64 L180 I512 H512 fp32, forward +
backward; lstm_b16 / gru_b16: B16 L180 I128 H256, the latency-bound target), bench/chunk_check.py (SSD,
RetNet, GLA with a decay per key bf16, forward and forward + backward) and bench/flash_check.py (causal
attention B4 H16 L4096 d128 bf16, forward + backward; doc: its document mask), mamba1_small:
bench/graph_step.py's Mamba-1 B32 D512 L180 N16 fp32 step (issue 43's seed size): two warm-up calls, then one
profiled call; prints the top kernels by GPU time (CUPTI sees CuPy's launches too) and the wall time of the
call, so the gap between kernel time and wall time (host work, gaps) shows. With --out, writes DIR/profile.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import ssmc  # noqa: E402


def profiled(name: str, fn, rows: int = 14, ops: bool = False) -> str:
    """One profiled call of `fn` after two warm-ups: a markdown section with its kernel table.

    With `ops`, a second table: the torch operators that launched GPU work, by their input shapes
    (which tensor the glue between generated kernels touches)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=ops) as prof:
        fn()
        torch.cuda.synchronize()
    # kernels and copies alone (CUDA events): the ops and autograd functions above them repeat their time
    timed = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events = [e for e in timed if e.device_type == torch.autograd.DeviceType.CUDA] or timed
    events.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events) / 1e3
    lines = [f"## {name}", "", f"wall {wall:.3f} ms (unprofiled), GPU kernels {total:.3f} ms", "",
             "| kernel | calls | GPU ms | share |", "|---|---|---|---|"]
    for e in events[:rows]:
        ms = e.self_device_time_total / 1e3
        lines.append(f"| `{e.key[:90]}` | {e.count} | {ms:.3f} | {ms / total:.0%} |")
    if ops:
        aten = [e for e in prof.key_averages(group_by_input_shape=True)
                if e.key.startswith("aten::") and e.self_device_time_total > 0]
        aten.sort(key=lambda e: -e.self_device_time_total)
        lines += ["", "| torch op | input shapes | calls | GPU ms |", "|---|---|---|---|"]
        for e in aten[:rows]:
            lines.append(f"| `{e.key}` | `{str(e.input_shapes)[:120]}` | {e.count} | "
                         f"{e.self_device_time_total / 1e3:.3f} |")
    return "\n".join(lines) + "\n"


def rnn_cases(kind: str, b: int = 64, t: int = 180, i: int = 512, k: int = 512) -> list:
    import persistent_check as pc
    inputs = pc.make_inputs(kind, b, t, i, k)
    fwd = pc.ssmc_call(kind, inputs, True)
    example = pc.KINDS[kind][0]
    fn = ssmc.torch.function(example.SPEC, layout=example.LAYOUT)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items()}
    dy = torch.randn(b, t, k, device="cuda")

    def train():
        for v in leaves.values():
            v.grad = None
        fn(**leaves).backward(dy)
    return [(f"{kind} B{b} L{t} I{i} H{k} fp32 forward", fwd), (f"{kind} forward + backward", train)]


def chunk_cases(name: str) -> list:
    import chunk_check as cc

    from ssmc.examples import gla, mamba2, retnet
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    example, inputs = {"ssd": (mamba2, cc.ssd_inputs), "retnet": (retnet, cc.retnet_inputs),
                       "gla_vector": (gla, cc.gla_vector_inputs)}[name]
    spec, layout = example.SPEC, example.LAYOUT
    a = inputs(g)
    fn = ssmc.compile(spec, layout=layout, backend="cuda")
    tfn = ssmc.torch.function(spec, layout=layout)
    leaves = {k: (v.detach().clone().requires_grad_(True) if v.is_floating_point() else v) for k, v in a.items()}
    out = tfn(**leaves)
    dy = torch.randn_like(out)

    def train():
        for v in leaves.values():
            v.grad = None
        tfn(**leaves).backward(dy)
    return [(f"{name} forward", lambda: fn(**a)), (f"{name} forward + backward", train)]


def mamba1_cases() -> list:
    """Mamba-1 at issue 43's seed size (graph_step.py's inputs): forward, and a training step into all 8 inputs."""
    import graph_step as gs

    from ssmc.examples import mamba1
    leaves = gs.inputs()
    fn = ssmc.torch.function(mamba1.SPEC, layout="b d t")
    dy = torch.randn_like(fn(**leaves))
    step = gs.step_of(lambda v: fn(**v), leaves, dy)

    def fwd():
        with torch.no_grad():
            return fn(**leaves)
    return [("Mamba-1 B32 D512 L180 N16 fp32 forward", fwd), ("Mamba-1 training step (8 gradients)", step)]


def flash_cases() -> list:
    import flash_check as fc

    import ssmc.torch
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    fn = ssmc.torch.function(fc.SPECS["causal"], layout="b h t ...")
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            return fn(q, k, v)

    def train():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(do)
    return [("causal attention B4 H16 L4096 d128 bf16 forward", fwd), ("causal attention forward + backward", train)]


def doc_cases() -> list:
    """flash_check's document mask (causal within 8 sorted documents a row) at B4 H16 L4096 d128 bf16."""
    import flash_check as fc

    import ssmc.torch
    torch.manual_seed(0)
    (q, k, v, do), extra = fc.gather_inputs("doc", 4, 16, 4096, 128)
    fn = ssmc.torch.function(fc.GATHER_SPECS["doc"], layout="b h t ...")
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            return fn(q, k, v, doc=extra["doc"])

    def train():
        for t in leaves:
            t.grad = None
        fn(*leaves, doc=extra["doc"]).backward(do)
    return [("document-masked attention B4 H16 L4096 d128 bf16 forward", fwd),
            ("document-masked attention forward + backward", train)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", default="lstm,gru,ssd,retnet,flash")
    ap.add_argument("--ops", action="store_true", help="also the torch operators by input shapes")
    args = ap.parse_args()
    import ssmc.torch  # noqa: F401
    sections = []
    for name in args.only.split(","):
        try:
            cases = (rnn_cases(name.upper()) if name in ("lstm", "gru") else
                     rnn_cases(name[:-4].upper(), 16, 180, 128, 256) if name in ("lstm_b16", "gru_b16") else
                     flash_cases() if name == "flash" else doc_cases() if name == "doc" else
                     mamba1_cases() if name == "mamba1_small" else chunk_cases(name))
            for title, fn in cases:
                sections.append(profiled(title, fn, ops=args.ops))
        except Exception as err:  # one family failing must not hide the others' profiles
            sections.append(f"## {name}\n\nfailed: {type(err).__name__}: {err}\n")
        print(sections[-1], flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile.md").write_text("# Kernel profiles\n\n" + "\n".join(sections))


if __name__ == "__main__":
    main()
