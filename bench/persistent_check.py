"""Check and time ssmc's persistent RNN forward and backward (backends/cuda/kernels/persistent) on a GPU.

    python bench/persistent_check.py [--out DIR] [--b 64 --t 180 --i 512 --k 512] [--small] [--forward-only]

For examples/lstm.py and examples/gru.py (fp32): ssmc's forward (y and the final states) against
torch.nn.LSTM / GRU (cuDNN) holding the same weights (torch's weight_ih = W[i (g k)]^T, weight_hh =
U[j (g k)]^T, as bench/workloads/rnn.py maps them), and the persistent kernel against the step loop;
then the forward's time: ssmc with the persistent kernel, ssmc with the step loop
(SSMC_CUDA_PERSISTENT=0; from a signature's second call it replays a CUDA graph) and cuDNN. Prints
a markdown table. Then forward + backward (`ssmc.torch.function`'s autograd, y.backward(dy): the
recording forward and the adjoint on the persistent kernel, the post products dU, dW, ... by cuBLAS):
every gradient (x, W, U, biases, initial states) against torch's autograd through cuDNN with the
same weights (TF32 off), max |got - want| / max |want|, and the persistent adjoint against the step
loop's; then the time of forward + backward (persistent, step loop, cuDNN). With --out, writes the
tables to DIR/persistent.md. Needs torch and cupy; no network.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import rnn as rnn_workloads  # bench/workloads/rnn.py: the example's weights in torch.nn.LSTM / GRU

import ssmc
from ssmc.backends.cuda.kernels.persistent import runner as persistent_runner
from ssmc.examples import gru, lstm

KINDS = {"LSTM": (lstm, 4), "GRU": (gru, 3)}


def timed(fn, reps: int = 30) -> float:
    """Milliseconds a call of `fn` takes (median of CUDA-event timings after a warm-up)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def make_inputs(kind: str, b: int, t: int, i: int, k: int, seed: int = 0) -> dict:
    """The example's inputs ("b t ..." layout), torch's initialisation range, fp32 on the GPU."""
    gates = KINDS[kind][1]
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    s = k ** -0.5

    def uniform(*shape):
        return (torch.rand(shape, device="cuda", generator=g) * 2 - 1) * s

    values = {"x": torch.randn((b, t, i), device="cuda", generator=g), "W": uniform(i, gates, k),
              "U": uniform(k, gates, k)}
    if kind == "LSTM":
        values["bias"] = uniform(gates, k)
        values["c"] = 0.5 * torch.randn((b, k), device="cuda", generator=g)
    else:
        values["b_i"], values["b_h"] = uniform(gates, k), uniform(gates, k)
    values["h"] = 0.5 * torch.randn((b, k), device="cuda", generator=g)
    return values


def torch_module(kind: str, inputs: dict):
    """torch.nn.LSTM / GRU with the example's weights, and its call on x from the same initial states."""
    module = rnn_workloads.torch_module(kind, inputs, "cuda", torch.float32)
    h0 = inputs["h"][None].contiguous()
    state = (h0, inputs["c"][None].contiguous()) if kind == "LSTM" else h0

    def call():
        with torch.no_grad():
            return module(inputs["x"], state)
    return call


def ssmc_call(kind: str, inputs: dict, persistent: bool):
    """ssmc's compiled forward of the example, with the persistent kernel on or off."""
    example = KINDS[kind][0]
    forward = ssmc.compile(example.SPEC, "cuda", layout=example.LAYOUT)

    def call():
        os.environ["SSMC_CUDA_PERSISTENT"] = "1" if persistent else "0"
        return forward(**inputs, return_final_states=True)
    return call


def as_list(out) -> list[torch.Tensor]:
    if isinstance(out, (tuple, list)):
        return [a for v in out for a in as_list(v)]
    if isinstance(out, dict):
        return [a for v in out.values() for a in as_list(v)]
    return [out if isinstance(out, torch.Tensor) else torch.as_tensor(out, device="cuda")]


def max_error(a, b) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True))


LAUNCHED: dict[str, int] = {}  # program -> persistent launches (counted by `count_launches`)


def count_launches() -> None:
    original = persistent_runner.PersistentLoop._launch

    def counted(self, *a, **k):
        result = original(self, *a, **k)
        if not isinstance(result, str):
            LAUNCHED[self.program.name] = LAUNCHED.get(self.program.name, 0) + 1
        return result
    persistent_runner.PersistentLoop._launch = counted


def launches() -> dict:
    """Per program: (launches, refusals, (a barrier timed out, its step)) of the persistent runners."""
    found = {}
    for loop in persistent_runner._LOOPS.values():
        if loop is not None:
            name = loop.program.name
            found[name] = (LAUNCHED.get(name, 0), dict(loop.refusals), loop.status())
    return found


def run(kind: str, b: int, t: int, i: int, k: int) -> dict:
    inputs = make_inputs(kind, b, t, i, k)
    cudnn = torch_module(kind, inputs)
    persistent, loop = ssmc_call(kind, inputs, True), ssmc_call(kind, inputs, False)
    torch.backends.cudnn.allow_tf32 = False  # the check: cuDNN in fp32 (its default may use TF32)
    y_ref, state = cudnn()
    ref = [y_ref, *(state if kind == "LSTM" else (state,))]
    ref = [r.squeeze(0) if r.dim() == 3 and r.shape[0] == 1 else r for r in ref]
    got_p, got_l = as_list(persistent()), as_list(loop())
    torch.cuda.synchronize()
    row = {"kind": kind, "shape": f"B{b} L{t} I{i} H{k}",
           "err_cudnn": max_error(got_p, ref), "err_loop": max_error(got_p, got_l),
           "err_loop_cudnn": max_error(got_l, ref)}
    row["ms_persistent"] = timed(persistent)
    row["ms_loop"] = timed(loop)
    row["ms_cudnn_fp32"] = timed(cudnn)
    torch.backends.cudnn.allow_tf32 = True  # torch's default
    row["ms_cudnn"] = timed(cudnn)
    row["runners"] = launches()
    os.environ["SSMC_CUDA_PERSISTENT"] = "1"
    return row


def torch_train(kind: str, inputs: dict, dy: torch.Tensor):
    """Forward + backward through torch.nn.LSTM / GRU (cuDNN) with the example's weights: a call returns
    the gradients named as the example's inputs (torch's weight gradients mapped back)."""
    i, gates, k = inputs["W"].shape
    module = rnn_workloads.torch_module(kind, inputs, "cuda", torch.float32)
    x = inputs["x"].detach().clone().requires_grad_(True)
    h0 = inputs["h"][None].detach().clone().requires_grad_(True)
    c0 = inputs["c"][None].detach().clone().requires_grad_(True) if kind == "LSTM" else None

    def call() -> dict:
        for t in (x, h0, c0, *module.parameters()):
            if t is not None:
                t.grad = None
        y, _ = module(x, (h0, c0) if kind == "LSTM" else h0)
        y.backward(dy)
        grads = {"x": x.grad, "W": module.weight_ih_l0.grad.T.reshape(i, gates, k),
                 "U": module.weight_hh_l0.grad.T.reshape(k, gates, k), "h": h0.grad[0]}
        if kind == "LSTM":
            grads["bias"] = module.bias_ih_l0.grad.reshape(gates, k)
            grads["c"] = c0.grad[0]
        else:
            grads["b_i"] = module.bias_ih_l0.grad.reshape(gates, k)
            grads["b_h"] = module.bias_hh_l0.grad.reshape(gates, k)
        return grads
    return call


def ssmc_train(kind: str, inputs: dict, dy: torch.Tensor, persistent: bool):
    """Forward + backward through `ssmc.torch.function` (persistent kernel on or off): a call returns the
    gradient of every input and initial state."""
    import ssmc.torch

    example = KINDS[kind][0]
    fn = ssmc.torch.function(example.SPEC, layout=example.LAYOUT)
    leaves = {name: t.detach().clone().requires_grad_(True) for name, t in inputs.items()}

    def call() -> dict:
        os.environ["SSMC_CUDA_PERSISTENT"] = "1" if persistent else "0"
        for t in leaves.values():
            t.grad = None
        fn(**leaves).backward(dy)
        return {name: t.grad for name, t in leaves.items()}
    return call


def relative_error(got: dict, want: dict) -> float:
    """The largest of max |got - want| / max |want| over the gradients `want` names."""
    return max(float((got[n].float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30))
               for n, w in want.items())


def train_row(kind: str, b: int, t: int, i: int, k: int) -> dict:
    inputs = make_inputs(kind, b, t, i, k)
    g = torch.Generator(device="cuda")
    g.manual_seed(1)
    dy = torch.randn((b, t, k), device="cuda", generator=g)
    cudnn = torch_train(kind, inputs, dy)
    persistent, loop = ssmc_train(kind, inputs, dy, True), ssmc_train(kind, inputs, dy, False)
    LAUNCHED.clear()
    torch.backends.cudnn.allow_tf32 = False
    want = cudnn()
    got_p = persistent()
    adjoint_launches = {n: c for n, c in LAUNCHED.items() if n.endswith("_backward")}
    got_l = loop()
    torch.cuda.synchronize()
    row = {"kind": kind, "shape": f"B{b} L{t} I{i} H{k}", "err_cudnn": relative_error(got_p, want),
           "err_loop_cudnn": relative_error(got_l, want), "err_loop": relative_error(got_p, got_l),
           "adjoint": adjoint_launches}
    row["ms_persistent"] = timed(persistent, reps=20)
    row["ms_loop"] = timed(loop, reps=20)
    row["ms_cudnn_fp32"] = timed(cudnn, reps=20)
    torch.backends.cudnn.allow_tf32 = True
    row["ms_cudnn"] = timed(cudnn, reps=20)
    row["runners"] = launches()
    os.environ["SSMC_CUDA_PERSISTENT"] = "1"
    return row


def train_table(rows: list[dict]) -> str:
    lines = ["| workload | cuDNN ms | cuDNN (TF32 off) ms | ssmc persistent ms | ssmc step loop ms | "
             "persistent / cuDNN | step loop / cuDNN | grad rel err vs cuDNN (persistent, loop) | "
             "persistent vs loop | adjoint launches |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['kind']} {r['shape']} fp32 fwd+bwd | {r['ms_cudnn']:.3f} | {r['ms_cudnn_fp32']:.3f} | "
            f"{r['ms_persistent']:.3f} | {r['ms_loop']:.3f} | {r['ms_persistent'] / r['ms_cudnn']:.2f} | "
            f"{r['ms_loop'] / r['ms_cudnn']:.2f} | {r['err_cudnn']:.2e}, {r['err_loop_cudnn']:.2e} | "
            f"{r['err_loop']:.2e} | {r['adjoint']} |")
    lines.append("")
    lines.append("gradients: x, W, U, biases, initial states; relative error = max |got - want| / max |want| "
                 "over them. Persistent runners (launches, refusals, (a barrier timed out, its step)):")
    for r in rows:
        lines.append(f"- {r['kind']}: {r['runners']}")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| workload | cuDNN ms | cuDNN (TF32 off) ms | ssmc persistent ms | ssmc step loop ms | "
             "persistent / cuDNN | step loop / cuDNN | persistent / step loop | "
             "max abs err vs cuDNN (persistent, loop) | "
             "persistent vs loop |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['kind']} {r['shape']} fp32 fwd | {r['ms_cudnn']:.3f} | {r['ms_cudnn_fp32']:.3f} | "
            f"{r['ms_persistent']:.3f} | "
            f"{r['ms_loop']:.3f} | {r['ms_persistent'] / r['ms_cudnn']:.2f} | {r['ms_loop'] / r['ms_cudnn']:.2f} | "
            f"{r['ms_persistent'] / r['ms_loop']:.3f} | {r['err_cudnn']:.2e}, {r['err_loop_cudnn']:.2e} | "
            f"{r['err_loop']:.2e} |")
    lines.append("")
    lines.append("ratios: time ÷ time (below 1: the first is faster), against cuDNN at torch's default "
                 "(TF32 allowed); errors against cuDNN with TF32 off. Persistent runners (launches, refusals, "
                 "(a barrier timed out, its step)):")
    for r in rows:
        lines.append(f"- {r['kind']}: {r['runners']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--b", type=int, default=64)
    parser.add_argument("--t", type=int, default=180)
    parser.add_argument("--i", type=int, default=512)
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--small", action="store_true", help="also B5 L37 I16 H37")
    parser.add_argument("--forward-only", action="store_true", help="no forward + backward rows")
    args = parser.parse_args()
    count_launches()
    shapes = [(args.b, args.t, args.i, args.k)] + ([(5, 37, 16, 37)] if args.small else [])
    rows = [run(kind, *shape) for shape in shapes for kind in KINDS]
    device = torch.cuda.get_device_name()
    text = (f"# Persistent RNN forward vs step loop vs cuDNN\n\n{device}, torch {torch.__version__}, "
            f"ssmc {ssmc.__version__}\n\n{table(rows)}\n")
    print(text)
    bad = [r for r in rows if r["err_cudnn"] > 1e-3 or r["err_loop"] > 1e-4
           or not any(n for n, _, _ in r["runners"].values())
           or any(status[0] for _, _, status in r["runners"].values())]
    if not args.forward_only:
        train = [train_row(kind, *shape) for shape in shapes for kind in KINDS]
        part = f"\n# Forward + backward\n\n{train_table(train)}\n"
        print(part)
        text += part
        bad += [r for r in train if r["err_cudnn"] > 1e-3 or r["err_loop"] > 1e-3 or not r["adjoint"]
                or any(status[0] for _, _, status in r["runners"].values())]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "persistent.md").write_text(text)
    if bad:
        raise SystemExit(f"mismatch or barrier timeout: {[r['kind'] + ' ' + r['shape'] for r in bad]}")


if __name__ == "__main__":
    main()
