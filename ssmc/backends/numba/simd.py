"""SIMD vectors in Numba: a value type that LLVM keeps in one vector register, and the few
operations a register-tiled matrix product needs.

Why: a matrix product is fast when its accumulator tile stays in registers across the whole
summed axis. Numba has no vector type, and a tile held in a stack array stays in memory (measured
far slower; see bench/results/2026-11-27-from-code-comments.md). A `Vector` is an LLVM
`<lanes x float>` SSA value, so LLVM allocates it a register.

A vector is 64 bytes (16 float32 or 8 float64 lanes: one AVX-512 register; LLVM splits it in two
on an AVX2 machine). Loads and stores are unaligned and unchecked: the caller keeps
`i + lanes <= len(array)` on a C-contiguous 1-D array.

    v = load(a, i)          # v[j] = a[i + j]
    store(a, i, v)          # a[i + j] = v[j]
    v = splat(x)            # v[j] = x
    v = zeros(a)            # v[j] = 0, of the array a's dtype
    v = fma(a, b, c)        # v[j] = a[j] * b[j] + c[j], rounded once

Numba's on-disk cache of a function that uses these is keyed by that function's file alone: after
changing the code generation here, clear the cache (or touch `gemm.py`). Generated modules that use
them name this file's hash in their source, so they get a new cache entry by themselves.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

BYTES = 64


def lanes(dtype) -> int:
    """Lanes of a vector of `dtype` (a NumPy or Numba float dtype)."""
    return BYTES * 8 // dtype.bitwidth if hasattr(dtype, "bitwidth") else BYTES // dtype.itemsize


class Vector(types.Type):
    """`lanes` values of the float type `dtype`, held as one LLVM vector."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.lanes = lanes(dtype)
        super().__init__(name=f"Vector({dtype} x {self.lanes})")


@register_model(Vector)
class _VectorModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        element = dmm.lookup(fe_type.dtype).get_value_type()
        super().__init__(dmm, fe_type, ir.VectorType(element, fe_type.lanes))


def _check_float_array(a):
    if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" and isinstance(a.dtype, types.Float)):
        raise TypeError(f"simd: expected a contiguous 1-D float array, got {a}")


def _vector_pointer(context, builder, array_type, array, index):
    data = context.make_array(array_type)(context, builder, array).data
    element = builder.gep(data, [index])
    vector = context.get_value_type(Vector(array_type.dtype))
    return builder.bitcast(element, vector.as_pointer())


@intrinsic
def load(typingctx, a, i):
    _check_float_array(a)

    def codegen(context, builder, signature, args):
        pointer = _vector_pointer(context, builder, a, args[0], args[1])
        return builder.load(pointer, align=a.dtype.bitwidth // 8)
    return Vector(a.dtype)(a, i), codegen


@intrinsic
def store(typingctx, a, i, v):
    _check_float_array(a)
    if v != Vector(a.dtype):
        raise TypeError(f"simd.store: {v} into an array of {a.dtype}")

    def codegen(context, builder, signature, args):
        pointer = _vector_pointer(context, builder, a, args[0], args[1])
        builder.store(args[2], pointer, align=a.dtype.bitwidth // 8)
        return context.get_dummy_value()
    return types.none(a, i, v), codegen


@intrinsic
def splat(typingctx, x):
    if not isinstance(x, types.Float):
        raise TypeError(f"simd.splat: expected a float, got {x}")
    vector = Vector(x)

    def codegen(context, builder, signature, args):
        llvm_type = context.get_value_type(vector)
        one = builder.insert_element(ir.Constant(llvm_type, ir.Undefined), args[0],
                                     ir.Constant(ir.IntType(32), 0))
        zeros = ir.Constant(ir.VectorType(ir.IntType(32), vector.lanes), [0] * vector.lanes)
        return builder.shuffle_vector(one, ir.Constant(llvm_type, ir.Undefined), zeros)
    return vector(x), codegen


@intrinsic
def zeros(typingctx, a):
    _check_float_array(a)
    vector = Vector(a.dtype)

    def codegen(context, builder, signature, args):
        return ir.Constant(context.get_value_type(vector), [0.0] * vector.lanes)
    return vector(a), codegen


@intrinsic
def fma(typingctx, a, b, c):
    if not (isinstance(a, Vector) and a == b == c):
        raise TypeError(f"simd.fma: expected three equal vectors, got {a}, {b}, {c}")

    def codegen(context, builder, signature, args):
        llvm_fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(args[0].type, [args[0].type] * 3),
            f"llvm.fma.v{a.lanes}f{a.dtype.bitwidth}")
        return builder.call(llvm_fma, args)
    return a(a, b, c), codegen
