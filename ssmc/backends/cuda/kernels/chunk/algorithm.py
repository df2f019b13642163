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

**A per-key decay** (GLA: ``S[κ, ν] = exp(ℓ_t[κ]) S[κ, ν] + k_t[κ] v_t[ν]``; ell [*H, NC, C, K],
`Chunks.per_key`): Λ_i is a vector over κ and

    O_i = (Q_i ⊙ exp(Λ_i)) S_p + Σ_{j≤i} Σ_κ Q_iκ K_jκ exp(Λ_iκ − Λ_jκ) V_j
    S_e = exp(Γ) ⊙ S_p (row κ by exp(Γ_κ)) + Σ_j (K_j ⊙ exp(Γ − Λ_j))ᵀ V_j

The intra-chunk scores are no product of one masked matrix with Q Kᵀ, and exp(Λ_i) exp(−Λ_j) would
overflow for strong decays (exp(−Λ_j) over a chunk: e^1280 at ℓ = −20), so they are taken by sub-blocks
of `SUB` steps (`_scores_per_key`): a query sub-block I starting at step n against the steps j < n
as one product of ``Q_I ⊙ exp(Λ_I − Λ_n)`` and ``K_j ⊙ exp(Λ_n − Λ_j)``, each exponent a sum of log
decays over steps in order (≤ 0 where ℓ ≤ 0, a decay ≤ 1: both factors ≤ 1; a decay above 1 is
right in exact arithmetic, but its factors grow as exp of the chunk's sum of ℓ), and the sub-block
against itself element-wise, ``Σ_κ Q_iκ K_jκ exp(Λ_iκ − Λ_jκ)`` over [SUB, SUB, K] in the compute
dtype, the exponents of j > i masked to −inf before `exp`. The carry across chunks is `_scan` per key
row. The VJP's intra-chunk dq, dk take the same sub-blocks (`_score_grads_per_key`), and
``dΛ_iκ = Q_iκ dQ_iκ − K_iκ dK_iκ (+ Σ_ν S_e dS_e at the chunk's last step)``, reverse-summed within
the chunk per key. Memory: the scores (and their cotangent) [*H, NC, C, C] as the scalar path's
decay matrix, the operands' [*H, NC, C, K]; no [.., C, C, K] array: the element-wise sub-blocks are
[*H, NC, SUB, SUB, K] one sub-block position at a time (L·K·SUB²/C values a head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HALF = (torch.bfloat16, torch.float16)
# chunks up to which the carry across chunks is one matrix product per head ([NC+1, NC] weights);
# beyond, a loop over the chunks
SCAN_MATRIX_CHUNKS = 512
# steps per sub-block of a per-key decay's intra-chunk terms (module docstring)
SUB = 16


class NonPositiveDecay(ValueError):
    """A decay given as is (not as exp of something) with a value <= 0: it has no log."""


def or_scan(core, attempt, seqs, params, initial, sizes, length, out_dtype):
    """(outputs, final states) of ``attempt()``, a core's forward without a tape ((outputs, final states, None)),
    or where it raises `NonPositiveDecay`, of `core.program` run as the element-wise scan (the runner of
    `core.compute`) on the same call, its outputs in `out_dtype` (`ChunkedCore.run`, `RankCore.run`)."""
    try:
        outs, finals, _ = attempt()
    except NonPositiveDecay:
        from ...runner import runner_for

        return runner_for(core.program, core.compute).run(seqs, params, initial, sizes, length, out_dtype)
    return outs, finals


@dataclass
class Chunks:
    """The inputs of one call, chunked: q, k [*H, NC, C, K]; v [*H, NC, C, V]; ell [*H, NC, C] (log
    decays, the compute dtype; zeros where there is no decay; [*H, NC, C, K] for a per-key decay), s0
    [*H, K, V] and beta [*H, NC, C] (the compute dtype; None: 1), the injection being β_t k_t ⊗ v_t; skip
    [*H, NC, C] (the compute dtype; None: 0), the output being ``o_t + skip_t v_t`` (SSD's D x, v the raw
    x)."""

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

    @property
    def per_key(self) -> bool:
        """Whether the decay varies along the key axis: ell [*H, NC, C, K] (module docstring)."""
        return self.ell.dim() == self.q.dim()

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


def _scan(gamma: torch.Tensor, delta: torch.Tensor, s0: torch.Tensor, reverse: bool = False,
          matrix_chunks: int | None = None):
    """The carry across chunks: ``s = exp(gamma_c) s + delta_c`` over c (last first where `reverse`),
    gamma [*H, NC] or, a per-key decay, [*H, NC, K] (row κ of s scaled by exp(gamma_c[κ])).
    Returns (the carry before each chunk [*H, NC, K, V], the carry after the last).

    As one matrix product per head: the carry before chunk c is ``Σ_{c'<c} exp(P_c − P_{c'+1}) delta_c'
    + exp(P_c) s0`` with P the exclusive prefix sums of gamma (taken in float64, so that the
    differences lose no digits); where there are more chunks than `matrix_chunks` (default
    `SCAN_MATRIX_CHUNKS`) for an [NC, NC] matrix, a loop. A per-key decay scans each key row as a head
    of its own ([1, V] states), as a matrix product only up to V chunks (its [NC+1, NC] weights per
    head and key then hold no more values than delta)."""
    if gamma.dim() == delta.dim() - 1:  # per key: the key axis as a head, each row [1, V] a state
        limit = min(SCAN_MATRIX_CHUNKS, delta.shape[-1]) if matrix_chunks is None else matrix_chunks
        before, last = _scan(gamma.movedim(-1, -2), delta.movedim(-2, -3)[..., None, :], s0[..., None, :],
                             reverse, limit)
        return before[..., 0, :].movedim(-3, -2), last[..., 0, :]
    if reverse:
        before, last = _scan(gamma.flip(-1), delta.flip(-3), s0, matrix_chunks=matrix_chunks)
        return before.flip(-3), last
    nc = delta.shape[-3]
    if nc > (SCAN_MATRIX_CHUNKS if matrix_chunks is None else matrix_chunks):
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
    if x.per_key:
        return _forward_per_key(x)
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
    heads (dell [*H, NC, C], [*H, NC, C, K] for a per-key decay; the caller sums them over the heads an
    operand lacks; dbeta, dskip None where there is no β, no skip), given its outputs' (d_out [*H, NC, C,
    V], d_final [*H, K, V]) and what its forward returned (`final` is not read: the log decays' cotangent
    takes the state at a chunk's end as `log_decay_grad` says). With β, the cotangent dṼ of β v gives
    ``dv = β dṼ`` and ``dβ_j = Σ_ν v_jν dṼ_jν``; with a skip, `skip_grad` adds its part."""
    if x.skip is not None:
        return skip_grad(x, vjp(x.core(), entering, final, d_out, d_final), d_out)
    if x.beta is not None:
        dq, dk, d_folded, d_ell, d_s0, _, _ = vjp(x.folded(), entering, final, d_out, d_final)
        return (dq, dk, d_folded * x.beta[..., None], d_ell, d_s0,
                (x.v.to(d_folded.dtype) * d_folded).sum(-1), None)
    if x.per_key:
        return _vjp_per_key(x, entering, d_out, d_final)
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


def _sub_blocks(c: int):
    """The sub-blocks of a chunk of `c` steps: (first step n, the steps [n, n + SUB) as a slice)."""
    return [(n, slice(n, min(n + SUB, c))) for n in range(0, c, SUB)]


def _within(lam: torch.Tensor) -> torch.Tensor:
    """exp(Λ_iκ − Λ_jκ) [*H, NC, b, b, K] of one sub-block's Λ [*H, NC, b, K], 0 where j > i (masked
    before `exp`: no overflow)."""
    b = lam.shape[-2]
    diff = lam[..., :, None, :] - lam[..., None, :, :]
    later = torch.ones(b, b, dtype=torch.bool, device=lam.device).triu(1)[..., None]
    return torch.exp(diff.masked_fill(later, float("-inf")))


def _scores_per_key(q: torch.Tensor, k: torch.Tensor, lam: torch.Tensor, mm: torch.dtype) -> torch.Tensor:
    """A_ij = Σ_κ Q_iκ K_jκ exp(Λ_iκ − Λ_jκ) for j ≤ i, else 0: [*H, NC, C, C] in Λ's dtype, from q, k
    [*H, NC, C, K] and Λ [*H, NC, C, K] (module docstring: sub-blocks, the products before the diagonal
    in `mm`)."""
    f32, c = lam.dtype, lam.shape[-2]
    heads = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], lam.shape[:-2])
    scores = torch.zeros((*heads, c, c), dtype=f32, device=lam.device)
    for n, rows in _sub_blocks(c):
        qb, lb = q[..., rows, :].to(f32), lam[..., rows, :]
        scores[..., rows, rows] = (qb[..., :, None, :] * k[..., rows, :].to(f32)[..., None, :, :]
                                   * _within(lb)).sum(-1)
        if n:
            anchor = lam[..., n:n + 1, :]   # Λ_n: exp(Λ_i − Λ_n) exp(Λ_n − Λ_j), each ≤ 1 for ℓ ≤ 0
            scores[..., rows, :n] = _mm(qb * torch.exp(lb - anchor),
                                        (k[..., :n, :] * torch.exp(anchor - lam[..., :n, :])).transpose(-1, -2), mm)
    return scores


def _score_grads_per_key(q: torch.Tensor, k: torch.Tensor, lam: torch.Tensor, d_scores: torch.Tensor):
    """(dq, dk) [*H, NC, C, K] of `_scores_per_key`'s A given dA [*H, NC, C, C] (its entries j > i not
    read): ``dQ_iκ = Σ_{j≤i} dA_ij K_jκ exp(Λ_iκ − Λ_jκ)``, ``dK_jκ = Σ_{i≥j} dA_ij Q_iκ exp(Λ_iκ − Λ_jκ)``,
    by the same sub-blocks, in Λ's dtype (q, k too)."""
    c = lam.shape[-2]
    heads = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], lam.shape[:-2], d_scores.shape[:-2])
    dq = torch.zeros((*heads, c, q.shape[-1]), dtype=lam.dtype, device=lam.device)
    dk = torch.zeros_like(dq)
    for n, rows in _sub_blocks(c):
        qb, kb, lb = q[..., rows, :], k[..., rows, :], lam[..., rows, :]
        weighted = d_scores[..., rows, rows, None] * _within(lb)           # dA_ij exp(Λ_i − Λ_j) [.., b, b, K]
        dq[..., rows, :] += (weighted * kb[..., None, :, :]).sum(-2)
        dk[..., rows, :] += (weighted * qb[..., :, None, :]).sum(-3)
        if n:
            anchor = lam[..., n:n + 1, :]
            to_anchor, from_anchor = torch.exp(lb - anchor), torch.exp(anchor - lam[..., :n, :])
            before = d_scores[..., rows, :n]                                  # dA of the rows I, the steps j < n
            dq[..., rows, :] += to_anchor * torch.matmul(before, k[..., :n, :] * from_anchor)
            dk[..., :n, :] += from_anchor * torch.matmul(before.transpose(-1, -2), qb * to_anchor)
    return dq, dk


def _forward_per_key(x: Chunks):
    """`forward` of a per-key decay (module docstring), β folded, no skip."""
    f32 = x.compute
    lam = torch.cumsum(x.ell, dim=-2)                  # Λ [*H, NC, C, K]
    gamma = lam[..., -1, :]                            # Γ [*H, NC, K]
    out = _mm(_scores_per_key(x.q, x.k, lam, x.mm), x.v, x.mm).to(f32)
    into_end = torch.exp(gamma[..., None, :] - lam)
    delta = _mm((x.k * into_end).transpose(-1, -2), x.v, x.mm).to(f32)
    entering, final = _scan(gamma, delta, x.s0)
    out = out + _mm(x.q * torch.exp(lam), entering, x.mm).to(f32)
    return out, entering, final


def _vjp_per_key(x: Chunks, entering: torch.Tensor, d_out: torch.Tensor, d_final: torch.Tensor):
    """`vjp` of a per-key decay, β folded, no skip: the scalar decay's formulas with exp(Λ_i) ⊙ Q_i per key,
    the intra-chunk dq, dk by `_score_grads_per_key`, dell [*H, NC, C, K] (`log_decay_grad`, per key)."""
    f32 = x.compute
    lam = torch.cumsum(x.ell, dim=-2)
    gamma = lam[..., -1, :]
    q, k, v, d_out = x.q.to(f32), x.k.to(f32), x.v.to(f32), d_out.to(f32)
    from_start = torch.exp(lam)
    into_end = torch.exp(gamma[..., None, :] - lam)
    into_state = _mm((q * from_start).transpose(-1, -2), d_out, f32)
    d_end, d_s0 = _scan(gamma, into_state, d_final, reverse=True)
    scores = _scores_per_key(x.q, x.k, lam, x.mm)
    d_scores = _mm(d_out, v.transpose(-1, -2), f32)    # dA (above the diagonal: not read)
    dq_in, dk_in = _score_grads_per_key(q, k, lam, d_scores)
    dq = from_start * _mm(d_out, entering.transpose(-1, -2), f32) + dq_in
    dk_end = into_end * _mm(v, d_end.transpose(-1, -2), f32)
    dk = dk_end + dk_in
    dv = _mm(k * into_end, d_end, f32) + _mm(scores.transpose(-1, -2), d_out, f32)
    d_ell = log_decay_grad(q, k, dq, dk, (k * dk_end).sum(-2), gamma, d_end, entering, per_key=True)
    return dq, dk, dv, d_ell, d_s0, None, None


def skip_grad(x: Chunks, grads: tuple, d_out: torch.Tensor) -> tuple:
    """`grads` (dq, dk, dv, dell, ds0, dbeta, None) of the core without the skip, with the skip's part:
    dv plus ``skip ⊙ d_out``, and the skip's cotangent ``Σ_ν v d_out`` [*H, NC, C] last."""
    dq, dk, dv, d_ell, d_s0, d_beta, _ = grads
    d_out = d_out.to(dv.dtype)
    return (dq, dk, dv + x.skip[..., None].to(dv.dtype) * d_out, d_ell, d_s0, d_beta,
            (x.v.to(dv.dtype) * d_out).sum(-1))


def log_decay_grad(q: torch.Tensor, k: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, at_end: torch.Tensor,
                   gamma: torch.Tensor, d_end: torch.Tensor, entering: torch.Tensor,
                   per_key: bool = False) -> torch.Tensor:
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
    rows as stored with the 16-bit q, k they read, the end dots of the state term dk's kernel added.

    `per_key`: the same per key κ, nothing summed over κ: dℓ [*H, NC, C, K] from at_end and Γ [*H, NC, K],
    ``⟨d_end, S_e⟩`` then row κ's ``Σ_ν d_end[κ, ν] S_e[κ, ν]``."""
    if per_key:
        d_lam = q * dq - k * dk
        return reverse_chunk_sums(d_lam, at_end + torch.exp(gamma) * (d_end * entering).sum(-1), per_key=True)
    d_lam = (q * dq).sum(-1) - (k * dk).sum(-1)   # 16-bit q, k promoted inside the product
    flat = d_end.reshape(*d_end.shape[:-2], 1, -1)
    entered = entering.reshape(*entering.shape[:-2], -1, 1)
    return reverse_chunk_sums(d_lam, at_end + torch.exp(gamma) * torch.matmul(flat, entered)[..., 0, 0])


def reverse_chunk_sums(d_lam: torch.Tensor, at_last: torch.Tensor, per_key: bool = False) -> torch.Tensor:
    """``dℓ_t = Σ_{i≥t} dΛ_i`` over the steps of t's chunk, from dΛ [*H, NC, C] (written: at_last
    [*H, NC] is added to each chunk's last step, the end state's term of `log_decay_grad`). `per_key`:
    dΛ [*H, NC, C, K], at_last [*H, NC, K], the sums per key."""
    step = -2 if per_key else -1
    d_lam.select(step, -1).add_(at_last)
    return torch.flip(torch.cumsum(torch.flip(d_lam, (step,)), step), (step,))
