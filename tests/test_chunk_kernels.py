"""The chunked matrix-linear forward and backward on tensor cores (backends/cuda/kernels/chunk/mma.py,
chunk.cu.j2).

- emulated on the CPU (SSMC_CUDA_EMULATE=1: the kernels' fragments, shuffles and barriers run as C++):
  the kernels' (output, entering states, final state) against algorithm.py's torch forward in float64
  on the same rounded inputs, at every chunk size they take (64, 128, 256) and lengths that leave the
  last chunk partial, heads broadcast as SSD's B and C are, operands in the time-first layout (strided
  steps);
- the backward's five kernels (emulated) against algorithm.vjp in float64 on the same rounded values,
  every cotangent (q, k, v, the log decays, the initial state), K and V apart, unaligned operands;
  ChunkedCore's backward on them against its torch backward; dk and dv from one kernel (chunk_dkv, chunk_dkv_n:
  SSMC_CUDA_CHUNK_DKV) bit for bit the split kernels' (chunk_dk, chunk_dv);
- NVRTC builds every size and chunk the kernels take for sm_80 and sm_90 with no spills, their dynamic
  shared memory within what an sm_80 block may have;
- which calls take the kernels (16-bit, sizes, the switch), and ChunkedCore choosing them;
- on a GPU: whole compiled specs (Mamba-2, RetNet) in bf16 against the torch path and the interpreter,
  forward and every gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
from profiles import in_ci, nightly_case

import ssmc
from ssmc.backends.cuda import emulator, nvrtc
from ssmc.backends.cuda.kernels.chunk import algorithm, mma

torch = pytest.importorskip("torch")

needs_emulator = pytest.mark.skipif(not emulator.available(), reason="no C++ compiler for the CUDA emulator")
C = mma.CHUNK
SM80_SHARED = 163 * 1024  # the most shared memory an sm_80 block may opt into


def _rel(x, ref) -> float:
    """Relative RMS error ‖x − ref‖ / ‖ref‖."""
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def _time_first(rng, length: int, heads: tuple[int, ...], dim: int | None, dtype, scale=1.0, chunk: int = C):
    """A random operand as the program holds it ([L, *heads(, dim)], time first) and chunked as
    `ChunkedCore._arrange` gives it: [*heads, NC, C(, dim)], a strided view where the chunks are whole,
    else a copy zero past `length`."""
    shape = (length, *heads, *([dim] if dim else []))
    x = torch.from_numpy(rng.standard_normal(shape) * scale).to(dtype)
    nh = len(heads)
    y = x.permute(*range(1, nh + 1), 0, *([nh + 1] if dim else []))
    padded = -(-length // chunk) * chunk
    inner = [dim] if dim else []
    if padded == length:
        return y.reshape(*heads, padded // chunk, chunk, *inner)
    out = torch.zeros((*heads, padded, *inner), dtype=dtype)
    out.narrow(nh, 0, length).copy_(y)
    return out.reshape(*heads, padded // chunk, chunk, *inner)


def _chunks(length: int, key: int = 64, value: int = 64, dtype=torch.bfloat16, seed: int = 0,
            q_heads=(1, 1), k_heads=(1, 1), v_heads=(1, 2), ell_heads=(1, 2), s0_heads=(1, 2), chunk: int = C,
            decay: float = 0.3, beta_heads=None, skip_heads=None):
    """Chunks with SSD's broadcast (q, k without the head axis r, here heads (b=1, r=2)); log decays
    uniform in [-decay, 0]; where `beta_heads`, a β over them (SSD's softplus(dt): in (0.1, 2), one step
    in 8 negative, which no softplus gives but the kernels take), zero past `length` as `_arrange` pads it;
    where `skip_heads`, a skip over them (SSD's D, repeated over the steps, as `_arrange` gives a param)."""
    rng = np.random.default_rng(seed)
    q = _time_first(rng, length, q_heads, key, dtype, key ** -0.5, chunk)
    k = _time_first(rng, length, k_heads, key, dtype, 1.0, chunk)
    v = _time_first(rng, length, v_heads, value, dtype, 1.0, chunk)
    ell = -torch.from_numpy(rng.uniform(0.0, decay, (length, *ell_heads))).float()
    nh = len(ell_heads)
    ell = ell.permute(*range(1, nh + 1), 0)
    padded = -(-length // chunk) * chunk
    full = torch.zeros((*ell_heads, padded))
    full[..., :length] = ell
    s0 = torch.from_numpy(rng.standard_normal((*s0_heads, key, value)) * 0.1).float()
    beta = None
    if beta_heads is not None:
        b = rng.uniform(0.1, 2.0, (*beta_heads, padded)) * np.where(rng.uniform(size=padded) < 0.125, -1.0, 1.0)
        b[..., length:] = 0.0
        beta = torch.from_numpy(b).float().reshape(*beta_heads, -1, chunk)
    skip = None
    if skip_heads is not None:
        d = np.repeat(rng.standard_normal((*skip_heads, 1)), padded, -1)
        d[..., length:] = 0.0
        skip = torch.from_numpy(d).float().reshape(*skip_heads, -1, chunk)
    return algorithm.Chunks(q, k, v, full.reshape(*ell_heads, -1, chunk), s0, beta, skip)


def _wide(x: algorithm.Chunks) -> algorithm.Chunks:
    """`x` in float64 (the same rounded values)."""
    d = torch.float64
    return algorithm.Chunks(x.q.to(d), x.k.to(d), x.v.to(d), x.ell.to(d), x.s0.to(d),
                            *(None if b is None else b.to(d) for b in (x.beta, x.skip)))


def _reference(x: algorithm.Chunks):
    """algorithm.forward in float64 on the same (rounded) values."""
    return algorithm.forward(_wide(x))


@pytest.fixture
def emulate(monkeypatch):
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    monkeypatch.delenv("SSMC_CUDA_CHUNK_KERNELS", raising=False)


@needs_emulator
@pytest.mark.parametrize("chunk, length", [
    (64, 1), (64, 130), (128, 7),
    nightly_case(128, 130, reason="several chunks through state_pass: chunk 64's and 256's cases take them"),
    (256, 300)])
def test_emulated_kernels_agree_with_the_torch_forward(emulate, chunk, length):
    """Every chunk size, the last chunk partial (or the only one), several chunks through state_pass;
    decays slow enough (at most 0.02 a step) that the state entering a chunk of 256 still counts. At
    chunk 256 one head (16 warps a block: the emulator's slowest case)."""
    heads = {} if chunk < 256 else {"v_heads": (1, 1), "ell_heads": (1, 1), "s0_heads": (1, 1)}
    x = _chunks(length, seed=length, chunk=chunk, decay=0.3 if chunk == 64 else 0.02, **heads)
    assert mma.kernels_apply(x)
    out, entering, final = mma.forward(x)
    ref_out, ref_entering, ref_final = _reference(x)
    assert out.shape == ref_out.shape and entering.shape == ref_entering.shape and final.shape == ref_final.shape
    assert _rel(out, ref_out) < 1e-2
    assert _rel(final, ref_final) < 1e-2
    assert _rel(entering, ref_entering) < 1e-2
    # the first chunk enters with s0 exactly (the pass copies it)
    torch.testing.assert_close(entering[..., 0, :, :], x.s0.expand_as(entering[..., 0, :, :]))


@needs_emulator
def test_emulated_16_bit_states_and_output_are_the_fp32_ones_rounded(emulate):
    """An inference call's forward (`half_states`: state_pass_half, chunk_output_hs; `out_dtype` 16-bit:
    chunk_output_ho / _hs_ho): the entering states are the fp32 pass's rounded to q's 16 bits, the
    output bit for bit the fp32 kernels' output (chunk_output rounds the states so either way) or it
    rounded, the final state the same; a head per operand broadcast as SSD's."""
    x = _chunks(70, seed=7, chunk=64)  # two chunks, the last partial
    out, entering, final = mma.forward(x)
    for half_out in (False, True):
        dtype = x.q.dtype if half_out else torch.float32
        got, half, got_final = mma.forward(x, half_states=True, out_dtype=dtype)
        assert half.dtype == x.q.dtype and got.dtype == dtype
        assert torch.equal(half, entering.to(x.q.dtype))
        assert torch.equal(got, out.to(dtype))
        assert torch.equal(got_final, final)
    got, _, _ = mma.forward(x, out_dtype=x.q.dtype)  # fp32 states, 16-bit output
    assert torch.equal(got, out.to(x.q.dtype))


ALL_FORMS = (("balanced", "split"), ("staged", "fused"), ("wide", "split"), ("wide", "fused"))


@needs_emulator
@pytest.mark.parametrize("chunk, length, key, value, ssd, half, forms", [
    (64, 130, 64, 64, True, False, (("balanced", "split"), ("staged", "fused"))),
    (64, 7, 64, 128, False, True, (("wide", "fused"),)),
    nightly_case(128, 7, 128, 128, False, True, ALL_FORMS,
                 reason="chunk 128 (8 warps, 4 balanced): the chunks of 64 take the forms"),
    nightly_case(64, 1, 64, 64, False, False, ALL_FORMS,
                 reason="one step: the chunks of 7 and 130 take the partial chunk"),
    nightly_case(256, 300, 64, 64, True, True, ALL_FORMS,
                 reason="chunk 256: the emulator's slowest; 64 and 128 take the forms")])
def test_emulated_output_forms_and_fused_states_are_the_plain_ones(emulate, monkeypatch, chunk, length, key, value,
                                                                   ssd, half, forms):
    """SSMC_CUDA_CHUNK_OUTPUT balanced (chunk_output*_b: half the warps, two row stripes each), staged and wide
    (chunk_output*_s: the balanced sums from cp.async-staged tiles and ldmatrix fragments, 64 or all values a
    block): every output row is the same sums in the same order, so the output is the plain kernel's bit for
    bit; SSMC_CUDA_CHUNK_STATES=fused (chunk_states_pass*: chunk_states' and state_pass's sums in one walk) the
    same entering and final states bit for bit; and near the float64 forward. SSD's broadcast heads, β and
    skip, or RetNet's one head with 16-bit states and output (chunk_output_hs_ho*, chunk_states_pass_half).
    Unset, the forms are `mma.OUTPUT_FORMS`' and `mma.FUSED_STATES`'."""
    heads = ({"beta_heads": (1, 2), "skip_heads": (1, 2)} if ssd else
             {"v_heads": (1, 1), "ell_heads": (1, 1), "s0_heads": (1, 1)})
    x = _chunks(length, key=key, value=value, seed=length + chunk, chunk=chunk, decay=0.02, **heads)
    names = []
    monkeypatch.setattr(mma, "_launch", lambda *a, _f=mma._launch: names.append(a[1]) or _f(*a))
    kw = {"half_states": True, "out_dtype": x.q.dtype} if half else {}

    def run(output, states):
        for name, value in (("SSMC_CUDA_CHUNK_OUTPUT", output), ("SSMC_CUDA_CHUNK_STATES", states)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        names.clear()
        return mma.forward(x, **kw), list(names)

    plain, launched = run("warps", "split")
    output = "chunk_output" + ("_hs_ho" if half else "")
    assert launched == ["chunk_states", "state_pass" + ("_half" if half else ""), output]
    default_form = mma.OUTPUT_FORMS[chunk]
    suffix = {"warps": "", "balanced": "_b", "staged": "_s", "wide": "_s"}
    for form, states in (*forms, (None, None)):
        got, launched = run(form, states)
        fused = states == "fused" or (states is None and mma.FUSED_STATES)
        first = ["chunk_states_pass" + ("_half" if half else "")] if fused else [
            "chunk_states", "state_pass" + ("_half" if half else "")]
        assert launched == [*first, output + suffix[form or default_form]]
        for a, b in zip(got, plain):
            assert torch.equal(a, b), (form, states)
    ref_out, _, ref_final = _reference(x)
    assert _rel(plain[0], ref_out) < 1e-2
    assert _rel(plain[2], ref_final) < 1e-2


@needs_emulator
@pytest.mark.parametrize("chunk, length", [
    (64, 70), nightly_case(128, 300, reason="chunk_states_scan's walk over the chunks: the chunks of 64 take it")])
def test_emulated_one_pass_states_agree_with_the_torch_forward(emulate, chunk, length):
    """chunk_states_scan (a block per state tile walking the chunks) in place of chunk_states and
    state_pass: the same entering states, final state and output."""
    x = _chunks(length, seed=length + 1, chunk=chunk, decay=0.02)
    out, entering, final = mma.forward(x, one_pass=True)
    ref_out, ref_entering, ref_final = _reference(x)
    assert _rel(out, ref_out) < 1e-2
    assert _rel(final, ref_final) < 1e-2
    assert _rel(entering, ref_entering) < 1e-2
    torch.testing.assert_close(entering[..., 0, :, :], x.s0.expand_as(entering[..., 0, :, :]))


@needs_emulator
def test_emulated_kernels_on_unaligned_operands(emulate, monkeypatch):
    """k at an odd storage offset with an odd step stride: the tiles load value by value (the aligned
    build, 16 bytes at a time, takes the others); both agree with the torch forward."""
    x = _chunks(70, seed=11)
    k = x.k
    wide = torch.zeros((*k.shape[:-1], k.shape[-1] + 1), dtype=k.dtype)
    wide[..., 1:] = k
    odd = algorithm.Chunks(x.q, wide[..., 1:], x.v, x.ell, x.s0)
    built = []
    monkeypatch.setattr(mma, "source", lambda *a, _f=mma.source: built.append(a[4]) or _f(*a))
    ref_out, ref_entering, ref_final = _reference(x)
    for case in (x, odd):
        out, entering, final = mma.forward(case)
        assert _rel(out, ref_out) < 1e-2
        assert _rel(final, ref_final) < 1e-2
        assert _rel(entering, ref_entering) < 1e-2
    assert built == [True, False]


@needs_emulator
def test_emulated_kernels_with_every_operand_per_head_in_fp16(emulate):
    """Two heads on every operand (no broadcast), fp16, a value size of 128 (two value tiles)."""
    h = (2,)
    x = _chunks(128, value=128, dtype=torch.float16, seed=3, q_heads=h, k_heads=h, v_heads=h, ell_heads=h,
                s0_heads=h, chunk=64)  # whole chunks: the operands are strided views of the time-first arrays
    assert not x.q.is_contiguous()
    out, entering, final = mma.forward(x)
    ref_out, ref_entering, ref_final = _reference(x)
    assert _rel(out, ref_out) < 5e-3
    assert _rel(final, ref_final) < 5e-3
    assert _rel(entering, ref_entering) < 5e-3


def test_which_calls_take_the_kernels(monkeypatch):
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    x = _chunks(7)
    assert mma.kernels_apply(x)
    monkeypatch.setenv("SSMC_CUDA_CHUNK_KERNELS", "0")
    assert not mma.kernels_apply(x)
    monkeypatch.delenv("SSMC_CUDA_CHUNK_KERNELS")
    assert not mma.kernels_apply(_chunks(7, dtype=torch.float32))   # fp32: the torch path
    assert not mma.kernels_apply(_chunks(7, key=32))                 # key size 32: the torch path
    assert not mma.kernels_apply(_chunks(7, value=96))
    assert not mma.kernels_apply(_chunks(7, chunk=32))               # chunks of 32: the torch path
    assert all(mma.kernels_apply(_chunks(7, chunk=c)) for c in mma.CHUNKS)
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "0")
    assert not mma.kernels_apply(x)                                  # CPU tensors, no emulation


def test_the_chunk_output_option():
    """SSMC_CUDA_CHUNK_OUTPUT: unset None (mma.forward's default form), "warps", "balanced", "staged" or "wide"
    as given, anything else refused; SSMC_CUDA_CHUNK_STATES likewise with "split" and "fused"."""
    from ssmc.backends.cuda.options import CudaOptions

    assert CudaOptions.parse({}).chunk_output is None
    for form in ("warps", "balanced", "staged", "wide"):
        assert CudaOptions.parse({"SSMC_CUDA_CHUNK_OUTPUT": form}).chunk_output == form
    with pytest.raises(ValueError, match="SSMC_CUDA_CHUNK_OUTPUT"):
        CudaOptions.parse({"SSMC_CUDA_CHUNK_OUTPUT": "balance"})
    assert CudaOptions.parse({}).chunk_states is None
    for way in ("split", "fused"):
        assert CudaOptions.parse({"SSMC_CUDA_CHUNK_STATES": way}).chunk_states == way
    with pytest.raises(ValueError, match="SSMC_CUDA_CHUNK_STATES"):
        CudaOptions.parse({"SSMC_CUDA_CHUNK_STATES": "one"})


@pytest.mark.skipif(not nvrtc.available(), reason="no NVRTC")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_kernels_compile_without_spills(arch):
    from ssmc.backends.cuda.source import compile_options

    for chunk in mma.CHUNKS:
        for key in mma.SIZES:
            for value in mma.SIZES:
                # fp16 and the unaligned loads: built at the largest sizes alone (CI's time); CI builds
                # every size for sm_90, the largest (the most registers and shared memory) for sm_80
                largest = key == value == max(mma.SIZES)
                if in_ci() and arch == "sm_80" and not largest:
                    continue
                for bf16, aligned in ((True, True), (False, True), (True, False)) if largest else ((True, True),):
                    text = mma.source(key, value, chunk, bf16, aligned)
                    resources = nvrtc.compile_source(text, arch=arch, options=compile_options(text)).resources
                    assert set(resources) == {"chunk_states", "state_pass", "state_pass_half", "chunk_states_scan",
                                              "chunk_output", "chunk_output_hs", "chunk_output_ho",
                                              "chunk_output_hs_ho", "chunk_dstates", "state_pass_reverse",
                                              "chunk_dq", "chunk_dk", "chunk_dv", "chunk_dq_ho", "chunk_dk_ho",
                                              "chunk_dv_ho"}
                    dynamic = mma.shared_bytes(key, value, chunk)
                    for name, r in resources.items():
                        assert not r.spills, r.summary()
                        assert r.shared_bytes <= 48 * 1024, r.summary()  # the static part
                        assert r.shared_bytes + dynamic[name] <= SM80_SHARED, (r.summary(), dynamic[name])



@pytest.mark.skipif(not nvrtc.available(), reason="no NVRTC")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_per_key_kernels_compile_without_spills(arch):
    """The per-key kernels (per_key.cu.j2: per_key_states, per_key_output; the backward's per_key_dstates,
    per_key_dq, per_key_dkv; per_key_dell.cu.j2's per_key_dell) at every key / value size, bf16 (and fp16 at the
    largest): no spills, no local memory (the anchored fragments and the accumulators stay in registers), shared
    memory within an sm_80 block's. CI builds sm_90's alone."""
    from ssmc.backends.cuda.source import compile_options

    if in_ci() and arch == "sm_80":
        pytest.skip("CI: sm_90's build alone")
    for key in mma.SIZES:
        for value in mma.SIZES:
            for bf16 in (True, False) if key == value == max(mma.SIZES) else (True,):
                text = mma.per_key_source(key, value, bf16)
                resources = nvrtc.compile_source(text, arch=arch, options=compile_options(text)).resources
                assert set(resources) == {"per_key_states", "per_key_output", "per_key_dstates", "per_key_dq",
                                          "per_key_dkv"}
                for name, r in resources.items():
                    assert not r.spills and r.stack_frame_bytes == 0, r.summary()
                    dynamic = {"per_key_output": mma.per_key_shared(key, value),
                               **dict.fromkeys(("per_key_states", "per_key_dstates"), mma.per_key_states_shared()),
                               "per_key_dq": mma.per_key_dq_shared(key, value),
                               "per_key_dkv": mma.per_key_dkv_shared(key, value)}[name]
                    assert r.shared_bytes <= 48 * 1024 and r.shared_bytes + dynamic <= SM80_SHARED, r.summary()
                # per_key_dell (per_key_dell.cu.j2, a module of its own): the log decays' cotangent, a thread a key
                text = mma.per_key_dell_source(key, value, bf16)
                resources = nvrtc.compile_source(text, arch=arch, options=compile_options(text)).resources
                assert set(resources) == {"per_key_dell"}
                r = resources["per_key_dell"]
                assert not r.spills and r.stack_frame_bytes == 0 and r.registers <= 64, r.summary()
                assert r.shared_bytes == 4 * key, r.summary()  # the rows' dots alone, no dynamic part


@pytest.mark.skipif(not nvrtc.available(), reason="no NVRTC")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_balanced_chunk_output_compiles_without_spills(arch):
    """The module with chunk_output*_b (SSMC_CUDA_CHUNK_OUTPUT=balanced): no spills; CI builds RetNet's
    sizes (K = V = 128, chunk 128) alone, the local and nightly runs every chunk at the largest and
    smallest sizes."""
    from ssmc.backends.cuda.source import compile_options

    if in_ci() and arch == "sm_80":
        pytest.skip("CI: sm_90's build alone")
    cases = [(128, 128)] if in_ci() else [(64, 64), (128, 64), (128, 128), (256, 128)]
    for chunk, size in cases:
        text = mma.source(size, size, chunk, True, True, True)
        resources = nvrtc.compile_source(text, arch=arch, options=compile_options(text)).resources
        balanced = {name for name in resources if name.endswith("_b")}
        assert balanced == {"chunk_output_b", "chunk_output_hs_b", "chunk_output_ho_b", "chunk_output_hs_ho_b"}
        dynamic = mma.shared_bytes(size, size, chunk)
        for name in balanced:
            r = resources[name]
            assert not r.spills, r.summary()
            assert r.shared_bytes + dynamic[name] <= SM80_SHARED, (r.summary(), dynamic[name])


@pytest.mark.skipif(not nvrtc.available(), reason="no NVRTC")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_staged_kernels_compile_without_spills(arch):
    """The module with staged.cu.j2's kernels (chunk_output*_s with 64 or all value columns a block,
    chunk_states_pass*): no spills, their shared memory within sm_80's; CI builds RetNet's sizes (K = V = 128,
    chunk 128, both blocks) for sm_90 alone, the local and nightly runs every chunk and size, fp16 and unaligned
    at K = V = 128 and chunk 256. (chunk_dstates_pass, the backward's walk, is in the same module, and chunk_dkv*
    at chunks 64 and 128: `mma.dkv_fits`.)"""
    from ssmc.backends.cuda.source import compile_options

    if in_ci() and arch == "sm_80":
        pytest.skip("CI: sm_90's build alone")
    cases = [(128, 128, 128, 64, True, True), (128, 128, 128, 128, True, True)]
    if not in_ci():
        cases += [(c, key, value, vb, bf16, aligned) for c in mma.CHUNKS for key in mma.SIZES for value in mma.SIZES
                  for vb in {64, mma.staged_block(key, value, c, "wide")}
                  for bf16, aligned in ((True, True), (False, True), (True, False))
                  if (c, key, value, vb) != (128, 128, 128, 64) and ((bf16 and aligned) or key == value == 128 < c)]
        cases += [(128, 128, 128, 64, False, True), (128, 128, 128, 64, True, False)]  # chunk_dkv's largest
    for chunk, key, value, vb, bf16, aligned in cases:
        text = mma.source(key, value, chunk, bf16, aligned, False, vb)
        resources = nvrtc.compile_source(text, arch=arch, options=compile_options(text)).resources
        staged = {name for name in resources if name.endswith("_s") or name.endswith("states_pass")
                  or name == "chunk_states_pass_half"}
        assert staged == {"chunk_output_s", "chunk_output_hs_s", "chunk_output_ho_s", "chunk_output_hs_ho_s",
                          "chunk_states_pass", "chunk_states_pass_half", "chunk_dstates_pass"}
        dkv = {name for name in resources if name.startswith("chunk_dkv")}
        fits = mma.dkv_fits(key, value, chunk)
        want = {"chunk_dkv", "chunk_dkv_ho", "chunk_dkv_n", "chunk_dkv_n_ho"} if fits else set()
        assert dkv == want, dkv
        staged |= dkv
        dynamic = mma.shared_bytes(key, value, chunk)
        # the kernels the default forms launch at these sizes (`module_forms`: chunk_output*_s only at chunk 128,
        # whose default is the wide block) spill nothing; chunk_output*_s elsewhere, compiled into the module for
        # the states pass but launched only under SSMC_CUDA_CHUNK_OUTPUT=staged / wide, spills a few words in one
        # build (sm_80, chunk 64, K 64 V 128, 64 value columns: 96 registers a thread): tolerated, bounded
        form = mma.OUTPUT_FORMS.get(chunk, "warps")
        launched = form in ("staged", "wide") and vb == mma.staged_block(key, value, chunk, form)
        for name in staged:
            r = resources[name]
            size = mma.staged_bytes(key, value, chunk, vb) if name.endswith("_s") else dynamic[name]
            if launched or not name.endswith("_s"):
                assert not r.spills, r.summary()
            else:
                assert r.spill_store_bytes + r.spill_load_bytes <= 64, r.summary()
            assert r.shared_bytes + size <= SM80_SHARED, (r.summary(), size)


# -- the tiles' shared-memory banks ---------------------------------------------------------------
# A model of one warp's shared-memory access (32 banks of 4 bytes): the hardware serves it in as many
# wavefronts as the most distinct 4-byte words any bank holds, per quarter warp for 16-byte accesses, per
# half warp for 8-byte ones. The index expressions below mirror chunk.cu.j2's (the source checks pin
# them): the transposed tiles' swizzle `sw`, the lanes of their stores and of the mma fragment reads.

def _wavefronts(words: list[int], width: int) -> int:
    """Wavefronts of one warp's access of `width` bytes a lane, lane l at 4-byte word words[l]."""
    group = {4: 32, 8: 16, 16: 8}[width]
    total = 0
    for start in range(0, 32, group):
        banks: dict[int, set[int]] = {}
        for w in words[start:start + group]:
            for k in range(width // 4):
                banks.setdefault((w + k) % 32, set()).add(w + k)
        total += max(len(v) for v in banks.values())
    return total


def _tile_accesses(ck: int, cc: int, swizzle: bool):
    """(what, width, [word a lane]) for every warp-wide access of chunk.cu.j2's transposed tiles at
    key size `ck` and chunk `cc` (tile 64, rows padded by 8 16-bit values); `swizzle` False: the
    layout without `sw`."""
    tile, pad = 64, 8

    def sw(r, j):
        return j ^ (r & 56) if swizzle else j

    def word(row, col, length):  # 16-bit entry [row][col] of rows `length` long: its 4-byte word
        return (row * (length + pad) + col) // 2

    def warps(items, threads):  # each warp's lanes' item e per iteration (e = tid + k * threads)
        for k in range(-(-items // threads)):
            for w in range(threads // 32):
                es = [k * threads + 32 * w + lane for lane in range(32)]
                if es[0] < items:
                    yield es

    for rows, length, threads, what in ((cc, cc, 128, "kT, vT store"), (cc, cc, 2 * cc, "vT store"),
                                        (ck, ck, 2 * cc, "16-bit sT store")):
        # steps (or state rows) j, j + 1 at columns d..d+7, a 32-bit word per column
        for es in warps(rows * tile // 16, threads):
            for i in range(8):
                yield what, 4, [word(8 * (e % 8) + i, sw(8 * (e % 8), 2 * (e // 8)), length) for e in es]
    for es in warps(ck * tile // 8, 2 * cc):  # fp32 sT: e = 64m + 32h + 8b + a
        for i in range(4):
            yield "fp32 sT store", 4, [word(4 * (e % 8 + 8 * ((e // 32) % 2)) + i,
                                            sw(4 * (e % 8 + 8 * ((e // 32) % 2)), 2 * ((e // 8) % 4 + 4 * (e // 64))),
                                            ck) for e in es]
    for es in warps(ck * tile // 4, 2 * cc):  # sT of [CV, CK] states: 4 values a lane, 8 bytes
        yield "transposed-state sT store", 8, [word(e // (ck // 4), sw(e // (ck // 4), 4 * (e % (ck // 4))), ck)
                                               for e in es]
    # fragment reads: rows 8 rb + g, columns sw(8 rb, c) + 2 q4 (+ 8), a 32-bit pair a lane
    for rows, length, what in ((tile, cc, "vT / kT read"), (tile, ck, "sT read")):
        for rb in range(rows // 8):
            for c in range(0, length, 8):
                yield what, 4, [word(8 * rb + lane // 4, sw(8 * rb, c) + 2 * (lane % 4), length) for lane in range(32)]


def test_the_tiles_shared_memory_accesses_are_free_of_bank_conflicts():
    """Every warp-wide store and fragment read of the transposed tiles takes the fewest wavefronts its
    width allows (1 for 4-byte accesses, 2 for 8-byte ones), at every key size and chunk; without the
    swizzle the transposing stores take 8 (ncu's 8-way conflict of chunk_states' stores)."""
    source = mma.source(128, 64, 128, True, True)
    for line in ("return j ^ (r & 56);", "const int d = 8 * (e % (TILE / 8)), j = 2 * (e / (TILE / 8));",
                 "const int d = 8 * (e % (TILE / 8)), r = 2 * (e / (TILE / 8));",
                 "const int d = 4 * (e % 8 + 8 * ((e / 32) % 2)), r = 2 * ((e / 8) % 4 + 4 * (e / 64));",
                 "const int d = e / (CK / 4), r = 4 * (e % (CK / 4));", "&vT[r][sw(8 * n, c) + 2 * q4]",
                 "&sT[r][sw(8 * n, c) + 2 * q4]", "&kT[row][sw(top, c) + 2 * q4]"):
        assert line in source, line  # the model's expressions are the kernels' own
    for ck in mma.SIZES:
        for cc in mma.CHUNKS:
            for what, width, words in _tile_accesses(ck, cc, swizzle=True):
                assert _wavefronts(words, width) == width // 4, (ck, cc, what)
    worst = max(_wavefronts(words, width) for what, width, words in _tile_accesses(128, 128, swizzle=False)
                if "store" in what)
    assert worst == 8


# -- the chunked core choosing the kernels ----------------------------------------------------------

def _core(name: str):
    """(the core program of example `name`, its sizes at kernel shapes)."""
    from ssmc.examples import mamba2, retnet
    from ssmc.passes.matrix_linear import chunk_stages, core_form

    if name == "retnet":
        return retnet.SPEC.program, {"b": 1, "h": 2, "k": 64, "v": 64}
    core = next(s.program for s in chunk_stages(mamba2.SPEC.program).stages if core_form(s.program) is not None)
    return core, {"b": 1, "g": 1, "r": 2, "p": 64, "n": 64}


def _core_inputs(program, sizes, length, rng, dtype):
    """(seqs [L, *axes], params, initial) of a core, time first, as the backend hands them over."""
    seqs, params = {}, {}
    for d in program.inputs:
        shape = [sizes[a] for a in d.axes]
        if d.role.value == "seq":
            x = rng.standard_normal([length, *shape])
            if d.name.endswith("_ell"):
                seqs[d.name] = torch.from_numpy(-np.abs(x) * 0.2).float()
            else:
                seqs[d.name] = torch.from_numpy(x * 0.3).to(dtype)
        elif d.name == "gamma":  # RetNet's decay, as is
            params[d.name] = torch.from_numpy(1.0 - 2.0 ** (-1.0 - 2.0 * np.arange(shape[0]))).float()
        else:  # Mamba-2's skip D
            params[d.name] = torch.from_numpy(rng.standard_normal(shape)).float()
    state = program.states[0]
    initial = {state.name: torch.from_numpy(0.1 * rng.standard_normal([sizes[a] for a in state.axes])).float()}
    return seqs, params, initial


@needs_emulator
@pytest.mark.parametrize("name", ["mamba2", "retnet"])
def test_chunked_core_runs_the_kernels_and_its_backward_reads_their_tape(name, emulate, monkeypatch):
    """ChunkedCore on bf16 operands: the forward on the kernels (counted), outputs and final state as
    the torch path's in float64; the backward on the kernels (counted), the torch backward on their
    tape and the torch path's backward on its own, each gradient against float64."""
    from ssmc.backends.cuda.kernels import chunk
    from ssmc.passes.autodiff import GRAD

    program, sizes = _core(name)
    length = 70
    rng = np.random.default_rng(5)
    seqs, params, initial = _core_inputs(program, sizes, length, rng, torch.bfloat16)
    calls = []
    monkeypatch.setattr(chunk.mma, "forward",
                        lambda x, _f=chunk.mma.forward, **kw: calls.append(kw.get("out")) or _f(x, **kw))
    core = chunk.ChunkedCore(program, "float32")
    outs, finals, tape = core.forward(seqs, params, initial, sizes, length)
    assert calls and tape.chunks.q.shape[-2] == mma.chunk_for(length)
    # the output written in place, time first (RetNet's heads h, b in the output's order)
    assert calls[0] is not None and outs[core.output].data_ptr() == calls[0].data_ptr()
    wide = chunk.ChunkedCore(program, "float64")
    d = torch.float64
    ref_outs, ref_finals, _ = wide.forward({k: v.to(d) for k, v in seqs.items()},
                                                  {k: v.to(d) for k, v in params.items()},
                                                  {k: v.to(d) for k, v in initial.items()}, sizes, length)
    assert len(calls) == 1  # float64: the torch path
    for k in ref_outs:
        assert outs[k].shape == ref_outs[k].shape and _rel(outs[k], ref_outs[k]) < 1e-2
    for k in ref_finals:
        assert finals[k].shape == ref_finals[k].shape and _rel(finals[k], ref_finals[k]) < 1e-2
    # an inference call (`run`, no tape): 16-bit entering states and output on the kernels, the output
    # bit for bit the training forward's rounded, written in place (time first), the final state the same
    run_outs, run_finals = core.run(seqs, params, initial, sizes, length, out_dtype=torch.bfloat16)
    assert len(calls) == 2 and calls[1].dtype == torch.bfloat16
    assert run_outs[core.output].data_ptr() == calls[1].data_ptr()
    for k in outs:
        assert torch.equal(run_outs[k], outs[k].to(torch.bfloat16)), k
    for k in finals:
        assert torch.equal(run_finals[k], finals[k]), k
    output, state = core.output, program.states[0].name
    cot = {GRAD + output: torch.from_numpy(rng.standard_normal(tuple(outs[output].shape))).float()}
    lam = {GRAD + state: torch.from_numpy(rng.standard_normal(tuple(finals[state].shape))).float()}
    backward_calls = []
    monkeypatch.setattr(chunk.mma, "backward", lambda *a, _f=chunk.mma.backward, **kw: backward_calls.append(
                        kw.get("outs")) or _f(*a, **kw))
    got = core.backward(seqs, params, tape, cot, lam, None, sizes, length)
    assert len(backward_calls) == 1
    # the gradients of the operands with every head (x; RetNet's q, k, v) written time first by the kernels,
    # returned as they are: no permuting copy
    direct = backward_calls[0]
    roles = {"dq": core.ml.q, "dk": core.ml.k, "dv": core.ml.v}
    assert set(direct) == ({"dv"} if name == "mamba2" else {"dq", "dk", "dv"})
    for role, out in direct.items():  # (each made as its kernel ran)
        assert got[0][GRAD + roles[role].arg].data_ptr() == out.array.data_ptr(), role
    # the torch backward on the kernels' tape, then on the torch forward's
    monkeypatch.setenv("SSMC_CUDA_CHUNK_BACKWARD", "0")
    on_tape = core.backward(seqs, params, tape, cot, lam, None, sizes, length)
    monkeypatch.setenv("SSMC_CUDA_CHUNK_KERNELS", "0")
    _, _, torch_tape = core.forward(seqs, params, initial, sizes, length)
    assert len(calls) == 2  # the torch path (its chunk by the state's size, maybe not the kernels')
    torch_path = core.backward(seqs, params, torch_tape, cot, lam, None, sizes, length)
    assert len(backward_calls) == 1
    _, _, wide_tape = wide.forward({k: v.to(d) for k, v in seqs.items()}, {k: v.to(d) for k, v in params.items()},
                                   {k: v.to(d) for k, v in initial.items()}, sizes, length)
    want = wide.backward({k: v.to(d) for k, v in seqs.items()}, {k: v.to(d) for k, v in params.items()}, wide_tape,
                         {k: v.to(d) for k, v in cot.items()}, {k: v.to(d) for k, v in lam.items()}, None, sizes,
                         length)
    # every gradient (q, k, v / x, B, C; the decay or its log; the initial state) within 1e-2 of float64
    # (bf16 operands, the cotangent of the output rounded to bf16 on the kernels)
    if name == "mamba2":  # Mamba-2's log decays' as close as the operands': chunk_dk takes β_i before its
        # scores round, as chunk_dq takes β_j (β after the rounding: q·dq − k·dk no longer cancels, 7x worse)
        errors = {k: _rel(got[0][k], want[0][k]) for k in want[0]}
        assert errors["grad_mamba2_ell"] < 2 * max(errors["grad_x"], errors["grad_B"], errors["grad_C"]), errors
    for kernels, tape_torch, torch_only, ref in zip(got, on_tape, torch_path, want):
        assert set(kernels) == set(ref) == set(tape_torch) == set(torch_only)
        for k in ref:
            assert kernels[k].shape == ref[k].shape, k
            assert _rel(kernels[k], ref[k]) < 1e-2, (k, _rel(kernels[k], ref[k]))
            assert _rel(tape_torch[k], ref[k]) < 1e-2, k
            assert _rel(torch_only[k], ref[k]) < 1e-2, k



@needs_emulator
def test_chunked_core_takes_a_16_bit_output_cotangent_as_given(emulate, monkeypatch):
    """RetNet's core at 64 steps (one whole chunk): the output's cotangent given in bf16 (as the prepared steps
    pass it: `takes_half_cotangents`) reaches the kernels as a view of it, no copy, and every gradient is bit
    for bit that of the same cotangent given in fp32 (which the core rounds to bf16)."""
    from ssmc.backends.cuda.kernels import chunk
    from ssmc.passes.autodiff import GRAD

    program, sizes = _core("retnet")
    length = 64
    rng = np.random.default_rng(8)
    seqs, params, initial = _core_inputs(program, sizes, length, rng, torch.bfloat16)
    core = chunk.ChunkedCore(program, "float32")
    assert core.takes_half_cotangents
    outs, finals, tape = core.forward(seqs, params, initial, sizes, length)
    output, state = core.output, program.states[0].name
    half = torch.from_numpy(rng.standard_normal(tuple(outs[output].shape))).to(torch.bfloat16)
    lam = {GRAD + state: torch.from_numpy(rng.standard_normal(tuple(finals[state].shape))).float()}
    seen = []
    monkeypatch.setattr(chunk.mma, "backward", lambda x, entering, final, d_out, *a, _f=chunk.mma.backward, **kw:
                        seen.append(d_out) or _f(x, entering, final, d_out, *a, **kw))
    got = core.backward(seqs, params, tape, {GRAD + output: half}, lam, None, sizes, length)
    want = core.backward(seqs, params, tape, {GRAD + output: half.float()}, lam, None, sizes, length)
    assert len(seen) == 2 and seen[0].data_ptr() == half.data_ptr() and seen[1].data_ptr() != half.data_ptr()
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for k in w:
            assert torch.equal(g[k], w[k]), k


def test_training_calls_keep_16_bit_operands_where_the_kernels_take_them(monkeypatch):
    """`ChunkedCore.half_inputs` (what `Grad` hands a training forward): q, k, v as given where q is
    16-bit and the kernels take the sizes; the compute dtype's casts otherwise (fp32 q, other sizes,
    SSMC_CUDA_CHUNK_KERNELS=0), and always for the other sequences (the decays)."""
    from ssmc.backends.cuda.kernels import chunk

    program, sizes = _core("mamba2")
    core = chunk.ChunkedCore(program, "float32")
    ml = core.ml
    rng = np.random.default_rng(0)
    given, _, _ = _core_inputs(program, sizes, 5, rng, torch.bfloat16)
    cast = {k: v.float() for k, v in given.items()}
    kept = core.half_inputs(cast, given, sizes)
    operands = {ml.q.arg, ml.k.arg, ml.v.arg}
    assert set(kept) == set(cast) and operands <= set(kept) and len(operands) == 3
    for name, value in kept.items():
        assert value is (given[name] if name in operands else cast[name]), name
    assert core.half_inputs(cast, cast, sizes) is cast                            # fp32 q
    assert core.half_inputs(cast, given, {**sizes, ml.key: 32}) is cast           # a key size they do not take
    monkeypatch.setenv("SSMC_CUDA_CHUNK_KERNELS", "0")
    assert core.half_inputs(cast, given, sizes) is cast

@ssmc.recurrence
def mapped_values(h: ssmc.State["b g r p n"], x: ssmc.Seq["b g r p"], dt: ssmc.Seq["b g r"], A: ssmc.Param["g r"],
                  B: ssmc.Seq["b g n"], C: ssmc.Seq["b g n"]):
    """Mamba-2's core with silu(x) for x (no output skip): v is no input as given, so β is folded into it
    and the pre stage writes v."""
    a = ssmc.softplus(dt)
    h = ssmc.exp(a * A) * h + a * ssmc.silu(x) * B
    return h, ssmc.dot(h, C, over="n")


def test_stages_around_the_core_write_its_operands_in_16_bits_and_results_in_the_calls_dtype(monkeypatch):
    """`CudaBackend.stage_dtypes` around a core. Mamba-2 (pre, core): the core reads x as given with
    β = softplus(dt) apart, so pre writes no operand, only β and the log decays, in the compute dtype; the
    core, whose output is the result y (o + D x, no post stage), writes the call's dtype. A spec whose v
    is no input as given (silu(x), β folded in): pre writes v in C's bf16, the core's rounding. fp32 q,
    a key size the kernels do not take: nothing in 16 bits. `runner.output_dtype` reads the per-output
    pairs."""
    from ssmc.backends.cuda.backend import CudaBackend, cuda_stages
    from ssmc.backends.cuda.runner import output_dtype
    from ssmc.examples import mamba2

    monkeypatch.delenv("SSMC_CUDA_CHUNK_KERNELS", raising=False)
    fused = cuda_stages(mamba2.SPEC.program)
    assert [st.kind for st in fused.stages] == ["pre", "core"]
    dtypes = CudaBackend("cuda").stage_dtypes(fused, np.dtype("float32"))
    sizes = {"b": 1, "g": 1, "r": 2, "p": 64, "n": 128}
    seqs = {name: torch.zeros(3, dtype=torch.bfloat16) for name in ("x", "dt", "B", "C")}
    pre = fused.stages[0]
    assert sorted(pre.writes) == ["mamba2_beta", "mamba2_ell"]
    assert dtypes(0, seqs, sizes, torch.bfloat16) is None
    assert dtypes(1, {**seqs, "mamba2_beta": None, "mamba2_ell": None}, sizes, torch.bfloat16) == torch.bfloat16

    fused = cuda_stages(mapped_values.program)
    assert [st.kind for st in fused.stages] == ["pre", "core"]
    dtypes = CudaBackend("cuda").stage_dtypes(fused, np.dtype("float32"))
    v_name = next(n for n in fused.stages[0].writes if n.endswith("_v"))
    ell_name = next(n for n in fused.stages[0].writes if n.endswith("_ell"))
    wanted = dtypes(0, seqs, sizes, torch.bfloat16)
    assert output_dtype(wanted, v_name) == torch.bfloat16 and output_dtype(wanted, ell_name) is None
    assert dtypes(0, {**seqs, "C": seqs["C"].float()}, sizes, torch.float32) is None
    assert dtypes(0, seqs, {**sizes, "n": 32}, torch.bfloat16) is None
    assert output_dtype(torch.float16, "y") == torch.float16 and output_dtype(None, "y") is None


# -- on the GPU: whole specs --------------------------------------------------------------------------

def _spec_case(name: str, length: int):
    """(spec, layout, inputs at kernel shapes: K = 128 and V = 64 for Mamba-2, K = V = 64 for RetNet and linear
    attention, whose layout is "b h t ...", time after the heads)."""
    from ssmc.examples import linear_attention, mamba2, retnet

    rng = np.random.default_rng(length)
    if name == "mamba2":
        inputs = mamba2.make_inputs(rng, length, batch=2, groups=1, heads=4, headdim=64, state=128)
        inputs["x"] = inputs["x"] * 0.3
        return mamba2.SPEC, mamba2.LAYOUT, inputs
    if name == "linear_attention":  # no decay: the state grows as the sum of every step's k v
        inputs = linear_attention.make_inputs(rng, length, batch=2, heads=3, dk=64, dv=64)
        inputs["q"] = inputs["q"] / (8.0 * max(1.0, length ** 0.5))
        return linear_attention.SPEC, linear_attention.LAYOUT, inputs
    inputs = retnet.make_inputs(rng, length, batch=2, heads=4, dk=64, dv=64)
    inputs["gamma"] = 1.0 - 2.0 ** (-5.0 - np.arange(4))
    inputs["q"] = inputs["q"] / 8.0
    return retnet.SPEC, retnet.LAYOUT, inputs


# L 1, 7 (one partial chunk), 63, 64, 65 (about the short calls' chunk of 64), 180, 1000, 4097 (many chunks, the last
# partial); linear attention ("b h t ..." layout) at a short and a long one
GPU_SPEC_CASES = [(n, length) for n in ("mamba2", "retnet") for length in (1, 7, 63, 64, 65, 180, 1000, 4097)] + [
    ("linear_attention", 65), ("linear_attention", 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("name, length", GPU_SPEC_CASES)
def test_gpu_specs_on_the_kernels_match_the_torch_path_and_the_interpreter(name, length, monkeypatch):
    """bf16 inputs: the kernels' output and final state against the interpreter (the float64 chunked
    path past L 180, which tests/test_chunked.py holds to the interpreter) on the same rounded inputs,
    relative RMS error within 1e-2 and at most twice the torch path's; the kernels counted."""
    import ssmc
    from ssmc.backends.cuda.kernels import chunk

    monkeypatch.delenv("SSMC_CUDA_EMULATE", raising=False)
    monkeypatch.delenv("SSMC_CUDA_CHUNK_KERNELS", raising=False)
    spec, layout, inputs = _spec_case(name, length)
    # as tests/test_chunked.py's GPU test: arrays of rank > 1 (the initial state too) in bf16
    bf = {k: torch.as_tensor(v, device="cuda").to(torch.bfloat16 if np.ndim(v) > 1 else torch.float32)
          for k, v in inputs.items()}
    rounded = {k: v.double().cpu().numpy() for k, v in bf.items()}
    if length <= 180:
        ref = ssmc.compile(spec, layout=layout, backend="interpreter")(**rounded, return_final_states=True)
    else:
        ref = ssmc.compile(spec, layout=layout, backend="cuda", dtype="float64")(**rounded, return_final_states=True)
    ref = [torch.as_tensor(np.asarray(r.cpu() if hasattr(r, "cpu") else r), device="cuda").double() for r in ref]
    calls = []
    monkeypatch.setattr(chunk.mma, "forward", lambda x, _f=chunk.mma.forward, **kw: calls.append(1) or _f(x, **kw))
    got = ssmc.compile(spec, layout=layout, backend="cuda")(**bf, return_final_states=True)
    assert calls, "the kernels did not run"
    monkeypatch.setenv("SSMC_CUDA_CHUNK_KERNELS", "0")
    n = len(calls)
    torch_path = ssmc.compile(spec, layout=layout, backend="cuda")(**bf, return_final_states=True)
    assert len(calls) == n
    for g, t, r in zip(got, torch_path, ref):
        assert g.shape == r.shape
        assert _rel(g, r) < 1e-2, (_rel(g, r), _rel(t, r))
        assert _rel(g, r) < 2 * _rel(t, r) + 1e-3, (_rel(g, r), _rel(t, r))


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [64, 128, 256])
@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("key, value", [(128, 64), (128, 128)])
def test_gpu_kernels_at_every_chunk_agree_with_the_torch_forward(chunk, one_pass, key, value, monkeypatch):
    """The kernels on the GPU (dynamic shared memory past 48 KiB, both ways to the states) against
    algorithm.py in float64 on the same rounded values: L 1000 (the last chunk partial), SSD's
    broadcast of q and k over two heads."""
    from ssmc.backends.cuda.kernels.chunk import algorithm as alg

    monkeypatch.delenv("SSMC_CUDA_EMULATE", raising=False)
    monkeypatch.delenv("SSMC_CUDA_CHUNK_KERNELS", raising=False)
    x = _chunks(1000, key=key, value=value, seed=chunk + key + value, chunk=chunk, decay=0.02)
    gpu = alg.Chunks(*(t.cuda() for t in (x.q, x.k, x.v, x.ell, x.s0)))
    assert mma.kernels_apply(gpu)
    out, entering, final = (t.cpu() for t in mma.forward(gpu, one_pass=one_pass))
    ref_out, ref_entering, ref_final = _reference(x)
    assert _rel(out, ref_out) < 1e-2
    assert _rel(final, ref_final) < 1e-2
    assert _rel(entering, ref_entering) < 1e-2



@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [64, 128, 256])
@pytest.mark.parametrize("key, value", [(128, 64), (128, 128)])
@pytest.mark.parametrize("half", [False, True], ids=["training", "inference"])
def test_gpu_forms_and_fused_states_are_the_plain_ones(chunk, key, value, half, monkeypatch):
    """On the GPU (cp.async, ldmatrix, two blocks' shared memory): every chunk_output form and the fused
    states, bit for bit the warps form on the split states (as on the emulator), SSD's broadcast heads with
    β and skip, L 1000 (the last chunk partial); fp32 or 16-bit states and output."""
    monkeypatch.delenv("SSMC_CUDA_EMULATE", raising=False)
    monkeypatch.delenv("SSMC_CUDA_CHUNK_KERNELS", raising=False)
    x = _chunks(1000, key=key, value=value, seed=chunk + key + value, chunk=chunk, decay=0.02, beta_heads=(1, 2),
                skip_heads=(1, 2))
    gpu = algorithm.Chunks(*(t.cuda() for t in (x.q, x.k, x.v, x.ell, x.s0, x.beta, x.skip)))
    kw = {"half_states": True, "out_dtype": x.q.dtype} if half else {}
    got = {}
    for form, states in (("warps", "split"), *ALL_FORMS, ("staged", "split"), ("warps", "fused")):
        monkeypatch.setenv("SSMC_CUDA_CHUNK_OUTPUT", form)
        monkeypatch.setenv("SSMC_CUDA_CHUNK_STATES", states)
        got[form, states] = [t.cpu() for t in mma.forward(gpu, **kw)]
    plain = got["warps", "split"]
    for config, outs in got.items():
        for a, b in zip(outs, plain):
            assert torch.equal(a, b), config
    ref_out, _, ref_final = _reference(x)
    assert _rel(plain[0], ref_out) < 1e-2
    assert _rel(plain[2], ref_final) < 1e-2

# -- the backward on the kernels ----------------------------------------------------------------------

def _cotangents(x: algorithm.Chunks, seed: int):
    """(d_out [*H, NC, C, V] in q's dtype, zero past the call's steps as `ChunkedCore._arrange` pads it,
    d_final [*H, K, V] fp32), H the heads of all operands."""
    t = x.q.dim() - 3
    heads = torch.broadcast_shapes(x.q.shape[:t], x.k.shape[:t], x.v.shape[:t], x.ell.shape[:t], x.s0.shape[:t])
    g = torch.Generator().manual_seed(seed)
    d_out = torch.randn(*heads, *x.q.shape[-3:-1], x.v.shape[-1], generator=g)
    d_out = d_out * (x.v.abs().sum(-1, keepdim=True) > 0)  # zero on the padded steps (v is zero there)
    d_final = torch.randn(*heads, x.q.shape[-1], x.v.shape[-1], generator=g)
    return d_out.to(x.q.dtype), d_final


def _reference_vjp(x: algorithm.Chunks, d_out, d_final):
    """algorithm.forward and vjp in float64 on the same (rounded) values: (dq, dk, dv, dell, ds0, dbeta,
    dskip)."""
    d = torch.float64
    wide = _wide(x)
    _, entering, final = algorithm.forward(wide)
    return algorithm.vjp(wide, entering, final, d_out.to(d), d_final.to(d))


def _summed_as(want: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """`want` ([*H, ...] per head) summed over the head axes where `got` has 1 and `want` more (the heads
    mma.backward sums dq, dk over in its kernels), keeping them."""
    axes = [i for i, (g, w) in enumerate(zip(got.shape, want.shape)) if g == 1 and w > 1]
    return want.sum(axes, keepdim=True) if axes else want


def _rel_summed(got, want) -> float:
    """`_rel` of a gradient the kernels summed over heads (`_summed_as`) against the per-head `want`,
    measured against the size of the terms: ‖got − Σ_h want_h‖ / ‖want‖ (the heads' sum may cancel, where
    each head's error, of its own roundings, does not; a head left out or added twice is ≈ 1/√r of ‖want‖)."""
    ref = _summed_as(want, got).double()
    return float((got.double() - ref).norm() / want.double().norm().clamp_min(1e-30))


def _check_parts(x: algorithm.Chunks, got, parts: dict, entering, d_out, want=None, tol: float = 0.0) -> None:
    """The kernels' side outputs (mma.backward's `parts`) against the same sums in float64 of what the
    kernels returned and read: chunk_dq's q_i·dq_i and chunk_dk's −k_i·dk_i over each key tile (q, k the
    16-bit operands, broadcast over the heads they lack), the reverse states pass's exp(Γ)⟨d_end, S_p⟩ per
    chunk, and chunk_dv's skip cotangent Σ_ν v_iν dO_iν: close to fp32 rounding, so a row, tile, head
    or chunk misplaced fails. Where the kernels summed dq or dk over heads (no per-head rows returned),
    its row dots against `want`'s (the float64 reference's, per head) within `tol`."""
    d = torch.float64
    dq, dk, d_skip = got[0].to(d), got[1].to(d), got[6]
    tiles = x.q.shape[-1] // 64
    rows = parts["rows"].to(d)
    assert rows.shape == (*entering.shape[:-2], x.q.shape[-2], 2 * tiles)
    scale = float(rows.abs().max())
    for at, operand, grad, sign, ref in ((slice(None, tiles), x.q, dq, 1, None if want is None else want[0]),
                                         (slice(tiles, None), x.k, dk, -1, None if want is None else want[1])):
        per_head = grad.shape[:-3] == rows.shape[:-3]
        dots = sign * (operand.to(d) * (grad if per_head else ref.to(d))).unflatten(-1, (tiles, 64)).sum(-1)
        if per_head:
            torch.testing.assert_close(rows[..., at], dots, rtol=1e-5, atol=1e-6 * scale)
        else:
            assert _rel(rows[..., at], dots) < tol, _rel(rows[..., at], dots)
    # ⟨d_end, S_p⟩ of the fp32 d_end (parts has it rounded to 16 bits: within half an ulp a term, 2^-8 of
    # bf16's magnitude; fp16's finer) and the 16-bit S_p the kernel reads
    assert parts["d_end"].dtype == x.q.dtype
    d_end, gamma = parts["d_end"].to(d), torch.cumsum(x.ell.to(d), -1)[..., -1]
    s_p = entering.to(x.q.dtype).to(d)
    entered = torch.exp(gamma) * (d_end * s_p).sum((-1, -2))
    bound = torch.exp(gamma) * (d_end.abs() * s_p.abs()).sum((-1, -2)) * 2.0 ** -8
    assert bool(((parts["entered"].to(d).sum(-1) - entered).abs() <= bound + 1e-6 * float(entered.abs().max())).all())
    if x.skip is not None:
        want = (x.v.to(d) * d_out.to(d)).sum(-1).expand(d_skip.shape)
        torch.testing.assert_close(d_skip.to(d), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def _check_backward(x: algorithm.Chunks, seed: int, tol: float, events=None, heads_a_block=None):
    d_out, d_final = _cotangents(x, seed)
    assert mma.backward_applies(x, d_out)
    _, entering, final = mma.forward(x)
    parts: dict = {}
    got = mma.backward(x, entering, final, d_out, d_final, events=events, parts=parts, heads_a_block=heads_a_block)
    want = _reference_vjp(x, d_out, d_final)
    _check_parts(x, got, parts, entering, d_out, want, tol)
    assert len(got) == len(want) == 7 and (got[5] is None) == (want[5] is None) == (x.beta is None)
    assert (got[6] is None) == (want[6] is None) == (x.skip is None)
    for name, g, w in zip(("dq", "dk", "dv", "dell", "ds0", "dbeta", "dskip"), got, want):
        if w is None:
            continue
        err = _rel(g, w)
        if name in ("dq", "dk"):  # summed over the heads q (k) lacks by the kernels
            err = _rel_summed(g, w)
            w = _summed_as(w, g)
        assert g.shape == w.shape, (name, g.shape, w.shape)
        assert g.dtype == torch.float32, name
        assert err < tol, (name, err)
    return {name: _rel_summed(g, w) for name, g, w in zip(("dq", "dk", "dv", "dell", "ds0", "dbeta", "dskip"), got,
                                                          want) if w is not None}


@needs_emulator
@pytest.mark.parametrize("chunk, length", [(64, 1), (64, 130), (128, 7)])
def test_emulated_backward_agrees_with_the_torch_vjp(emulate, chunk, length):
    """The five backward kernels (and the log decays' cotangent after them) against algorithm.vjp in
    float64 on the same rounded values: SSD's broadcast of q and k over two heads, K = V = 64, the last
    chunk partial or the only one, several chunks through the reverse pass."""
    x = _chunks(length, seed=length + 7, chunk=chunk, decay=0.3 if chunk == 64 else 0.02)
    _check_backward(x, length, 6e-3)


def _fused_against_split(x: algorithm.Chunks, seed: int, monkeypatch, device: str = "cpu") -> None:
    """mma.backward of `x` (CPU tensors, moved to `device`) with SSMC_CUDA_CHUNK_STATES=fused (chunk_dstates_pass)
    against split (chunk_dstates, then state_pass_reverse): d_end, ds0 and every gradient but the log decays' bit
    for bit, the ⟨d_end, S_p⟩ parts' sums per chunk (and d_ell) within fp32 rounding."""
    d_out, d_final = (t.to(device) for t in _cotangents(x, seed))
    x = algorithm.Chunks(*(None if a is None else a.to(device) for a in (x.q, x.k, x.v, x.ell, x.s0, x.beta, x.skip)))
    names = []
    monkeypatch.setattr(mma, "_launch", lambda *a, _f=mma._launch: names.append(a[1]) or _f(*a))

    def run(states):
        monkeypatch.setenv("SSMC_CUDA_CHUNK_STATES", states)
        _, entering, final = mma.forward(x, half_states=True)
        names.clear()
        parts: dict = {}
        got = mma.backward(x, entering, final, d_out, d_final, parts=parts)
        return got, parts, list(names)

    split, split_parts, launched = run("split")
    assert launched[:2] == ["chunk_dstates", "state_pass_reverse"]
    fused, fused_parts, launched = run("fused")
    assert launched[0] == "chunk_dstates_pass" and "state_pass_reverse" not in launched
    assert torch.equal(fused_parts["d_end"], split_parts["d_end"])
    nc, key, value = x.q.shape[-3], x.q.shape[-1], x.v.shape[-1]
    assert fused_parts["entered"].shape[-2:] == (nc, key * value // 1024)
    want = split_parts["entered"].sum(-1)
    torch.testing.assert_close(fused_parts["entered"].sum(-1), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    for name, a, b in zip(("dq", "dk", "dv", "dell", "ds0", "dbeta", "dskip"), fused, split):
        if b is None:
            assert a is None, name
        elif name == "dell":
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))
        else:
            assert torch.equal(a, b), name


@needs_emulator
@pytest.mark.parametrize("chunk, length, key, value, ssd", [
    (64, 130, 64, 64, True),
    nightly_case(64, 70, 128, 64, False, reason="two key tiles: the fused walk's dots of several tiles are "
                 "test_emulated_backward_with_key_and_value_sizes_apart's against float64 too")])
def test_emulated_fused_backward_states_are_the_split_ones(emulate, monkeypatch, chunk, length, key, value, ssd):
    """SSMC_CUDA_CHUNK_STATES=fused (chunk_dstates_pass: one walk of the chunks, last first, no fp32 chunk sums
    in memory) against split (chunk_dstates, then state_pass_reverse): the same sums in the same order
    (`_fused_against_split`). Three chunks (SSD's broadcast heads, β and skip) or two of a 128-key state (two key
    tiles a head)."""
    heads = ({"beta_heads": (1, 2), "skip_heads": (1, 2)} if ssd else
             {"v_heads": (1, 1), "ell_heads": (1, 1), "s0_heads": (1, 1)})
    x = _chunks(length, key=key, value=value, seed=length + key, chunk=chunk, decay=0.05, **heads)
    _fused_against_split(x, length, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [64, 128, 256])
@pytest.mark.parametrize("key, value", [(128, 64), (128, 128)])
def test_gpu_fused_backward_states_are_the_split_ones(chunk, key, value, monkeypatch):
    """`_fused_against_split` on the GPU (cp.async, ldmatrix and the paired roundings as the hardware does them):
    SSD's broadcast heads with β and skip, L 1000 (the last chunk partial)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.delenv("SSMC_CUDA_EMULATE", raising=False)
    x = _chunks(1000, key=key, value=value, seed=chunk + key + value, chunk=chunk, decay=0.02,
                beta_heads=(1, 2), skip_heads=(1, 2))
    _fused_against_split(x, chunk, monkeypatch, "cuda")


def _dkv_chunks(length: int, key: int, value: int, chunk: int, kind: str, initial: bool, seed: int, heads=(1, 2)):
    """Chunks whose k has every head (chunk_dkv's calls): "retnet" (a decay per head, the same at every step),
    "linear" (no decay: ell 0), "ssd" (`_chunks`' decays per step, β and skip over the heads); s0 zero where not
    `initial`."""
    ssd = kind == "ssd"
    x = _chunks(length, key=key, value=value, seed=seed, chunk=chunk, decay=0.05, q_heads=heads, k_heads=heads,
                v_heads=heads, ell_heads=heads, s0_heads=heads, beta_heads=heads if ssd else None,
                skip_heads=heads if ssd else None)
    ell = x.ell
    if kind != "ssd":
        steps = torch.arange(ell.shape[-2] * chunk).reshape(ell.shape[-2:]) < length  # zero past the call
        gammas = [0.0] * heads[-1] if kind == "linear" else [np.log(1 - 2.0 ** (-5 - h)) for h in range(heads[-1])]
        ell = torch.tensor(gammas, dtype=torch.float32).reshape(-1, 1, 1) * steps
        ell = ell.expand(*heads, *ell.shape[-2:]).contiguous()
    s0 = x.s0 if initial else torch.zeros_like(x.s0)
    return algorithm.Chunks(x.q, x.k, x.v, ell, s0, x.beta, x.skip)


def _dkv_against_split(x: algorithm.Chunks, seed: int, monkeypatch, device: str = "cpu", half: bool = False) -> None:
    """mma.backward of `x` (moved to `device`) with SSMC_CUDA_CHUNK_DKV=fused (chunk_dkv: dk and dv from one block a
    chunk) and narrow (chunk_dkv_n: the same, 64 columns a warp's pass) against split (chunk_dk, chunk_dv): every
    gradient, the row dots (rows), end dots (ends) and d_end bit for bit (the same sums in the same order and
    roundings); `half`: dk and dv into 16-bit time-first arrays (`outs`: chunk_dkv*_ho against chunk_dk_ho,
    chunk_dv_ho). On a GPU the dots (rows, ends, dβ, dskip, and dℓ of them) within 1e-6: the compiler may contract
    a dot's `a·b + c·d` into either fma in each kernel (the gradients' sums have one product an add)."""
    d_out, d_final = (t.to(device) for t in _cotangents(x, seed))
    x = algorithm.Chunks(*(None if a is None else a.to(device) for a in (x.q, x.k, x.v, x.ell, x.s0, x.beta, x.skip)))
    heads, nc, chunk, key, value = x.q.shape[:-3], *x.q.shape[-3:], x.v.shape[-1]
    names = []
    monkeypatch.setattr(mma, "_launch", lambda *a, _f=mma._launch: names.append(a[1]) or _f(*a))

    def run(form):
        monkeypatch.setenv("SSMC_CUDA_CHUNK_DKV", form)
        _, entering, final = mma.forward(x, half_states=True)
        outs = {}
        if half:
            outs = {"dk": _time_first_view(heads, nc, chunk, key, x.q.dtype).to(device),
                    "dv": _time_first_view(heads, nc, chunk, value, x.q.dtype).to(device)}
        names.clear()
        parts: dict = {}
        got = mma.backward(x, entering, final, d_out, d_final, parts=parts, outs=outs)
        if half:
            assert got[1] is outs["dk"] and got[2] is outs["dv"]
        return got, parts, list(names)

    dots = ("rows", "ends", "dell", "dbeta", "dskip") if device != "cpu" else ()

    def same(a, b, form, name):
        if name in dots:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()), msg=f"{form} {name}")
        else:
            assert torch.equal(a, b), (form, name, float((a.double() - b.double()).abs().max()))

    split, split_parts, launched = run("split")
    assert "chunk_dkv" not in launched and "chunk_dkv_ho" not in launched
    assert {"chunk_dk", "chunk_dv"} <= {n.removesuffix("_ho") for n in launched}
    for form in ("fused", "narrow"):
        fused, fused_parts, launched = run(form)
        assert launched[-1] == "chunk_dkv" + ("_n" if form == "narrow" else "") + ("_ho" if half else ""), launched
        assert not {"chunk_dk", "chunk_dv"} & {n.removesuffix("_ho") for n in launched}
        for name in ("rows", "ends", "d_end"):
            same(fused_parts[name], split_parts[name], form, name)
        for name, a, b in zip(("dq", "dk", "dv", "dell", "ds0", "dbeta", "dskip"), fused, split):
            if b is None:
                assert a is None, name
            else:
                assert a.dtype == b.dtype == (x.q.dtype if half and name in ("dk", "dv") else torch.float32), name
                same(a, b, form, name)


@needs_emulator
@pytest.mark.parametrize("chunk, length, key, value, kind, initial", [
    (64, 130, 64, 64, "retnet", True),
    (64, 100, 128, 64, "linear", False),
    (64, 70, 64, 128, "ssd", True),
    (128, 200, 128, 128, "retnet", False),
    nightly_case(128, 150, 64, 64, "ssd", False, reason="chunk 128's warps: the retnet case at K = V = 128 has them"),
    nightly_case(128, 130, 128, 64, "linear", True, reason="K and V apart: chunk 64's cases have them")])
def test_emulated_fused_dkv_is_the_split_kernels(emulate, monkeypatch, chunk, length, key, value, kind, initial):
    """SSMC_CUDA_CHUNK_DKV=fused and narrow (chunk_dkv, chunk_dkv_n) against split (chunk_dk, chunk_dv): bit for
    bit (`_dkv_against_split`), K and V of 64 and 128, chunks of 64 and 128, the last chunk partial, RetNet's decays,
    none (linear attention), SSD's with β and skip (k per head), with and without an initial state."""
    x = _dkv_chunks(length, key, value, chunk, kind, initial, seed=length + key + value)
    _dkv_against_split(x, length, monkeypatch)


@needs_emulator
def test_emulated_fused_dkv_writes_16_bit_gradients(emulate, monkeypatch):
    """chunk_dkv_ho and chunk_dkv_n_ho (dk and dv rounded to 16 bits as stored, into the time-first arrays of
    `outs`) against chunk_dk_ho and chunk_dv_ho, bit for bit; fp16, SSD's β and skip, two chunks of 64, V = 128."""
    x = _dkv_chunks(100, 64, 128, 64, "ssd", True, seed=4)
    x = algorithm.Chunks(x.q.half(), x.k.half(), x.v.half(), x.ell, x.s0, x.beta, x.skip)
    _dkv_against_split(x, 4, monkeypatch, half=True)


@needs_emulator
def test_emulated_fused_dkv_on_unaligned_operands(emulate, monkeypatch):
    """k and v at an odd storage offset with an odd step stride (the module whose tiles load value by value and
    whose fragments load 16 bits at a time): chunk_dkv against chunk_dk, chunk_dv bit for bit; SSD's β and skip."""
    x = _dkv_chunks(70, 64, 64, 64, "ssd", True, seed=8)

    def odd(a):
        wide = torch.zeros((*a.shape[:-1], a.shape[-1] + 1), dtype=a.dtype)
        wide[..., 1:] = a
        return wide[..., 1:]

    x = algorithm.Chunks(x.q, odd(x.k), odd(x.v), x.ell, x.s0, x.beta, x.skip)
    built = []
    monkeypatch.setattr(mma, "source", lambda *a, _f=mma.source: built.append(a[4]) or _f(*a))
    _dkv_against_split(x, 8, monkeypatch)
    assert set(built) == {False}


@needs_emulator
def test_grouped_keys_keep_the_split_kernels(emulate, monkeypatch):
    """Where k lacks heads of the call (SSD's B over a group's r heads), dk is summed over them by chunk_dk:
    SSMC_CUDA_CHUNK_DKV=fused launches chunk_dk and chunk_dv as split does; and chunk 256 takes them too (narrow)."""
    names = []
    monkeypatch.setattr(mma, "_launch", lambda *a, _f=mma._launch: names.append(a[1]) or _f(*a))
    for form, x in (("fused", _chunks(70, seed=2, chunk=64)), ("narrow", _dkv_chunks(20, 64, 64, 256, "retnet", True,
                                                                                   seed=3))):
        monkeypatch.setenv("SSMC_CUDA_CHUNK_DKV", form)
        d_out, d_final = _cotangents(x, 1)
        _, entering, final = mma.forward(x, half_states=True)
        names.clear()
        mma.backward(x, entering, final, d_out, d_final)
        assert "chunk_dk" in names and "chunk_dv" in names and not any("dkv" in n for n in names), names


def test_the_chunk_dkv_option():
    from ssmc.backends.cuda.options import CudaOptions

    assert CudaOptions.parse({}).chunk_dkv is None
    for form in ("split", "fused", "narrow"):
        assert CudaOptions.parse({"SSMC_CUDA_CHUNK_DKV": form}).chunk_dkv == form
    with pytest.raises(ValueError, match="SSMC_CUDA_CHUNK_DKV"):
        CudaOptions.parse({"SSMC_CUDA_CHUNK_DKV": "both"})


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [64, 128])
@pytest.mark.parametrize("kind", ["retnet", "ssd"])
def test_gpu_fused_dkv_is_the_split_kernels(chunk, kind, monkeypatch):
    """`_dkv_against_split` on the GPU (cp.async, ldmatrix, the hardware's mma and roundings): RetNet's bench shape
    reduced (B 1, H 2, L 1000, K = V = 128), RetNet's decays or SSD's with β and skip; bf16, and 16-bit outs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.delenv("SSMC_CUDA_EMULATE", raising=False)
    x = _dkv_chunks(1000, 128, 128, chunk, kind, True, seed=chunk, heads=(1, 2))
    _dkv_against_split(x, chunk, monkeypatch, "cuda")
    _dkv_against_split(x, chunk + 1, monkeypatch, "cuda", half=True)


@needs_emulator
@pytest.mark.parametrize("heads_a_block", [4, 2, nightly_case(1, reason="a head a block: 4 and 2 sum in and across")])
def test_emulated_backward_sums_dq_dk_over_a_groups_heads(emulate, heads_a_block):
    """SSD's groups: q and k ([b, g, 1]) lack the r = 4 heads of a group ([b, g, r]: b 2, g 1), so chunk_dq and
    chunk_dk sum dq and dk over them in the kernel: one block set of all 4 heads, two subsets of 2 (partial
    sums added after) or a head a block. Against algorithm.vjp's per-head gradients summed: a head left out,
    counted twice or taken from another group fails; the per-head row dots of the log decays' cotangent
    against the reference's; L 100 over two chunks of 64, the second partial."""
    x = _chunks(100, seed=11, chunk=64, q_heads=(2, 1), k_heads=(2, 1), v_heads=(2, 4), ell_heads=(2, 4),
                s0_heads=(2, 4), beta_heads=(2, 4))
    errs = _check_backward(x, 9, 6e-3, heads_a_block=heads_a_block)
    assert errs["dq"] > 0 and errs["dk"] > 0


@needs_emulator
def test_emulated_backward_with_key_and_value_sizes_apart(emulate):
    """K = 64, V = 128: dq and dk come from the module of (V, K), dv and the states from that of (K, V)
    (two value tiles: the end dots summed over them); fp16, every operand per head; L 70 over two
    chunks of 64. (The forward's module is test_emulated_kernels_with_every_operand_per_head_in_fp16's:
    built once.)"""
    h = (2,)
    x = _chunks(70, value=128, dtype=torch.float16, seed=5, q_heads=h, k_heads=h, v_heads=h, ell_heads=h,
                s0_heads=h, chunk=64)
    _check_backward(x, 3, 1e-3)


def _time_first_view(heads: tuple[int, ...], nc: int, chunk: int, dim: int, dtype) -> torch.Tensor:
    """[*heads, NC, C, dim] view of a new time-first array [NC·C, *heads, dim] of NaN (`ChunkedCore._time_first_out`'s
    layout: what the kernels leave unwritten shows)."""
    nh = len(heads)
    buf = torch.full((nc * chunk, *heads, dim), float("nan"), dtype=dtype)
    view = buf.permute(*range(1, nh + 1), 0, nh + 1).reshape(*heads, nc, chunk, dim)
    assert view.data_ptr() == buf.data_ptr() and view.stride(nh) == chunk * view.stride(nh + 1)
    return view


@needs_emulator
@pytest.mark.parametrize("every_head", [False, True])
def test_emulated_16_bit_direct_gradients_are_the_fp32_ones_rounded(emulate, every_head):
    """`outs` in q's 16-bit dtype (the time-first gradients of 16-bit inputs: chunk_dq_ho, chunk_dk_ho, chunk_dv_ho)
    against the same call with fp32 `outs`: each written in place, bit for bit the fp32 gradient rounded as torch's
    cast rounds it (to nearest even); every other result (dq, dk summed over heads, the log decays' cotangent of the
    row and end dots, ds0, dbeta, dskip) bit for bit the fp32 call's, so nothing the kernels derive from dv, dq, dk
    reads the rounded values. SSD's broadcast (dv alone 16-bit, with β and a skip) and every operand per head
    (RetNet's: dq, dk, dv); L 100 over two chunks of 64, the second partial."""
    h = (1, 2)
    heads = dict(q_heads=h, k_heads=h) if every_head else dict(q_heads=(1, 1), k_heads=(1, 1))
    x = _chunks(100, seed=12, chunk=64, v_heads=h, ell_heads=h, s0_heads=h, beta_heads=h, skip_heads=h, **heads)
    d_out, d_final = _cotangents(x, 13)
    _, entering, final = mma.forward(x, half_states=True)
    roles = ("dq", "dk", "dv") if every_head else ("dv",)
    nc, chunk = x.q.shape[-3:-1]
    dims = {"dq": 64, "dk": 64, "dv": 64}
    wide = {r: _time_first_view(h, nc, chunk, dims[r], torch.float32) for r in roles}
    half = {r: _time_first_view(h, nc, chunk, dims[r], torch.bfloat16) for r in roles}
    want = mma.backward(x, entering, final, d_out, d_final, outs=wide)
    got = mma.backward(x, entering, final, d_out, d_final, outs=half)
    for i, name in enumerate(("dq", "dk", "dv", "dell", "ds0", "dbeta", "dskip")):
        if name in roles:
            assert got[i].data_ptr() == half[name].data_ptr() and got[i].dtype == torch.bfloat16, name
            assert want[i].data_ptr() == wide[name].data_ptr(), name
            assert not bool(want[i].isnan().any()), name
            assert torch.equal(got[i], want[i].to(torch.bfloat16)), name
        else:
            assert got[i].dtype == torch.float32 and torch.equal(got[i], want[i]), name


@needs_emulator
@pytest.mark.parametrize("name", ["mamba2", "retnet"])
def test_chunked_core_writes_16_bit_inputs_gradients_in_16_bits(name, emulate, monkeypatch):
    """ChunkedCore's backward (and its prepared one) on bf16 operands, where the caller only casts their gradients
    (`casting_gradients`, as ssmc.torch's backward says): the gradients the kernels write time first (SSD's x;
    RetNet's q, k, v) come in bf16, as the kernels wrote them, bit for bit the fp32 ones of `HALF_GRADIENTS` off
    rounded; every other gradient bit for bit the same. Outside that context (ssmc.grad) they stay fp32. L 64 (one
    whole chunk)."""
    from ssmc.backends.cuda.kernels import chunk
    from ssmc.passes.autodiff import GRAD
    from ssmc.runtime.precision import casting_gradients

    program, sizes = _core(name)
    length = 64
    rng = np.random.default_rng(14)
    seqs, params, initial = _core_inputs(program, sizes, length, rng, torch.bfloat16)
    core = chunk.ChunkedCore(program, "float32")
    outs, finals, tape = core.forward(seqs, params, initial, sizes, length)
    output, state = core.output, program.states[0].name
    cot = {GRAD + output: torch.from_numpy(rng.standard_normal(tuple(outs[output].shape))).to(torch.bfloat16)}
    lam = {GRAD + state: torch.from_numpy(rng.standard_normal(tuple(finals[state].shape))).float()}
    names = ["x"] if name == "mamba2" else ["q", "k", "v"]
    direct = {GRAD + n for n in names}
    prepared = core.prepare_backward(seqs, params, tape, cot, lam, None, sizes, length)
    with casting_gradients(frozenset(names)):
        got = core.backward(seqs, params, tape, cot, lam, None, sizes, length)
        got_prepared = [prepared(seqs, params, tape, cot, lam, None) for _ in range(2)]  # (its plan made, then taken)
    want = core.backward(seqs, params, tape, cot, lam, None, sizes, length)  # (no context: fp32)
    # the prepared backward outside the context: a plan of its own (fp32), not the 16-bit one
    outside = [prepared(seqs, params, tape, cot, lam, None) for _ in range(2)]
    monkeypatch.setattr(chunk, "HALF_GRADIENTS", False)
    with casting_gradients(frozenset(names)):
        off = core.backward(seqs, params, tape, cot, lam, None, sizes, length)
    for result in (off, *outside):
        for g, w in zip(result, want):
            assert set(g) == set(w)
            for k in w:
                assert g[k].dtype == w[k].dtype and torch.equal(g[k], w[k]), k
    for result in (got, *got_prepared):
        for g, w in zip(result, want):
            assert set(g) == set(w)
            for k in w:
                if k in direct:
                    assert g[k].dtype == torch.bfloat16 and w[k].dtype == torch.float32, k
                    assert torch.equal(g[k], w[k].to(torch.bfloat16)), k
                else:
                    assert g[k].dtype == w[k].dtype and torch.equal(g[k], w[k]), k


@needs_emulator
@pytest.mark.parametrize("name", ["mamba2", "retnet"])
def test_emulated_spec_gradients_of_16_bit_inputs(name, emulate, monkeypatch):
    """A training step through ssmc.torch.function on bf16 inputs, emulated (K = V = 64, L 64): the gradients
    of x (RetNet's q, k, v) reach the caller in bf16 as the backward kernels wrote them (`ChunkedCore._gradients`
    returns them so: no fp32 array between), every gradient bit for bit that of `HALF_GRADIENTS` off (fp32, cast
    by the torch op) and, as the GPU test holds them, within 2e-2 (the decays' parameters 3e-2) of the torch
    backward's (SSMC_CUDA_CHUNK_BACKWARD=0). Two steps each: the general path, then the prepared one."""
    import ssmc.torch
    from ssmc.backends.cuda.kernels import chunk
    from ssmc.examples import mamba2, retnet

    rng = np.random.default_rng(15)
    if name == "mamba2":
        spec, layout = mamba2.SPEC, mamba2.LAYOUT
        inputs = mamba2.make_inputs(rng, 64, batch=1, groups=1, heads=2, headdim=64, state=64)
        inputs["x"] = inputs["x"] * 0.3
        direct = ["x"]
    else:
        spec, layout = retnet.SPEC, retnet.LAYOUT
        inputs = retnet.make_inputs(rng, 64, batch=1, heads=2, dk=64, dv=64)
        inputs["gamma"] = 1.0 - 2.0 ** (-5.0 - np.arange(2))  # (as `_spec_case`'s)
        inputs["q"] = inputs["q"] / 8.0
        direct = ["q", "k", "v"]
    inputs.pop(spec.program.states[0].name, None)  # (no initial state: the prepared step's own zeros)
    bf = {k: torch.from_numpy(v).to(torch.bfloat16 if np.ndim(v) > 2 else torch.float32) for k, v in inputs.items()}
    returned = []
    monkeypatch.setattr(chunk.ChunkedCore, "_gradients", lambda *a, _f=chunk.ChunkedCore._gradients, **kw:
                        (lambda r: returned.append(r[0]) or r)(_f(*a, **kw)))
    dy = None

    def steps():
        nonlocal dy
        fn = ssmc.torch.function(spec, "cuda", layout=layout)
        results = []
        for _ in range(2):
            leaves = {k: v.clone().requires_grad_(True) for k, v in bf.items()}
            y = fn(**leaves)
            if dy is None:
                dy = torch.from_numpy(rng.standard_normal(tuple(y.shape))).to(y.dtype)
            y.backward(dy)
            results.append({k: v.grad for k, v in leaves.items()})
        return results

    got = steps()
    assert len(returned) == 2
    for grads in returned:
        for n in direct:
            assert grads["grad_" + n].dtype == torch.bfloat16, n
    for grads in got:
        for n in direct:
            assert grads[n].dtype == torch.bfloat16, n
    monkeypatch.setattr(chunk, "HALF_GRADIENTS", False)
    want = steps()
    assert all(grads["grad_" + n].dtype == torch.float32 for grads in returned[2:] for n in direct)
    for g, w in zip(got, want):
        for k in w:
            assert g[k].dtype == w[k].dtype and torch.equal(g[k], w[k]), k
    monkeypatch.setattr(chunk, "HALF_GRADIENTS", True)
    monkeypatch.setenv("SSMC_CUDA_CHUNK_BACKWARD", "0")
    before = len(returned)
    torch_backward = steps()
    assert len(returned) == before + 2
    assert all(grads["grad_" + n].dtype == torch.float32 for grads in returned[before:] for n in direct)
    for k, t in torch_backward[-1].items():
        g = got[-1][k]
        assert _rel(g, t) < (3e-2 if k in ("dt", "A", "gamma") else 2e-2), (k, _rel(g, t))


@ssmc.recurrence
def value_gated(S: ssmc.State["b h k v"], q: ssmc.Seq["b h k"], k: ssmc.Seq["b h k"], v: ssmc.Seq["b h v"]):
    """Linear attention gated by silu(v): a post stage that reads v too, so v's gradient has two parts."""
    S = S + k * v
    y = ssmc.dot(S, q, over="k") * ssmc.silu(v)
    return S, y


@needs_emulator
def test_emulated_staged_input_read_by_two_stages_keeps_an_fp32_gradient(emulate, monkeypatch):
    """A staged layer (core, post) whose post stage reads v too: the core writes q's and k's gradients in bf16 (only
    cast after) but v's in fp32 (the post's part is added into it before the cast: `StagedGrad.read_alone`), so
    every gradient is bit for bit that of `HALF_GRADIENTS` off. Emulated, K = V = 64, L 64, two steps each."""
    import ssmc.torch
    from ssmc.backends.cuda.kernels import chunk

    rng = np.random.default_rng(16)
    shapes = {"q": (1, 64, 2, 64), "k": (1, 64, 2, 64), "v": (1, 64, 2, 64)}
    bf = {n: torch.from_numpy(rng.standard_normal(s) * (0.125 if n == "q" else 1.0)).to(torch.bfloat16)
          for n, s in shapes.items()}
    roles = []
    monkeypatch.setattr(chunk.ChunkedCore, "_direct_roles", lambda *a, _f=chunk.ChunkedCore._direct_roles:
                        (lambda r: roles.append({n.arg: d for _, n, _, _, d in r}) or r)(_f(*a)))
    dy = torch.from_numpy(rng.standard_normal((1, 64, 2, 64))).to(torch.bfloat16)

    def steps():
        fn = ssmc.torch.function(value_gated, "cuda", layout="b t ...")
        results = []
        for _ in range(2):
            leaves = {n: t.clone().requires_grad_(True) for n, t in bf.items()}
            fn(**leaves).backward(dy)
            results.append({n: t.grad for n, t in leaves.items()})
        return results

    got = steps()
    assert roles and all(r == {"q": torch.bfloat16, "k": torch.bfloat16, "v": torch.float32} for r in roles), roles
    monkeypatch.setattr(chunk, "HALF_GRADIENTS", False)
    want = steps()
    for g, w in zip(got, want):
        for n in w:
            assert g[n].dtype == w[n].dtype == torch.bfloat16 and torch.equal(g[n], w[n]), n


@needs_emulator
@pytest.mark.parametrize("length", [
    nightly_case(7, reason="one partial chunk: L 130's last chunk is partial too"), 130])
def test_emulated_kernels_with_a_per_step_beta(emulate, length):
    """A per-(step, head) β (SSD's softplus(dt), v the raw x) and a skip (SSD's D: O_i + D v_i, added by
    chunk_output): the forward (both ways to the states, 16-bit states and output) and every cotangent,
    β's and the skip's included, against algorithm.py in float64 with β folded into v; β and the skip
    with SSD's heads (b, r), some of β negative; the last chunk partial or the only one."""
    x = _chunks(length, seed=length + 21, chunk=64, decay=0.3, beta_heads=(1, 2), skip_heads=(1, 2))
    assert mma.kernels_apply(x)
    ref_out, ref_entering, ref_final = _reference(x)
    wide = _wide(x)  # the reference folds β into v, then adds the skip's D v (of the raw v)
    assert torch.allclose(algorithm.forward(wide.folded())[0] + wide.skip[..., None] * wide.v, ref_out)
    for one_pass in (False, True):
        out, entering, final = mma.forward(x, one_pass=one_pass)
        assert _rel(out, ref_out) < 1e-2 and _rel(final, ref_final) < 1e-2 and _rel(entering, ref_entering) < 1e-2
    half_out, _, _ = mma.forward(x, half_states=True, out_dtype=x.q.dtype)
    assert torch.equal(half_out, out.to(x.q.dtype))
    core_out = mma.forward(x.core())[0]  # the skip is D v added to the core's output
    torch.testing.assert_close(out, core_out + x.skip[..., None] * x.v.float(), rtol=1e-5, atol=1e-5)
    # without β the same kernels give the output of β = 1
    ones = algorithm.Chunks(x.q, x.k, x.v, x.ell, x.s0, (x.beta != 0).float())
    plain = algorithm.Chunks(x.q, x.k, x.v, x.ell, x.s0)
    assert torch.allclose(mma.forward(ones)[0], mma.forward(plain)[0])
    _check_backward(x, length, 6e-3)


def test_beta_folds_into_v_in_the_torch_path():
    """algorithm.vjp with β: dv = β dṼ and dβ = Σ_ν v dṼ, dṼ the cotangent of the folded v; the other
    cotangents those of the folded chunks."""
    x = _wide(_chunks(40, seed=2, chunk=16, beta_heads=(1, 2), dtype=torch.float32))
    folded = x.folded()
    d_out, d_final = _cotangents(folded, 9)
    _, entering, final = algorithm.forward(x)
    got = algorithm.vjp(x, entering, final, d_out.double(), d_final.double())
    want = algorithm.vjp(folded, entering, final, d_out.double(), d_final.double())
    for i in (0, 1, 3, 4):
        torch.testing.assert_close(got[i], want[i])
    torch.testing.assert_close(got[2], want[2] * x.beta[..., None])
    torch.testing.assert_close(got[5], (want[2] * x.v).sum(-1))
    assert want[5] is None and got[6] is None and want[6] is None


def test_the_torch_path_with_beta_and_skip_matches_autograd():
    """algorithm.forward / vjp with β and a skip (o + skip v) against torch autograd of the forward."""
    x = _wide(_chunks(40, seed=4, chunk=16, beta_heads=(1, 2), skip_heads=(1, 2), dtype=torch.float32))
    names = ("q", "k", "v", "ell", "s0", "beta", "skip")
    leaves = {n: getattr(x, n).clone().requires_grad_(True) for n in names}
    out, entering, final = algorithm.forward(algorithm.Chunks(**leaves))
    d_out, d_final = torch.randn_like(out), torch.randn_like(final)
    want = torch.autograd.grad((out * d_out).sum() + (final * d_final).sum(), list(leaves.values()))
    got = algorithm.vjp(x, entering.detach(), final.detach(), d_out, d_final)
    for name, w, g in zip(names, want, got):
        axes = [i for i in range(g.dim()) if w.shape[i] == 1 and g.shape[i] != 1]
        g = g.sum(axes, keepdim=True) if axes else g
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("name, length", GPU_SPEC_CASES)
def test_gpu_spec_gradients_on_the_backward_kernels(name, length, monkeypatch):
    """A training step through ssmc.torch.function on bf16 inputs (the initial state included): every
    gradient (x, B, C, dt, A, D, the initial state; q, k, v, gamma, S) with the backward kernels
    (counted) against float64 on the same rounded inputs and cotangents (the chunked torch path, which
    tests/test_chunked.py holds to the interpreter), relative RMS error within 2e-2 and at most twice
    the torch backward's (SSMC_CUDA_CHUNK_BACKWARD=0: fp32 products) plus 2e-3; the decays' parameters
    (sums over every step) within 3e-2. The training call takes the kernels (q, k, v kept 16-bit:
    `ChunkedCore.half_inputs`), the forward counted too."""
    import ssmc
    import ssmc.torch
    from ssmc.backends.cuda.kernels import chunk

    monkeypatch.delenv("SSMC_CUDA_EMULATE", raising=False)
    monkeypatch.delenv("SSMC_CUDA_CHUNK_KERNELS", raising=False)
    monkeypatch.delenv("SSMC_CUDA_CHUNK_BACKWARD", raising=False)
    spec, layout, inputs = _spec_case(name, length)
    bf = {k: torch.as_tensor(v, device="cuda").to(torch.bfloat16 if np.ndim(v) > 1 else torch.float32)
          for k, v in inputs.items()}
    fn = ssmc.torch.function(spec, layout=layout, return_final_states=True)
    rng = np.random.default_rng(length + 1)
    y, final = fn(**bf)
    dy = torch.from_numpy(rng.standard_normal(tuple(y.shape))).to("cuda", torch.bfloat16)
    dfinal = torch.from_numpy(rng.standard_normal(tuple(final.shape))).to("cuda", torch.float32)
    calls, forwards = [], []
    monkeypatch.setattr(chunk.mma, "backward", lambda *a, _f=chunk.mma.backward, **kw: calls.append(1) or _f(*a, **kw))
    monkeypatch.setattr(chunk.mma, "forward", lambda *a, _f=chunk.mma.forward, **kw: forwards.append(1) or _f(*a, **kw))

    def gradients():
        leaves = {k: v.clone().requires_grad_(True) for k, v in bf.items()}
        y, final = fn(**leaves)
        torch.autograd.backward([y, final], [dy.to(y.dtype), dfinal.to(final.dtype)])
        return {k: v.grad for k, v in leaves.items()}

    got = gradients()
    assert calls and forwards, "the kernels did not run"

    def output_only():  # a cotangent of y alone: the prepared steps' backward (bf16 dy to the kernels as given)
        leaves = {k: v.clone().requires_grad_(True) for k, v in bf.items()}
        fn(**leaves)[0].backward(dy)
        return {k: v.grad for k, v in leaves.items()}

    n = len(calls)
    prepared = output_only()
    assert len(calls) == n + 1
    monkeypatch.setenv("SSMC_CUDA_CHUNK_BACKWARD", "0")
    prepared_torch = output_only()
    assert len(calls) == n + 1
    for k, t in prepared_torch.items():
        assert _rel(prepared[k], t) < (3e-2 if k in ("dt", "A", "gamma") else 2e-2), (k, _rel(prepared[k], t))
    n = len(calls)
    torch_backward = gradients()
    assert len(calls) == n
    rounded = {k: v.double().cpu().numpy() for k, v in bf.items()}
    state = spec.program.states[0].name
    output = spec.program.outputs[0][0]
    want = ssmc.grad(spec, backend="cuda", layout=layout, dtype="float64")(
        **rounded, grad_outputs={output: dy.double().cpu().numpy()},
        grad_final_states={state: dfinal.double().cpu().numpy()})
    for k, w in want.items():
        w = torch.as_tensor(np.asarray(w.cpu() if hasattr(w, "cpu") else w), device="cuda").double()
        g, t = got[k], torch_backward[k]
        assert g is not None and g.shape == w.shape, k
        if k in ("dt", "A", "gamma"):  # sums over every step: the kernels' 16-bit products weigh more there
            assert _rel(g, w) < 3e-2, (k, _rel(g, w), _rel(t, w))
        else:
            assert _rel(g, w) < 2e-2, (k, _rel(g, w), _rel(t, w))
            assert _rel(g, w) < 2 * _rel(t, w) + 2e-3, (k, _rel(g, w), _rel(t, w))
        assert _rel(t, w) < 2e-2, (k, _rel(t, w))  # the torch backward on the kernels' forward


def count_prepared_calls(monkeypatch, counts: dict) -> dict:
    """`counts` ({"plans": 0, "general": 0, ...}) counting the plans `PreparedForward` makes and the calls of
    the general `ChunkedCore.forward` (either path's), by wrapping both; returned."""
    from ssmc.backends.cuda.kernels.chunk import ChunkedCore, PreparedForward

    def plan(*a, _f=PreparedForward._plan):
        found = _f(*a)
        counts["plans"] += found is not False
        return found

    def general(*a, _f=ChunkedCore.forward, **kw):
        counts["general"] += 1
        return _f(*a, **kw)
    monkeypatch.setattr(PreparedForward, "_plan", plan)
    monkeypatch.setattr(ChunkedCore, "forward", general)
    return counts


@pytest.mark.gpu
@pytest.mark.parametrize("length", [180, 70])
def test_gpu_short_calls_take_the_padded_prepared_path(length, monkeypatch):
    """SSD bf16 at a length no multiple of the chunk (180: 128 + 52; 70: 64 + 6 at SSMC_CUDA_CHUNK=64) through
    ssmc.torch.function on the GPU: the first calls general (the second makes the prepared forward's plan), the
    third on the padded prepared path (`PreparedForward`: no general forward, no plan made again), with the first
    call's output and every gradient bit for bit."""
    import ssmc.torch
    from ssmc.examples import mamba2

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for name in ("SSMC_CUDA_EMULATE", "SSMC_CUDA_CHUNK_KERNELS", "SSMC_CUDA_CHUNK", "SSMC_CUDA_CHUNK_TUNE"):
        monkeypatch.delenv(name, raising=False)
    if length == 70:
        monkeypatch.setenv("SSMC_CUDA_CHUNK", "64")
    counts = count_prepared_calls(monkeypatch, {"plans": 0, "general": 0})
    rng = np.random.default_rng(length)
    inputs = mamba2.make_inputs(rng, length, batch=2, groups=1, heads=4, headdim=64, state=64)
    bf = {k: torch.as_tensor(v, device="cuda").to(torch.bfloat16 if np.ndim(v) > 1 else torch.float32)
          for k, v in inputs.items()}
    fn = ssmc.torch.function(mamba2.SPEC, layout=mamba2.LAYOUT)
    dy = None
    results = []
    for _ in range(3):
        leaves = {k: v.clone().requires_grad_(True) for k, v in bf.items()}
        y = fn(**leaves)
        if dy is None:
            g = torch.Generator(device="cuda").manual_seed(1)
            dy = torch.randn(y.shape, generator=g, device="cuda").to(y.dtype)
        y.backward(dy)
        results.append([y.detach(), *(leaves[k].grad for k in sorted(leaves))])
    # the general forward at the first call and at the prepared forward's first (which makes the plan) only
    assert counts["plans"] == 1 and counts["general"] == 2, counts
    for got in results[1:]:
        for a, b in zip(got, results[0], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [64, 128, 256])
@pytest.mark.parametrize("key, value", [(128, 64), (128, 128), (64, 128)])
def test_gpu_backward_kernels_at_every_chunk_agree_with_the_torch_vjp(chunk, key, value, monkeypatch):
    """The backward kernels on the GPU (dynamic shared memory past 48 KiB; dq and dk from the module of
    (V, K)) against algorithm.vjp in float64 on the same rounded values: L 1000 (the last chunk
    partial), SSD's broadcast of q and k over two heads, every cotangent within 6e-3."""
    monkeypatch.delenv("SSMC_CUDA_EMULATE", raising=False)
    monkeypatch.delenv("SSMC_CUDA_CHUNK_KERNELS", raising=False)
    monkeypatch.delenv("SSMC_CUDA_CHUNK_BACKWARD", raising=False)
    x = _chunks(1000, key=key, value=value, seed=chunk + key + value + 1, chunk=chunk, decay=0.02)
    d_out, d_final = _cotangents(x, chunk)
    want = _reference_vjp(x, d_out, d_final)
    gpu = algorithm.Chunks(*(t.cuda() for t in (x.q, x.k, x.v, x.ell, x.s0)))
    _, entering, final = mma.forward(gpu)
    got = mma.backward(gpu, entering, final, d_out.cuda(), d_final.cuda())
    for name, g, w in zip(("dq", "dk", "dv", "dell", "ds0"), got, want):
        assert g.shape == _summed_as(w, g).shape, name
        assert _rel_summed(g.cpu(), w) < 6e-3, (name, _rel_summed(g.cpu(), w))
