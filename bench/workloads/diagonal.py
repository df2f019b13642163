"""Diagonal linear recurrences: a first-order scan, HGRN, Mamba-1's selective scan.

    scan1          h = a*h + x, "b d t"                  vs accelerated-scan's scalar scan (Triton)
    hgrn           examples/hgrn.py, "b t ..."           vs fla's chunk_hgrn (gates computed by torch)
    mamba1(_small) examples/mamba1.py, "b d t"           vs mamba-ssm's selective_scan_fn (its CUDA extension)
    mamba1_block   examples/mamba1_block.py, "b d t"     vs selective_scan_fn, then torch's rms_norm over d and the add
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import ssmc
from ssmc.examples import hgrn, mamba1, mamba1_block

from . import Side, Workload, autograd_side, cuda_only, randn, ssmc_sides, uniform


@ssmc.recurrence
def scan(h: ssmc.State["b d"], a: ssmc.Seq["b d"], x: ssmc.Seq["b d"]):  # noqa: F722
    """The first-order scan h_t = a_t h_{t-1} + x_t."""
    h = a * h + x
    return h, h


# -- scan1 ----------------------------------------------------------------------------------------------------------

def _scan_inputs(sizes, device, dtype, g):
    shape = (sizes["b"], sizes["d"], sizes["t"])
    return {"a": uniform(shape, device, g, 0.5, 1.0).to(dtype), "x": randn(shape, device, g).to(dtype)}


def _scan_peer(peers, device: str) -> Side:
    cuda_only(device, "accelerated-scan (Triton)")
    scalar = peers.module("accelerated_scan.scalar")
    return autograd_side("accelerated-scan scalar", lambda v: scalar.scan(v["a"], v["x"]), ("a", "x"))


# -- hgrn -----------------------------------------------------------------------------------------------------------

def _hgrn_inputs(sizes, device, dtype, g):
    shape = (sizes["b"], sizes["t"], sizes["d"])
    return {"x": randn(shape, device, g).to(dtype), "f": randn(shape, device, g, shift=1.0).to(dtype)}


def _hgrn_peer(peers, device: str) -> Side:
    cuda_only(device, "fla (Triton)")
    chunk_hgrn = peers.module("fla.ops.hgrn").chunk_hgrn

    def run(v):  # h = exp(g) h + x' with g = log sigmoid(f), x' = (1 - sigmoid(f)) silu(x): examples/hgrn.py
        return chunk_hgrn((1 - torch.sigmoid(v["f"])) * F.silu(v["x"]), F.logsigmoid(v["f"]))[0]

    return autograd_side("fla chunk_hgrn (+ torch gates)", run, ("x", "f"))


# -- mamba1 ---------------------------------------------------------------------------------------------------------

MAMBA1_KEYS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def _mamba1_inputs(sizes, device, dtype, g):
    b, d, n, t = sizes["b"], sizes["d"], sizes["n"], sizes["t"]
    dt = torch.exp(uniform((d,), device, g, math.log(1e-3), math.log(0.1)))
    values = {
        "u": randn((b, d, t), device, g),
        "delta": randn((b, d, t), device, g, scale=0.5),
        "A": -torch.exp(randn((d, n), device, g, scale=0.5)),
        "B": randn((b, n, t), device, g),
        "C": randn((b, n, t), device, g),
        "D": randn((d,), device, g),
        "z": randn((b, d, t), device, g),
        "delta_bias": dt + torch.log(-torch.expm1(-dt)),  # softplus(delta_bias) = dt, as Mamba sets it
    }
    return {k: v.to(dtype) for k, v in values.items()}


def _mamba1_peer(peers, device: str) -> Side:
    cuda_only(device, "mamba-ssm's selective_scan_cuda")
    fn = peers.mamba("mamba_ssm.ops.selective_scan_interface", extension=True).selective_scan_fn
    return autograd_side("mamba-ssm selective_scan_fn",
                          lambda v: fn(*(v[k] for k in MAMBA1_KEYS), delta_softplus=True), MAMBA1_KEYS)


BLOCK_KEYS = (*MAMBA1_KEYS, "res", "norm_weight")


def _block_inputs(sizes, device, dtype, g):
    b, d, t = sizes["b"], sizes["d"], sizes["t"]
    values = _mamba1_inputs(sizes, device, dtype, g)
    values["res"] = randn((b, d, t), device, g).to(dtype)
    values["norm_weight"] = randn((d,), device, g, scale=0.1, shift=1.0).to(dtype)
    return values


def _block_peer(peers, device: str) -> Side:
    cuda_only(device, "mamba-ssm's selective_scan_cuda")
    fn = peers.mamba("mamba_ssm.ops.selective_scan_interface", extension=True).selective_scan_fn

    def run(v):
        y = fn(*(v[k] for k in MAMBA1_KEYS), delta_softplus=True)   # [b d t]
        normed = F.rms_norm(y.transpose(1, 2), (y.shape[1],), v["norm_weight"], mamba1_block.EPS)
        return v["res"] + normed.transpose(1, 2)

    return autograd_side("selective_scan_fn + torch rms_norm, add", run, BLOCK_KEYS)


def _mamba1(name: str, sizes: dict[str, int], tiny: dict[str, int]) -> Workload:
    return Workload(
        name=name, family="diagonal", title="Mamba-1 \"b d t\" B{b} D{d} L{t} N{n}", sizes=sizes,
        tiny=tiny, build=_mamba1_inputs,
        ssmc=lambda backend: ssmc_sides(mamba1.SPEC, mamba1.LAYOUT, backend, MAMBA1_KEYS),
        peer=_mamba1_peer, peer_name="mamba-ssm selective_scan_fn", compare=MAMBA1_KEYS)


WORKLOADS = [
    Workload(
        name="scan1", family="diagonal", title="scan h = a*h + x \"b d t\" B{b} D{d} L{t}",
        sizes={"b": 8, "d": 2048, "t": 4096}, tiny={"b": 2, "d": 8, "t": 37}, build=_scan_inputs,
        ssmc=lambda backend: ssmc_sides(scan, "b d t", backend, ("a", "x")),
        peer=_scan_peer, peer_name="accelerated-scan scalar", compare=("a", "x")),
    Workload(
        name="hgrn", family="diagonal", title="HGRN \"b t d\" B{b} D{d} L{t}",
        sizes={"b": 8, "d": 2048, "t": 4096}, tiny={"b": 2, "d": 8, "t": 33}, build=_hgrn_inputs,
        ssmc=lambda backend: ssmc_sides(hgrn.SPEC, hgrn.LAYOUT, backend, ("x", "f")),
        peer=_hgrn_peer, peer_name="fla chunk_hgrn", compare=("x", "f"),
        notes=["the peer's time includes torch's gate kernels (sigmoid, silu, logsigmoid)"]),
    _mamba1("mamba1", {"b": 8, "d": 1536, "n": 16, "t": 2048}, {"b": 2, "d": 8, "n": 4, "t": 33}),
    _mamba1("mamba1_small", {"b": 32, "d": 512, "n": 16, "t": 180}, {"b": 3, "d": 5, "n": 3, "t": 19}),
    Workload(
        name="mamba1_block", family="diagonal", title="Mamba-1 block tail \"b d t\" B{b} D{d} L{t} N{n}",
        sizes={"b": 8, "d": 1536, "n": 16, "t": 2048},
        tiny={"b": 2, "d": 8, "n": 4, "t": 33}, build=_block_inputs,
        ssmc=lambda backend: ssmc_sides(mamba1_block.SPEC, mamba1_block.LAYOUT, backend, BLOCK_KEYS),
        peer=_block_peer, peer_name="mamba-ssm selective_scan_fn + torch", compare=BLOCK_KEYS),
]
