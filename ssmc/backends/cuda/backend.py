"""The CUDA backend as `base.Backend` answers for it: kernels through `runner.CudaRunner`, arrays as
torch tensors on the GPU (`DeviceArrays`), prepared calls and the fused backward. Its heavier modules
are imported inside the methods, so that the other backends run where CuPy or torch are missing."""

from __future__ import annotations

import math
from functools import lru_cache, partial

import numpy as np

from ...passes.autodiff import DEFAULT_CHUNK
from ..base import Backend, Runner


class DeviceArrays:
    """`ArrayOps` on torch CUDA tensors (the cuda backend)."""

    @staticmethod
    def convert(x, name):
        from .arrays import to_device

        return to_device(x, name)

    @staticmethod
    def zeros(shape, dtype):
        import torch

        from .devices import device_name

        return torch.zeros(tuple(shape), device=device_name(),
                           dtype=torch.float64 if dtype == np.float64 else torch.float32)

    @staticmethod
    def cast(x, dtype):
        import torch

        return x.to(torch.float64 if dtype == np.float64 else torch.float32)

    @staticmethod
    def cat(parts):
        import torch

        return torch.cat(parts, dim=0)

    @staticmethod
    def permute(x, perm):
        return x.permute(*perm)

    @staticmethod
    def contiguous(x):
        return x.contiguous()


class CudaBackend(Backend):
    """Generated CUDA kernels on torch CUDA tensors (or, ``SSMC_CUDA_EMULATE=1``, emulated on the CPU)."""

    on_device = True
    # one chunk, no outputs wanted (`ssmc.grad`'s call): no forward runs, the backward's recompute of
    # the carries is the one pass over them (where outputs are wanted, the recording forward's
    # writing them costs less than that pass)
    records_without_outputs = False
    arrays = DeviceArrays()

    def stages(self, program):
        return cuda_stages(program)

    def compiled(self, program, dtype: np.dtype, products: dict | None = None) -> Runner:
        from .hoisted import hoisted_runner
        from .kernels.chunk import chunked_core
        from .kernels.step_loop import step_loop
        from .runner import runner_for

        core = chunked_core(program, dtype.name)
        if core is not None:  # a matrix-linear core: chunks of matrix products (kernels/chunk/)
            return core.run
        hoisted = hoisted_runner(program, dtype.name)
        if hoisted is not None:  # contractions out of the time loop, as matrix products (cuda/hoisted.py)
            return hoisted.run if products is None else partial(hoisted.run, products=products)
        loop = step_loop(program, dtype.name)
        if loop is not None:  # a recurrent product: a loop over steps of matrix products (kernels/step_loop.py)
            return loop.run
        return runner_for(program, dtype.name).run

    def takes_products(self, program, dtype: np.dtype) -> bool:
        """Only the hoisted runner of a program run whole takes them (`compiled`)."""
        from .hoisted import hoisted_runner
        from .kernels.chunk import chunked_core

        return (not self.stages(program).staged and chunked_core(program, dtype.name) is None
                and hoisted_runner(program, dtype.name) is not None)

    def step_runner(self, program, layout, dtype=None):
        """A step as one kernel launch where the program lowers to one (cuda/step.py)."""
        from .step import CudaStep

        return CudaStep(self, program, layout, dtype)

    def layer_runner(self, fused, dtype: np.dtype, staged: Runner) -> Runner:
        """Where one block of threads owns each row, the layer in one kernel; else `staged`."""
        from .runner import layer_runner

        return layer_runner(fused, dtype.name, staged)

    def stage_dtypes(self, fused, dtype: np.dtype):
        """Around a chunked core (`cuda_stages` of a matrix-linear program): the stages whose every output is
        a result of the call write it in the call's dtype (no cast after), and a stage writes the core's
        operands q, k, v in the 16 bits the core's kernels round them to (`ChunkedCore.operand_dtypes`: no
        fp32 copy written, read and cast); intermediates read otherwise (the log decays, the contraction a
        post stage reads) stay in the compute dtype. Other staged programs: None."""
        from .kernels.chunk import chunked_core

        cores = [(i, chunked_core(st.program, dtype.name)) for i, st in enumerate(fused.stages)]
        cores = [(i, core) for i, core in cores if core is not None]
        if not cores:
            return None

        def dtypes(index, seqs, sizes, out_dtype):
            stage = fused.stages[index]
            if not stage.writes:
                return out_dtype
            half = {}
            for i, core in cores:
                if i > index:
                    half.update(core.operand_dtypes(seqs, sizes))
            wanted = tuple((n, half[n]) for n in stage.writes if n in half)
            return wanted or None
        return dtypes

    def preparer(self, program, dtype: np.dtype):
        """`CudaRunner.prepare` of a program run as one kernel (not in stages, no matrix products
        around its kernels), as stages around a chunked core (`staged.StagedPreparer`) or as a chunked core
        alone (`ChunkedCore.prepare_run`); else None."""
        from .kernels.chunk import chunked_core
        from .kernels.step_loop import step_loop

        if self.stages(program).staged:  # stages around a chunked core: their runs kept per call (staged.py)
            from .staged import staged_preparer

            return staged_preparer(self, program, dtype)
        core = chunked_core(program, dtype.name)
        if core is not None:  # a chunked core alone (RetNet, linear attention)
            return core.prepare_run
        if step_loop(program, dtype.name) is not None:
            return None
        from .hoisted import hoisted_runner
        from .runner import runner_for

        if hoisted_runner(program, dtype.name) is not None:  # matrix products around the kernels
            return None
        return runner_for(program, dtype.name).prepare

    def call_key(self, args: tuple, kwargs: dict):
        from .arrays import call_key

        return call_key(args, kwargs)

    def on_current_device(self, tensor) -> bool:
        from .devices import current_device, on_backend_device

        return on_backend_device(tensor) and tensor.get_device() == current_device()

    def array_support(self, read_only_zeros: bool = False):
        """Torch CUDA tensors (a ValueError where this machine cannot run cuda); zero initial states
        shared between calls where only read (`shared_device_zeros`)."""
        from .arrays import device_zeros, require_gpu, shared_device_zeros, to_device

        require_gpu()
        return to_device, shared_device_zeros if read_only_zeros else device_zeros

    def check_arrays(self, arrays: dict) -> None:
        from .devices import check_one_device

        check_one_device(arrays)

    def run_inputs(self, program, bound, dtype: np.dtype) -> tuple[dict, dict, dict, dict]:
        """The arrays as given (kernels read any float dtype and strides in place); the outputs come
        in the first argument's dtype."""
        first = next(iter(bound.arrays.values()), None)
        seqs = {d.name: bound.arrays[d.name] for d in program.seqs}
        params = {d.name: bound.arrays[d.name] for d in program.params}
        return seqs, params, bound.initial, {"out_dtype": first.dtype if first is not None else None}

    def from_host(self, values: dict, dtype: str) -> dict:
        import torch

        from .devices import device_name

        torch_dtype = torch.float64 if dtype == "float64" else torch.float32
        return {k: torch.as_tensor(v, dtype=torch_dtype, device=device_name()) for k, v in values.items()}

    def synchronize(self) -> None:
        from .devices import emulating

        if not emulating():  # an emulated launch runs to completion
            import torch

            torch.cuda.synchronize()

    def device_description(self) -> str:
        """The GPU's name (or that its kernels are emulated on the CPU); a ValueError where there is none."""
        from .arrays import require_gpu

        require_gpu()  # a ValueError (one line) where there is none
        import torch

        from .devices import emulating

        if emulating():
            return f"{super().device_description()}, CUDA kernels emulated (SSMC_CUDA_EMULATE=1)"
        return torch.cuda.get_device_name()

    def default_chunk(self, length: int, program, sizes: dict[str, int], itemsize: int = 4) -> int:
        """Every chunk costs a few kernel launches, so the chunk is as long as keeps the recomputed
        carries no bigger than the sequences given: one chunk for a scan whose state is as big as
        its input, about L / 5 steps for Mamba-1 (state N = 16 per channel); at least `DEFAULT_CHUNK`.

        A recurrence that reads its states through a recurrent product (`sequential_recompute`: an
        LSTM, a GRU) is the exception: recomputing its carries is a second sequential pass as long as
        the forward (the persistent kernel, or the step loop), where keeping them costs memory only.
        Its chunk is the whole sequence as long as every carry fits `DEVICE_CARRIES_BUDGET`: the
        training step is then one recording forward and one adjoint, nothing recomputed."""
        per_step_state = sum(math.prod(sizes[a] for a in s.axes) for s in program.states)
        if sequential_recompute(program):
            return max(DEFAULT_CHUNK, min(length, DEVICE_CARRIES_BUDGET // max(per_step_state * itemsize, 1)))
        per_step_seqs = sum(math.prod(sizes[a] for a in d.axes) for d in program.seqs)
        return max(DEFAULT_CHUNK, min(length, length * per_step_seqs // max(per_step_state, 1)))

    def fused_backward(self, backward, dtype: str):
        from .fused_backward import fused_backward_runner
        from .kernels.chunk import chunked_core

        core = chunked_core(backward.forward, dtype)
        if core is not None:  # a matrix-linear core: its chunked VJP (kernels/chunk/)
            return core

        return fused_backward_runner(backward, dtype)


# bytes of carries a gradient of a sequential recurrence keeps on the device rather than recompute
# (`CudaBackend.default_chunk`): LSTM B64 L180 H512 fp32 keeps 47 MiB, B256 L1024 H1024 2 GiB
DEVICE_CARRIES_BUDGET = 4 << 30


@lru_cache(maxsize=256)
def sequential_recompute(program) -> bool:
    """Whether recomputing `program`'s carries is a sequential pass over steps as costly as its forward:
    after the hoisting of its state-free products, it reads its states through a recurrent product
    (`kernels.step_loop.applies`: nonlinear or general linear, no scan takes it). Decided from the
    IR alone, whatever runs it (the persistent kernel, the step loop, the thread kernels)."""
    from ...lowering.hoist import hoist
    from .kernels.step_loop import applies

    return applies(hoist(program, transpose=False).program) is not None


def cuda_stages(program):
    """The programs the CUDA backend runs `program` as: its fusion stages, or where it is matrix linear,
    a chunked core between state-free stages (passes/matrix_linear.py; SSMC_CUDA_CHUNKED=0: not), or
    where an output reads the states through a matrix-product-like contraction, the recurrence then
    that readout for all steps (lowering/readout.py)."""
    from ...lowering.readout import readout_stages
    from ...lowering.stages import fuse
    from ...passes.matrix_linear import chunk_stages
    from .options import options

    chunked = None if options().chunked is False else chunk_stages(program)
    return chunked or readout_stages(program) or fuse(program)
