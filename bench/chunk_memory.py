"""Which tensors a training step of SSD keeps, and when: the peak of `bench/chunk_check.py`'s
"peak MiB ssmc" row explained by tensor, on the CPU.

The step is chunk_check's (`ssmc.torch.function(mamba2.SPEC)`, forward then `.backward(dy)`, bf16
inputs), run with the CUDA backend emulated (SSMC_CUDA_EMULATE=1) and every kernel launch a no-op:
the host code, and so every allocation's shape, dtype and lifetime, is the GPU's. A dispatch mode
records each new storage an op returns (with the ssmc lines that made it) and holds a weak
reference to it, so the live set after every op is known; the inputs and dy are left out.

    python bench/chunk_memory.py                    # B4 L4096 H32 P64 N128 (about a minute)
    python bench/chunk_memory.py --length 512 --min-mib 0.5

The GPU figure (`torch.cuda.max_memory_allocated` beyond what was allocated before the step) is this
peak less what was allocated before the step and is still live at the peak (the prepared step's zero
initial state) and less the previous step's gradients, which the step frees as it starts
(docs/design/matrix-linear-chunks.md, "Training memory").
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

os.environ["SSMC_CUDA_EMULATE"] = "1"

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent)]

import ssmc.torch  # noqa: E402
from ssmc.examples import mamba2  # noqa: E402

MIB = 2 ** 20


def _no_launches() -> None:
    """Every module of ssmc that launches kernels: launches do nothing (the arrays stay as allocated)."""
    from ssmc.backends.cuda import launch
    from ssmc.backends.cuda.kernels.chunk import mma  # noqa: F401  (imported: patched below)

    def nothing(*args, **kwargs):
        return None

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("ssmc") and getattr(module, "launch_kernel", None) is not None:
            module.launch_kernel = nothing
    launch.launch_kernel = nothing


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if "/ssmc/" in f.filename]
    return " < ".join(f"{f.filename.split('/ssmc/')[-1]}:{f.lineno}({f.name})" for f in reversed(frames[-3:]))


class Live(TorchDispatchMode):
    """The storages ops return, live or freed, after every op: `log` (event, op index, text, bytes),
    `peak` (bytes), `at_peak` ([(bytes, text)] live then)."""

    def __init__(self, exclude: set[int]):
        super().__init__()
        self.exclude, self.live, self.log = exclude, {}, []
        self.n, self.peak, self.peak_at, self.at_peak = 0, 0, "", []

    def _total(self) -> int:
        for key in [k for k, (ref, _, _) in self.live.items() if ref.expired()]:
            _, nbytes, text = self.live.pop(key)
            self.log.append(("free", self.n, text, nbytes))
        return sum(nbytes for _, nbytes, _ in self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.n += 1
        self._total()
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in self.exclude or key in self.live:
                continue
            text = (f"#{self.n} {func.__name__} {tuple(t.shape)} {str(t.dtype)[6:]} {storage.nbytes() / MIB:.1f} MiB"
                    f" @ {_where()}")
            self.live[key] = (StorageWeakRef(storage), storage.nbytes(), text)
            self.log.append(("alloc", self.n, text, storage.nbytes()))
        total = self._total()
        if total > self.peak:
            self.peak, self.peak_at = total, f"#{self.n} {func.__name__} @ {_where()}"
            self.at_peak = sorted(((nbytes, text) for _, nbytes, text in self.live.values()), reverse=True)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--min-mib", type=float, default=1.0, help="list tensors of at least this size")
    a = ap.parse_args()
    _no_launches()
    b, t, g, r, p, n = a.batch, a.length, 1, a.heads, 64, 128
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, shift=0.0):
        return (torch.randn(*shape, generator=gen) + shift).to(torch.bfloat16)

    leaves = {"x": randn(b, t, g, r, p), "dt": randn(b, t, g, r, shift=-1.0),
              "A": -torch.exp(torch.rand(g, r, generator=gen) * 2 - 1), "B": randn(b, t, g, n),
              "C": randn(b, t, g, n), "D": torch.randn(g, r, generator=gen)}
    for v in leaves.values():
        v.requires_grad_(True)
    fn = ssmc.torch.function(mamba2.SPEC, backend="cuda", layout=mamba2.LAYOUT)
    dy = randn(b, t, g, r, p)

    def step():
        for v in leaves.values():
            v.grad = None
        fn(**leaves).backward(dy)

    step()  # the first call compiles and prepares; the second is the one counted, as on the GPU
    live = Live({v.untyped_storage().data_ptr() for v in (*leaves.values(), dy)})
    with live:
        step()
    for event, i, text, nbytes in live.log:
        if nbytes >= a.min_mib * MIB:
            print(f"{event:5s} at {i:4d}: {text if event == 'alloc' else text.split(' @')[0]}")
    print(f"\npeak {live.peak / MIB:.1f} MiB at {live.peak_at}; live then:")
    for nbytes, text in live.at_peak:
        if nbytes >= a.min_mib * MIB:
            print(f"  {nbytes / MIB:8.1f}  {text}")
    small = sum(nbytes for nbytes, _ in live.at_peak if nbytes < a.min_mib * MIB)
    print(f"  {small / MIB:8.1f}  (smaller ones)")


if __name__ == "__main__":
    main()
