"""Check and time ssmc's flash attention forward and backward (backends/cuda/kernels/flash) on a GPU.

    python bench/flash_check.py [--out DIR] [--small] [--forward-only] [--specs causal,alibi,window]
    python bench/flash_check.py --gqa [--out DIR]      # causal GQA 32 / 8 heads against SDPA's enable_gqa
    python bench/flash_check.py --d 256 [--out DIR]    # causal at B4 H16 L4096 d256 against SDPA
    python bench/flash_check.py --gather [--out DIR]   # a bias table / document ids (issue #42) vs FlexAttention

For causal, ALiBi (causal) and sliding-window-512 specs at B4 H16 L4096 d128 bf16 and a small shape
(B2 H4 L1000 d64): the flash kernel's output against torch SDPA (causal) or FlexAttention (ALiBi,
window) and the tiled torch path (max abs error, lse error against the tiled path), then the forward's
time (triton.testing.do_bench, else CUDA events) against SDPA (causal) and FlexAttention under
torch.compile (ALiBi, window) and the tiled path. Then forward + backward (`ssmc.torch.function`'s
autograd, out.backward(dO)): the gradients of q, k, v (and the ALiBi slope; a second ALiBi row with the slope
a constant, as the peers' is) against the peer's autograd
and the tiled backward (``SSMC_CUDA_FLASH_BACKWARD=0``), max abs error over the gradient's max abs
value, then the time of forward + backward against the same peers. Prints markdown tables; with
--out, writes them to DIR/flash.md. ``SSMC_CUDA_FLASH_DQ=kernel`` in the environment times the
backward with its deterministic dQ kernel instead of atomics. With ``--d 256``: the causal spec alone (others
with --specs) at B4 H16 L4096 d256 bf16, its output and gradients checked against SDPA's before any timing, then
the same forward and forward + backward rows. With ``--gather``: the indexed reads at B4 H16 L4096 d128 bf16, a
causal relative-position bias table ``table[h, clamp(i - j, 0, R - 1)]`` (FlexAttention: a score_mod indexing the
same table) and a causal document mask from sorted ids ``doc[b, i] == doc[b, j]`` (FlexAttention: a block mask
built from the ids), outputs and gradients (q, k, v, the table) checked against FlexAttention's first, then
forward and forward + backward timed, and the host time a call of ssmc takes to return from an idle GPU (`host_ms`:
enqueueing, plus any wait on the device); the path ssmc ran (flash kernels, or the tiled path and why) in the table.
FlexAttention runs with the first of `FLEX_OPTIONS`' kernel_options whose compile succeeds (the table names them,
and lists the failed attempts); where none does, ssmc's rows are checked against dense fp32 torch and timed alone.
Needs torch, triton and cupy; no network.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ssmc
from ssmc.backends.tiled_attention import TiledAttention

WINDOW = 512


def alibi(score, q_idx, kv_idx, slope: ssmc.Param["h"]):  # noqa: F821, UP037 (an axis name)
    return score - slope * (q_idx - kv_idx)


BUCKETS = 128  # the relative-position table's entries per head (distances past the last share it)


def relpos(score, q_idx, kv_idx, table: ssmc.Param["h r=128"]):  # noqa: F722 (axis names)
    return score + table[ssmc.clamp(q_idx - kv_idx, 0, BUCKETS - 1)]


def doc_causal(q_idx, kv_idx, doc: ssmc.Seq["b"]):  # noqa: F821, UP037 (an axis name)
    return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])


GATHER_SPECS = {
    "relpos": ssmc.attention(score_mod=relpos, mask_mod=ssmc.causal, batch="b h", head_dim="d"),
    "doc": ssmc.attention(mask_mod=doc_causal, batch="b h", head_dim="d"),
}


SPECS = {
    "causal": ssmc.attention(mask_mod=ssmc.causal, batch="b h", head_dim="d"),
    "alibi": ssmc.attention(score_mod=alibi, mask_mod=ssmc.causal, batch="b h", head_dim="d"),
    f"window-{WINDOW}": ssmc.attention(mask_mod=ssmc.sliding_window(WINDOW), batch="b h", head_dim="d"),
}
GQA = ssmc.attention(mask_mod=ssmc.causal, batch="b h", head_dim="d", kv_heads="h")


def timed(fn) -> float:
    """Milliseconds a call of `fn` takes (median)."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100))
    except ImportError:
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(20):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


def flex_reference(name: str, b: int, h: int, length: int, slope: torch.Tensor):
    """(compiled flex_attention call of q, k, v) for spec `name`, or None where torch has no FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    flex = torch.compile(flex_attention, dynamic=False)
    if name.startswith("window"):
        def mask(bi, hi, qi, ki):
            return (ki <= qi) & (qi - ki < WINDOW)
    else:
        def mask(bi, hi, qi, ki):
            return ki <= qi
    block_mask = create_block_mask(mask, None, None, length, length, device="cuda")
    score_mod = None
    if name == "alibi":
        def score_mod(score, bi, hi, qi, ki):
            return score - slope[hi] * (qi - ki)
    return lambda q, k, v: flex(q, k, v, score_mod=score_mod, block_mask=block_mask)


def visible_fraction(name: str, length: int) -> float:
    if name.startswith("window"):
        w = min(WINDOW, length)
        pairs = w * (w + 1) / 2 + (length - w) * w
    else:
        pairs = length * (length + 1) / 2
    return pairs / (length * length)


def row(name: str, b: int, h: int, length: int, d: int) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    slope = 2.0 ** (-8.0 * torch.arange(1, h + 1, device="cuda", dtype=torch.float32) / h)
    params = {"slope": slope} if name == "alibi" else {}
    tiled = TiledAttention(SPECS[name].program)
    call = tiled.bind(q, k, v, "b h t ...", params)
    if tiled.flash(call) is None:
        raise SystemExit(f"{name}: the flash kernel does not run this call: {tiled.flash_reason}")
    out, lse = tiled.forward(call)
    os.environ["SSMC_CUDA_FLASH"] = "0"
    try:
        t_out, t_lse = tiled.forward(call)
        ms_tiled = timed(lambda: tiled.forward(call))
    finally:
        del os.environ["SSMC_CUDA_FLASH"]
    fin = torch.isfinite(t_lse)
    err_tiled = (out.float() - t_out.float()).abs().max().item()
    err_lse = (lse[fin] - t_lse[fin]).abs().max().item()
    flex = flex_reference(name, b, h, length, slope)
    if name == "causal":
        ref_name = "SDPA"

        def ref():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    elif flex is not None:
        ref_name = "FlexAttention"

        def ref():
            return flex(q, k, v)
    else:
        ref_name, ref = "tiled", None
    err_ref = (out.float() - ref().float()).abs().max().item() if ref is not None else err_tiled
    ms_flash = timed(lambda: tiled.forward(call))
    ms_ref = timed(ref) if ref is not None else float("nan")
    flops = 4.0 * b * h * length * length * d * visible_fraction(name, length)
    return {"spec": name, "shape": f"B{b} H{h} L{length} d{d}", "ref": ref_name, "err_ref": err_ref,
            "err_tiled": err_tiled, "err_lse": err_lse, "ms_flash": ms_flash, "ms_ref": ms_ref,
            "ms_tiled": ms_tiled, "tflops": flops / ms_flash / 1e9}


def table(rows: list[dict]) -> str:
    head = ("| spec | shape | max abs err vs ref | vs tiled | lse err vs tiled | flash ms | ref | ref ms | "
            "flash / ref | tiled ms | flash TFLOP/s |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        ratio = r["ms_ref"] / r["ms_flash"] if math.isfinite(r["ms_ref"]) else float("nan")
        lines.append(f"| {r['spec']} | {r['shape']} | {r['err_ref']:.2e} | {r['err_tiled']:.2e} | "
                     f"{r['err_lse']:.2e} | {r['ms_flash']:.3f} | {r['ref']} | {r['ms_ref']:.3f} | "
                     f"{ratio:.2f}x | {r['ms_tiled']:.3f} | {r['tflops']:.1f} |")
    return "\n".join(lines)


def _grads(fn, inputs: list, do: torch.Tensor, constants: tuple = ()) -> list:
    """The gradients of `inputs` (leaves) of fn(*inputs, *constants) at cotangent `do`."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    fn(*leaves, *constants).backward(do)
    return [t.grad for t in leaves]


def _rel_err(got: list, want: list) -> float:
    """The largest of max |got - want| / max |want| over the gradients."""
    return max(((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-6)).item()
               for g, w in zip(got, want))


def train_row(name: str, b: int, h: int, length: int, d: int, fixed: bool = False) -> dict:
    """Forward + backward of spec `name`: gradients checked against the peer and the tiled backward,
    then timed (fwd + bwd) against the peer and the tiled backward. `fixed`: ALiBi's slope a constant
    (no gradient, as the peers' slope), else a leaf whose gradient ssmc computes too."""
    import ssmc.torch

    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    slope = 2.0 ** (-8.0 * torch.arange(1, h + 1, device="cuda", dtype=torch.float32) / h)
    fn = ssmc.torch.function(SPECS[name], layout="b h t ...")
    inputs = [q, k, v] + ([slope] if name == "alibi" and not fixed else [])
    constants = (slope,) if name == "alibi" and fixed else ()
    got = _grads(fn, inputs, do, constants)
    if fn.tiled.flash_backward_reason is not None:
        raise SystemExit(f"{name}: the flash backward does not run this call: {fn.tiled.flash_backward_reason}")
    os.environ["SSMC_CUDA_FLASH_BACKWARD"] = "0"
    try:
        want_tiled = _grads(fn, inputs, do, constants)
        ms_tiled = timed(lambda: _grads(fn, inputs, do, constants))
    finally:
        del os.environ["SSMC_CUDA_FLASH_BACKWARD"]
    err_tiled = _rel_err(got, want_tiled)
    flex = flex_reference(name, b, h, length, slope)
    if name == "causal":
        ref_name, ref = "SDPA", lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                                                  is_causal=True)
    elif flex is not None:
        ref_name, ref = "FlexAttention", flex
    else:
        ref_name, ref = "tiled", None
    # the peers' slope is a constant: q, k, v's gradients compared
    err_ref = _rel_err(got[:3], _grads(ref, [q, k, v], do)) if ref is not None else err_tiled
    ms_ssmc = timed(lambda: _grads(fn, inputs, do, constants))
    ms_ref = timed(lambda: _grads(ref, [q, k, v], do)) if ref is not None else float("nan")
    flops = 14.0 * b * h * length * length * d * visible_fraction(name, length)  # 2 + 5 products
    return {"spec": name + (" (fixed slope)" if fixed else ""), "shape": f"B{b} H{h} L{length} d{d}",
            "ref": ref_name, "err_ref": err_ref,
            "err_tiled": err_tiled, "ms_ssmc": ms_ssmc, "ms_ref": ms_ref, "ms_tiled": ms_tiled,
            "tflops": flops / ms_ssmc / 1e9}


def train_table(rows: list[dict]) -> str:
    head = ("| spec | shape | grad rel err vs ref | vs tiled | ssmc fwd+bwd ms | ref | ref ms | ssmc / ref | "
            "tiled bwd ms | ssmc TFLOP/s |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        ratio = r["ms_ref"] / r["ms_ssmc"] if math.isfinite(r["ms_ref"]) else float("nan")
        lines.append(f"| {r['spec']} | {r['shape']} | {r['err_ref']:.2e} | {r['err_tiled']:.2e} | "
                     f"{r['ms_ssmc']:.3f} | {r['ref']} | {r['ms_ref']:.3f} | {ratio:.2f}x | {r['ms_tiled']:.3f} | "
                     f"{r['tflops']:.1f} |")
    return "\n".join(lines)


def gqa_row(b: int, hq: int, hkv: int, length: int, d: int) -> dict:
    """Causal GQA (k and v with `hkv` heads): forward and forward + backward against SDPA with
    enable_gqa, outputs and gradients checked first."""
    import ssmc.torch

    torch.manual_seed(0)
    q, do = (torch.randn(b, hq, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fn = ssmc.torch.function(GQA, layout="b h t ...")

    def ref(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    err_out = (fn(q, k, v).float() - ref(q, k, v).float()).abs().max().item()
    if fn.tiled.flash_reason is not None:
        raise SystemExit(f"gqa: the flash kernel does not run this call: {fn.tiled.flash_reason}")
    err_grad = _rel_err(_grads(fn, [q, k, v], do), _grads(ref, [q, k, v], do))
    return {"shape": f"B{b} Hq{hq} Hkv{hkv} L{length} d{d}", "err_out": err_out, "err_grad": err_grad,
            "fwd": timed(lambda: fn(q, k, v)), "fwd_ref": timed(lambda: ref(q, k, v)),
            "train": timed(lambda: _grads(fn, [q, k, v], do)), "train_ref": timed(lambda: _grads(ref, [q, k, v], do))}


def check_d256(b: int, h: int, length: int) -> None:
    """Causal at head dim 256: ssmc's output and q, k, v gradients against SDPA's, before any timing (exits
    where an error passes 3e-2 of the reference's largest value, or the flash kernels do not run the call)."""
    import ssmc.torch

    torch.manual_seed(1)
    q, k, v, do = (torch.randn(b, h, length, 256, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    fn = ssmc.torch.function(SPECS["causal"], layout="b h t ...")

    def ref(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out, want = fn(q, k, v), ref(q, k, v)
    if fn.tiled.flash_reason is not None:
        raise SystemExit(f"d256: the flash kernel does not run this call: {fn.tiled.flash_reason}")
    err_out = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
    err_grad = _rel_err(_grads(fn, [q, k, v], do), _grads(ref, [q, k, v], do))
    if fn.tiled.flash_backward_reason is not None:
        raise SystemExit(f"d256: the flash backward does not run this call: {fn.tiled.flash_backward_reason}")
    print(f"d256 check against SDPA: out rel err {err_out:.2e}, grad rel err {err_grad:.2e}", flush=True)
    if not (err_out < 3e-2 and err_grad < 3e-2):
        raise SystemExit("d256: errors against SDPA too large; nothing timed")


def host_ms(fn, n: int = 20) -> float:
    """Milliseconds of host time a call of `fn` takes from an idle GPU to its return (the time to enqueue its work,
    plus any wait on the device: a call that copies device data to the host waits for it)."""
    fn()
    total = 0.0
    for _ in range(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        total += time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e3 * total / n


def gather_inputs(name: str, b: int, h: int, length: int, d: int, documents: int = 8) -> tuple[list, dict]:
    """(q, k, v, dO in bf16; the spec's other inputs: the bias table fp32, or sorted document ids [b, t] int32,
    `documents` documents of random lengths per row)."""
    torch.manual_seed(0)
    qkvd = [torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    if name == "relpos":
        return qkvd, {"table": 0.5 * torch.randn(h, BUCKETS, device="cuda")}
    starts = torch.sort(torch.randint(1, length, (b, documents - 1), device="cuda"), dim=1).values
    doc = (torch.arange(length, device="cuda")[None, :, None] >= starts[:, None, :]).sum(-1).to(torch.int32)
    return qkvd, {"doc": doc}


# FlexAttention's kernel_options, tried in order until its forward and backward compile and run: its autotuned
# defaults, then fewer pipeline stages, then smaller tiles (a captured table's loads beside d 128's default tiles
# asked for more shared memory than a block has: "No valid triton configs")
FLEX_OPTIONS = [None, {"fwd_num_stages": 2, "bwd_num_stages": 2}, {"fwd_num_stages": 1, "bwd_num_stages": 1},
                {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 1, "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64,
                 "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32, "bwd_num_stages": 1}]


def flex_gather(name: str, b: int, h: int, length: int, extra: dict, kernel_options: dict | None = None):
    """FlexAttention under torch.compile for a gather spec: fn(q, k, v, table) for "relpos" (the table a
    tensor the score_mod indexes, so its gradient flows), fn(q, k, v) for "doc" (a block mask from the ids);
    `kernel_options` passed to flex_attention (None: its defaults)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    given = {} if kernel_options is None else {"kernel_options": dict(kernel_options)}
    if name == "relpos":
        causal = create_block_mask(lambda bi, hi, qi, ki: ki <= qi, None, None, length, length, device="cuda")

        def run(q, k, v, table):
            def score_mod(score, bi, hi, qi, ki):
                return score + table[hi, (qi - ki).clamp(0, BUCKETS - 1)]
            return flex(q, k, v, score_mod=score_mod, block_mask=causal, **given)
        return run
    doc = extra["doc"]

    def mask(bi, hi, qi, ki):
        return (ki <= qi) & (doc[bi, qi] == doc[bi, ki])
    block_mask = create_block_mask(mask, b, None, length, length, device="cuda")
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask, **given)


def dense_gather(name: str, length: int, extra: dict):
    """The gather spec in dense fp32 torch (every score materialized): the check's reference where FlexAttention
    does not compile. fn(q, k, v[, table]) as `flex_gather`'s."""
    i = torch.arange(length, device="cuda")
    rel = i[:, None] - i[None, :]

    def run(q, k, v, *table):
        s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        visible = rel >= 0
        if name == "relpos":
            s = s + table[0][:, rel.clamp(0, BUCKETS - 1)][None]
        else:
            doc = extra["doc"]
            visible = visible & (doc[:, None, :, None] == doc[:, None, None, :])
        return torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ v.float()
    return run


def flex_compiled(name: str, b: int, h: int, length: int, extra: dict, leaves: list, do: torch.Tensor):
    """(FlexAttention's fn, the kernel_options it ran with, its output and gradients at `leaves`, what failed
    before), the first of `FLEX_OPTIONS` whose forward and backward compile and run; fn None where none does (a
    peer that fails leaves ssmc's rows to be checked against `dense_gather`)."""
    failures = []
    for opts in FLEX_OPTIONS:
        try:
            fn = flex_gather(name, b, h, length, extra, opts)
            want, want_g = fn(*leaves), _grads(fn, leaves, do)
            torch.cuda.synchronize()
            return fn, opts, want, want_g, failures
        except Exception as err:  # the peer's compile (InductorError, its out-of-resource) or launch
            first = (str(err).strip().splitlines() or [""])[0]
            failures.append(f"kernel_options={opts}: {type(err).__name__}: {first[:300]}")
            print(f"FlexAttention ({name}) failed with {failures[-1]}", flush=True)
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    return None, None, None, None, failures


def gather_row(name: str, b: int, h: int, length: int, d: int) -> dict:
    """A gather spec: ssmc (ssmc.torch.function) against FlexAttention, output and gradients checked, then the
    forward and forward + backward timed. FlexAttention runs with the first `FLEX_OPTIONS` that compiles; where
    none does, ssmc is checked against `dense_gather` and timed alone (the peer's times NaN)."""
    import ssmc.torch

    (q, k, v, do), extra = gather_inputs(name, b, h, length, d)
    fn = ssmc.torch.function(GATHER_SPECS[name], layout="b h t ...")
    leaves = [q, k, v] + ([extra["table"]] if name == "relpos" else [])
    consts = (extra["doc"],) if name == "doc" else ()

    def ours(*xs):
        return fn(*xs[:3], **({"table": xs[3]} if name == "relpos" else {"doc": xs[3]}))

    ref, opts, want, want_g, failures = flex_compiled(name, b, h, length, extra, leaves, do)
    if ref is None:
        dense = dense_gather(name, length, extra)
        want, want_g = dense(*leaves), _grads(dense, leaves, do)
    out = ours(*leaves, *consts)
    err_out = ((out.float() - want.float()).abs().max() / want.float().abs().max()).item()
    got_g = _grads(ours, leaves, do, consts)
    # (a torch whose FlexAttention gives captured tensors no gradient: the table's left out of the check)
    err_grad = _rel_err(*zip(*[(g, w) for g, w in zip(got_g, want_g) if w is not None]))
    del want, want_g
    path = "flash" if fn.tiled.flash_reason is None else f"tiled ({fn.tiled.flash_reason})"
    nan = float("nan")
    return {"spec": name, "shape": f"B{b} H{h} L{length} d{d}", "path": path, "err_out": err_out,
            "err_grad": err_grad, "peer": "FlexAttention" if ref is not None else "dense fp32 (Flex failed)",
            "flex_options": "failed" if ref is None else ("defaults" if opts is None else str(opts)),
            "flex_failures": failures,
            "fwd": timed(lambda: ours(*leaves, *consts)),
            "fwd_ref": timed(lambda: ref(*leaves)) if ref is not None else nan,
            "train": timed(lambda: _grads(ours, leaves, do, consts)),
            "train_ref": timed(lambda: _grads(ref, leaves, do)) if ref is not None else nan,
            "host_fwd": host_ms(lambda: ours(*leaves, *consts)),
            "host_train": host_ms(lambda: _grads(ours, leaves, do, consts))}


def gather_table(rows: list[dict]) -> str:
    lines = ["| spec | shape | ssmc path | checked against | out rel err | grad rel err | fwd ms | Flex ms | "
             "Flex / ssmc | fwd+bwd ms | Flex ms | Flex / ssmc | ssmc host ms fwd | host ms fwd+bwd | "
             "Flex kernel_options |", "|" + "---|" * 15]
    for r in rows:
        lines.append(f"| {r['spec']} | {r['shape']} | {r['path']} | {r['peer']} | {r['err_out']:.2e} | "
                     f"{r['err_grad']:.2e} | {r['fwd']:.3f} | {r['fwd_ref']:.3f} | {r['fwd_ref'] / r['fwd']:.2f}x | "
                     f"{r['train']:.3f} | {r['train_ref']:.3f} | {r['train_ref'] / r['train']:.2f}x | "
                     f"{r['host_fwd']:.3f} | {r['host_train']:.3f} | {r['flex_options']} |")
    failures = [f"- {r['spec']} {r['shape']}: {f}" for r in rows for f in r["flex_failures"]]
    return "\n".join(lines + (["", "FlexAttention's failed attempts (then the next kernel_options):", *failures]
                              if failures else []))


def config_report(text: str, out: Path | None, filename: str, rows: list[dict], base: str) -> None:
    """The config sweeps' ending (bench/flash_*_configs.py): print `text`, write it to out/filename, and exit
    non-zero where a row's error against the base config (key `base`) or the peer passes 3e-2."""
    print(text)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / filename).write_text(text)
    bad = [(r["spec"], r["shape"], r["config"]) for r in rows
           if not (r[base] < 3e-2 and (math.isnan(r["err_ref"]) or r["err_ref"] < 3e-2))]
    if bad:
        raise SystemExit(f"errors too large: {bad}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="folder to write flash.md to")
    parser.add_argument("--small", action="store_true", help="the small shape only")
    parser.add_argument("--forward-only", action="store_true", help="no forward + backward rows")
    parser.add_argument("--gqa", action="store_true", help="only causal GQA 32 / 8 heads, B2 L8192 d128, vs SDPA")
    parser.add_argument("--gather", action="store_true",
                        help="only the indexed reads (bias table, document ids), B4 H16 L4096 d128, vs FlexAttention")
    parser.add_argument("--specs", help="comma-separated specs (default all); 'alibi' brings its fixed-slope row")
    parser.add_argument("--d", type=int, choices=(128, 256), default=128,
                        help="256: B4 H16 L4096 d256, the causal spec unless --specs, checked against SDPA first")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if args.gather:
        shapes = [(2, 4, 1000, 64)] + ([] if args.small else [(4, 16, 4096, 128)])
        rows = [gather_row(name, *shape) for shape in shapes for name in GATHER_SPECS]
        text = (f"# ssmc attention with indexed reads (bf16), {torch.cuda.get_device_name()}, "
                f"torch {torch.__version__}\n\nrelpos: causal + a bias table per head indexed by clamp(i - j, 0, "
                "127); doc: causal within documents from sorted ids (8 a row); Flex: FlexAttention under "
                "torch.compile (a score_mod indexing the table; a block mask from the ids), with the first "
                "kernel_options of bench/flash_check.py FLEX_OPTIONS that compiles (its column); where none does, "
                "ssmc checked "
                "against dense fp32 torch and timed alone; grad rel err: max |error| / max |gradient| over q, k, v "
                "(and the table).\n\n" + gather_table(rows) + "\n")
        print(text)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "flash_gather.md").write_text(text)
        bad = [(r["spec"], r["shape"]) for r in rows if not (r["err_out"] < 3e-2 and r["err_grad"] < 3e-2)]
        if bad:
            raise SystemExit(f"errors too large: {bad}")
        return
    if args.gqa:
        r = gqa_row(2, 32, 8, 8192, 128)
        text = (f"# ssmc GQA attention (causal, bf16), {torch.cuda.get_device_name()}\n\n"
                "| shape | out err | grad rel err | fwd ms | SDPA ms | ratio | fwd+bwd ms | SDPA ms | ratio |\n"
                + "|" + "---|" * 9 + "\n"
                f"| {r['shape']} | {r['err_out']:.2e} | {r['err_grad']:.2e} | {r['fwd']:.3f} | {r['fwd_ref']:.3f} | "
                f"{r['fwd_ref'] / r['fwd']:.2f}x | {r['train']:.3f} | {r['train_ref']:.3f} | "
                f"{r['train_ref'] / r['train']:.2f}x |\n")
        print(text)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "flash_gqa.md").write_text(text)
        if not (r["err_out"] < 3e-2 and r["err_grad"] < 3e-2):
            raise SystemExit("gqa: errors too large")
        return
    shapes = [(2, 4, 1000, 64)] + ([] if args.small else [(4, 16, 4096, 128)])
    specs = args.specs.split(",") if args.specs else list(SPECS)
    if args.d == 256:
        shapes = [(4, 16, 4096, 256)]
        specs = args.specs.split(",") if args.specs else ["causal"]
        check_d256(4, 16, 4096)
    unknown = sorted(set(specs) - set(SPECS))
    if unknown:
        raise SystemExit(f"unknown specs {unknown}; known: {list(SPECS)}")
    rows = []
    for shape in shapes:
        for name in specs:
            rows.append(row(name, *shape))
            r = rows[-1]
            print(f"{r['spec']} {r['shape']}: err {r['err_ref']:.2e} / {r['err_tiled']:.2e}, "
                  f"flash {r['ms_flash']:.3f} ms, {r['ref']} {r['ms_ref']:.3f} ms", flush=True)
    train = []
    if not args.forward_only:
        for shape in shapes:
            for name, fixed in [(n, False) for n in specs] + ([("alibi", True)] if "alibi" in specs else []):
                train.append(train_row(name, *shape, fixed=fixed))
                r = train[-1]
                print(f"{r['spec']} {r['shape']} fwd+bwd: grad err {r['err_ref']:.2e} / {r['err_tiled']:.2e}, "
                      f"ssmc {r['ms_ssmc']:.3f} ms, {r['ref']} {r['ms_ref']:.3f} ms", flush=True)
    text = (f"# ssmc flash attention forward\n\n{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16; "
            "ref: SDPA (causal), FlexAttention under torch.compile (ALiBi, window); flash / ref > 1: flash faster; "
            "tiled: the torch path it replaces.\n\n" + table(rows) + "\n")
    if train:
        text += ("\n# forward + backward\n\nssmc.torch.function's autograd (flash forward and backward kernels) "
                 "against the peer's autograd; grad rel err: max |error| / max |gradient| over q, k, v (and the "
                 "slope against the tiled backward); tiled bwd: the flash forward with the tiled backward; dQ: "
                 f"{os.environ.get('SSMC_CUDA_FLASH_DQ') or 'atomic'}.\n\n"
                 + train_table(train) + "\n")
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "flash.md").write_text(text)
    bad = [r for r in rows if not (r["err_tiled"] < 3e-2 and r["err_ref"] < 3e-2 and r["err_lse"] < 1e-2)]
    bad += [r for r in train if not (r["err_tiled"] < 3e-2 and r["err_ref"] < 3e-2)]
    if bad:
        raise SystemExit(f"errors too large: {[(r['spec'], r['shape']) for r in bad]}")


if __name__ == "__main__":
    main()
