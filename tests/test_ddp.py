"""`ssmc.torch.Recurrence` under `DistributedDataParallel` (#43 item 3): two CPU processes on gloo, one
training step on different data per rank. The gradients after DDP's allreduce are the average of the two
single-process gradients, and the params stay equal on both ranks after an optimizer step.

(`state_dict` round trip and `.to(torch.float64)`: tests/test_layers.py.)
"""

from __future__ import annotations

import os
import socket

import pytest

from ssmc.examples import lstm

torch = pytest.importorskip("torch")
st = pytest.importorskip("ssmc.torch")
dist = pytest.importorskip("torch.distributed")

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with the gloo backend is not available in this torch build",
                allow_module_level=True)

SIZES = {"i": 3, "j": 4, "k": 4}
BATCH, LENGTH = 2, 5
WORLD = 2
LR = 0.1


class Tiny(torch.nn.Module):
    """An LSTM layer (numba backend, CPU tensors) and a linear head."""

    def __init__(self):
        super().__init__()
        self.rnn = st.Recurrence(lstm.SPEC, layout=lstm.LAYOUT, sizes=SIZES, dtype=torch.float64, backend="numba")
        self.head = torch.nn.Linear(SIZES["k"], 1, dtype=torch.float64)

    def forward(self, x):
        return self.head(self.rnn(x)).square().mean()


def _data(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)  # different data per rank
    return torch.randn(BATCH, LENGTH, SIZES["i"], dtype=torch.float64, generator=g)


def _worker(rank: int, port: int, state: dict, out: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        model = Tiny()
        model.load_state_dict(state)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        ddp(_data(rank)).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.save({"grads": grads, "params": params}, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_averages_gradients_and_keeps_params_in_sync(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    # the single-process gradients, one per rank's data, without DDP
    want = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for rank in range(WORLD):
        model.zero_grad()
        model(_data(rank)).backward()
        for n, p in model.named_parameters():
            want[n] += p.grad / WORLD
    torch.multiprocessing.spawn(_worker, args=(_free_port(), state, str(tmp_path)), nprocs=WORLD, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert set(want) == {"rnn.W", "rnn.U", "rnn.bias", "head.weight", "head.bias"}
    for n in want:
        for r in range(WORLD):
            assert torch.allclose(got[r]["grads"][n], want[n], rtol=1e-12, atol=1e-14), (n, r)
        # after the step both ranks hold the same params: the start minus lr times the averaged gradient
        assert torch.equal(got[0]["params"][n], got[1]["params"][n]), n
        assert torch.allclose(got[0]["params"][n], state[n] - LR * want[n], rtol=1e-12, atol=1e-14), n
