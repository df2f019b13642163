"""Check and time complex diagonal recurrences on CUDA against torch references (issue #44).

    python bench/complex_scan_check.py [--out DIR] [--peers peers] [--lru-n 256] [--budget 100]

Two workloads at B8 D1536 L2048, complex64 (float32 real parts):

- ``scan``: h[b, d] = lam[d] * h[b, d] + x[b, t, d] (complex), y = h, as tests/test_complex_scan.py's
  spec, with time second ("b t d": ssmc's time blocks) and time last ("b d t": ssmc's warp kernel and
  fused backward). Against torch autograd of (1) a log-depth scan over time in complex64 (Hillis-Steele:
  11 rounds of complex products over [b, t, d]) and (2) a plain loop over t (forward only: its
  backward takes seconds). For scale, accelerated-scan's real scalar scan over twice the channels
  (the same count of floats; real products, not complex) where the peers folder has it.
- ``lru``: examples/lru.py (complex lambda, B, C; y = Re(C h) + D x), N = --lru-n, "b t d", against
  the same layer in torch: the input projection as a complex matmul, the log-depth scan, the output
  projection as a matmul.

Each row: max |ssmc - torch| / max |torch| of the outputs (and of the gradients, in float32: a check
that the fast path computes the same thing, not a precision test; tests/test_complex_scan.py is),
then milliseconds of the forward and of the forward + backward (CUDA events; a warm-up call first,
then repeats until about 0.3 s). A measurement whose first call takes longer than the time left in
--budget seconds is skipped and said so. Prints a markdown table; with --out, writes it to
DIR/complex_scan.md. Also prints the strategies `ssmc inspect` reports for each spec.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

import ssmc  # noqa: E402
import ssmc.torch  # noqa: E402
from ssmc.backends.cuda.report import kernel_reports  # noqa: E402
from ssmc.examples import lru  # noqa: E402

B, D, L = 8, 1536, 2048
DEVICE = "cuda"  # --dry-run: "cpu", with SSMC_CUDA_EMULATE=1 (the kernels emulated: a check of this script)


@ssmc.recurrence
def complex_diagonal(h: ssmc.State["b d", complex], x: ssmc.Seq["b d", complex], lam: ssmc.Param["d", complex]):  # noqa: F722, F821
    """h[b, d] = lam[d] * h[b, d] + x[b, t, d] for each t; y = h."""
    h = lam * h + x
    return h, h


def torch_scan(lam: torch.Tensor, x: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """h[:, t] = lam * h[:, t - 1] + x[:, t] (h[:, -1] = h0), x [b t d]: a log-depth scan over t, out of place."""
    h = torch.cat([(x[:, :1] + lam * h0[:, None]), x[:, 1:]], 1)
    a = lam.expand(x.shape[1], -1)[None]
    off = 1
    while off < x.shape[1]:
        h = torch.cat([h[:, :off], a[:, off:] * h[:, :-off] + h[:, off:]], 1)
        a = torch.cat([a[:, :off], a[:, off:] * a[:, :-off]], 1)
        off *= 2
    return h


def torch_loop(lam, x, h0):
    h, ys = h0, []
    for t in range(x.shape[1]):
        h = lam * h + x[:, t]
        ys.append(h)
    return torch.stack(ys, 1)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, budget: float) -> float | None:
    """Milliseconds a call of `fn` takes (CUDA events), or None where its first call leaves no room in
    `budget` seconds."""
    t0 = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - t0
    if first > budget:
        return None
    reps = max(1, min(20, int(0.3 / max(first, 1e-4))))
    if DEVICE != "cuda":
        return 1e3 * first
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


class Budget:
    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.perf_counter())


def fwd_bwd(fn, leaves: list[torch.Tensor], cot: torch.Tensor):
    def run():
        for v in leaves:
            v.grad = None
        y = fn()
        y.backward(cot)
    return run


def scan_rows(layout: str, budget: Budget) -> list[list[str]]:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    cplx = lambda *s: torch.complex(torch.randn(*s, generator=g, device=DEVICE),  # noqa: E731
                                    torch.randn(*s, generator=g, device=DEVICE))
    radius = torch.rand(D, generator=g, device=DEVICE) * 0.5 + 0.49
    lam = (radius * torch.exp(1j * torch.rand(D, generator=g, device=DEVICE) * 6.28)).to(torch.complex64)
    x, h0, cot = cplx(B, L, D), cplx(B, D), cplx(B, L, D)
    leaves = [v.requires_grad_() for v in (lam, x, h0)]
    f = ssmc.torch.function(complex_diagonal, "cuda", layout=layout)
    if layout == "b d t":
        xs = x.detach().transpose(1, 2).contiguous().requires_grad_()
        ssmc_call = lambda: f(xs, lam, h=h0).transpose(1, 2)  # noqa: E731
        ssmc_leaves = [lam, xs, h0]
    else:
        ssmc_call = lambda: f(x, lam, h=h0)  # noqa: E731
        ssmc_leaves = leaves
    want = torch_scan(lam, x, h0)
    got = ssmc_call()
    grads_want = torch.autograd.grad(want, leaves, cot)
    grads_got = torch.autograd.grad(got, ssmc_leaves, cot)  # got: [b t d] in both layouts
    if layout == "b d t":
        grads_got = (grads_got[0], grads_got[1].transpose(1, 2), grads_got[2])
    err = rel(got.detach(), want.detach())
    gerr = max(rel(a, b) for a, b in zip(grads_got, grads_want))
    loop_err = rel(torch_loop(lam.detach(), x.detach(), h0.detach()), want.detach())
    rows = []
    with torch.no_grad():
        t_ssmc = timed(ssmc_call, budget.left())
        t_scan = timed(lambda: torch_scan(lam, x, h0), budget.left())
        t_loop = timed(lambda: torch_loop(lam, x, h0), budget.left())
    tb_ssmc = timed(fwd_bwd(ssmc_call, ssmc_leaves, cot), budget.left())
    tb_scan = timed(fwd_bwd(lambda: torch_scan(lam, x, h0), leaves, cot), budget.left())
    rows.append([f"scan {layout}", "ssmc", f"{err:.1e}", f"{gerr:.1e}", ms(t_ssmc), ms(tb_ssmc)])
    rows.append([f"scan {layout}", "torch log-depth scan", "ref", "ref", ms(t_scan), ms(tb_scan)])
    rows.append([f"scan {layout}", "torch loop over t", f"{loop_err:.1e}", "-", ms(t_loop), "-"])
    return rows


def accelerated_rows(peers_dir: Path, budget: Budget) -> list[list[str]]:
    try:
        from harness import Peers
        scalar = Peers(peers_dir, Path("/tmp/ssmc_peers")).module("accelerated_scan.scalar")
    except Exception as err:  # a peer that does not load is reported, not fatal
        return [["scan b d t (real, 2D)", "accelerated-scan scalar", "-", "-", f"n/a: {err}"[:60], "-"]]
    g = torch.Generator(device=DEVICE).manual_seed(1)
    a = (torch.rand(B, 2 * D, L, generator=g, device=DEVICE) * 0.5 + 0.5).requires_grad_()
    x = torch.randn(B, 2 * D, L, generator=g, device=DEVICE).requires_grad_()
    cot = torch.randn(B, 2 * D, L, generator=g, device=DEVICE)
    with torch.no_grad():
        t = timed(lambda: scalar.scan(a, x), budget.left())
    tb = timed(fwd_bwd(lambda: scalar.scan(a, x), [a, x], cot), budget.left())
    return [["scan b d t (real, 2D)", "accelerated-scan scalar", "-", "-", ms(t), ms(tb)]]


def lru_torch(x, nu_log, theta_log, gamma_log, Bm, Cm, Dv, h0):
    lam = torch.exp(torch.complex(-torch.exp(nu_log), torch.exp(theta_log)))
    u = torch.exp(gamma_log) * (x.to(Bm.dtype) @ Bm.T)
    h = torch_scan(lam, u, h0)
    return (h @ Cm.T).real + Dv * x


def lru_rows(n: int, budget: Budget) -> list[list[str]]:
    g = torch.Generator(device=DEVICE).manual_seed(2)
    import numpy as np

    inputs = lru.make_inputs(np.random.default_rng(0), 1, batch=B, dim=D, state=n)
    v = {k: torch.tensor(val).to(DEVICE, torch.complex64 if np.iscomplexobj(val) else torch.float32)
         for k, val in inputs.items() if k != "x"}
    v["x"] = torch.randn(B, L, D, generator=g, device=DEVICE)
    names = ["x", "nu_log", "theta_log", "gamma_log", "B", "C", "D"]
    leaves = [v[k].requires_grad_() for k in names]
    h0 = v["h"].requires_grad_()
    f = ssmc.torch.function(lru.SPEC, "cuda", layout=lru.LAYOUT)
    call = lambda: f(*leaves, h=h0)  # noqa: E731
    ref = lambda: lru_torch(*leaves, h0)  # noqa: E731
    cot = torch.randn(B, L, D, generator=g, device=DEVICE)
    t0 = time.perf_counter()
    got = call()
    sync()
    first = time.perf_counter() - t0
    want = ref()
    err = rel(got.detach(), want.detach())
    gerr = "-"
    if first * 3 < budget.left():
        gw = torch.autograd.grad(want, [*leaves, h0], cot)
        gg = torch.autograd.grad(call(), [*leaves, h0], cot)
        gerr = f"{max(rel(a, b) for a, b in zip(gg, gw)):.1e}"
    with torch.no_grad():
        t_ssmc = timed(call, budget.left())
        t_ref = timed(ref, budget.left())
    tb_ssmc = timed(fwd_bwd(call, [*leaves, h0], cot), budget.left())
    tb_ref = timed(fwd_bwd(ref, [*leaves, h0], cot), budget.left())
    return [[f"lru N{n} b t d", "ssmc", f"{err:.1e}", gerr, ms(t_ssmc), ms(tb_ssmc)],
            [f"lru N{n} b t d", "torch: matmuls + log-depth scan", "ref", "ref", ms(t_ref), ms(tb_ref)]]


def ms(t: float | None) -> str:
    return "skipped (budget)" if t is None else f"{t:.3f}"


def strategies(program, sizes: dict, contiguous: bool) -> str:
    reports = kernel_reports(program, sizes, L, "float32", compile_kernels=False, time_contiguous=contiguous)
    seen = []
    for r in reports:
        line = f"{r.program}: {r.strategy}"
        if line not in seen:
            seen.append(line)
    return "; ".join(seen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--peers", type=Path, default=BENCH.parent / "peers")
    parser.add_argument("--lru-n", type=int, default=256)
    parser.add_argument("--budget", type=float, default=100.0, help="seconds for all the timings")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU, the kernels emulated")
    args = parser.parse_args()
    if args.dry_run:
        import os

        global B, D, L, DEVICE
        B, D, L, DEVICE = 2, 8, 100, "cpu"
        os.environ["SSMC_CUDA_EMULATE"] = "1"
    budget = Budget(args.budget)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "dry run: CPU, kernels emulated"
    lines = [f"# complex diagonal scans, B{B} D{D} L{L} complex64 ({name})", ""]
    for layout, contiguous in (("b t d", False), ("b d t", True)):
        lines.append(f"- scan {layout}: {strategies(complex_diagonal.program, {'b': B, 'd': D}, contiguous)}")
    lines.append(f"- lru: {strategies(lru.SPEC.program, {'b': B, 'd': D, 'n': args.lru_n}, False)}")
    lines += ["", "| workload | implementation | out err | grad err | fwd ms | fwd+bwd ms |",
              "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for rows in (lambda: scan_rows("b t d", budget), lambda: scan_rows("b d t", budget),
                 lambda: accelerated_rows(args.peers, budget), lambda: lru_rows(args.lru_n, budget)):
        try:
            done = rows()
        except Exception as err:  # one workload's failure is reported, the others still run
            done = [["?", "error", f"{type(err).__name__}: {err}"[:200], "", "", ""]]
        for r in done:
            line = "| " + " | ".join(r) + " |"
            print(line, flush=True)
            lines.append(line)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "complex_scan.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
