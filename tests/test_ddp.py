"""`ssmc.torch.Recurrence` under `DistributedDataParallel` and FSDP (#43 item 3): two CPU processes on gloo.
DDP: one training step on different data per rank; the gradients after DDP's allreduce are the average of
the two single-process gradients, and the params stay equal on both ranks after an optimizer step.
FSDP2 (`fully_shard`) and FSDP1 (`FullyShardedDataParallel`): a few steps train as one process would on
both ranks' data.

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
    """An LSTM layer (CPU tensors; numba backend unless told) and a linear head."""

    def __init__(self, backend: str = "numba"):
        super().__init__()
        self.rnn = st.Recurrence(lstm.SPEC, layout=lstm.LAYOUT, sizes=SIZES, dtype=torch.float64, backend=backend)
        self.head = torch.nn.Linear(SIZES["k"], 1, dtype=torch.float64)

    def forward(self, x):
        return self.head(self.rnn(x)).square().mean()


def _data(rank: int, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank + WORLD * step)  # different data per rank and step
    return torch.randn(BATCH, LENGTH, SIZES["i"], dtype=torch.float64, generator=g)


def _init_process_group(rank: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)


def _worker(rank: int, port: int, state: dict, out: str) -> None:
    _init_process_group(rank, port)
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


FSDP_STEPS = 3


def _train(model, rank: int) -> torch.Tensor:
    """FSDP_STEPS SGD steps on this rank's data; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(FSDP_STEPS):
        opt.zero_grad()
        loss = model(_data(rank, step))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _fsdp_worker(rank: int, port: int, state: dict, out: str) -> None:
    """`Tiny` (interpreter backend) under FSDP2 and under FSDP1, each trained from `state`: the losses, the
    loss of a forward without grad after the steps (and under FSDP2 a `step`'s outputs), and the full params."""
    from torch.distributed import fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    _init_process_group(rank, port)
    try:
        results = {}
        # FSDP2: every param a DTensor holding this rank's rows; the layer a unit of its own, its params
        # gathered before its forward and freed after it (reshard_after_forward), gathered again for its backward
        model = Tiny("interpreter")
        model.load_state_dict(state)
        mesh = init_device_mesh("cpu", (WORLD,))
        fsdp.fully_shard(model.rnn, mesh=mesh)
        fsdp.fully_shard(model, mesh=mesh)
        losses = _train(model, rank)
        fsdp.register_fsdp_forward_method(model.rnn, "step")  # FSDP2 gathers the params around `forward` only
        with torch.no_grad():
            final = model(_data(rank, FSDP_STEPS))
            results["step"] = model.rnn.step(_data(rank, FSDP_STEPS)[:, 0])[0]
        results["fsdp2"] = (losses, final, {n: p.full_tensor() for n, p in model.state_dict().items()})
        # FSDP1: the params flattened into one sharded FlatParameter per unit, the layer's params views of it
        model = Tiny("interpreter")
        model.load_state_dict(state)
        wrapped = fsdp.FullyShardedDataParallel(model, device_id=torch.device("cpu"),
                                                auto_wrap_policy=ModuleWrapPolicy({st.Recurrence}))
        losses = _train(wrapped, rank)
        with torch.no_grad():
            final = wrapped(_data(rank, FSDP_STEPS))
        full = fsdp.FullStateDictConfig(rank0_only=False)
        with fsdp.FullyShardedDataParallel.state_dict_type(wrapped, fsdp.StateDictType.FULL_STATE_DICT, full):
            results["fsdp1"] = (losses, final, wrapped.state_dict())
        torch.save(results, os.path.join(out, f"fsdp_rank{rank}.pt"))
        # every rank past its last collective before any tears the group down (a rank that exited while the
        # other's gloo threads still ran aborted the process once, "terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp_trains_as_one_process_on_all_the_data(tmp_path):
    """FSDP2 (`fully_shard`) and FSDP1 on two CPU processes (gloo), FSDP_STEPS SGD steps on different
    data per rank: each rank's losses, a forward (and a `step`) without grad after the steps, and the final
    params equal one process stepping on the mean of the ranks' losses (FSDP averages the gradients over
    the ranks). The layer's params are freed between its forward and its backward there: ssmc.torch's
    host path reads copies of them (`SsmcFunction._own_host_params`)."""
    pytest.importorskip("torch.distributed.fsdp")
    torch.manual_seed(0)
    model = Tiny("interpreter")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    want_losses = torch.zeros(WORLD, FSDP_STEPS, dtype=torch.float64)
    for step in range(FSDP_STEPS):
        opt.zero_grad()
        losses = [model(_data(rank, step)) for rank in range(WORLD)]
        torch.stack(losses).mean().backward()
        opt.step()
        want_losses[:, step] = torch.stack(losses).detach()
    with torch.no_grad():
        want_final = [model(_data(rank, FSDP_STEPS)) for rank in range(WORLD)]
        want_step = [model.rnn.step(_data(rank, FSDP_STEPS)[:, 0])[0] for rank in range(WORLD)]
    want_params = model.state_dict()
    torch.multiprocessing.spawn(_fsdp_worker, args=(_free_port(), state, str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"fsdp_rank{rank}.pt")
        assert torch.allclose(got.pop("step"), want_step[rank], rtol=1e-12, atol=1e-14), rank
        for how, (losses, final, params) in got.items():
            assert torch.allclose(losses, want_losses[rank], rtol=1e-12, atol=1e-14), (how, rank, losses)
            assert torch.allclose(final, want_final[rank], rtol=1e-12, atol=1e-14), (how, rank)
            assert set(params) == set(want_params), (how, sorted(params))
            for n, p in params.items():
                assert torch.allclose(p, want_params[n], rtol=1e-12, atol=1e-14), (how, rank, n)
