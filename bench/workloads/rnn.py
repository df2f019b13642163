"""Nonlinear recurrences: the LSTM and the GRU, whose gates read the previous h through a matrix.

    lstm  examples/lstm.py, "b t ..."   vs torch.nn.LSTM (cuDNN on a GPU; also a CPU peer)
    gru   examples/gru.py, "b t ..."    vs torch.nn.GRU

The examples' gates are in torch's row order (LSTM i, f, g, o; GRU r, z, n), so torch's weights are
ssmc's viewed as matrices: weight_ih = W[i (g k)]^T, weight_hh = U[j (g k)]^T.
"""

from __future__ import annotations

import torch

from ssmc.examples import gru, lstm

from . import Side, Workload, randn, ssmc_sides, uniform

LSTM_KEYS = ("x", "W", "U", "bias")
GRU_KEYS = ("x", "W", "U", "b_i", "b_h")


def _inputs(gates: int, biases: tuple[str, ...]):
    def build(sizes, device, dtype, g):
        b, t, i, k = sizes["b"], sizes["t"], sizes["i"], sizes["k"]
        s = k ** -0.5  # torch's initialisation range
        values = {"x": randn((b, t, i), device, g), "W": uniform((i, gates, k), device, g, -s, s),
                  "U": uniform((k, gates, k), device, g, -s, s)}
        values |= {name: uniform((gates, k), device, g, -s, s) for name in biases}
        return {name: v.to(dtype) for name, v in values.items()}

    return build


def torch_module(kind: str, inputs: dict, device, dtype) -> torch.nn.Module:
    """torch.nn.LSTM / GRU ("LSTM" / "GRU") holding the example's weights `inputs` (W [i g k], U [k g k],
    the biases [g k]): weight_ih = W[i (g k)]^T, weight_hh = U[j (g k)]^T; the LSTM's one bias as bias_ih
    (torch's two add up), the GRU's b_i and b_h as bias_ih and bias_hh."""
    W, U = inputs["W"], inputs["U"]
    i, gates, k = W.shape
    module = getattr(torch.nn, kind)(i, k, batch_first=True, device=device, dtype=dtype)
    with torch.no_grad():
        module.weight_ih_l0.copy_(W.reshape(i, gates * k).T)
        module.weight_hh_l0.copy_(U.reshape(k, gates * k).T)
        if kind == "LSTM":
            module.bias_ih_l0.copy_(inputs["bias"].reshape(-1))
            module.bias_hh_l0.zero_()
        else:
            module.bias_ih_l0.copy_(inputs["b_i"].reshape(-1))
            module.bias_hh_l0.copy_(inputs["b_h"].reshape(-1))
    module.flatten_parameters()
    return module


def _torch_rnn(kind: str):
    """The peer: a torch.nn.LSTM / GRU module holding the workload's weights."""
    def peer(peers, device: str) -> Side:
        def prepare(inputs, dout):
            x = inputs["x"]
            module = torch_module(kind, inputs, device, x.dtype)
            return {"module": module, "x": x.detach().clone().requires_grad_(), "dout": dout,
                    "shape": tuple(inputs["W"].shape)}

        def step(p):
            m = p["module"]
            wanted = [p["x"], m.weight_ih_l0, m.weight_hh_l0, m.bias_ih_l0, m.bias_hh_l0]
            return torch.autograd.grad(m(p["x"])[0], wanted, p["dout"])

        def grads(g, p):
            i, gates, k = p["shape"]
            out = {"x": g[0], "W": g[1].T.reshape(i, gates, k), "U": g[2].T.reshape(k, gates, k)}
            if kind == "LSTM":
                out["bias"] = g[3].reshape(gates, k)
            else:
                out["b_i"], out["b_h"] = g[3].reshape(gates, k), g[4].reshape(gates, k)
            return out

        return Side(label=f"torch.nn.{kind}" + (" (cuDNN)" if device == "cuda" else ""),
                    forward=lambda p: p["module"](p["x"])[0], step=step, prepare=prepare, grads=grads)

    return peer


def _rnn(name: str, example, kind: str, keys: tuple[str, ...], gates: int, biases: tuple[str, ...]) -> Workload:
    return Workload(
        name=name, family="rnn", title=kind + " B{b} L{t} I{i} H{k}", sizes={"b": 64, "t": 180, "i": 512, "k": 512},
        tiny={"b": 2, "t": 17, "i": 8, "k": 8}, build=_inputs(gates, biases),
        ssmc=lambda backend: ssmc_sides(example.SPEC, example.LAYOUT, backend, keys),
        peer=_torch_rnn(kind), peer_name=f"torch.nn.{kind}", compare=keys)


WORKLOADS = [
    _rnn("lstm", lstm, "LSTM", LSTM_KEYS, 4, ("bias",)),
    _rnn("gru", gru, "GRU", GRU_KEYS, 3, ("b_i", "b_h")),
]
