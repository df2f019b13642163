"""One workload of bench/profile_families.py, called a few times, for a hardware-counter profiler.

    ncu --clock-control none -k regex:flash_fwd --launch-skip 2 --launch-count 1 \
        python bench/ncu_case.py flash_fwd

Cases: flash_fwd, flash_train, sdpa_fwd, sdpa_train, ssd_fwd, ssd_train, retnet_fwd, lstm_train,
lstm_bf16_train. Each runs its
callable `--calls` times (default 4), synchronizing after each, so `--launch-skip` can pass the warm-up calls.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import profile_families as pf

import ssmc.torch


def sdpa_fwd():
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_train():
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    return lambda: torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True).backward(do)


def lstm_bf16_train():
    """LSTM B256 L1024 I1024 H1024 bf16, a training step: the recording forward and the adjoint kernels."""
    import persistent_check as pc

    from ssmc.examples import lstm
    inputs = {k: v.to(torch.bfloat16) for k, v in pc.make_inputs("LSTM", 256, 1024, 1024, 1024).items()}
    fn = ssmc.torch.function(lstm.SPEC, layout=lstm.LAYOUT)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in inputs.items()}
    dy = torch.randn(256, 1024, 1024, device="cuda", dtype=torch.bfloat16)

    def train():
        for v in leaves.values():
            v.grad = None
        fn(**leaves).backward(dy)
    return train


CASES = {
    "flash_fwd": lambda: pf.flash_cases()[0][1],
    "flash_train": lambda: pf.flash_cases()[1][1],
    "sdpa_fwd": sdpa_fwd,
    "ssd_fwd": lambda: pf.chunk_cases("ssd")[0][1],
    "ssd_train": lambda: pf.chunk_cases("ssd")[1][1],
    "retnet_fwd": lambda: pf.chunk_cases("retnet")[0][1],
    "sdpa_train": sdpa_train,
    "lstm_train": lambda: pf.rnn_cases("LSTM")[1][1],
    "lstm_bf16_train": lstm_bf16_train,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    import ssmc.torch  # noqa: F401
    fn = CASES[args.case]()
    for _ in range(args.calls):
        fn()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
