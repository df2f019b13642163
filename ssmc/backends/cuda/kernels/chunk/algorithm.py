"""The chunked (state-space-dual) form of a matrix-linear core, forward and VJP, on torch tensors.

Per head, over chunks of C steps, with ``Λ_i`` the log decays summed from the chunk's start to step
i (inclusive), ``Γ = Λ_last`` and ``S_p`` the state entering the chunk:

    O_i = exp(Λ_i) Q_i S_p + Σ_{j≤i} exp(Λ_i − Λ_j) (Q_i·K_j) V_j
    S_e = exp(Γ) S_p + Σ_j exp(Γ − Λ_j) K_jᵀ V_j                     (the next chunk's S_p)

which is, as a plain loop, ``S = exp(ℓ_t) S + k_t ⊗ v_t;  o_t = Σ_κ S q_t``, V_j standing for
β_j V_j where the injection has a per-step scalar β (SSD's softplus(dt): v the input x as given, β
apart). Every exponent is of a sum of log decays over steps of one chunk, never a global
cumulative sum, and the masked
entries are set to −inf before `exp`, so that no inf·0 arises. The VJP follows the same shape
(docs/design/matrix-linear-chunks.md gives the formulas): the cotangent of each chunk's end state
runs through the chunks in reverse, the intra-chunk terms are matrix products of the same masked
decay matrix, and ``dΛ_i = Q_i·dQ_i − K_i·dK_i (+ ⟨dS_e, S_e⟩ at the chunk's last step)``.

Arrays are ``[*H, NC, C, D]``: the head axes first (size 1 where an operand lacks one: torch
broadcasts), then chunk, step in the chunk, and the key or value axis. Matrix products of the
intra-chunk terms run in the operands' dtype where that is a 16-bit float (tensor cores, fp32
accumulation), everything that touches a state in fp32 (or float64 for float64 inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HALF = (torch.bfloat16, torch.float16)
# chunks up to which the carry across chunks is one matrix product per head ([NC+1, NC] weights);
# beyond, a loop over the chunks
SCAN_MATRIX_CHUNKS = 512


@dataclass
class Chunks:
    """The inputs of one call, chunked: q, k [*H, NC, C, K]; v [*H, NC, C, V]; ell [*H, NC, C] (log
    decays, the compute dtype; zeros where there is no decay), s0 [*H, K, V] and beta [*H, NC, C] (the
    compute dtype; None: 1), the injection being β_t k_t ⊗ v_t; skip [*H, NC, C] (the compute dtype;
    None: 0), the output being ``o_t + skip_t v_t`` (SSD's D x, v the raw x)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ell: torch.Tensor
    s0: torch.Tensor
    beta: torch.Tensor | None = None
    skip: torch.Tensor | None = None

    @property
    def compute(self) -> torch.dtype:
        return self.s0.dtype

    def folded(self) -> Chunks:
        """These chunks with β folded into v (β_j v_j in the compute dtype; itself where there is no β), the
        skip left out (it weighs the raw v)."""
        if self.beta is None:
            return self
        return Chunks(self.q, self.k, self.v.to(self.compute) * self.beta[..., None], self.ell, self.s0)

    def core(self) -> Chunks:
        """These chunks without the skip term."""
        return self if self.skip is None else Chunks(self.q, self.k, self.v, self.ell, self.s0, self.beta)

    @property
    def mm(self) -> torch.dtype:
        """The dtype of the intra-chunk products' operands."""
        return self.q.dtype if self.q.dtype in HALF else self.compute


def _decays(ell: torch.Tensor):
    """(Λ [*H, NC, C], Γ [*H, NC], the masked decay matrix exp(Λ_i − Λ_j) [*H, NC, C, C], 0 where j > i)."""
    lam = torch.cumsum(ell, dim=-1)
    gamma = lam[..., -1]
    diff = lam[..., :, None] - lam[..., None, :]
    c = ell.shape[-1]
    causal = torch.ones(c, c, dtype=torch.bool, device=ell.device).tril()
    return lam, gamma, torch.exp(diff.masked_fill(~causal, float("-inf")))


def _scan(gamma: torch.Tensor, delta: torch.Tensor, s0: torch.Tensor, reverse: bool = False):
    """The carry across chunks: ``s = exp(gamma_c) s + delta_c`` over c (last first where `reverse`).
    Returns (the carry before each chunk [*H, NC, K, V], the carry after the last).

    As one matrix product per head: the carry before chunk c is ``Σ_{c'<c} exp(P_c − P_{c'+1}) delta_c'
    + exp(P_c) s0`` with P the exclusive prefix sums of gamma (taken in float64, so that the
    differences lose no digits); where there are too many chunks for an [NC, NC] matrix, a loop."""
    if reverse:
        before, last = _scan(gamma.flip(-1), delta.flip(-3), s0)
        return before.flip(-3), last
    nc = delta.shape[-3]
    if nc > SCAN_MATRIX_CHUNKS:
        return _scan_loop(gamma, delta, s0)
    prefix = torch.nn.functional.pad(torch.cumsum(gamma.double(), -1), (1, 0))          # P_0 .. P_NC
    exponent = prefix[..., :, None] - prefix[..., None, 1:]                              # [NC+1, NC]
    later = torch.ones(nc + 1, nc, dtype=torch.bool, device=gamma.device).tril(-1)       # c' < c
    weights = torch.exp(exponent.masked_fill(~later, float("-inf"))).to(s0.dtype)
    flat = delta.reshape(*delta.shape[:-2], -1)
    carried = torch.matmul(weights, flat) + torch.exp(prefix).to(s0.dtype)[..., None] * s0.reshape(
        *s0.shape[:-2], 1, -1)
    carried = carried.reshape(*carried.shape[:-1], *delta.shape[-2:])
    return carried[..., :nc, :, :], carried[..., nc, :, :]


def _scan_loop(gamma: torch.Tensor, delta: torch.Tensor, s0: torch.Tensor):
    """`_scan` forward, chunk by chunk."""
    shape = torch.broadcast_shapes(delta.shape, (*s0.shape[:-2], 1, *s0.shape[-2:]))
    before = torch.empty(shape, dtype=s0.dtype, device=s0.device)
    s = s0.expand(*shape[:-3], *shape[-2:])
    factor = torch.exp(gamma)[..., None, None]
    for c in range(delta.shape[-3]):
        before[..., c, :, :] = s
        s = factor[..., c, :, :] * s + delta[..., c, :, :]
    return before, s


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.matmul(a.to(dtype), b.to(dtype))


def forward(x: Chunks):
    """(O [*H, NC, C, V], the state entering each chunk [*H, NC, K, V], the final state [*H, K, V])."""
    if x.skip is not None:
        out, entering, final = forward(x.core())
        return out + x.skip[..., None] * x.v.to(out.dtype), entering, final
    x = x.folded()
    f32 = x.compute
    lam, gamma, decay = _decays(x.ell)
    scores = _mm(x.q, x.k.transpose(-1, -2), x.mm) * decay
    out = _mm(scores, x.v, x.mm).to(f32)
    into_end = torch.exp(gamma[..., None] - lam)[..., None]
    delta = _mm((x.k * into_end).transpose(-1, -2), x.v, x.mm).to(f32)
    entering, final = _scan(gamma, delta, x.s0)
    out = out + _mm(x.q * torch.exp(lam)[..., None], entering, x.mm).to(f32)
    return out, entering, final


def vjp(x: Chunks, entering: torch.Tensor, final: torch.Tensor, d_out: torch.Tensor, d_final: torch.Tensor):
    """Cotangents (dq, dk, dv, dell, ds0, dbeta, dskip) of `forward`'s inputs, in the shapes of the full
    heads (the caller sums them over the heads an operand lacks; dbeta, dskip None where there is no β,
    no skip), given its
    outputs' (d_out [*H, NC, C, V], d_final [*H, K, V]) and what its forward returned (`final` is not
    read: the log decays' cotangent takes the state at a chunk's end as `log_decay_grad` says). With β,
    the cotangent dṼ of β v gives ``dv = β dṼ`` and ``dβ_j = Σ_ν v_jν dṼ_jν``; with a skip, `skip_grad`
    adds its part."""
    if x.skip is not None:
        return skip_grad(x, vjp(x.core(), entering, final, d_out, d_final), d_out)
    if x.beta is not None:
        dq, dk, d_folded, d_ell, d_s0, _, _ = vjp(x.folded(), entering, final, d_out, d_final)
        return (dq, dk, d_folded * x.beta[..., None], d_ell, d_s0,
                (x.v.to(d_folded.dtype) * d_folded).sum(-1), None)
    f32 = x.compute
    lam, gamma, decay = _decays(x.ell)
    q, k, v, d_out = x.q.to(f32), x.k.to(f32), x.v.to(f32), d_out.to(f32)
    from_start = torch.exp(lam)[..., None]
    into_end = torch.exp(gamma[..., None] - lam)[..., None]
    # the cotangent of each chunk's end state, through the chunks last first
    into_state = _mm((q * from_start).transpose(-1, -2), d_out, f32)
    d_end, d_s0 = _scan(gamma, into_state, d_final, reverse=True)
    scores = _mm(x.q, x.k.transpose(-1, -2), x.mm).to(f32) * decay
    d_scores = _mm(d_out, v.transpose(-1, -2), f32) * decay
    dq = from_start * _mm(d_out, entering.transpose(-1, -2), f32) + _mm(d_scores, k, f32)
    dk_end = into_end * _mm(v, d_end.transpose(-1, -2), f32)   # k_j·dk_j's part through d_end
    dk = dk_end + _mm(d_scores.transpose(-1, -2), q, f32)
    dv = into_end * _mm(k, d_end, f32) + _mm(scores.transpose(-1, -2), d_out, f32)
    d_ell = log_decay_grad(q, k, dq, dk, (k * dk_end).sum((-1, -2)), gamma, d_end, entering)
    return dq, dk, dv, d_ell, d_s0, None, None


def skip_grad(x: Chunks, grads: tuple, d_out: torch.Tensor) -> tuple:
    """`grads` (dq, dk, dv, dell, ds0, dbeta, None) of the core without the skip, with the skip's part:
    dv plus ``skip ⊙ d_out``, and the skip's cotangent ``Σ_ν v d_out`` [*H, NC, C] last."""
    dq, dk, dv, d_ell, d_s0, d_beta, _ = grads
    d_out = d_out.to(dv.dtype)
    return (dq, dk, dv + x.skip[..., None].to(dv.dtype) * d_out, d_ell, d_s0, d_beta,
            (x.v.to(dv.dtype) * d_out).sum(-1))


def log_decay_grad(q: torch.Tensor, k: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, at_end: torch.Tensor,
                   gamma: torch.Tensor, d_end: torch.Tensor, entering: torch.Tensor) -> torch.Tensor:
    """The log decays' cotangent [*H, NC, C] from dq, dk [*H, NC, C, K] (`vjp`'s; the kernels take the
    same dots in chunk_dq, chunk_dk, chunk_dv and state_pass_reverse, mma.backward), the
    cotangent of each chunk's end state d_end and the state entering it [*H, NC, K, V], Γ [*H, NC] and
    ``at_end`` [*H, NC]: Σ_j k_j·dk_j's part through d_end, ``Σ_j exp(Γ − Λ_j) k_j d_end v_jᵀ``.

    `vjp`'s ``dΛ_i = q_i·dq_i − k_i·dk_i (+ ⟨d_end, S_e⟩ at the chunk's last step)``, then
    ``dℓ_t = Σ_{i≥t} dΛ_i``, with ``⟨d_end, S_e⟩ = exp(Γ) ⟨d_end, S_p⟩ + at_end``: S_e's part from the
    chunk's own steps cancels k·dk's part through d_end, and taking both from the same (16-bit
    rounded) d_end that dk's kernel multiplied leaves no difference of roundings for the reverse sum
    to spread over every step of the chunk (where S_e is the forward's state, it does: its own 16-bit
    rounding of k against dk's of d_end). The kernels keep to it: their row dots are of the fp32 dq, dk
    rows as stored with the 16-bit q, k they read, the end dots of the state term dk's kernel added."""
    d_lam = (q * dq).sum(-1) - (k * dk).sum(-1)   # 16-bit q, k promoted inside the product
    flat = d_end.reshape(*d_end.shape[:-2], 1, -1)
    entered = entering.reshape(*entering.shape[:-2], -1, 1)
    return reverse_chunk_sums(d_lam, at_end + torch.exp(gamma) * torch.matmul(flat, entered)[..., 0, 0])


def reverse_chunk_sums(d_lam: torch.Tensor, at_last: torch.Tensor) -> torch.Tensor:
    """``dℓ_t = Σ_{i≥t} dΛ_i`` over the steps of t's chunk, from dΛ [*H, NC, C] (written: at_last
    [*H, NC] is added to each chunk's last step, the end state's term of `log_decay_grad`)."""
    d_lam[..., -1] += at_last
    return torch.flip(torch.cumsum(torch.flip(d_lam, (-1,)), -1), (-1,))
