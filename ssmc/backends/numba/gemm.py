"""A matrix product in Numba, for the contractions `lowering/hoist.py` takes out of the time loop.

Why not NumPy's BLAS: its threads spin for a while after each call, and on a machine with few
cores they then fight the Numba threads of the next kernel (on two cores the LSTM's forward+backward
ran slower than the sum of its parts; see bench/results/2026-11-27-from-code-comments.md). This
product runs on Numba's own threads.

    C[m, n] = sum_k A[m, k] B[k, n]         A (M, K) any strides, B (K, N) and C C-contiguous, float32 or float64

As a loop (the register-tiled form of BLAS libraries): C is cut into tiles of MR = 6 rows by
NR = 2 SIMD vectors of columns (32 float32). A tile's 12 vectors stay in registers (`simd.py`)
while k runs; each step loads two vectors of B, broadcasts six elements of A and does 12 vector
FMAs. Jobs (parallel): 32 row tiles x 4 column panels. A job copies its panels of B for a block of
KC = 256 values of k into one contiguous buffer first, so the tiles stream B from L1 instead of
striding across B's rows; with several blocks of k, a tile adds to what the previous block stored.
Each element of C is a chain of fused multiply-adds in the order of k. Fastmath is off.

On two cores, fp32, for the LSTM's shapes (M, K, N) = (2880, 256, 1024), (2880, 1024, 256) and
transposed A (1024, 2880, 256), (256, 2880, 1024), this product outran NumPy's OpenBLAS at all four,
by most where A is not transposed, and replaced a row-streaming loop that was slower; see
bench/results/2026-11-27-from-code-comments.md.
"""

from __future__ import annotations

import numba
import numpy as np

from .simd import fma, load, splat, store, zeros
from .simd import lanes as simd_lanes

MR = 6  # rows of a tile: 12 accumulators + 2 vectors of B + 1 broadcast fit 16 vector registers
ROW_TILES = 32  # row tiles per job
PANELS = 4  # column panels per job
KC = 256  # values of k per packed block of B


@numba.njit(parallel=True, cache=True, fastmath=False, nogil=True)
def _gemm(A, B, C, NR):
    """C = A @ B with panels NR (= 2 vectors) wide; B and C C-contiguous. One function although long:
    a Numba kernel whose register tiles are locals of one loop nest (a call per tile would spill them)."""
    M, K = A.shape
    N = C.shape[1]
    L = NR // 2
    panels = (N + NR - 1) // NR
    tiles = (M + MR - 1) // MR
    b_flat = B.reshape(-1)
    c_flat = C.reshape(-1)
    # groups of equal size (prange hands each thread a contiguous range of jobs)
    row_groups = (tiles + ROW_TILES - 1) // ROW_TILES
    col_groups = (panels + PANELS - 1) // PANELS
    for job in numba.prange(row_groups * col_groups):
        packed = np.empty(PANELS * KC * NR, dtype=C.dtype)  # [panel, k, NR]
        edge = np.empty(MR * NR, dtype=C.dtype)  # a tile that overhangs C
        g, h = job // col_groups, job % col_groups
        t0, t1 = g * tiles // row_groups, (g + 1) * tiles // row_groups
        p0, p1 = h * panels // col_groups, (h + 1) * panels // col_groups
        for k0 in range(0, K, KC):
            k1 = min(K, k0 + KC)
            for k in range(k0, k1):
                for p in range(p0, p1):
                    n0 = p * NR
                    at = ((p - p0) * KC + k - k0) * NR
                    if n0 + NR <= N:
                        store(packed, at, load(b_flat, k * N + n0))
                        store(packed, at + L, load(b_flat, k * N + n0 + L))
                    else:  # the last panel, zero-padded
                        for j in range(NR):
                            packed[at + j] = b_flat[k * N + n0 + j] if n0 + j < N else 0
            for p in range(p0, p1):
                n0 = p * NR
                for t in range(t0, t1):
                    r0 = t * MR
                    inside = r0 + MR <= M and n0 + NR <= N
                    out, at, stride = (c_flat, r0 * N + n0, N) if inside else (edge, 0, NR)
                    if k0 == 0:
                        c00 = c01 = c10 = c11 = c20 = c21 = zeros(c_flat)
                        c30 = c31 = c40 = c41 = c50 = c51 = zeros(c_flat)
                    else:  # add to the previous blocks of k
                        if not inside:
                            edge[:] = 0
                            for i in range(min(MR, M - r0)):
                                for j in range(min(NR, N - n0)):
                                    edge[i * NR + j] = C[r0 + i, n0 + j]
                        c00, c01 = load(out, at), load(out, at + L)
                        c10, c11 = load(out, at + stride), load(out, at + stride + L)
                        c20, c21 = load(out, at + 2 * stride), load(out, at + 2 * stride + L)
                        c30, c31 = load(out, at + 3 * stride), load(out, at + 3 * stride + L)
                        c40, c41 = load(out, at + 4 * stride), load(out, at + 4 * stride + L)
                        c50, c51 = load(out, at + 5 * stride), load(out, at + 5 * stride + L)
                    # rows past M repeat the last row; their results are dropped
                    a0, a1, a2 = A[min(r0, M - 1)], A[min(r0 + 1, M - 1)], A[min(r0 + 2, M - 1)]
                    a3, a4, a5 = A[min(r0 + 3, M - 1)], A[min(r0 + 4, M - 1)], A[min(r0 + 5, M - 1)]
                    bi = (p - p0) * KC * NR
                    for k in range(k0, k1):
                        b0, b1 = load(packed, bi), load(packed, bi + L)
                        bi += NR
                        a = splat(a0[k])
                        c00, c01 = fma(a, b0, c00), fma(a, b1, c01)
                        a = splat(a1[k])
                        c10, c11 = fma(a, b0, c10), fma(a, b1, c11)
                        a = splat(a2[k])
                        c20, c21 = fma(a, b0, c20), fma(a, b1, c21)
                        a = splat(a3[k])
                        c30, c31 = fma(a, b0, c30), fma(a, b1, c31)
                        a = splat(a4[k])
                        c40, c41 = fma(a, b0, c40), fma(a, b1, c41)
                        a = splat(a5[k])
                        c50, c51 = fma(a, b0, c50), fma(a, b1, c51)
                    store(out, at, c00)
                    store(out, at + L, c01)
                    store(out, at + stride, c10)
                    store(out, at + stride + L, c11)
                    store(out, at + 2 * stride, c20)
                    store(out, at + 2 * stride + L, c21)
                    store(out, at + 3 * stride, c30)
                    store(out, at + 3 * stride + L, c31)
                    store(out, at + 4 * stride, c40)
                    store(out, at + 4 * stride + L, c41)
                    store(out, at + 5 * stride, c50)
                    store(out, at + 5 * stride + L, c51)
                    if not inside:
                        for i in range(min(MR, M - r0)):
                            for j in range(min(NR, N - n0)):
                                C[r0 + i, n0 + j] = edge[i * NR + j]


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` for 2-D arrays of one float dtype. `a` is read an element at a time and may have
    any strides (a transposed view: no copy); `b` is copied to C order if its rows are not."""
    if a.dtype != b.dtype:
        b = b.astype(a.dtype)
    if b.strides[1] != b.itemsize or b.strides[0] != b.shape[1] * b.itemsize:
        b = np.ascontiguousarray(b)
    c = np.empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    if a.shape[1] == 0:
        c[...] = 0
        return c
    if c.size:
        _gemm(a, b, c, 2 * simd_lanes(a.dtype))
    return c
