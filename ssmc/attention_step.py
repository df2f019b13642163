"""`ssmc.step` of an attention spec: decoding one token at a time against a KV cache.

    s = ssmc.step(spec, layout="b h t ...")                     # spec = ssmc.attention(..., batch="b h", head_dim="d")
    cache = s.cache({"b": 2, "h": 16, "d": 128}, max_len=4096, dtype=torch.bfloat16, device="cuda")
    for t in range(L):
        out_t = s(q[:, :, t], k[:, :, t], v[:, :, t], cache, slope)   # q_t, k_t, v_t: [b h d]; out_t: [b h d]

Each call, with pos = cache.length (one length for the whole batch: every sequence holds as many tokens,
as in a decoder fed equal-length or left-padded prompts), as a plain loop over the batch indices:

    cache.k[..., pos, :] = k_t;  cache.v[..., pos, :] = v_t;  cache.length = pos + 1
    s[j] = score_mod(scale * sum_d q_t[d] cache.k[j, d], pos, j, params)    for j in 0..pos
    s[j] = -inf where not mask_mod(pos, j, params)
    out_t = softmax(s) @ cache.v[0..pos]                 (0 where every key is masked)

so stepping L times gives the full-sequence call's outputs (its row i is step i's query at q_idx = i).
Grouped-query specs (``kv_heads``) take k_t and v_t with their own fewer heads; the cache holds q's
heads (each KV head repeated as the query heads that read it).

Where it runs: the "interpreter" backend in float64 NumPy (the cache's arrays NumPy); the others through
torch, on the cache's device (plain tensor ops, `AttentionStep._torch_step`), and on CUDA tensors of bf16 /
fp16 at head dim 64 or 128 with printable modifiers one generated kernel a step
(backends/cuda/kernels/flash/decode.py: it writes k_t and v_t into the cache and attends; the emulator
runs it for CPU tensors under ``SSMC_CUDA_EMULATE=1``; ``SSMC_CUDA_FLASH=0`` keeps the torch ops). The
kernel's scratch (splits' partials, a counter a batch index, the params' table) lives in the cache,
made at its first step; with ``out=`` given nothing is allocated a step.
"""

from __future__ import annotations

import math

import numpy as np

from .backends import interpreter
from .backends.registry import get_backend
from .ir.axes import TIME
from .ir.program import Attention
from .runtime.binding import layout_of
from .runtime.prologue import attention_params, repeat_heads


class AttentionCache:
    """The keys and values of the tokens so far: k [*batch, max_len, d], v [*batch, max_len, e] (the spec's
    batch axes in its order, then time, then the head / value dim), NumPy arrays or torch tensors of one
    dtype and device, and `length`, the tokens held (rows 0..length-1; one count for the batch).

    Own one by giving the arrays (``AttentionCache(k, v)``), or let `AttentionStep.cache` allocate it;
    `reset()` empties it for a new batch of sequences. A prompt's keys and values go in directly:
    ``cache.k[..., :n, :] = k_prompt; cache.v[..., :n, :] = v_prompt; cache.length = n`` (canonical order),
    its outputs from the full-sequence call; the steps then continue at position n."""

    def __init__(self, k, v, length: int = 0):
        if k.ndim < 2 or v.ndim != k.ndim or k.shape[:-1] != v.shape[:-1]:
            raise ValueError(f"AttentionCache: k {tuple(k.shape)} and v {tuple(v.shape)} must be [*batch, max_len, d] "
                             "and [*batch, max_len, e] with the same batch sizes and max_len")
        if k.dtype != v.dtype:
            raise ValueError(f"AttentionCache: k is {k.dtype} but v is {v.dtype}")
        if not 0 <= length <= k.shape[-2]:
            raise ValueError(f"AttentionCache: length {length} outside 0..{k.shape[-2]}")
        self.k, self.v = k, v
        self.length = int(length)
        self.numpy = isinstance(k, np.ndarray)
        self._work = None     # the kernel's splits' partials [BH * splits, d + 2] fp32
        self._meta = None     # the kernel's int32 [max_len, a counter per batch index]
        self.table = None     # the params' table [BH, NP] fp32 the kernel reads (AttentionStep._param_table)
        self.table_key = None  # the params it holds (tensors and their versions)

    @property
    def max_len(self) -> int:
        return self.k.shape[-2]

    def reset(self) -> None:
        """Hold no token (the arrays are kept; rows are overwritten as tokens come)."""
        self.length = 0

    def __repr__(self) -> str:
        return (f"<ssmc.AttentionCache {self.length}/{self.max_len} tokens, k {tuple(self.k.shape)}, "
                f"{self.k.dtype}>")

    def workspace(self, splits: int):
        """(work, meta) for the decode kernel with room for `splits` splits a batch index: made once (the
        kernel asks for the most splits the cache's length can take), grown only where more are asked."""
        import torch

        bh = math.prod(self.k.shape[:-2])
        rows = bh * splits
        if self._work is None or self._work.shape[0] < rows:
            self._work = torch.empty((rows, self.k.shape[-1] + 2), dtype=torch.float32, device=self.k.device)
        if self._meta is None:
            self._meta = torch.zeros(1 + bh, dtype=torch.int32, device=self.k.device)
            self._meta[0] = self.max_len
        return self._work, self._meta


class AttentionStep:
    """The single-step form of an attention spec (module docstring): ``s(q_t, k_t, v_t, cache, *params,
    out=None, **params)`` returns the new token's output in the layout's order without time. `splits`:
    the kernel's key splits a batch index (None: chosen a step from the batch, the length and the device)."""

    def __init__(self, program: Attention, backend: str, layout):
        if program.seqs:
            raise ValueError(f"{program.name}: a decode step takes no sequence inputs "
                             f"({', '.join(d.name for d in program.seqs)}): the cache keeps no per-position ids")
        self.program = program
        self.backend = backend
        self.layout = layout
        self.torch = get_backend(backend).attention(program) is not None  # else NumPy on the interpreter
        self.splits: int | None = None
        self.kernel_reason: str | None = None  # why the last step did not run the decode kernel (None: it did)
        self._decode = None
        self._unprintable: str | None = None  # why the modifiers do not print as CUDA C ("" where they do)
        p = program
        self._orders = {}
        for name, axes in (("q", p.q_axes), ("k", p.q_axes), ("v", p.v_axes), ("out", p.v_axes)):
            order = tuple(a for a in layout_of(layout, name, axes) if a != TIME)
            to_canonical = [order.index(a) for a in axes]
            # None where the layout's order is already canonical: no permute a step (host time)
            ident = to_canonical == sorted(to_canonical)
            self._orders[name] = (order, None if ident else to_canonical,
                                  None if ident else [axes.index(a) for a in order])

    def __repr__(self) -> str:
        return f"<ssmc.AttentionStep {self.program.name} backend={self.backend}>"

    # -- the cache ---------------------------------------------------------------------------------

    def cache(self, sizes: dict[str, int], max_len: int, dtype=None, device=None) -> AttentionCache:
        """An empty cache for `max_len` tokens at `sizes` (every batch axis and the head dim; the value dim
        where it differs): torch tensors of `dtype` (default float32) on `device` (default CPU), or
        float64 NumPy arrays on the interpreter backend."""
        p = self.program
        need = [*p.batch_axes, p.head_dim]
        missing = [a for a in need if a not in sizes]
        if missing:
            raise ValueError(f"cache: sizes must name the axes {need}; missing {missing}")
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"cache: max_len must be a positive int, got {max_len!r}")
        batch = [int(sizes[a]) for a in p.batch_axes]
        d = int(sizes[p.head_dim])
        e = int(sizes.get(p.value_dim, d))
        if not self.torch:
            if dtype is not None and np.dtype(dtype) != np.float64:
                raise ValueError(f"cache: the interpreter computes in float64; dtype {dtype} asked")
            return AttentionCache(np.zeros((*batch, max_len, d)), np.zeros((*batch, max_len, e)))
        import torch

        dtype = dtype or torch.float32
        k = torch.zeros((*batch, max_len, d), dtype=dtype, device=device)
        v = torch.zeros((*batch, max_len, e), dtype=dtype, device=device)
        return AttentionCache(k, v)

    # -- a step ------------------------------------------------------------------------------------

    def __call__(self, q, k, v, cache: AttentionCache, *args, out=None, **params):
        p = self.program
        if not isinstance(cache, AttentionCache):
            raise ValueError(f"{p.name} step: the fourth argument must be an AttentionCache, "
                             f"got {type(cache).__name__}")
        if cache.length >= cache.max_len:
            raise ValueError(f"{p.name} step: the cache is full ({cache.length} of {cache.max_len} tokens)")
        params = attention_params(p, args, params)
        sizes = self._sizes(cache)
        qc, kc, vc = (self._canonical(x, name, sizes, cache) for name, x in (("q", q), ("k", k), ("v", v)))
        prm = self._params(params, sizes, cache)
        if out is not None:
            out = self._out_view(out, sizes, cache)
        if cache.numpy:
            y = self._numpy_step(qc, kc, vc, cache, prm, sizes)
            if out is not None:
                self._canonical_out(out)[...] = y
        else:
            y = self._torch_or_kernel_step(qc, kc, vc, cache, prm, sizes, out)
        cache.length += 1
        if out is not None:
            return out
        back = self._orders["out"][2]
        if back is None:
            return y
        return y.transpose(back) if cache.numpy else y.permute(*back)

    def _sizes(self, cache: AttentionCache) -> dict[str, int]:
        p = self.program
        n = len(p.batch_axes)
        if cache.k.ndim != n + 2:
            raise ValueError(f"{p.name} step: the cache's k has {cache.k.ndim} dims; the spec's batch axes "
                             f"{p.batch_axes} need {n + 2} ([*batch, max_len, d])")
        sizes = dict(zip(p.batch_axes, cache.k.shape[:n]))
        sizes[p.head_dim] = cache.k.shape[-1]
        sizes[p.value_dim] = cache.v.shape[-1]
        for a, size in p.static_sizes.items():
            if a in sizes and sizes[a] != size:
                raise ValueError(f"{p.name} step: axis {a!r} is {size} in the spec but {sizes[a]} in the cache")
        return sizes

    def _canonical(self, x, name: str, sizes: dict[str, int], cache: AttentionCache):
        """`x` (one token, the layout's order without time) as [*batch, d]: checked against the cache's
        sizes, dtype and device; a ValueError naming it otherwise."""
        p = self.program
        order, to_canonical, _ = self._orders[name]
        want = tuple(sizes[a] for a in order)
        if cache.numpy:
            from .runtime.binding import numeric_array

            x = numeric_array(x.detach().cpu().numpy() if hasattr(x, "detach") else x, name)
            if x.dtype.kind not in "fiu":
                raise ValueError(f"{p.name} step: argument {name!r} has dtype {x.dtype}; attention takes real numbers")
            x = x.astype(np.float64)
        else:
            import torch

            if type(x) is not torch.Tensor and not isinstance(x, torch.Tensor):
                from .backends.tiled_attention import to_tensor

                x = to_tensor(x, name)
            if x.dtype != cache.k.dtype:
                raise ValueError(f"{p.name} step: argument {name!r} is {x.dtype} but the cache holds {cache.k.dtype}")
            if x.device != cache.k.device:
                raise ValueError(f"{p.name} step: argument {name!r} is on {x.device} but the cache on {cache.k.device}")
        if name in ("k", "v") and p.kv_heads is not None and x.shape != want:
            x = self._kv_heads_repeated(x, order, want)
        if x.shape != want:
            raise ValueError(f"{p.name} step: argument {name!r} has shape {tuple(x.shape)}, expected {want} for "
                             f"axes {' '.join(order)} (one token: no time axis)")
        if to_canonical is None:
            return x
        return x.transpose(to_canonical) if cache.numpy else x.permute(*to_canonical)

    def _kv_heads_repeated(self, x, order, want):
        """GQA: a token's k or v with fewer heads along `kv_heads` than the cache (which holds q's heads,
        each KV head repeated) as the cache's; `x` as it is where it does not fit that way."""
        i = order.index(self.program.kv_heads)
        fits = (x.ndim == len(want) and x.shape[i] > 0 and want[i] % x.shape[i] == 0
                and all(x.shape[j] == want[j] for j in range(len(want)) if j != i))
        return repeat_heads(x, want[i] // x.shape[i], i) if fits else x

    def _params(self, params: dict, sizes: dict[str, int], cache: AttentionCache) -> dict:
        p = self.program
        names = [d.name for d in p.params]
        unknown = sorted(set(params) - set(names))
        if unknown:
            raise ValueError(f"{p.name} step: unknown arguments {unknown}; the params are {names}")
        missing = [n for n in names if n not in params]
        if missing:
            raise ValueError(f"{p.name} step: missing the params {missing}")
        out = {}
        static = p.static_sizes
        for d in p.params:
            x = params[d.name]
            if cache.numpy:
                x = np.asarray(x.detach().cpu() if hasattr(x, "detach") else x, dtype=np.float64)
            else:
                import torch

                if not isinstance(x, torch.Tensor):
                    from .backends.tiled_attention import to_tensor

                    x = to_tensor(x, d.name)
            # an indexed table's own axis (not the cache's): its declared size, else the array's
            for i, a in enumerate(d.axes):
                if a not in sizes and (a in static or i < x.ndim):
                    sizes[a] = static.get(a, x.shape[i] if i < x.ndim else 0)
            want = tuple(sizes[a] for a in d.axes)
            if tuple(x.shape) != want:
                raise ValueError(f"{p.name} step: param {d.name!r} has shape {tuple(x.shape)}, expected {want} "
                                 f"for axes {' '.join(d.axes)}")
            out[d.name] = x
        return out

    def _out_view(self, out, sizes, cache: AttentionCache):
        p = self.program
        order = self._orders["out"][0]
        want = tuple(sizes[a] for a in order)
        if cache.numpy:
            ok = isinstance(out, np.ndarray) and out.dtype == np.float64
        else:
            import torch

            ok = isinstance(out, torch.Tensor) and out.device == cache.k.device and out.dtype == cache.k.dtype
        if not ok or tuple(out.shape) != want:
            raise ValueError(f"{p.name} step: out must be an array of shape {want} (axes {' '.join(order)}), the "
                             f"cache's dtype and device; got {type(out).__name__} {tuple(getattr(out, 'shape', ()))}")
        return out

    # -- the interpreter ---------------------------------------------------------------------------

    def _numpy_step(self, q, k, v, cache: AttentionCache, params: dict, sizes: dict[str, int]):
        pos = cache.length
        cache.k[..., pos, :] = k
        cache.v[..., pos, :] = v
        keys = np.moveaxis(cache.k[..., :pos + 1, :], -2, 0)
        values = np.moveaxis(cache.v[..., :pos + 1, :], -2, 0)
        y, _ = interpreter.run_attention(self.program, q[None], keys, values, params, sizes, q_offset=pos)
        return y[0]

    # -- torch -------------------------------------------------------------------------------------

    def kernel(self, q, cache: AttentionCache):
        """The decode kernel where it runs this step, else None (`kernel_reason` says why): CUDA tensors
        (CPU ones under ``SSMC_CUDA_EMULATE=1``), bf16 / fp16, head and value dims equal and 64 or 128,
        a contiguous cache, printable modifiers, CuPy importable, ``SSMC_CUDA_FLASH`` not 0."""
        import torch

        from .backends.cuda.options import emulating, options

        reason = None
        if not (q.is_cuda or emulating()):
            reason = "CPU tensors"
        elif not options().flash:
            reason = "SSMC_CUDA_FLASH=0"
        elif q.dtype not in (torch.bfloat16, torch.float16):
            reason = f"dtype {q.dtype} (the kernel takes bf16 or fp16)"
        elif cache.k.shape[-1] not in (64, 128, 256) or cache.v.shape[-1] != cache.k.shape[-1]:
            reason = (f"head dim {cache.k.shape[-1]}, value dim {cache.v.shape[-1]} (the kernel takes equal dims "
                      "64, 128 or 256)")
        elif (not (cache.k.is_contiguous() and cache.v.is_contiguous())
              or (cache.k.data_ptr() | cache.v.data_ptr()) % 16):
            reason = "a cache of non-contiguous tensors, or not 16-byte aligned"
        else:
            from .backends.cuda.kernels.flash import forward

            if self._unprintable is None:  # printing the modifiers walks the IR: once a step object
                self._unprintable = forward.unsupported(self.program) or (
                    "an indexed table (the decode kernel reads params from registers)"
                    if forward.gather_sources(self.program) else "")
            reason = self._unprintable or (forward.cupy_missing() if q.is_cuda else None)
        self.kernel_reason = reason
        if reason is not None:
            return None
        if self._decode is None:
            from .backends.cuda.kernels.flash import decode

            self._decode_module = decode
            self._decode = decode.FlashDecode(self.program)
        return self._decode

    def _param_table(self, cache: AttentionCache, params: dict, sizes: dict[str, int]):
        """The [BH, NP] fp32 table of the params' values per flattened batch index, kept in the cache and
        refilled only where a param is another tensor or was modified in place since (its version)."""
        import torch

        p = self.program
        key = tuple((params[d.name], params[d.name]._version) for d in p.params)
        held = cache.table_key
        if (cache.table is not None and held is not None and len(held) == len(key)
                and all(a is b and va == vb for (a, va), (b, vb) in zip(held, key))):
            return cache.table
        batch = [sizes[a] for a in p.batch_axes]
        if cache.table is None:
            cache.table = torch.zeros((math.prod(batch), max(1, len(p.params))), dtype=torch.float32,
                                      device=cache.k.device)
        view = cache.table.view(*batch, cache.table.shape[1])
        for i, d in enumerate(p.params):
            t = params[d.name]
            order = [a for a in p.batch_axes if a in d.axes]
            t = t.permute([d.axes.index(a) for a in order])  # a list: a scalar param has no dims
            view[..., i].copy_(t.reshape([sizes[a] if a in d.axes else 1 for a in p.batch_axes]))
        cache.table_key = key
        return cache.table

    def _torch_or_kernel_step(self, q, k, v, cache: AttentionCache, params: dict, sizes: dict[str, int], out):
        import torch

        kernel = self.kernel(q, cache)
        if kernel is None:
            y = self._torch_step(q, k, v, cache, params, sizes)
            if out is not None:
                self._canonical_out(out).copy_(y)
            return y
        d = q.shape[-1]
        bh = q.numel() // d
        q2, k2, v2 = (t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.contiguous().clone()
                      for t in (q, k, v))  # the kernel reads 16 bytes at a time
        y2 = None
        if out is not None:
            view = self._canonical_out(out)
            if view.is_contiguous():
                y2 = view
        target = y2 if y2 is not None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
        table = self._param_table(cache, params, sizes)
        decode = self._decode_module
        if self.splits is None:
            splits = decode.choose_splits(bh, cache.length + 1, d, decode.multiprocessors(q.device))
        else:
            splits = decode.fitted_splits(cache.length + 1, d, self.splits)
        kernel(q2, k2, v2, cache, table, target, splits, self.splits or 1)
        if out is not None and y2 is None:
            self._canonical_out(out).copy_(target)
        return target

    def _canonical_out(self, out):
        to_canonical = self._orders["out"][1]
        if to_canonical is None:
            return out
        return out.transpose(to_canonical) if isinstance(out, np.ndarray) else out.permute(*to_canonical)

    def _torch_step(self, q, k, v, cache: AttentionCache, params: dict, sizes: dict[str, int]):
        """The step in torch ops on the cache's device: scores and softmax in fp32 (fp64 for fp64)."""
        import torch

        from .backends.tiled_attention import _mm
        from .backends.torch_eval import TorchEvaluator, align

        p = self.program
        pos = cache.length
        cache.k[..., pos, :] = k
        cache.v[..., pos, :] = v
        n = pos + 1
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        dev = q.device
        scale = p.scale if p.scale is not None else 1.0 / math.sqrt(sizes[p.head_dim])
        keys, values = cache.k[..., :n, :], cache.v[..., :n, :]
        raw = _mm(q.unsqueeze(-2), keys.transpose(-1, -2), acc) * scale        # [*batch, 1, n]
        target = (*p.batch_axes, "~q", "~k")
        ev = TorchEvaluator(sizes, acc, dev)
        env = {d.name: (params[d.name].to(device=dev, dtype=acc), d.axes) for d in p.params}
        env.update({"score": (raw, target),
                    "q_idx": (torch.full((1,), float(pos), dtype=acc, device=dev), ("~q",)),
                    "kv_idx": (torch.arange(n, dtype=acc, device=dev), ("~k",))})
        s = raw
        if p.score is not None:
            (value,) = ev.run([p.score], env)
            s = align(value, target).expand_as(raw)
        if p.mask is not None:
            (visible,) = ev.run([p.mask], env)
            s = s.masked_fill(~align(visible, target), -math.inf)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, 0.0)
        e = torch.exp(s - m)
        total = e.sum(-1, keepdim=True)
        o = _mm(e, values, acc) * torch.where(total > 0, 1.0 / total, 0.0)
        return o.squeeze(-2).to(q.dtype)
