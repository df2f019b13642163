"""Every knob of the CUDA backend in one frozen dataclass, and the one place that reads them from the
environment.

    opts = options()                 # the current CudaOptions (the SSMC_CUDA_* variables)
    opts.strategy, opts.time_blocks  # None where unset: the backend decides

Every decision the backend caches per shape (a strategy, a launch plan, a prepared call) has the
options in its key (`CudaOptions.key`), so setting a variable between two calls takes effect (tests
and benchmarks force strategies that way). A small training step asks for them a few dozen times:
`options` compares the variables' raw values (the environment's own table, keys encoded once) with
the last call's and parses them only when they changed. A malformed value raises a `ValueError`
naming the variable before any kernel is built.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields, replace
from functools import cached_property

STRATEGIES = ("fused", "time blocks", "warp", "rows", "lanes")
FLASH_FORWARD = ("bm64", "bm128w8", "bm128w8n128", "bm128w4", "wg128", "wg128s")  # kernels/flash/forward.py's CONFIGS
# kernels/flash/backward.py's CONFIGS
FLASH_BACKWARD = ("bn64", "w4q64", "w8q64", "w8q32", "wg", "wgp", "wgws", "wgwsa", "wgwss", "wgwse")
CHUNK_OUTPUT = ("warps", "balanced", "staged", "wide")  # kernels/chunk/mma.py's forms of chunk_output
CHUNK_STATES = ("split", "fused")  # kernels/chunk/mma.py's ways to the entering states
CHUNK_DKV = ("split", "fused", "narrow")  # kernels/chunk/mma.py's backward: chunk_dk and chunk_dv, or chunk_dkv(_n)
SM_COUNT = 132  # SMs a grid's waves are counted on where no device says otherwise (sm_90 parts)


@dataclass(frozen=True)
class CudaOptions:
    """The CUDA backend's overrides; each field's variable is ``SSMC_CUDA_<FIELD>`` in upper case.

    strategy: the forward's strategy (one of `STRATEGIES`) instead of the selection's
    time_blocks: blocks of time a diagonal scan splits into (1: time-parallel scans off)
    steps_per_lane: the warp kernel's consecutive steps a lane
    row_groups: threads sharing a map kernel's long row (a power of two)
    row_recurrence: False turns the "rows" strategy off, True allows it wherever it can run
    recurrence_warps: warps of a block sharing one recurrence in the warp kernel
    fused_backward: False turns the fused backward off, True runs it wherever it can
    state_major_backward: False / True turns the fused backward's state-major rounds off / on
    backward_steps_per_lane: the fused backward's steps a lane
    lanes_backward: False turns the lanes backward off
    lanes_step: False keeps a call of one step on the chunked lanes kernel, and the lanes strategy to its rule for
        long calls (enough threads); unset: such a call runs the lanes kernel's step form (kernels/lanes/step.py),
        and the strategy takes it wherever it can run
    hoist: False keeps products hoisted out of time in the kernels (no GEMM before the scan)
    chunked: False runs matrix-linear recurrences as element-wise scans (not in chunks of matrix products)
    chunk: steps per chunk of the chunked matrix-linear path
    chunk_tune: True times each shape's chunk at its first use on a GPU and keeps the fastest (kernels/chunk/tune.py);
        unset: the kernels' chunk rule (kernels/chunk/mma.py `chunk_for`)
    chunk_kernels: False runs the chunked forward as torch matrix products (not the mma.sync kernels)
    chunk_backward: False runs the chunked backward as torch matrix products where the forward ran on the kernels
    chunk_per_key: False runs a per-key decay's chunked core (GLA) as torch matrix products (not its mma.sync kernels)
    chunk_output: the forward's chunk_output form (`CHUNK_OUTPUT`): "warps" (a warp per 16 query rows),
        "balanced" (half the warps, each two row stripes: the same causal work a warp), "staged" (balanced's
        sums from cp.async-staged tiles and ldmatrix fragments, 64 values a block) or "wide" (staged, all values
        a block where the tiles fit); unset: kernels/chunk/mma.py's `OUTPUT_FORMS` per chunk size
    chunk_states: the forward's entering states (`CHUNK_STATES`): "split" (chunk_states, then state_pass) or
        "fused" (chunk_states_pass: a block per state tile walks the chunks); unset: kernels/chunk/mma.py's
        `FUSED_STATES`
    chunk_dkv: the backward's dk and dv (`CHUNK_DKV`): "split" (chunk_dk, chunk_dv: a block per 64 output
        columns each), "fused" (chunk_dkv: a block per chunk makes both, where k has every head of the call; a
        warp all output columns, each score tile made once) or "narrow" (chunk_dkv_n: the same, a warp 64 output
        columns at a time, in half the registers); unset: kernels/chunk/mma.py's `DKV_FORM`
    step_loop: False runs recurrences with a recurrent product (LSTM, GRU) as kernels, not as a loop over steps
    step_graphs: False runs the step loop op by op every call (default: a CUDA graph from a signature's 2nd call)
    step_products: True runs a single step (`ssmc.step`) of a recurrence reading its states through a recurrent
        product (LSTM, GRU) as one kernel, a thread per (batch, hidden) index summing its own products over the
        input and the old state (cuda/step.py: one launch, nothing allocated in place, but each thread's sums
        are loops as long as the input and hidden axes, whose loads it waits for one by one); unset: ``x W``
        and ``h U`` as two cuBLAS products, then one kernel of the cell
    persistent: False runs the step loop's programs as the step loop, not as one persistent kernel a call;
        "streamed" (SSMC_CUDA_PERSISTENT=streamed) forces the persistent kernel's streamed form (U read from L2
        through shared memory each step, not resident), which is otherwise taken only where U does not fit on chip
    persistent_blocks: the persistent kernel's blocks at most (default: the SMs, fewer where the shape is small)
    persistent_mma: False keeps an fp32 call's persistent kernel on fp32 FMAs (not the tensor cores' 3xTF32 /
        TF32 form; 16-bit calls stay on the tensor cores)
    persistent_late_stores: True splits the persistent kernel's grid barrier after the operand's publish into an
        arrival and a wait, and writes the step's outputs between them (those that do not need the step's product
        from the publish's values, the others, and the recorded product, one step late from registers): off the
        path to the arrival, whose fence would wait for them (not the default: with the early loads a GPU test of
        the heads cell gave NaN gradients; docs/design/persistent-rnn.md §0.4)
    persistent_early_loads: True (with persistent_late_stores) has the persistent adjoint load the next step's
        sequences as soon as the step's product is done, where its cell then reads none of them (its publish
        needs them before its barrier)
    persistent_prefetch: True has the persistent kernel prefetch the next step's sequences into L2 while it runs
        a step (an adjoint's publish reads them before its barrier)
    persistent_reload_index: True has the persistent kernel's pairs recompute their indices and addresses in each
        phase of a step rather than keep them in registers across the product (fewer registers; implied by
        persistent_late_stores, whose adjoint would spill otherwise)
    persistent_forward_chunk: the tensor-core persistent forward's staging chunk (contracted indices: 16, 32, 64 or
        128) where it fits, its deepest ring unless persistent_forward_stages says (the adjoints keep theirs)
    persistent_forward_stages: the tensor-core persistent forward's ring of staged chunks (buffers, at least 2)
        where it fits, its largest chunk unless persistent_forward_chunk says
    persistent_adjoint_chunk, persistent_adjoint_stages: the same for the one-column tensor-core products (the
        adjoints; by default the ring of the most bytes in flight)
    persistent_phases: True has the persistent kernel's thread 0 of every block count its clocks by phase of the
        step (sequences and publish, the barrier, the product, the partial sums, the cell), kept in the
        barrier words after the counters (`PersistentLoop.phases`; a measurement, not for production)
    tf32: True multiplies fp32 recurrent products on the tensor cores in plain TF32 (one mma a tile, about 1e-3
        relative), False in 3xTF32 (three: about fp32's 1e-6); unset: TF32 where torch allows it for its own
        fp32 matrix products (`torch.backends.cuda.matmul.allow_tf32`, which the hoisted products follow too)
    emulate: run the kernels on the CPU (backends/cuda/emulator.py)
    flash: False keeps softmax attention's forward on the tiled torch path (no flash kernel)
    flash_backward: False keeps softmax attention's backward on the tiled torch path
    span_kernel: False builds the flash forward's span tables over per-position ids (document masks) from torch
        ops (mask_blocks.span_tables), not from the generated span kernel (kernels/flash/spans.py)
    flash_dq: how the flash backward sums dQ: "atomic" (fp32 atomics) or "kernel" (a second kernel, repeatable)
    flash_forward: the flash forward's config (kernels/flash/forward.py `CONFIGS`): "bm64" (64-row blocks of
        4 warps), "bm128w8" / "bm128w8n128" (128-row blocks of 8 warps, key tiles of 64 / 128) or "bm128w4"
        (128-row blocks of 4 warps of 32 rows)
    flash_backward_config: the flash backward's key-block kernel (kernels/flash/backward.py `CONFIGS`): "bn64"
        (4 warps, 64 keys, query tiles of 32 / 16 rows at d 64 / 128), "w4q64" (4 warps, 64 keys, query tiles
        of 64, two stages), "w8q64" (8 warps, 128 keys, query tiles of 64, two stages), "w8q32" (the same
        with query tiles of 32), "wg" (wgmma, sm_90 only), "wgp" ("wg" with a tile's steps overlapped),
        "wgws" / "wgwsa" / "wgwss" / "wgwse" ("wgp"'s loop with a producer warpgroup; dQ by bulk reductions /
        atomics / each warpgroup's own bulk reductions / "wgws" with the next tile's S^T issued early);
        unset: "w4q64" at head dim 64, "w8q32" at 128; on sm_90 parts "wgp" at 64, "wgws" at 128
    sm_count: SMs of the GPU the kernels are planned for
    """

    strategy: str | None = None
    time_blocks: int | None = None
    steps_per_lane: int | None = None
    row_groups: int | None = None
    row_recurrence: bool | None = None
    recurrence_warps: int | None = None
    fused_backward: bool | None = None
    state_major_backward: bool | None = None
    backward_steps_per_lane: int | None = None
    lanes_backward: bool | None = None
    lanes_step: bool | None = None
    hoist: bool = True
    chunked: bool | None = None
    chunk: int | None = None
    chunk_tune: bool | None = None
    chunk_kernels: bool | None = None
    chunk_backward: bool | None = None
    chunk_per_key: bool | None = None
    chunk_output: str | None = None
    chunk_states: str | None = None
    chunk_dkv: str | None = None
    step_loop: bool | None = None
    step_graphs: bool | None = None
    step_products: bool | None = None
    persistent: bool | str | None = None
    persistent_blocks: int | None = None
    persistent_mma: bool | None = None
    persistent_late_stores: bool | None = None
    persistent_early_loads: bool | None = None
    persistent_prefetch: bool | None = None
    persistent_reload_index: bool | None = None
    persistent_forward_chunk: int | None = None
    persistent_forward_stages: int | None = None
    persistent_adjoint_chunk: int | None = None
    persistent_adjoint_stages: int | None = None
    persistent_phases: bool | None = None
    tf32: bool | None = None
    emulate: bool = False
    flash: bool = True
    flash_backward: bool = True
    span_kernel: bool = True
    flash_dq: str | None = None
    flash_backward_config: str | None = None
    flash_forward: str | None = None
    sm_count: int = SM_COUNT

    @cached_property
    def key(self) -> tuple:
        """The options as a tuple, for the keys of cached decisions (worked out once per options)."""
        return tuple(getattr(self, f.name) for f in fields(self))

    @classmethod
    def parse(cls, env: dict[str, str | None]) -> CudaOptions:
        """The options of the variables in `env` (name -> value; unset or empty: the default)."""
        given = {}
        for f in fields(cls):
            name = variable(f.name)
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            given[f.name] = _parse(name, f.name, raw)
        return cls(**given)


def variable(field: str) -> str:
    """The environment variable of option `field`."""
    return "SSMC_CUDA_" + field.upper()


_BOOLS = {"0": False, "1": True}
# the options that take one of a list of names
_CHOICES = {"strategy": STRATEGIES, "flash_backward_config": FLASH_BACKWARD, "chunk_output": CHUNK_OUTPUT,
            "chunk_states": CHUNK_STATES, "chunk_dkv": CHUNK_DKV, "flash_forward": FLASH_FORWARD}


def _parse(name: str, field: str, raw: str):
    kind = {f.name: f.type for f in fields(CudaOptions)}[field]
    choices = _CHOICES.get(field)
    if choices is not None:
        if raw not in choices:
            raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
        return raw
    if field == "persistent" and raw == "streamed":
        return raw
    if field == "flash_dq":
        if raw not in ("atomic", "kernel"):
            raise ValueError(f"{name}={raw!r}: expected 'atomic' or 'kernel'")
        return raw
    if "bool" in str(kind):
        if raw not in _BOOLS:
            extra = " or streamed" if field == "persistent" else ""
            raise ValueError(f"{name}={raw!r}: expected 0 or 1{extra}")
        return _BOOLS[raw]
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a whole number") from None
    if field == "row_groups" and (value < 1 or value & (value - 1)):
        raise ValueError(f"{name}={raw!r}: expected a power of two")
    return value


NAMES = tuple(variable(f.name) for f in fields(CudaOptions) if f.name != "sm_count")

# os.environ keeps its values in a dict of encoded keys (`_data`; bytes on POSIX), which
# os.environ[...] = ... and del update; where that differs, the public reads
_TABLE = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_KEYS = tuple(map(_ENCODE, NAMES)) if _TABLE is not None and _ENCODE is not None else None
_LAST: list = [None, CudaOptions()]  # the raw values last parsed, and their options


def _raw() -> tuple:
    if _KEYS is not None:
        return tuple(map(_TABLE.get, _KEYS))
    return tuple(map(os.environ.get, NAMES))


_EMULATE = NAMES.index("SSMC_CUDA_EMULATE")


def emulating() -> bool:
    """`options().emulate`, asked several times a launch: where that one variable is as last parsed,
    the last options' answer (one lookup where `options` makes one per variable)."""
    if _KEYS is not None and _LAST[0] is not None and _TABLE.get(_KEYS[_EMULATE]) == _LAST[0][_EMULATE]:
        return _LAST[1].emulate
    return options().emulate


def options() -> CudaOptions:
    """The current options: the SSMC_CUDA_* variables, parsed again only when they changed."""
    raw = _raw()
    if raw != _LAST[0]:
        decode = os.environ.decodevalue if _KEYS is not None else (lambda v: v)
        env = {name: None if value is None else decode(value) for name, value in zip(NAMES, raw)}
        parsed = CudaOptions.parse(env)
        _LAST[:] = [raw, parsed if parsed.emulate else replace(parsed, sm_count=_device_sm_count())]
    return _LAST[1]


@functools.cache
def _device_sm_count() -> int:
    """The SMs of the current GPU (`SM_COUNT` where none is found: planning on the CPU, `ssmc inspect`)."""
    try:
        import cupy

        return int(cupy.cuda.Device().attributes["MultiProcessorCount"])
    except Exception:  # no CuPy, no driver or no device: plan for the default part
        return SM_COUNT


def environment_variable(name: str, default: str | None = None) -> str | None:
    """A variable of the CUDA toolchain's environment (CUDA_HOME, CXX, ...): the backend's one reader
    of `os.environ` besides `options`."""
    return os.environ.get(name, default)


def environment_default(name: str, value: str) -> None:
    """Set the toolchain's variable `name` to `value` unless it is set (CuPy's cache folder)."""
    os.environ.setdefault(name, value)
