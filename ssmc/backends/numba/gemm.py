"""A matrix product in Numba, for the contractions `lowering/hoist.py` takes out of the time loop.

Why not NumPy's BLAS: its threads spin for a while after each call, and on a machine with few
cores they then fight the Numba threads of the next kernel (measured on 2 cores: forward+backward
of the LSTM 1.5-2x slower than the sum of its parts). This product runs on Numba's own threads.

    C[m, n] = sum_k A[m, k] B[k, n]         A (M, K) any strides, B (K, N) and C C-contiguous, float32 or float64

As a loop: parallel over blocks of 8 rows of C and tiles of 1024 columns; inside, k advances 4 at
a time, two rows of C at once, and each C element takes the 4 terms by fused multiply-adds in
order (C is loaded and stored once per 4 terms, each B element loaded once per 2 rows; the
innermost loop runs along n, contiguous in B and C). Fastmath is off; the FMAs are explicit.
Measured on the bench machine's 2 cores, fp32, (M, K, N) = (2880, 256, 1024), (2880, 1024, 256)
and a transposed A (1024, 2880, 256): 195, 163, 151 GF/s (a pairwise sum of products instead:
156, 147, 145; 4 rows per pass: slower; NumPy's OpenBLAS: 216-222, with the thread fight above).
"""

from __future__ import annotations

import numba
import numba.extending
import numpy as np

ROWS = 8
COLS = 1024


@numba.extending.intrinsic
def fma(typingctx, a, b, c):
    """a * b + c rounded once (LLVM's fma; a vector FMA in the vectorised loops)."""
    def codegen(context, builder, signature, args):
        return builder.fma(*args)
    return a(a, b, c), codegen


@numba.njit(parallel=True, cache=True, fastmath=False, nogil=True)
def _gemm(A, B, C):
    M, K = A.shape
    N = B.shape[1]
    row_blocks = (M + ROWS - 1) // ROWS
    col_tiles = (N + COLS - 1) // COLS
    k4 = K // 4 * 4
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
        for k in range(0, k4, 4):  # rows of B as 1-D views: the n loops vectorise
            B0 = B[k, c0:c1]
            B1 = B[k + 1, c0:c1]
            B2 = B[k + 2, c0:c1]
            B3 = B[k + 3, c0:c1]
            r = r0
            while r + 1 < r1:  # two rows of C per pass share the loads of B
                a0, a1, a2, a3 = A[r, k], A[r, k + 1], A[r, k + 2], A[r, k + 3]
                e0, e1, e2, e3 = A[r + 1, k], A[r + 1, k + 1], A[r + 1, k + 2], A[r + 1, k + 3]
                Cr = C[r, c0:c1]
                Cs = C[r + 1, c0:c1]
                for n in range(w):
                    b0, b1, b2, b3 = B0[n], B1[n], B2[n], B3[n]
                    Cr[n] = fma(a3, b3, fma(a2, b2, fma(a1, b1, fma(a0, b0, Cr[n]))))
                    Cs[n] = fma(e3, b3, fma(e2, b2, fma(e1, b1, fma(e0, b0, Cs[n]))))
                r += 2
            if r < r1:
                a0, a1, a2, a3 = A[r, k], A[r, k + 1], A[r, k + 2], A[r, k + 3]
                Cr = C[r, c0:c1]
                for n in range(w):
                    Cr[n] = fma(a3, B3[n], fma(a2, B2[n], fma(a1, B1[n], fma(a0, B0[n], Cr[n]))))
        for k in range(k4, K):
            Bk = B[k, c0:c1]
            for r in range(r0, r1):
                a = A[r, k]
                Cr = C[r, c0:c1]
                for n in range(w):
                    Cr[n] = fma(a, Bk[n], Cr[n])


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
        _gemm(a, b, c)
    return c
