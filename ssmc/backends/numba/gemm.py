"""A matrix product in Numba, for the contractions `lowering/hoist.py` takes out of the time loop.

Why not NumPy's BLAS: its threads spin for a while after each call, and on a machine with few
cores they then fight the Numba threads of the next kernel (measured on 2 cores: forward+backward
of the LSTM 1.5-2x slower than the sum of its parts). This product runs on Numba's own threads.

    C[m, n] = sum_k A[m, k] B[k, n]         A (M, K), B (K, N), C-contiguous, float32 or float64

As a loop: parallel over blocks of 8 rows of C and tiles of 1024 columns; inside, k advances 8 at
a time and each C element takes the 8 terms as one pairwise sum (so C is loaded and stored once
per 8 terms; the innermost loop runs along n, contiguous in B and C). Fastmath is off.
"""

from __future__ import annotations

import numba
import numpy as np

ROWS = 8
COLS = 1024


@numba.njit(parallel=True, cache=True, fastmath=False, nogil=True)
def _gemm(A, B, C):
    M, K = A.shape
    N = B.shape[1]
    row_blocks = (M + ROWS - 1) // ROWS
    col_tiles = (N + COLS - 1) // COLS
    k8 = K // 8 * 8
    for job in numba.prange(row_blocks * col_tiles):
        r0 = (job // col_tiles) * ROWS
        r1 = min(M, r0 + ROWS)
        c0 = (job % col_tiles) * COLS
        c1 = min(N, c0 + COLS)
        w = c1 - c0
        for r in range(r0, r1):
            Cr = C[r, c0:c1]
            for n in range(w):
                Cr[n] = 0
        for k in range(0, k8, 8):  # rows of B as 1-D views: the n loop vectorises
            B0 = B[k, c0:c1]
            B1 = B[k + 1, c0:c1]
            B2 = B[k + 2, c0:c1]
            B3 = B[k + 3, c0:c1]
            B4 = B[k + 4, c0:c1]
            B5 = B[k + 5, c0:c1]
            B6 = B[k + 6, c0:c1]
            B7 = B[k + 7, c0:c1]
            for r in range(r0, r1):
                a0 = A[r, k]
                a1 = A[r, k + 1]
                a2 = A[r, k + 2]
                a3 = A[r, k + 3]
                a4 = A[r, k + 4]
                a5 = A[r, k + 5]
                a6 = A[r, k + 6]
                a7 = A[r, k + 7]
                Cr = C[r, c0:c1]
                for n in range(w):
                    Cr[n] += (((a0 * B0[n] + a1 * B1[n]) + (a2 * B2[n] + a3 * B3[n]))
                              + ((a4 * B4[n] + a5 * B5[n]) + (a6 * B6[n] + a7 * B7[n])))
        for k in range(k8, K):
            Bk = B[k, c0:c1]
            for r in range(r0, r1):
                a = A[r, k]
                Cr = C[r, c0:c1]
                for n in range(w):
                    Cr[n] += a * Bk[n]


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` for 2-D arrays of one float dtype (copied to C order if needed)."""
    a = np.ascontiguousarray(a)
    b = np.ascontiguousarray(b, dtype=a.dtype)
    c = np.empty((a.shape[0], b.shape[1]), dtype=a.dtype)
    if a.shape[1] == 0:
        c[...] = 0
        return c
    if c.size:
        _gemm(a, b, c)
    return c
