"""Calls on another GPU than the current one (backends/cuda/devices.py): they run on their arrays'
device, with kernels loaded there, and give what the same call gives on the current device. The
tests that need two GPUs skip on a machine with one; the checks of the argument devices run anywhere."""

from __future__ import annotations

import numpy as np
import pytest

import ssmc
from ssmc.backends.cuda.devices import check_one_device, device_of, on_arrays_device
from ssmc.examples import hgrn, mamba1

torch = pytest.importorskip("torch")
ssmc_torch = pytest.importorskip("ssmc.torch")


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


two_gpus = pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA devices")
# (module, sizes): Mamba-1 takes the fused backward, HGRN a prepared chunk (grad_prepared.py)
CASES = [(mamba1, {"batch": 2, "dim": 64, "state": 16}), (hgrn, {"batch": 3, "dim": 37})]
IDS = ["mamba1", "hgrn"]


def test_arguments_on_two_devices_are_an_error_naming_one():
    """Checked where a call is bound (any device type: meta tensors stand for a second GPU here)."""
    check_one_device({"u": torch.zeros(2), "delta": torch.zeros(2)})
    with pytest.raises(ValueError, match="argument 'delta' is on meta, argument 'u' on cpu"):
        check_one_device({"u": torch.zeros(2), "delta": torch.zeros(2, device="meta")})


def test_calls_without_cuda_tensors_stay_where_they_are():
    class Calls:
        backend = "cuda"

        @on_arrays_device(lambda args, kwargs: (*args, kwargs))
        def run(self, *args, **kwargs):
            return "ran"

    assert device_of((np.zeros(3), {"x": torch.zeros(2)}, [1.0])) is None
    assert Calls().run(np.zeros(3), x=torch.zeros(2)) == "ran"


def _tensors(module, sizes, length, device, seed=0):
    values = module.make_inputs(np.random.default_rng(seed), length, **sizes)
    return {k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in values.items()}


def _close(got, want, tol=1e-5):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)) <= tol


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("module, sizes", CASES, ids=IDS)
@pytest.mark.parametrize("length", [7, 180])
def test_calls_on_another_device_than_the_current_one_run_there(module, sizes, length):
    """Arguments on cuda:1, cuda:0 current: the forward, `ssmc.grad` and the torch op, each twice (the
    second call takes the prepared path), give on cuda:1 what the same calls give on cuda:0."""
    spec, layout = module.SPEC, module.LAYOUT
    with torch.cuda.device(0):
        home = _tensors(module, sizes, length, "cuda:0")
        away = {k: v.to("cuda:1") for k, v in home.items()}
        dy0 = torch.randn(ssmc.compile(spec, "cuda", layout=layout)(**home).shape, device="cuda:0")
        dy1 = dy0.to("cuda:1")
        want_y = ssmc.compile(spec, "cuda", layout=layout)(**home)
        want_g = ssmc.grad(spec, "cuda", layout=layout)(**home, grad_outputs=dy0)
        f, g = ssmc.compile(spec, "cuda", layout=layout), ssmc.grad(spec, "cuda", layout=layout)
        op = ssmc_torch.function(spec, layout=layout)
        for _ in range(2):
            y = f(**away)
            assert y.device == torch.device("cuda:1") and _close(y, want_y)
            grads = g(**away, grad_outputs=dy1)
            for name, want in want_g.items():
                assert grads[name].device == torch.device("cuda:1") and _close(grads[name], want), name
            leaves = {k: v.clone().requires_grad_(True) for k, v in away.items() if k != "h"}
            out = op(**leaves, **({"h": away["h"]} if "h" in away else {}))
            out.backward(dy1)
            assert _close(out, want_y)
            for name, leaf in leaves.items():
                assert leaf.grad.device == torch.device("cuda:1") and _close(leaf.grad, want_g[name]), name
        assert torch.cuda.current_device() == 0


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("module, sizes", CASES, ids=IDS)
def test_one_function_serves_each_device_with_its_own_kernels(module, sizes):
    """As a process per GPU sets its device (torch.cuda.set_device): the same function and shapes on
    cuda:0, then with cuda:1 current on cuda:1, then cuda:0 again, each right."""
    spec, layout = module.SPEC, module.LAYOUT
    f, g = ssmc.compile(spec, "cuda", layout=layout), ssmc.grad(spec, "cuda", layout=layout)
    results = {}
    for device in (0, 1, 0):
        with torch.cuda.device(device):
            x = _tensors(module, sizes, 180, f"cuda:{device}")
            y = f(**x)
            grads = g(**x, grad_outputs=torch.ones_like(y))
            assert y.device == torch.device(f"cuda:{device}")
            results.setdefault(device, []).append((y, grads))
    for runs in results.values():
        for y, grads in runs:
            assert _close(y, results[0][0][0])
            for name, want in results[0][0][1].items():
                assert _close(grads[name], want), name


@pytest.mark.gpu
@two_gpus
def test_arguments_on_two_gpus_are_an_error_before_any_kernel_runs():
    x = _tensors(hgrn, {"batch": 2, "dim": 5}, 7, "cuda:0")
    x["f"] = x["f"].to("cuda:1")
    with pytest.raises(ValueError, match="argument 'f' is on cuda:1, argument 'x' on cuda:0"):
        ssmc.compile(hgrn.SPEC, "cuda", layout=hgrn.LAYOUT)(**x)
    with pytest.raises(ValueError, match="on one GPU"):
        ssmc.grad(hgrn.SPEC, "cuda", layout=hgrn.LAYOUT)(**x, grad_outputs=torch.ones(2, 7, 5, device="cuda:0"))
