"""Tell apart the flash backward's configs and its GPU-only code paths on a GPU, then time the configs.

    python bench/flash_backward_bisect.py [--out DIR] [--no-timing] [--no-toggles]

Part 1, correctness. Each variant's gradients (dq, dk, dv, the ALiBi slope) through `ssmc.torch.function`'s
autograd (the flash forward, then the variant's backward), max abs error against float64 torch autograd of
the same 16-bit inputs, and that error over the gradient's largest entry (columns "rel"; the GPU tests'
tolerances: 16-bit q, k, v 2e-2 (bf16) / 4e-3 (fp16), params 1e-2 / 2e-3). Variants:

    bn64, w4q64, w8q64, w8q32      the key-block kernel's configs (SSMC_CUDA_FLASH_BACKWARD_CONFIG)
    <config>+dqk                   dQ by the second kernel (SSMC_CUDA_FLASH_DQ=kernel; no atomics)
    <config>+SCALAR_DQ ...         a wide config compiled with one toggle of backward_wide.cu.j2 defined
                                   (SCALAR_DQ: scalar atomicAdd for dQ, not red.global.add.v2; PLAIN_PACK:
                                   no cvt.rn.*x2; SYNC_LOADS: no cp.async; PLAIN_ROWSUMS: the general
                                   shuffles for one param's row sums), then all four at once
    tiled-fp32                     the tiled torch backward from the flash forward's fp32 lse
                                   (SSMC_CUDA_FLASH_BACKWARD=0), the GPU tests' reference before

Cases: the GPU test that failed, test_gpu_flash_backward_time_major_layout_and_lq_apart_from_lk[1000-7]
(ALiBi with the causal mask, fp16, layout "b t h ...", B2 H4 Lq 1000 Lk 7 d64; slopes 1, 0.5, 0.1, 2^-8:
a far row's lse is about -slope (i - 7)), then causal / ALiBi / sliding window 512 at B2 H4 L777 bf16, d64
and d128.

Part 2, time at B4 H16 L4096 d128 bf16 (causal against torch SDPA, ALiBi and window 512 against
FlexAttention under torch.compile; bench/flash_check.py's specs and peers): per config, the backward alone
(the FlashBackward call: delta kernel, key-block kernel, from the forward's out and lse) and ssmc's
forward + backward (autograd) against the peer's backward alone and forward + backward
(triton.testing.do_bench medians). Prints markdown; with --out writes DIR/flash_backward_bisect.md.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flash_check import SPECS, WINDOW, flex_reference, timed

from ssmc.backends.cuda.kernels.flash import backward as flash_bwd

CONFIGS = list(flash_bwd.CONFIGS)
TOGGLES = ["SCALAR_DQ", "PLAIN_PACK", "SYNC_LOADS", "PLAIN_ROWSUMS"]
GRAD_TOL = {True: 2e-2, False: 4e-3}   # tests/test_flash_backward.py
PARAM_TOL = {True: 1e-2, False: 2e-3}

_kernel_source = flash_bwd.kernel_source
_defines: list[str] = []
DEVICE = "cuda"  # --dry-run: "cpu", the kernels emulated (SSMC_CUDA_EMULATE=1) at tiny sizes


def _toggled_source(*args, **kwargs):
    """flash_bwd.kernel_source with `_defines` ahead of the source (the wide template's toggles)."""
    name, text = _kernel_source(*args, **kwargs)
    return name, "".join(f"#define SSMC_FLASH_BWD_{x} 1\n" for x in _defines) + text


flash_bwd.kernel_source = _toggled_source


@contextmanager
def variant(config: str | None = None, dq: str | None = None, defines=(), flash_backward: bool = True):
    """The environment (and toggles) of one variant for the calls inside."""
    saved = {n: os.environ.get(n) for n in ("SSMC_CUDA_FLASH_BACKWARD_CONFIG", "SSMC_CUDA_FLASH_DQ",
                                             "SSMC_CUDA_FLASH_BACKWARD")}
    values = {"SSMC_CUDA_FLASH_BACKWARD_CONFIG": config, "SSMC_CUDA_FLASH_DQ": dq,
              "SSMC_CUDA_FLASH_BACKWARD": None if flash_backward else "0"}
    _defines[:] = list(defines)
    try:
        for n, x in values.items():
            if x is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = x
        yield
    finally:
        _defines[:] = []
        for n, x in saved.items():
            if x is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = x


def variants(d: int, toggles: bool) -> list[tuple[str, dict]]:
    """(label, `variant` arguments) for head dim `d`: each config, dQ by the kernel at the default, each
    toggle (and all) at the default wide config, the tiled fp32 backward."""
    default = flash_bwd.DEFAULT_CONFIG[d]
    out = [(c, dict(config=c)) for c in CONFIGS]
    out.append((f"{default}+dqk", dict(config=default, dq="kernel")))
    if toggles:
        out += [(f"{default}+{t}", dict(config=default, defines=[t])) for t in TOGGLES]
        out.append((f"{default}+all4", dict(config=default, defines=TOGGLES)))
    out.append(("tiled-fp32", dict(flash_backward=False)))
    return out


def prewarm(jobs: list[tuple[str, dict]], program, d: int, bf16: bool) -> None:
    """Compile the variants' backward kernels in threads (NVRTC runs outside the GIL; CuPy keeps them in
    its disk cache, so the calls' own compiles hit it). Best effort: an error here shows at the call."""
    try:
        import cupy

        from ssmc.backends.cuda.source import compile_options
    except ImportError:
        return
    texts = []
    for _, kw in jobs:
        if not kw.get("flash_backward", True):
            continue
        with variant(**kw):
            atomic = kw.get("dq") != "kernel"
            texts.append(flash_bwd.kernel_source(program, d, bf16, atomic_dq=atomic))
            if not atomic:
                texts.append(flash_bwd.dq_source(program, d, bf16))

    def build(item):
        name, text = item
        try:
            with cupy.cuda.Device(0):
                cupy.RawModule(code=text, options=compile_options(text)).compile()
        except Exception as err:  # the call reports it
            print(f"prewarm {name}: {type(err).__name__}: {err}", flush=True)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(build, texts))


def float64_grads(name: str, q, k, v, slope, do, time_major: bool) -> dict:
    """Plain float64 torch autograd of spec `name` (flash_check.SPECS: causal, ALiBi (causal), window)
    from the 16-bit inputs: {"q", "k", "v", "slope" (ALiBi)} in the inputs' layout."""
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    sl = slope.detach().double().requires_grad_(True)
    qq, kk, vv = (t.transpose(1, 2) if time_major else t for t in leaves)   # b h t d
    lq, lk, d = qq.shape[-2], kk.shape[-2], qq.shape[-1]
    i = torch.arange(lq, device=q.device, dtype=torch.float64)[:, None]
    j = torch.arange(lk, device=q.device, dtype=torch.float64)[None, :]
    s = (qq @ kk.transpose(-1, -2)) / math.sqrt(d)
    if name == "alibi":
        s = s - sl.view(1, -1, 1, 1) * (i - j)
    visible = j <= i
    if name.startswith("window"):
        visible = visible & (i - j < WINDOW)
    p = torch.softmax(s.masked_fill(~visible, -math.inf), -1).nan_to_num(0.0)
    out = p @ vv
    out = out.transpose(1, 2) if time_major else out
    out.backward(do.double())
    grads = {"q": leaves[0].grad, "k": leaves[1].grad, "v": leaves[2].grad}
    if name == "alibi":
        grads["slope"] = sl.grad
    return grads


def correctness_case(label: str, name: str, b: int, h: int, lq: int, lk: int, d: int, dtype, time_major: bool,
                     slope, toggles: bool) -> list[dict]:
    import ssmc.torch

    gen = torch.Generator(device=DEVICE).manual_seed(lq + lk + d)
    shape = (lambda t: (b, t, h, d)) if time_major else (lambda t: (b, h, t, d))
    q = torch.randn(shape(lq), device=DEVICE, dtype=dtype, generator=gen)
    k, v = (torch.randn(shape(lk), device=DEVICE, dtype=dtype, generator=gen) for _ in range(2))
    do = torch.randn(q.shape, device=DEVICE, dtype=dtype, generator=gen)
    want = float64_grads(name, q, k, v, slope, do, time_major)
    fn = ssmc.torch.function(SPECS[name], layout="b t h ..." if time_major else "b h t ...")
    inputs = [q, k, v] + ([slope] if name == "alibi" else [])
    names = ["q", "k", "v"] + (["slope"] if name == "alibi" else [])
    jobs = variants(d, toggles)
    if DEVICE == "cuda":
        prewarm(jobs, SPECS[name].program, d, dtype == torch.bfloat16)
    bf16 = dtype == torch.bfloat16
    rows = []
    for vlabel, kw in jobs:
        t0 = time.perf_counter()
        try:
            with variant(**kw):
                leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
                fn(*leaves).backward(do)
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                reason = fn.tiled.flash_backward_reason
                got = dict(zip(names, (t.grad for t in leaves)))
        except Exception as err:  # a row says what failed
            rows.append({"case": label, "variant": vlabel, "error": f"{type(err).__name__}: {err}"[:200]})
            print(f"{label} {vlabel}: {rows[-1]['error']}", flush=True)
            continue
        r = {"case": label, "variant": vlabel, "ran": "flash" if reason is None else "tiled"}
        ok = True
        for n in names:
            g, w = got[n].double(), want[n]
            err = (g - w).abs().max().item() if torch.isfinite(g).all() else math.inf
            rel = err / max(w.abs().max().item(), 1e-3)
            r[n], r[n + "_rel"] = err, rel
            ok &= rel <= (PARAM_TOL if n == "slope" else GRAD_TOL)[bf16]
        r["ok"] = ok
        rows.append(r)
        print(f"{label} {vlabel} ({time.perf_counter() - t0:.1f} s): "
              + ", ".join(f"{n} {r[n]:.3g} ({r[n + '_rel']:.2e})" for n in names) + ("" if ok else "  OVER"),
              flush=True)
    return rows


def correctness_table(rows: list[dict]) -> str:
    lines = ["| case | variant | ran | dq max err (rel) | dk | dv | slope | within the tests' tolerance |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['variant']} | error: {r['error']} | | | | | no |")
            continue
        cells = [f"{r[n]:.3g} ({r[n + '_rel']:.1e})" if n in r else "" for n in ("q", "k", "v", "slope")]
        lines.append(f"| {r['case']} | {r['variant']} | {r['ran']} | " + " | ".join(cells)
                     + f" | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def _time_peer(ref, q, k, v, do) -> tuple[float, float]:
    """(the peer's backward alone, its forward + backward) in ms. The backward alone repeats one graph's
    backward (retain_graph): torch.compile's donated buffers (FlexAttention's) refuse that, so they are off."""
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = ref(*leaves)
    bwd = timed(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True))

    def step():
        ls = [t.detach().requires_grad_(True) for t in (q, k, v)]
        ref(*ls).backward(do)
    return bwd, timed(step)


def _time_config(name: str, config: str, fn, q, k, v, do, params: dict) -> tuple[float, float]:
    """(ssmc's backward alone: the FlashBackward call from the forward's out and lse, its forward +
    backward through `fn`'s autograd) in ms, in key-block config `config`."""
    from ssmc.backends.tiled_attention import TiledAttention

    inputs = [q, k, v, *params.values()]
    with variant(config=config):
        tiled = TiledAttention(SPECS[name].program)
        call = tiled.bind(q, k, v, "b h t ...", params)
        out32 = tiled.delta_output(call)
        out, lse = tiled.forward(call, out32=out32)
        kernel = tiled.flash_backward(call)
        if kernel is None:
            raise RuntimeError(tiled.flash_backward_reason)
        o = out if out32 is None else out32
        bwd = timed(lambda: kernel(call, o, lse, do))

        def step():
            ls = [t.detach().requires_grad_(True) for t in inputs]
            fn(*ls).backward(do)
        return bwd, timed(step)


def timing_rows(b: int, h: int, length: int, d: int) -> list[dict]:
    import ssmc.torch

    rows = []
    for name in SPECS:
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        slope = 2.0 ** (-8.0 * torch.arange(1, h + 1, device="cuda", dtype=torch.float32) / h)
        params = {"slope": slope} if name == "alibi" else {}
        if name == "causal":
            ref_name = "SDPA"

            def ref(q, k, v):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            ref_name, ref = "FlexAttention", flex_reference(name, b, h, length, slope)
        peer_bwd, peer_all = _time_peer(ref, q, k, v, do) if ref is not None else (float("nan"), float("nan"))
        prewarm([(c, dict(config=c)) for c in CONFIGS], SPECS[name].program, d, True)
        fn = ssmc.torch.function(SPECS[name], layout="b h t ...")
        for config in CONFIGS:
            try:
                ms_bwd, ms_all = _time_config(name, config, fn, q, k, v, do, params)
            except Exception as err:  # a row says what failed
                print(f"{name} {config}: {type(err).__name__}: {err}", flush=True)
                ms_bwd = ms_all = float("nan")
            r = {"spec": name, "config": config, "ref": ref_name, "bwd": ms_bwd, "all": ms_all, "ref_bwd": peer_bwd,
                 "ref_all": peer_all, "default": config == flash_bwd.config(d, None, q.device).name}
            rows.append(r)
            print(f"{name} {config}: bwd {ms_bwd:.3f} ms (peer {peer_bwd:.3f}), fwd+bwd {ms_all:.3f} ms "
                  f"(peer {peer_all:.3f})", flush=True)
    return rows


def timing_table(rows: list[dict]) -> str:
    lines = ["B4 H16 L4096 d128 bf16; peer: SDPA (causal), FlexAttention under torch.compile (ALiBi, window 512); "
             "ratio = peer ms / ssmc ms (above 1: ssmc faster); * the default config.", "",
             "| spec | config | ssmc bwd ms | peer | peer bwd ms | bwd ratio | ssmc fwd+bwd ms | peer fwd+bwd ms | "
             "fwd+bwd ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['spec']} | {r['config']}{' *' if r['default'] else ''} | {r['bwd']:.3f} | {r['ref']} | "
                     f"{r['ref_bwd']:.3f} | {r['ref_bwd'] / r['bwd']:.2f}x | {r['all']:.3f} | {r['ref_all']:.3f} | "
                     f"{r['ref_all'] / r['all']:.2f}x |")
    best = {}
    for r in rows:
        if math.isfinite(r["all"]) and (r["spec"] not in best or r["all"] < best[r["spec"]]["all"]):
            best[r["spec"]] = r
    lines += ["", "fastest fwd+bwd per spec: " + ", ".join(f"{s}: {r['config']}" for s, r in best.items())]
    return "\n".join(lines)


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="folder to write flash_backward_bisect.md to")
    parser.add_argument("--no-timing", action="store_true", help="part 1 only")
    parser.add_argument("--no-toggles", action="store_true", help="no toggled variants")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: part 1 on the CPU emulator at tiny sizes (checks this script)")
    args = parser.parse_args()
    if args.dry_run:
        DEVICE = "cpu"
        os.environ["SSMC_CUDA_EMULATE"] = "1"
        lq, length, ds, heads = 70, 70, (64,), 2
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (or --dry-run)")
        lq, length, ds, heads = 1000, 777, (64, 128), 4
    start = time.perf_counter()
    failing = torch.tensor([1.0, 0.5, 0.1, 2.0 ** -8][:heads], device=DEVICE)
    rows = correctness_case(f"ALiBi fp16 b t h B2 H{heads} Lq{lq} Lk7 d64", "alibi", 2, heads, lq, 7, 64,
                            torch.float16, True, failing, not args.no_toggles)
    small_slope = 2.0 ** (-8.0 * torch.arange(1, heads + 1, device=DEVICE, dtype=torch.float32) / heads)
    for d in ds:
        for name in SPECS:
            rows += correctness_case(f"{name} bf16 B2 H{heads} L{length} d{d}", name, 2, heads, length, length, d,
                                     torch.bfloat16, False, small_slope,
                                     not args.no_toggles and d == 128 and name == "alibi")
    print(f"part 1: {time.perf_counter() - start:.0f} s", flush=True)
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU emulator (dry run)"
    text = (f"# flash backward bisect\n\n{device}, torch {torch.__version__}. Max abs error against float64 torch "
            "autograd of the same 16-bit inputs (over the gradient's largest entry).\n\n"
            + correctness_table(rows) + "\n")
    if args.out:  # part 1's table now: part 2 may run past the caller's time limit
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "flash_backward_bisect.md").write_text(text)
    if not args.no_timing and DEVICE == "cuda":
        timing = timing_rows(4, 16, 4096, 128)
        text += "\n# time\n\n" + timing_table(timing) + "\n"
    print(f"total: {time.perf_counter() - start:.0f} s", flush=True)
    print(text)
    if args.out:
        (args.out / "flash_backward_bisect.md").write_text(text)


if __name__ == "__main__":
    main()
