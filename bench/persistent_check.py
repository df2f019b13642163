"""Check and time ssmc's persistent RNN forward and backward (backends/cuda/kernels/persistent) on a GPU.

    python bench/persistent_check.py [--out DIR] [--b 64 --t 180 --i 512 --k 512] [--small] [--forward-only]
                                     [--all [--peak-tflops T --peak-gbs G]]

For examples/lstm.py and examples/gru.py (fp32): ssmc's forward (y and the final states) against
torch.nn.LSTM / GRU (cuDNN) holding the same weights (torch's weight_ih = W[i (g k)]^T, weight_hh =
U[j (g k)]^T, as bench/workloads/rnn.py maps them), and the persistent kernel against the step loop;
then the forward's time: ssmc with the persistent kernel (its fp32 recurrent product on tensor cores in 3xTF32;
"TF32 products": with torch.backends.cuda.matmul.allow_tf32, every product in TF32, the recurrent one too; "FMA
form": SSMC_CUDA_PERSISTENT_MMA=0, the recurrent product in fp32 FMAs as before the tensor cores), ssmc with the
step loop (SSMC_CUDA_PERSISTENT=0; from a signature's second call it replays a CUDA graph) and cuDNN. Prints
a markdown table. Then forward + backward (`ssmc.torch.function`'s autograd, y.backward(dy): the
recording forward and the adjoint on the persistent kernel, the post products dU, dW, ... by cuBLAS):
every gradient (x, W, U, biases, initial states) against torch's autograd through cuDNN with the
same weights (TF32 off), max |got - want| / max |want|, and the persistent adjoint against the step
loop's; then the time of forward + backward (persistent, step loop, cuDNN). With --out, writes the
tables to DIR/persistent.md. Needs torch and cupy; no network.

--all adds the other workloads of the persistent kernel's targets:
- LSTM B256 L1024 I1024 H1024 in bf16 (the tensor-core form): ssmc and cuDNN both given bf16 inputs,
  each checked against cuDNN in fp32 (TF32 off) on the same bf16-rounded values (outputs, and every
  gradient of forward + backward); times of the forward and of forward + backward. Then its training
  step with the adjoint's contracted indices split in 1, 2 and 4 K groups (analysis.SPLITS; 4 is the
  default at this shape), and unsplit with the shallower rings of before: forward + backward ms, the adjoint
  kernel's and the recording forward's own ms (torch.profiler), the gradients' error against cuDNN fp32,
  the plan.
- LSTM B16 L180 I128 H256 in fp32 (short and narrow: latency-bound): as the B64 rows, and the forward's
  time at several grids (SSMC_CUDA_PERSISTENT_BLOCKS: the blocks at most).
- examples/layernorm_lstm.py, B64 L180 I512 H512 in fp32 (no cuDNN peer; section "layernorm"): ssmc's forward
  against a loop of torch ops of the same cell (torch.nn.functional.layer_norm; TF32 off) and against ssmc's
  step loop, then every gradient of forward + backward (ssmc.torch.function) against torch's autograd through
  that loop; the times of the forward and of forward + backward: ssmc persistent, ssmc step loop, the torch loop,
  and the loop with its step torch.compile'd (where it compiles); the plans (the levels of reductions over the
  units, an exchange among a tile's blocks each) and the launches.
- LSTM B64 L180 I1024 H2048 bf16 and H1536 fp32 (section "streamed", not in the default sections): U too large
  to stay on chip, so the persistent kernel streams it from L2 each step (`Plan.streamed`): checked against cuDNN
  fp32 on the same values (outputs, every gradient), then forward and forward + backward ms of ssmc, its step loop
  (the fallback before the streamed form) and cuDNN in the call's dtype. `--all --sections streamed` runs it alone.
- examples/lstm_heads.py, 4 heads of 128, B64 L1024 I512 in bf16 (no peer): checked against ssmc's own
  fp32 call on the same values; forward and forward + backward times as TFLOP/s (the input and the
  recurrent products' FLOPs) and GB/s (the sequences' and the hoisted product's bytes), and as
  fractions of the peaks given by --peak-tflops / --peak-gbs.
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
from ssmc.backends.cuda.kernels.persistent import analysis as persistent_analysis
from ssmc.backends.cuda.kernels.persistent import runner as persistent_runner
from ssmc.examples import gru, layernorm_lstm, lstm, lstm_heads

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
    row["ms_tf32"], row["err_tf32"] = tf32_variant(persistent, lambda got: max_error(as_list(got), ref))
    row["ms_fma"], row["err_fma"] = fma_variant(persistent, lambda got: max_error(as_list(got), ref))
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


def fma_variant(call, error, reps: int | None = None) -> tuple[float, float]:
    """(ms, error) of `call` with the persistent kernels' fp32 recurrent product in fp32 FMAs
    (SSMC_CUDA_PERSISTENT_MMA=0: the form before the tensor cores), for the comparison in one run."""
    os.environ["SSMC_CUDA_PERSISTENT_MMA"] = "0"
    try:
        err = error(call())
        return (timed(call) if reps is None else timed(call, reps=reps)), err
    finally:
        os.environ["SSMC_CUDA_PERSISTENT_MMA"] = ""


def tf32_variant(call, error, reps: int | None = None) -> tuple[float, float]:
    """(ms, error) of `call` with torch's fp32 matrix products in TF32 (`torch.backends.cuda.matmul.allow_tf32`,
    off by default): ssmc's hoisted products (x W, the post products) follow it, and so does the persistent
    kernel's recurrent product (plain TF32 on the tensor cores, SSMC_CUDA_TF32 unset); cuDNN's default takes TF32
    for all of its own."""
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        err = error(call())
        return (timed(call) if reps is None else timed(call, reps=reps)), err
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


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
    row["ms_tf32"], row["err_tf32"] = tf32_variant(persistent, lambda got: relative_error(got, want), reps=20)
    row["ms_fma"], row["err_fma"] = fma_variant(persistent, lambda got: relative_error(got, want), reps=20)
    row["ms_loop"] = timed(loop, reps=20)
    row["ms_cudnn_fp32"] = timed(cudnn, reps=20)
    torch.backends.cudnn.allow_tf32 = True
    row["ms_cudnn"] = timed(cudnn, reps=20)
    row["runners"] = launches()
    os.environ["SSMC_CUDA_PERSISTENT"] = "1"
    return row


def train_table(rows: list[dict]) -> str:
    lines = ["| workload | cuDNN ms | cuDNN (TF32 off) ms | ssmc persistent ms | ssmc, TF32 products ms | "
             "ssmc, FMA form ms | ssmc step loop ms | persistent / cuDNN | TF32 products / cuDNN | "
             "FMA form / cuDNN | step loop / cuDNN | "
             "grad rel err vs cuDNN (persistent, TF32 products, FMA form, loop) | persistent vs loop | "
             "adjoint launches |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['kind']} {r['shape']} fp32 fwd+bwd | {r['ms_cudnn']:.3f} | {r['ms_cudnn_fp32']:.3f} | "
            f"{r['ms_persistent']:.3f} | {r['ms_tf32']:.3f} | {r['ms_fma']:.3f} | {r['ms_loop']:.3f} | "
            f"{r['ms_persistent'] / r['ms_cudnn']:.2f} | {r['ms_tf32'] / r['ms_cudnn']:.2f} | "
            f"{r['ms_fma'] / r['ms_cudnn']:.2f} | "
            f"{r['ms_loop'] / r['ms_cudnn']:.2f} | {r['err_cudnn']:.2e}, {r['err_tf32']:.2e}, {r['err_fma']:.2e}, "
            f"{r['err_loop_cudnn']:.2e} | {r['err_loop']:.2e} | {r['adjoint']} |")
    lines.append("")
    lines.append("gradients: x, W, U, biases, initial states; relative error = max |got - want| / max |want| "
                 "over them. Persistent runners (launches, refusals, (a barrier timed out, its step)):")
    for r in rows:
        lines.append(f"- {r['kind']}: {r['runners']}")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| workload | cuDNN ms | cuDNN (TF32 off) ms | ssmc persistent ms | ssmc, TF32 products ms | "
             "ssmc, FMA form ms | ssmc step loop ms | persistent / cuDNN | TF32 products / cuDNN | "
             "FMA form / cuDNN | step loop / cuDNN | persistent / step loop | "
             "max abs err vs cuDNN (persistent, TF32 products, FMA form, loop) | persistent vs loop |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['kind']} {r['shape']} fp32 fwd | {r['ms_cudnn']:.3f} | {r['ms_cudnn_fp32']:.3f} | "
            f"{r['ms_persistent']:.3f} | {r['ms_tf32']:.3f} | {r['ms_fma']:.3f} | {r['ms_loop']:.3f} | "
            f"{r['ms_persistent'] / r['ms_cudnn']:.2f} | {r['ms_tf32'] / r['ms_cudnn']:.2f} | "
            f"{r['ms_fma'] / r['ms_cudnn']:.2f} | "
            f"{r['ms_loop'] / r['ms_cudnn']:.2f} | {r['ms_persistent'] / r['ms_loop']:.3f} | "
            f"{r['err_cudnn']:.2e}, {r['err_tf32']:.2e}, {r['err_fma']:.2e}, {r['err_loop_cudnn']:.2e} | "
            f"{r['err_loop']:.2e} |")
    lines.append("")
    lines.append("ratios: time ÷ time (below 1: the first is faster), against cuDNN at torch's default "
                 "(TF32 allowed); errors against cuDNN with TF32 off. persistent: the recurrent product on tensor "
                 "cores in 3xTF32 (fp32 inputs). TF32 products: ssmc with torch.backends.cuda.matmul.allow_tf32 "
                 "(its hoisted products and the recurrent one in plain TF32). FMA form: SSMC_CUDA_PERSISTENT_MMA=0 "
                 "(the recurrent product in fp32 FMAs). "
                 "Persistent runners (launches, refusals, "
                 "(a barrier timed out, its step)):")
    for r in rows:
        lines.append(f"- {r['kind']}: {r['runners']}")
    return "\n".join(lines)


def _plans() -> dict:
    """Per program: the plans its persistent runner made (describe lines), for the logs."""
    found = {}
    for loop in persistent_runner._LOOPS.values():
        if loop is not None:
            found.setdefault(loop.program.name, set()).update(
                p.describe() if not isinstance(p, str) else f"refused: {p}" for p in loop._plans.values())
    return {k: sorted(v) for k, v in found.items()}


def half_rows(b: int = 256, t: int = 1024, i: int = 1024, k: int = 1024) -> list[str]:
    """LSTM in bf16 (module docstring): lines of a markdown table and notes (a line starting MISMATCH where
    an error is past its bound or the persistent kernel did not run)."""
    inputs = make_inputs("LSTM", b, t, i, k)
    bf = {n: v.to(torch.bfloat16) for n, v in inputs.items()}
    exact = {n: v.float() for n, v in bf.items()}  # the bf16 values in fp32: the reference's inputs
    LAUNCHED.clear()
    forward = ssmc.compile(lstm.SPEC, "cuda", layout=lstm.LAYOUT)
    ours = lambda: forward(**bf, return_final_states=True)  # noqa: E731
    torch.backends.cudnn.allow_tf32 = False
    ref = torch_module("LSTM", exact)
    y_ref, (h_ref, c_ref) = ref()
    want = [y_ref, h_ref[0], c_ref[0]]
    module = rnn_workloads.torch_module("LSTM", bf, "cuda", torch.bfloat16)
    state = (bf["h"][None].contiguous(), bf["c"][None].contiguous())

    def cudnn():
        with torch.no_grad():
            return module(bf["x"], state)
    got = as_list(ours())
    y_c, (h_c, c_c) = cudnn()
    torch.cuda.synchronize()

    def rel(a, b):
        return max(float((x.float() - y.float()).abs().max() / y.float().abs().max()) for x, y in zip(a, b))
    err, err_cudnn = rel(got, want), rel([y_c, h_c[0], c_c[0]], want)
    ms, ms_cudnn = timed(ours, reps=20), timed(cudnn, reps=20)
    runners = launches()
    lines = [f"| LSTM B{b} L{t} I{i} H{k} bf16 fwd | {ms_cudnn:.3f} | {ms:.3f} | {ms / ms_cudnn:.2f} | "
             f"{err:.2e} | {err_cudnn:.2e} |"]
    bad = err > 5e-2 or not runners.get("lstm", (0,))[0]
    # forward + backward: ssmc.torch.function and cuDNN, both bf16; the reference cuDNN fp32 (TF32 off)
    g = torch.Generator(device="cuda")
    g.manual_seed(1)
    dy = torch.randn((b, t, k), device="cuda", generator=g).to(torch.bfloat16)
    want_g = torch_train("LSTM", exact, dy.float())()
    train = ssmc_train("LSTM", bf, dy, True)
    LAUNCHED.clear()
    got_g = train()
    adjoint = {n: c for n, c in LAUNCHED.items() if n.endswith("_backward")}
    cudnn_train = _torch_train_dtype(bf, dy, torch.bfloat16)
    got_c = cudnn_train()
    torch.cuda.synchronize()
    gerr, gerr_cudnn = relative_error(got_g, want_g), relative_error(got_c, want_g)
    ms_t, ms_t_cudnn = timed(train, reps=10), timed(cudnn_train, reps=10)
    torch.backends.cudnn.allow_tf32 = True
    lines.append(f"| LSTM B{b} L{t} I{i} H{k} bf16 fwd+bwd | {ms_t_cudnn:.3f} | {ms_t:.3f} | "
                 f"{ms_t / ms_t_cudnn:.2f} | {gerr:.2e} | {gerr_cudnn:.2e} |")
    bad = bad or gerr > 1e-1 or not adjoint
    lines += ["", f"adjoint launches: {adjoint}; plans: {_plans()}"]
    if bad:
        lines.append(f"MISMATCH (bf16 H{k}): errors {err:.2e} / {gerr:.2e}, launches {runners}")
    return lines


def _streamed_programs(k: int) -> set:
    """The programs whose persistent runner planned the streamed form (U not resident) at hidden size `k` and
    launched since `LAUNCHED` was cleared (the runners and their plans outlive a row: a row of another size, or a
    plan whose launch the driver refused, must not count)."""
    return {loop.program.name for loop in persistent_runner._LOOPS.values()
            if loop is not None and LAUNCHED.get(loop.program.name)
            and any(getattr(p, "streamed", False) and ("k", k) in key[0] for key, p in loop._plans.items())}


def streamed_rows(b: int = 64, t: int = 180, i: int = 1024) -> list[str]:
    """LSTM where U does not fit on chip (the streamed form, module docstring): B64 L180 I1024 H2048 bf16 (U 32
    MiB) and H1536 fp32 (36 MiB, 3xTF32). Checked first: the outputs and every gradient of forward + backward
    against cuDNN fp32 (TF32 off) on the same values, cuDNN in the call's dtype against the same; then the ms of
    ssmc (streamed), its step loop and cuDNN in the call's dtype (fp32: TF32 allowed, torch's default), forward
    and forward + backward. Lines of a markdown table; MISMATCH where an error is past its bound or the forward,
    the recording forward and the adjoint did not all run streamed."""
    lines = ["| workload | cuDNN ms | ssmc streamed ms | ssmc step loop ms | ssmc / cuDNN | ssmc err | cuDNN err |",
             "|---|---|---|---|---|---|---|"]

    def rel(a, b):
        return max(float((x.float() - y.float()).abs().max() / y.float().abs().max()) for x, y in zip(a, b))
    for k, dtype in ((2048, torch.bfloat16), (1536, torch.float32)):
        name = f"LSTM B{b} L{t} I{i} H{k} {'bf16' if dtype == torch.bfloat16 else 'fp32'}"
        bound, grad_bound = (5e-2, 1e-1) if dtype == torch.bfloat16 else (1e-3, 1e-3)
        given = {n: v.to(dtype) for n, v in make_inputs("LSTM", b, t, i, k).items()}
        exact = {n: v.float() for n, v in given.items()}  # the given values in fp32: the reference's inputs
        torch.backends.cudnn.allow_tf32 = False
        y_ref, (h_ref, c_ref) = torch_module("LSTM", exact)()
        want = [y_ref, h_ref[0], c_ref[0]]
        module = rnn_workloads.torch_module("LSTM", given, "cuda", dtype)
        state = (given["h"][None].contiguous(), given["c"][None].contiguous())

        def cudnn(module=module, given=given, state=state):
            with torch.no_grad():
                return module(given["x"], state)
        ours, loop = ssmc_call("LSTM", given, True), ssmc_call("LSTM", given, False)
        LAUNCHED.clear()
        got = as_list(ours())
        y_c, (h_c, c_c) = cudnn()
        torch.cuda.synchronize()
        err, err_c = rel(got, want), rel([y_c, h_c[0], c_c[0]], want)
        g = torch.Generator(device="cuda")
        g.manual_seed(1)
        dy = torch.randn((b, t, k), device="cuda", generator=g).to(dtype)
        want_g = torch_train("LSTM", exact, dy.float())()
        train, train_loop = ssmc_train("LSTM", given, dy, True), ssmc_train("LSTM", given, dy, False)
        cudnn_train = _torch_train_dtype(given, dy, dtype)
        got_g, got_gc = train(), cudnn_train()
        torch.cuda.synchronize()
        gerr, gerr_c = relative_error(got_g, want_g), relative_error(got_gc, want_g)
        streamed = _streamed_programs(k)
        torch.backends.cudnn.allow_tf32 = True  # torch's default for the times
        ms, ms_loop, ms_c = timed(ours, reps=10), timed(loop, reps=3), timed(cudnn, reps=10)
        ms_t, ms_t_loop, ms_t_c = timed(train, reps=5), timed(train_loop, reps=2), timed(cudnn_train, reps=5)
        os.environ["SSMC_CUDA_PERSISTENT"] = "1"
        lines.append(f"| {name} fwd | {ms_c:.3f} | {ms:.3f} | {ms_loop:.3f} | {ms / ms_c:.2f} | {err:.2e} | "
                     f"{err_c:.2e} |")
        lines.append(f"| {name} fwd+bwd | {ms_t_c:.3f} | {ms_t:.3f} | {ms_t_loop:.3f} | {ms_t / ms_t_c:.2f} | "
                     f"{gerr:.2e} | {gerr_c:.2e} |")
        lines.append(f"<!-- {name}: streamed programs {sorted(streamed)}; launches {launches()} -->")
        if err > bound or gerr > grad_bound or not {"lstm", "lstm_backward"} <= streamed:
            lines.append(f"MISMATCH ({name}): errors {err:.2e} / {gerr:.2e}, streamed {sorted(streamed)}, "
                         f"launches {launches()}")
    lines += ["", f"plans: {_plans()}",
              "\nerrors: max |got - want| / max |want| against cuDNN fp32 (TF32 off) on the same inputs; fwd: outputs "
              "and final states, fwd+bwd: every gradient"]
    return lines


def _kernel_ms(fn) -> dict:
    """One call of `fn` under torch.profiler: GPU ms by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    # the kernels alone, not the operations above them (bench/host_time.py)
    return {e.key: e.self_device_time_total / 1000 for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA}


def split_sweep(b: int = 256, t: int = 1024, i: int = 1024, k: int = 1024) -> list[str]:
    """The bf16 LSTM training step with the adjoint's contracted indices in 1, 2, 4 K groups (module
    docstring): lines of a markdown table (MISMATCH where a gradient is off or the adjoint did not run)."""
    inputs = make_inputs("LSTM", b, t, i, k)
    bf = {n: v.to(torch.bfloat16) for n, v in inputs.items()}
    exact = {n: v.float() for n, v in bf.items()}
    g = torch.Generator(device="cuda")
    g.manual_seed(1)
    dy = torch.randn((b, t, k), device="cuda", generator=g).to(torch.bfloat16)
    torch.backends.cudnn.allow_tf32 = False
    want_g = torch_train("LSTM", exact, dy.float())()
    torch.backends.cudnn.allow_tf32 = True
    lines = ["| K groups | fwd+bwd ms | adjoint kernel ms | recording forward kernel ms | other kernels ms | "
             "grad err | plan of the adjoint |", "|---|---|---|---|---|---|---|"]
    saved = (persistent_analysis.SPLITS, persistent_analysis.SPLIT_ACCUMULATORS, persistent_analysis.DEEP_STAGES)
    try:
        # the last row: no groups and the rings of before (at most 3 buffers, the forward's too), about the
        # kernels of before (the adjoint's chunk 64 x 3 buffers there, was 128 x 2: about the bytes in flight)
        for splits, most, deep in (((1,), 32, saved[2]), ((2,), 32, saved[2]), ((4,), 32, saved[2]),
                                   ((1,), 32, (3, 2))):
            persistent_analysis.SPLITS, persistent_analysis.SPLIT_ACCUMULATORS = splits, most
            persistent_analysis.DEEP_STAGES = deep
            train = ssmc_train("LSTM", bf, dy, True)
            LAUNCHED.clear()
            got = train()
            torch.cuda.synchronize()
            ran = LAUNCHED.get("lstm_backward", 0)
            err = relative_error(got, want_g)
            ms = timed(train, reps=5)
            kernels = _kernel_ms(train)
            adjoint = sum(v for n, v in kernels.items() if "backward_persistent" in n)
            forward = sum(v for n, v in kernels.items() if n.endswith("_persistent") and "backward" not in n)
            other = sum(v for n, v in kernels.items() if "persistent" not in n)
            # this variant's plan (the runner keys its plans by these constants too)
            key = (persistent_analysis.SPLITS, persistent_analysis.SPLIT_ACCUMULATORS, persistent_analysis.DEEP_STAGES)
            plans = sorted({p.describe() for loop in persistent_runner._LOOPS.values()
                            if loop is not None and loop.program.name == "lstm_backward"
                            for at, p in loop._plans.items()
                            if not isinstance(p, str) and p.rows == b and p.size == k and at[-4:-1] == key})
            label = f"{splits[0]}" + (" (rings of at most 3)" if deep != saved[2] else "")
            lines.append(f"| {label} | {ms:.3f} | {adjoint:.3f} | {forward:.3f} | {other:.3f} | {err:.2e} | "
                         f"{'; '.join(plans) or 'none (another plan ran)'} |")
            if err > 1e-1 or not ran:
                lines.append(f"MISMATCH (adjoint in {splits[0]} K groups): error {err:.2e}, adjoint launches {ran}")
    finally:
        persistent_analysis.SPLITS, persistent_analysis.SPLIT_ACCUMULATORS, persistent_analysis.DEEP_STAGES = saved
    lines.append("\nother kernels: the matrix products, conversions and element-wise ops of the step (profiled "
                 "sums, one call)")
    return lines


# the persistent kernel's options swept by `variant_sweep` (label -> SSMC_CUDA_PERSISTENT_* settings); every
# variant's gradients are checked against cuDNN fp32 before it is timed
VARIANTS = {
    "default": {},
    "late stores": {"LATE_STORES": "1"},
    "late + early loads": {"LATE_STORES": "1", "EARLY_LOADS": "1"},
    "reload index": {"RELOAD_INDEX": "1"},
    "prefetch": {"PREFETCH": "1"},
    "fwd ring 64x5": {"FORWARD_CHUNK": "64"},
    "fwd ring 64x3": {"FORWARD_CHUNK": "64", "FORWARD_STAGES": "3"},
    "fwd ring 32x8": {"FORWARD_CHUNK": "32"},
    "late + early loads + adjoint ring 64x5": {"LATE_STORES": "1", "EARLY_LOADS": "1", "ADJOINT_CHUNK": "64"},
    "fwd ring 64x3 + adjoint ring 64x5": {"FORWARD_CHUNK": "64", "FORWARD_STAGES": "3", "ADJOINT_CHUNK": "64"},
}
VARIANTS_FP32 = ("default", "late stores", "late + early loads", "prefetch")  # (no ring: bf16's shape)
# the variants run again with SSMC_CUDA_PERSISTENT_PHASES=1 (clocks by phase of a step; not timed)
PHASED = ("default", "late + early loads")
PHASES = ("sequences + publish", "barrier", "product", "to the pairs (split: partials, barrier, sums)", "cell")
OPTION_NAMES = ("RELOAD_INDEX", "LATE_STORES", "EARLY_LOADS", "PREFETCH", "FORWARD_CHUNK", "FORWARD_STAGES",
                "ADJOINT_CHUNK", "ADJOINT_STAGES", "PHASES")


def _set_variant(settings: dict) -> None:
    for name in OPTION_NAMES:
        os.environ[f"SSMC_CUDA_PERSISTENT_{name}"] = settings.get(name, "")


def _phase_lines(label: str, steps: int) -> list[str]:
    """Each persistent runner's clocks by phase in its last launch (SSMC_CUDA_PERSISTENT_PHASES), a block's mean:
    the loop's clocks a step (and in µs at the SM's clock rate) and each phase's share of them."""
    try:
        import cupy

        khz = float(cupy.cuda.Device().attributes["ClockRate"])  # (the clock's kHz: the µs are an estimate)
    except Exception:  # no such attribute: clocks and shares only
        khz = None

    def us(clocks: float) -> str:
        return f" ({clocks / steps / khz * 1e3:.2f} µs)" if khz else ""

    lines = []
    for loop in persistent_runner._LOOPS.values():
        counted = loop.phases() if loop is not None else None
        if not counted or not counted[5]:
            continue
        total = counted[5]
        shares = ", ".join(f"{name} {v / total:.0%}{us(v)}" for name, v in zip(PHASES, counted[:5]))
        lines.append(f"| {label} | {loop.program.name} | {total / steps:.0f}{us(total)} | {shares} |")
    return lines


def variant_sweep(b: int = 256, t: int = 1024, i: int = 1024, k: int = 1024, dtype=torch.bfloat16,
                  names=tuple(VARIANTS), phased=PHASED) -> list[str]:
    """LSTM at B b L t I i H k in `dtype` (bf16: the tensor-core form; fp32: 3xTF32) with each option variant
    (VARIANTS): first every variant's forward and gradients against cuDNN fp32 (TF32 off) on the same inputs,
    then its forward and training step times, the recording forward's and the adjoint's kernel ms
    (torch.profiler, one step), the plain forward's kernel ms, and the recording forward's staging ring; then
    the `phased` variants' clocks by phase (`_phase_lines`)."""
    inputs = make_inputs("LSTM", b, t, i, k)
    given = {n: v.to(dtype) for n, v in inputs.items()}
    exact = {n: v.float() for n, v in given.items()}
    g = torch.Generator(device="cuda")
    g.manual_seed(1)
    dy = torch.randn((b, t, k), device="cuda", generator=g).to(dtype)
    torch.backends.cudnn.allow_tf32 = False
    want_g = torch_train("LSTM", exact, dy.float())()
    y_ref, (h_ref, c_ref) = torch_module("LSTM", exact)()
    want = [y_ref, h_ref[0], c_ref[0]]
    torch.backends.cudnn.allow_tf32 = True
    forward = ssmc.compile(lstm.SPEC, "cuda", layout=lstm.LAYOUT)
    bound, gbound = (5e-2, 1e-1) if dtype != torch.float32 else (1e-3, 1e-3)
    shape = f"B{b} L{t} I{i} H{k} {str(dtype).split('.')[-1]}"
    lines = [f"## {shape}", "", "| variant | fwd ms | fwd+bwd ms | plain fwd kernel ms | recording fwd kernel ms | "
             "adjoint kernel ms | other kernels ms | fwd err | grad err | rings (chunk x buffers): recording; "
             "adjoint |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    checked = {}
    try:
        for label in names:  # correctness first, every variant
            _set_variant(VARIANTS[label])
            LAUNCHED.clear()
            got = as_list(forward(**given, return_final_states=True))
            train = ssmc_train("LSTM", given, dy, True)
            got_g = train()
            torch.cuda.synchronize()
            err = max(float((x.float() - y).abs().max() / y.abs().max()) for x, y in zip(got, want))
            gerr = relative_error(got_g, want_g)
            ran = dict(LAUNCHED)
            checked[label] = (err, gerr, train)
            if err > bound or gerr > gbound or not ran.get("lstm_backward") or not ran.get("lstm"):
                lines.append(f"MISMATCH ({shape}, {label}): errors {err:.2e} / {gerr:.2e}, launches {ran}")
        for label in names:
            err, gerr, train = checked[label]
            _set_variant(VARIANTS[label])
            ms_f = timed(lambda: forward(**given, return_final_states=True), reps=10)
            ms_t = timed(train, reps=5)
            kernels = _kernel_ms(train)
            fwd_kernels = _kernel_ms(lambda: forward(**given, return_final_states=True))
            adjoint = sum(v for n, v in kernels.items() if "backward_persistent" in n)
            recording = sum(v for n, v in kernels.items() if "recording_persistent" in n)
            plain = sum(v for n, v in fwd_kernels.items() if n.endswith("_persistent"))
            other = sum(v for n, v in kernels.items() if "persistent" not in n)
            rings = {}
            for loop in persistent_runner._LOOPS.values():
                if loop is not None and loop.program.name in ("lstm_recording", "lstm_backward"):
                    chosen = loop.plan_for({"b": b, "i": i, "k": k, "j": k, "g": 4}, half=dtype != torch.float32)
                    rings[loop.program.name] = (f"{chosen.chunk} x {chosen.stages}" if not isinstance(chosen, str)
                                                else chosen)
            ring = f"{rings.get('lstm_recording', '-')}; {rings.get('lstm_backward', '-')}"
            lines.append(f"| {label} | {ms_f:.3f} | {ms_t:.3f} | {plain:.3f} | {recording:.3f} | {adjoint:.3f} | "
                         f"{other:.3f} | {err:.2e} | {gerr:.2e} | {ring} |")
        if phased:
            lines += ["", "| variant (phases counted) | kernel | clocks a step (a block's mean) | phases: share of the "
                      "loop (µs a step) |",
                      "|---|---|---|---|"]
        for label in phased:
            _set_variant({**VARIANTS[label], "PHASES": "1"})
            forward(**given, return_final_states=True)
            ssmc_train("LSTM", given, dy, True)()
            torch.cuda.synchronize()
            lines += _phase_lines(label, t)
    finally:
        _set_variant({})
    return lines


def _torch_train_dtype(inputs: dict, dy: torch.Tensor, dtype):
    """`torch_train` with the module and its inputs in `dtype`."""
    i, gates, k = inputs["W"].shape
    module = rnn_workloads.torch_module("LSTM", inputs, "cuda", dtype)
    x = inputs["x"].detach().clone().requires_grad_(True)
    h0 = inputs["h"][None].detach().clone().requires_grad_(True)
    c0 = inputs["c"][None].detach().clone().requires_grad_(True)

    def call() -> dict:
        for t in (x, h0, c0, *module.parameters()):
            t.grad = None
        y, _ = module(x, (h0, c0))
        y.backward(dy)
        return {"x": x.grad, "W": module.weight_ih_l0.grad.T.reshape(i, gates, k),
                "U": module.weight_hh_l0.grad.T.reshape(k, gates, k), "h": h0.grad[0],
                "bias": module.bias_ih_l0.grad.reshape(gates, k), "c": c0.grad[0]}
    return call


def grid_sweep(b: int = 16, t: int = 180, i: int = 128, k: int = 256) -> list[str]:
    """The fp32 LSTM forward's time at several caps on the persistent grid (SSMC_CUDA_PERSISTENT_BLOCKS)."""
    inputs = make_inputs("LSTM", b, t, i, k)
    forward = ssmc.compile(lstm.SPEC, "cuda", layout=lstm.LAYOUT)
    lines = ["| blocks at most | ms | plan |", "|---|---|---|"]
    for cap in ("", "128", "64", "16", "8"):
        os.environ["SSMC_CUDA_PERSISTENT_BLOCKS"] = cap
        ms = timed(lambda: forward(**inputs, return_final_states=True))
        loops = [loop for loop in persistent_runner._LOOPS.values() if loop is not None and loop.program.name == "lstm"]
        chosen = loops[0].plan_for({"b": b, "i": i, "k": k, "j": k, "g": 4}) if loops else "no persistent runner"
        lines.append(f"| {cap or 'default'} | {ms:.3f} | {chosen if isinstance(chosen, str) else chosen.describe()} |")
    os.environ["SSMC_CUDA_PERSISTENT_BLOCKS"] = ""
    return lines


def heads_rows(peak_tflops: float | None, peak_gbs: float | None, b: int = 64, t: int = 1024, i: int = 512,
               heads: int = 4, k: int = 128) -> list[str]:
    """examples/lstm_heads.py in bf16: TFLOP/s and GB/s of the forward and of forward + backward."""
    import ssmc.torch
    g = torch.Generator(device="cuda")
    g.manual_seed(2)
    s = k ** -0.5

    def uniform(*shape):
        return ((torch.rand(shape, device="cuda", generator=g) * 2 - 1) * s).to(torch.bfloat16)
    bf = {"x": torch.randn((b, t, i), device="cuda", generator=g).to(torch.bfloat16),
          "W": uniform(heads, i, 4, k), "U": uniform(heads, k, 4, k), "bias": uniform(heads, 4, k),
          "h": (0.5 * torch.randn((b, heads, k), device="cuda", generator=g)).to(torch.bfloat16),
          "c": (0.5 * torch.randn((b, heads, k), device="cuda", generator=g)).to(torch.bfloat16)}
    forward = ssmc.compile(lstm_heads.SPEC, "cuda", layout=lstm_heads.LAYOUT)
    LAUNCHED.clear()
    got = as_list(forward(**bf, return_final_states=True))
    want = as_list(forward(**{n: v.float() for n, v in bf.items()}, return_final_states=True))
    err = max(float((x.float() - y).abs().max() / y.abs().max()) for x, y in zip(got, want))
    ms = timed(lambda: forward(**bf, return_final_states=True))
    fn = ssmc.torch.function(lstm_heads.SPEC, layout=lstm_heads.LAYOUT)
    leaves = {n: v.detach().clone().requires_grad_(True) for n, v in bf.items()}
    dy = torch.randn((b, t, heads, k), device="cuda", generator=g).to(torch.bfloat16)

    def train():
        for v in leaves.values():
            v.grad = None
        fn(**leaves).backward(dy)
    train()
    ms_t = timed(train, reps=10)
    gates = 4 * heads * k
    flops = 2 * b * t * (i * gates + k * gates)          # x W and h U of every step
    moved = 2 * b * t * (i + heads * k + 2 * gates)      # x and y, the hoisted x W written and read (bf16)
    lines = ["| heads LSTM | ms | TFLOP/s | GB/s | of peak FLOP/s | of peak bytes/s | err vs fp32 |",
             "|---|---|---|---|---|---|---|"]
    for what, time_ms, f, m in (("fwd", ms, flops, moved), ("fwd+bwd", ms_t, 3 * flops, 3 * moved)):
        tf, gb = f / time_ms / 1e9, m / time_ms / 1e6
        of_tf = f"{tf / peak_tflops:.1%}" if peak_tflops else "-"
        of_gb = f"{gb / peak_gbs:.1%}" if peak_gbs else "-"
        lines.append(f"| {heads}x{k} B{b} L{t} I{i} bf16 {what} | {time_ms:.3f} | {tf:.1f} | {gb:.0f} | {of_tf} | "
                     f"{of_gb} | {err:.2e} |")
    lines += ["", "fwd+bwd counts 3x the forward's FLOPs and bytes (the adjoint's product and the two weight "
              f"gradients' matrix products). Launches: {dict(LAUNCHED)}; plans: {_plans()}"]
    if err > 5e-2 or not LAUNCHED.get("lstm_heads"):
        lines.append(f"MISMATCH (heads): error {err:.2e}, launches {dict(LAUNCHED)}")
    return lines


def layernorm_inputs(b: int, t: int, i: int, k: int, seed: int = 3) -> dict:
    """examples/layernorm_lstm.py's inputs (its make_inputs: weights uniform in 1 / sqrt(k)), fp32 on the GPU."""
    import numpy as np

    made = layernorm_lstm.make_inputs(np.random.default_rng(seed), t, batch=b, inp=i, hidden=k)
    return {n: torch.as_tensor(v, dtype=torch.float32, device="cuda") for n, v in made.items()}


def layernorm_torch_step():
    """One step of the LayerNorm LSTM as torch ops (the example's cell, written without ssmc): (zx_t, h, c, U,
    beta, gamma_c, beta_c) -> (h, c), zx_t = LN_{g k}(x_t W) gamma given flat [b, 4k] (g major, as U's columns)."""
    import torch.nn.functional as F

    eps = layernorm_lstm.EPS

    def step(zx, h, c, uf, beta, gamma_c, beta_c):
        b, k = h.shape
        z = (zx + F.layer_norm(h @ uf, (4 * k,), eps=eps) + beta).view(b, 4, k)
        i, f, g, o = z.unbind(1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(F.layer_norm(c, (k,), gamma_c, beta_c, eps))
        return h, c
    return step


def layernorm_torch(inputs: dict, step) -> tuple:
    """The LayerNorm LSTM over all steps as a loop of torch ops calling `step` (autograd through it where the
    inputs require gradients): (y [b t k], final h, final c)."""
    import torch.nn.functional as F

    x, W, U = inputs["x"], inputs["W"], inputs["U"]
    _, t, i = x.shape
    k = U.shape[0]
    zx = F.layer_norm(x @ W.reshape(i, 4 * k), (4 * k,), eps=layernorm_lstm.EPS) * inputs["gamma"].reshape(4 * k)
    uf, beta = U.reshape(k, 4 * k), inputs["beta"].reshape(4 * k)
    h, c, ys = inputs["h"], inputs["c"], []
    for s in range(t):
        h, c = step(zx[:, s], h, c, uf, beta, inputs["gamma_c"], inputs["beta_c"])
        ys.append(h)
    return torch.stack(ys, 1), h, c


def layernorm_rows(b: int = 64, t: int = 180, i: int = 512, k: int = 512) -> list[str]:
    """The LayerNorm LSTM in fp32: checked against the torch loop and the step loop, then timed (module
    docstring)."""
    import ssmc.torch

    torch.backends.cuda.matmul.allow_tf32 = False  # the check and the default: 3xTF32 in the persistent kernel
    inputs = layernorm_inputs(b, t, i, k)
    forward = ssmc.compile(layernorm_lstm.SPEC, "cuda", layout=layernorm_lstm.LAYOUT)

    def ssmc_forward(persistent: bool):
        def call():
            os.environ["SSMC_CUDA_PERSISTENT"] = "1" if persistent else "0"
            return forward(**inputs, return_final_states=True)
        return call
    step, why = layernorm_torch_step(), ""
    try:
        compiled = torch.compile(step)
        layernorm_torch(inputs, compiled)  # (compiles here; a failure leaves the compiled rows out)
    except Exception as err:  # (torch.compile's failures are many: the row says which)
        compiled, why = None, f"{type(err).__name__}: {err}"
    LAUNCHED.clear()
    with torch.no_grad():
        want = as_list(layernorm_torch(inputs, step))
        exact = as_list(layernorm_torch({n: v.double() for n, v in inputs.items()}, step))
    got, got_loop = as_list(ssmc_forward(True)()), as_list(ssmc_forward(False)())

    def worst(xs, ys) -> float:
        return max(float((x.double() - y.double()).abs().max() / y.double().abs().max())
                   for x, y in zip(xs, ys, strict=True))
    err, err_loop = worst(got, want), worst(got, got_loop)
    # each fp32 path against the float64 loop: the persistent kernel's sums (3xTF32, the units' sums in block order)
    # round otherwise than cuBLAS's, and LayerNorm's division carries that over 180 steps
    err64 = {"ssmc persistent": worst(got, exact), "ssmc step loop": worst(got_loop, exact),
             "torch loop": worst(want, exact)}
    fwd_launched = dict(LAUNCHED)
    times = {"ssmc persistent": timed(ssmc_forward(True)), "ssmc step loop": timed(ssmc_forward(False), reps=10)}
    with torch.no_grad():
        times["torch loop"] = timed(lambda: layernorm_torch(inputs, step), reps=10)
        if compiled is not None:
            times["torch loop, torch.compile'd step"] = timed(lambda: layernorm_torch(inputs, compiled), reps=10)
    os.environ["SSMC_CUDA_PERSISTENT"] = "1"

    # forward + backward: ssmc.torch.function against autograd through the torch loop
    g = torch.Generator(device="cuda")
    g.manual_seed(4)
    dy = torch.randn((b, t, k), device="cuda", generator=g)
    fn = ssmc.torch.function(layernorm_lstm.SPEC, layout=layernorm_lstm.LAYOUT)
    leaves = {n: v.detach().clone().requires_grad_(True) for n, v in inputs.items()}
    ref_leaves = {n: v.detach().clone().requires_grad_(True) for n, v in inputs.items()}

    def ssmc_train_ln(persistent: bool):
        def call() -> dict:
            os.environ["SSMC_CUDA_PERSISTENT"] = "1" if persistent else "0"
            for v in leaves.values():
                v.grad = None
            fn(**leaves).backward(dy)
            return {n: v.grad for n, v in leaves.items()}
        return call

    def torch_train_ln(cell):
        def call() -> dict:
            for v in ref_leaves.values():
                v.grad = None
            layernorm_torch(ref_leaves, cell)[0].backward(dy)
            return {n: v.grad for n, v in ref_leaves.items()}
        return call
    LAUNCHED.clear()
    want_g = {n: v.clone() for n, v in torch_train_ln(step)().items()}
    got_g = ssmc_train_ln(True)()
    err_g = relative_error(got_g, want_g)
    worst = max(want_g, key=lambda n: relative_error({n: got_g[n]}, {n: want_g[n]}))
    train_launched = dict(LAUNCHED)
    train_times = {"ssmc persistent": timed(ssmc_train_ln(True), reps=10),
                   "ssmc step loop": timed(ssmc_train_ln(False), reps=5),
                   "torch loop": timed(torch_train_ln(step), reps=5)}
    if compiled is not None:
        try:
            train_times["torch loop, torch.compile'd step"] = timed(torch_train_ln(compiled), reps=5)
        except Exception as err:  # (its backward compiles here)
            why = f"(backward) {type(err).__name__}: {err}"
    os.environ["SSMC_CUDA_PERSISTENT"] = "1"
    shape = f"B{b} L{t} I{i} H{k} fp32"
    lines = [f"| LayerNorm LSTM {shape} | fwd ms | fwd+bwd ms |", "|---|---|---|"]
    for name in times:
        lines.append(f"| {name} | {times[name]:.3f} | {train_times.get(name, float('nan')):.3f} |")
    lines += ["", f"forward: ssmc (persistent) vs the torch loop {err:.2e}, vs ssmc's step loop {err_loop:.2e}; "
              f"against the torch loop in float64: {', '.join(f'{n} {e:.2e}' for n, e in err64.items())}; "
              f"forward + backward: every gradient vs torch's autograd through the loop, the worst {err_g:.2e} "
              f"({worst}); max |got - want| / max |want|, TF32 off",
              f"launches: forward {fwd_launched}, forward + backward {train_launched}; plans: {_plans()}"]
    if why:
        lines.append(f"torch.compile of the step failed: {why}")
    status = [loop.status() for loop in persistent_runner._LOOPS.values()
              if loop is not None and loop.program.name.startswith("layernorm_lstm")]
    expected = {"layernorm_lstm", "layernorm_lstm_recording", "layernorm_lstm_backward"}
    fp32_floor = max(err64["ssmc step loop"], err64["torch loop"])
    if (err > 1e-3 or err64["ssmc persistent"] > max(2 * fp32_floor, 1e-5) or err_g > 1e-2 or any(s[0] for s in status)
            or not expected <= {*fwd_launched, *train_launched}):
        lines.append(f"MISMATCH (layernorm): errors {err:.2e} / {err64} / {err_g:.2e}, barriers {status}, "
                     f"launches {fwd_launched} {train_launched}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--b", type=int, default=64)
    parser.add_argument("--t", type=int, default=180)
    parser.add_argument("--i", type=int, default=512)
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--small", action="store_true", help="also B5 L37 I16 H37")
    parser.add_argument("--forward-only", action="store_true", help="no forward + backward rows")
    parser.add_argument("--all", action="store_true", help="also bf16 H1024, B16 H256 (and its grids), heads")
    parser.add_argument("--sections", default="half,split,grid,heads,layernorm",
                        help="with --all, which of its sections run (half: bf16 H1024; split: its K groups; grid: "
                             "B16 H256's grids; heads; variants: the persistent kernel's options at bf16 H1024 and "
                             "fp32 B64 H512, checked then timed; layernorm: the LayerNorm LSTM B64 H512 fp32 vs "
                             "torch; streamed, not by default: LSTM B64 L180 I1024 H2048 bf16 and H1536 fp32, U "
                             "streamed, vs cuDNN)")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 TFLOP/s (for the heads rows)")
    parser.add_argument("--peak-gbs", type=float, help="the device's memory GB/s (for the heads rows)")
    args = parser.parse_args()
    count_launches()
    shapes = [(args.b, args.t, args.i, args.k)] + ([(5, 37, 16, 37)] if args.small else [])
    shapes += [(16, 180, 128, 256)] if args.all else []
    device = torch.cuda.get_device_name()
    text = f"{device}, torch {torch.__version__}, ssmc {ssmc.__version__}\n"

    def emit(part: str) -> None:
        """Print `part` and keep it (and the file so far: a run cut by its time limit leaves what it did)."""
        nonlocal text
        print(part, flush=True)
        text += part
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "persistent.md").write_text(text)
    rows = [run(kind, *shape) for shape in shapes for kind in KINDS]
    emit(f"\n# Persistent RNN forward vs step loop vs cuDNN\n\n{table(rows)}\n")
    bad = [r for r in rows if r["err_cudnn"] > 1e-3 or r["err_loop"] > 1e-4 or r["err_fma"] > 1e-3
           or not any(n for n, _, _ in r["runners"].values())
           or any(status[0] for _, _, status in r["runners"].values())]
    if args.all:  # before the forward + backward rows of fp32: the workloads a run cut short would miss
        sections = [("half", "bf16 LSTM (tensor-core form) vs cuDNN bf16",
                     ["| workload | cuDNN bf16 ms | ssmc ms | ssmc / cuDNN | ssmc err | cuDNN bf16 err |",
                      "|---|---|---|---|---|---|"], half_rows),
                    ("split", "bf16 LSTM training step: the adjoint's contracted indices in K groups", [], split_sweep),
                    ("grid", "B16 L180 I128 H256 fp32 forward: the grid", [], grid_sweep),
                    ("variants", "LSTM: the persistent kernel's options (SSMC_CUDA_PERSISTENT_*)", [],
                     lambda: [*variant_sweep(), "", *variant_sweep(64, 180, 512, 512, torch.float32,
                                                                   names=VARIANTS_FP32, phased=("default",))]),
                    ("heads", "LSTM heads (block-diagonal U), bf16", [],
                     lambda: heads_rows(args.peak_tflops, args.peak_gbs)),
                    ("layernorm", "LayerNorm LSTM (reductions over the units in the cell) vs torch", [],
                     lambda: layernorm_rows(args.b, args.t, args.i, args.k)),
                    ("streamed", "LSTM with U streamed from L2 (too large to stay on chip) vs cuDNN", [],
                     streamed_rows)]
        wanted = set(args.sections.split(","))
        for _, title, head, fn in (section for section in sections if section[0] in wanted):
            try:
                body = fn()
            except Exception as err:  # one workload's failure is reported, the others still run
                body = [f"MISMATCH ({title}): {type(err).__name__}: {err}"]
            if title.startswith("bf16"):
                body.append("\nerrors: max |got - want| / max |want| against cuDNN fp32 (TF32 off) on the bf16 "
                            "inputs; fwd: outputs and final states, fwd+bwd: every gradient")
            emit(f"\n# {title}\n\n" + "\n".join(head + body) + "\n")
            if any(line.startswith("MISMATCH") for line in body):
                bad.append({"kind": title, "shape": ""})
    if not args.forward_only:
        train = [train_row(kind, *shape) for shape in shapes for kind in KINDS]
        emit(f"\n# Forward + backward\n\n{train_table(train)}\n")
        bad += [r for r in train if r["err_cudnn"] > 1e-3 or r["err_loop"] > 1e-3 or r["err_fma"] > 1e-3
                or not r["adjoint"]
                or any(status[0] for _, _, status in r["runners"].values())]
    if bad:
        raise SystemExit(f"mismatch or barrier timeout: {[r['kind'] + ' ' + r['shape'] for r in bad]}")


if __name__ == "__main__":
    main()
