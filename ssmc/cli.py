"""The ``ssmc`` command line.

    ssmc show SPEC.py[:NAME] [--stage STAGE]     print a spec's program after a compiler stage
    ssmc inspect SPEC.py[:NAME] [--sizes b=8,d=64] [--length L] [--dtype T] [--arch sm_90]
                                                 the CUDA kernels: launch shape, registers, spills
    ssmc check SPEC.py [SPEC.py ...]             run every spec in the files on random inputs
    ssmc bench SPEC.py[:NAME] [--backend B] [--sizes b=8,d=64] [--length L] [--layout "b d t"]
                                                 check a spec against the interpreter, then time it
    ssmc demo [--backend B]                      run the bundled examples against their references

A spec file is any Python file that defines ``@ssmc.recurrence`` / ``ssmc.attention`` objects at
module level. Problems with the user's input (a bad spec, a missing file) are reported as one line
on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import runpy
import sys
import time
import traceback

import numpy as np

from . import __version__, api, pipeline
from .backends.registry import get_backend
from .errors import SpecError
from .frontend.attention import AttentionSpec
from .frontend.spec import RecurrenceSpec
from .runtime.random_inputs import axis_sizes, default_sizes, random_recurrence_inputs

SPEC_TYPES = (RecurrenceSpec, AttentionSpec)
DEMO_LENGTH = 256
DEMO_TOLERANCE = 1e-9  # max relative error in float64


class UsageError(Exception):
    """A problem with what the user asked for (missing file, unknown name): one line, exit 1."""


# -- loading spec files ------------------------------------------------------------------------

def split_target(target: str) -> tuple[str, str | None]:
    """``"path.py:NAME"`` -> ("path.py", "NAME"); a plain path -> (path, None)."""
    path, sep, name = target.rpartition(":")
    if sep and name.isidentifier() and not os.path.exists(target):
        return path, name
    return target, None


def _run_file(path: str) -> dict:
    """Execute a spec file (not as __main__) with its folder importable; return its globals."""
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    try:
        return runpy.run_path(path, run_name="__ssmc_spec__")
    except SpecError:
        raise
    except Exception as err:
        frames = [f for f in traceback.extract_tb(err.__traceback__)
                  if os.path.abspath(f.filename) == os.path.abspath(path)]
        where = f"{path}:{frames[-1].lineno}" if frames else path
        raise UsageError(f"{where}: {type(err).__name__}: {err}") from None
    finally:
        sys.path.remove(folder)


def load_specs(target: str, required: bool = True) -> list[tuple[str, RecurrenceSpec | AttentionSpec]]:
    """The specs defined in a file, as (variable name, spec); ``path:NAME`` picks one.

    A spec bound to several names (``SPEC = hgrn``) is listed once, under its first name. A file
    without specs is an error when `required`, else gives an empty list.
    """
    path, name = split_target(target)
    if os.path.isdir(path):
        raise UsageError(f"{path}: a folder; give a spec file (SPEC.py)")
    if not os.path.isfile(path):
        raise UsageError(f"{path}: no such file")
    namespace = _run_file(path)
    found: list[tuple[str, RecurrenceSpec | AttentionSpec]] = []
    for var, value in namespace.items():
        new = all(value is not spec for _, spec in found)
        if isinstance(value, SPEC_TYPES) and not var.startswith("_") and new:
            found.append((var, value))
    if name is not None:
        spec = namespace.get(name)
        if not isinstance(spec, SPEC_TYPES):
            known = ", ".join(var for var, _ in found) or "none"
            raise UsageError(f"{path}: no spec named {name!r} (specs here: {known})")
        return [(name, spec)]
    if not found and required:
        raise UsageError(f"{path}: no specs found (define @ssmc.recurrence or ssmc.attention objects "
                         "at module level)")
    return found


# -- show --------------------------------------------------------------------------------------

def cmd_show(args) -> int:
    specs = load_specs(args.spec)
    print("\n\n".join(pipeline.show(spec.program, args.stage) for _, spec in specs))
    return 0


# -- inspect -----------------------------------------------------------------------------------

def parse_sizes(text: str | None) -> dict[str, int]:
    """``"b=8,d=1536"`` -> {"b": 8, "d": 1536}."""
    sizes = {}
    for item in (text or "").replace(" ", "").split(","):
        if not item:
            continue
        axis, sep, value = item.partition("=")
        if not sep or not axis.isidentifier() or not value.isdigit() or int(value) < 1:
            raise UsageError(f"--sizes: expected axis=N items separated by commas (N >= 1), got {item!r}")
        if axis in sizes:
            raise UsageError(f"--sizes: {axis} given twice")
        sizes[axis] = int(value)
    return sizes


def _at_least_one(args, *options: str) -> None:
    """UsageError naming the first of `options` (attribute names) below 1."""
    for option in options:
        if getattr(args, option) is not None and getattr(args, option) < 1:
            raise UsageError(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")


def cmd_inspect(args) -> int:
    from .backends.cuda.report import format_reports, kernel_reports, path_notes

    _at_least_one(args, "length")
    given = parse_sizes(args.sizes)
    for label, spec in load_specs(args.spec):
        if isinstance(spec, AttentionSpec):
            print(_attention_path(label, spec, given, args.length))
            print(_flash_kernels(spec, given, args))
            continue
        program = spec.program
        unknown = sorted(set(given) - {a for d in program.decls for a in d.axes})
        if unknown:
            raise UsageError(f"--sizes: {label} has no axes {unknown}")
        sizes = default_sizes(program, given)
        shape = " ".join(f"{a}={n}" for a, n in sizes.items())
        print(f"{label}: {shape} L={args.length} {args.dtype}, {args.arch}")
        print(format_reports(kernel_reports(program, sizes, args.length, args.dtype, args.arch,
                                            backward=not args.forward_only,
                                            time_contiguous=args.time_contiguous)))
        for line in path_notes(program, sizes, args.length, args.dtype):
            print(line)
    return 0


def _attention_path(label: str, spec: AttentionSpec, given: dict[str, int], length: int) -> str:
    """How attention runs on the cuda backend at these sizes (the flash kernels, or the tiled torch path)."""
    program = spec.program
    unknown = sorted(set(given) - {*program.q_axes, *program.v_axes, *(a for d in program.params for a in d.axes)})
    if unknown:
        raise UsageError(f"--sizes: {label} has no axes {unknown}")
    tiled = get_backend("cuda").attention(program)
    if tiled is None:
        return f"{label}: attention runs on the interpreter (torch is not importable)"
    sizes = default_sizes(program, given)
    shape = " ".join(f"{a}={n}" for a, n in sizes.items())
    return (f"{label}: {shape} Lq=Lk={length}: on the numba and cuda backends and "
            f"through ssmc.torch.function, the {tiled.describe(sizes, length, length)}")


def _flash_kernels(spec: AttentionSpec, given: dict[str, int], args) -> str:
    """The flash kernels a CUDA call at these sizes, length and dtype launches, with ptxas' resources
    (backends/cuda/kernels/flash/report.py); or why that call takes the tiled torch path instead."""
    from .backends.cuda.kernels.flash import forward as flash
    from .backends.cuda.kernels.flash.report import flash_reports, format_flash_reports
    from .backends.cuda.options import options

    program = spec.program
    sizes = default_sizes(program, given)
    d, e = sizes[program.head_dim], sizes[program.value_dim]
    why = flash.unsupported(program)
    if why is None and args.dtype not in ("bfloat16", "float16"):
        why = f"{args.dtype} inputs (the flash kernels take bfloat16 or float16: --dtype)"
    if why is None and (d not in flash.HEAD_DIMS or e != d):
        why = f"head dim {d}, value dim {e} (the flash kernels take equal head and value dims in {flash.HEAD_DIMS})"
    if why is not None:
        return f"no flash kernels: {why}"
    reports = flash_reports(program, sizes, args.length, args.length, args.dtype, args.arch,
                            backward=not args.forward_only)
    return f"flash kernels ({args.dtype}, {args.arch}):\n" + format_flash_reports(reports, options().sm_count)


# -- check -------------------------------------------------------------------------------------

def _flatten(value) -> list:
    """Arrays in a nested tuple / list, in order (None, for no outputs, gives none)."""
    if value is None:
        return []
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in _flatten(v)]
    return [np.asarray(value)]


def _run_recurrence(spec: RecurrenceSpec, length: int, rng) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    p = spec.program
    sizes = axis_sizes(p, rng)
    inputs = random_recurrence_inputs(p, length, rng, sizes)
    ys, finals = api.compile(spec)(**inputs, return_final_states=True)
    names = [n for n, _ in p.outputs] + [s.name for s in p.states]
    return sizes, dict(zip(names, _flatten(ys) + _flatten(finals)))


def _run_attention(spec: AttentionSpec, length: int, rng) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    p = spec.program
    sizes = axis_sizes(p, rng)
    batch = [sizes[a] for a in p.batch_axes]
    q, k = (0.5 * rng.standard_normal((length, *batch, sizes[p.head_dim])) for _ in range(2))
    v = 0.5 * rng.standard_normal((length, *batch, sizes[p.value_dim]))
    params = {d.name: 0.5 * rng.standard_normal([sizes[a] for a in d.axes]) for d in p.params}
    for d in p.seqs:  # ids of documents packed along time (time first: the default layout)
        params[d.name] = np.sort(rng.integers(0, 3, (length, *(sizes[a] for a in d.axes))), axis=0)
    return sizes, {"out": spec.compile()(q, k, v, **params)}


def _check_spec(label: str, spec, length: int, seed: int) -> bool:
    rng = np.random.default_rng(seed)
    kind = "attention" if isinstance(spec, AttentionSpec) else "recurrence"
    run = _run_attention if kind == "attention" else _run_recurrence
    start = time.perf_counter()
    try:
        sizes, outputs = run(spec, length, rng)
    except Exception as err:  # one line per failing spec; the others still run
        print(f"error: {label}: {type(err).__name__}: {err}", file=sys.stderr)
        return False
    elapsed = time.perf_counter() - start
    finite = all(np.isfinite(a).all() for a in outputs.values())
    axes = " ".join(f"{a}={n}" for a, n in sizes.items())
    shapes = " ".join(f"{n}[{','.join(map(str, a.shape))}]" for n, a in outputs.items())
    print(f"{label}  {kind}  {axes}  L={length}  {shapes}  {'finite' if finite else 'NOT FINITE'}  "
          f"{elapsed * 1e3:.1f} ms")
    return finite


def cmd_check(args) -> int:
    _at_least_one(args, "length")
    print(f"ssmc check: backend {api.default_backend()}, length {args.length}, seed {args.seed}")
    ok, checked = True, 0
    for path in args.specs:
        try:
            specs = load_specs(path, required=False)
        except (SpecError, UsageError) as err:
            print(f"error: {err}", file=sys.stderr)
            ok = False
            continue
        if not specs:
            print(f"{path}: no specs here, skipped")
        for name, spec in specs:
            ok &= _check_spec(f"{path}:{name}", spec, args.length, args.seed)
            checked += 1
    if checked == 0 and ok:
        print("error: no specs found in the files given", file=sys.stderr)
        ok = False
    return 0 if ok else 1


# -- bench -------------------------------------------------------------------------------------

def cmd_bench(args) -> int:
    from .runtime.benchmark import bench, check_tolerance

    backend = args.backend or api.default_backend()
    _at_least_one(args, "length", "repeat", "check_length")
    if not args.scale > 0 or args.scale == float("inf"):
        raise UsageError(f"--scale must be a positive number, got {args.scale}")
    given = parse_sizes(args.sizes)
    specs = load_specs(args.spec)
    what = "forward" if args.forward_only else "forward and forward + backward"
    print(f"ssmc {__version__} bench: backend {backend}, device {_device(backend)}, {args.dtype}, "
          f"layout {args.layout!r}; {what}: medians of {args.repeat} calls on fresh random inputs, wall clock")
    rows = [["spec", "sizes", "length", "fwd ms", "fwd+bwd ms", "max rel err", ""]]
    ok = True
    for label, spec in specs:
        if isinstance(spec, AttentionSpec):
            print(f"{label}: ssmc bench times recurrences; attention's tiled torch path is timed by "
                  "bench/harness.py --family attention")
            continue
        try:
            r = bench(spec, backend, sizes=given, length=args.length, layout=args.layout, dtype=args.dtype,
                      repeat=args.repeat, with_grad=not args.forward_only, check_length=args.check_length,
                      seed=args.seed, scale=args.scale, label=label)
        except ValueError as err:  # this spec cannot be checked so; the others still run
            print(f"error: {label}: {err}", file=sys.stderr)
            ok = False
            continue
        ok &= r.ok
        tolerance = check_tolerance(backend, args.dtype)
        verdict = "OK" if r.ok else f"FAIL ({r.worst}; tolerance {tolerance:g}; not timed)"
        if r.ok and not r.finite:
            verdict += f" (outputs over {r.length} steps not finite: the inputs make it grow; see --scale)"
        rows.append([label, " ".join(f"{a}={n}" for a, n in r.sizes.items()), str(r.length),
                     "-" if r.forward_ms is None else f"{r.forward_ms:.3f}",
                     "-" if r.grad_ms is None else f"{r.grad_ms:.3f}", f"{r.error:.1e} (L={r.check_length})", verdict])
    if len(rows) > 1:
        _print_table(rows)
    return 0 if ok else 1


def _print_table(rows: list[list[str]]) -> None:
    """Rows of cells as columns aligned on their widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


# -- demo --------------------------------------------------------------------------------------

def _device(backend: str) -> str:
    """Where `backend` runs: the GPU's name for cuda, else the CPU (a ValueError where it cannot)."""
    return get_backend(backend).device_description()


def _rel_error(got: list, want: list) -> float:
    """Max over the arrays of max|got - want| / max|want| (nan if any value is not finite)."""
    if [a.shape for a in got] != [b.shape for b in want]:
        raise ValueError(f"output shapes {[a.shape for a in got]} differ from the reference's "
                         f"{[b.shape for b in want]}")
    tiny = np.finfo(np.float64).tiny
    errs = [np.abs(a - b).max(initial=0.0) / max(np.abs(b).max(initial=0.0), tiny) for a, b in zip(got, want)]
    return float(np.max(errs, initial=0.0))


def _demo_one(name: str, backend: str | None) -> tuple[list[str], str | None]:
    """Run one example: its table row, and the error it raised (None if it ran)."""
    row = [name, "?", backend or "?", str(DEMO_LENGTH), "-", "-", "FAIL"]
    try:
        ex = importlib.import_module(f"ssmc.examples.{name}")
        row[1] = ex.FAMILY
        inputs = ex.make_inputs(np.random.default_rng(0), length=DEMO_LENGTH)
        if isinstance(ex.SPEC, AttentionSpec):
            compiled = ex.SPEC.compile(backend, layout=ex.LAYOUT)
            extra = {}
        else:
            compiled = api.compile(ex.SPEC, backend, layout=ex.LAYOUT)
            extra = {"return_final_states": True}
        row[2] = compiled.backend if not isinstance(ex.SPEC, AttentionSpec) else f"{compiled.backend}: {compiled.path}"
        start = time.perf_counter()
        got = compiled(**inputs, **extra)
        row[4] = f"{(time.perf_counter() - start) * 1e3:.1f} ms"
        err = _rel_error(_flatten(got), _flatten(ex.reference(**inputs)))
    except Exception as exc:  # an example that fails is a FAIL row; the others still run
        return row, f"{type(exc).__name__}: {exc}"
    row[5] = f"{err:.1e}"
    row[6] = "OK" if err <= DEMO_TOLERANCE else "FAIL"
    return row, None


def cmd_demo(args) -> int:
    import ssmc.examples

    backend = args.backend or api.default_backend()
    print(f"ssmc {__version__} demo: backend {backend}, device {_device(backend)}")
    print(f"each example in float64 vs its NumPy reference; OK when the max relative error is <= "
          f"{DEMO_TOLERANCE:g}")
    names = sorted(m.name for m in pkgutil.iter_modules(ssmc.examples.__path__) if not m.name.startswith("_"))
    rows = [["example", "family", "backend", "length", "first call", "max rel err", ""]]
    errors = []
    for name in names:
        row, error = _demo_one(name, args.backend)
        rows.append(row)
        if error:
            errors.append(f"{name}: {error}")
    _print_table(rows)
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    passed = sum(r[-1] == "OK" for r in rows)
    print(f"{passed} of {len(names)} examples OK")
    return 0 if passed == len(names) else 1


# -- the parser --------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ssmc",
                                     description="ssmc: a compiler for recurrent sequence layers")
    parser.add_argument("--version", action="version", version=f"ssmc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    stages = "\n".join(f"  {name:<12}{desc}" for name, (desc, _) in pipeline.STAGES.items())
    show = sub.add_parser("show", help="print a spec's program after a compiler stage",
                          formatter_class=argparse.RawDescriptionHelpFormatter,
                          epilog=f"stages:\n{stages}")
    show.add_argument("spec", metavar="SPEC.py[:NAME]",
                      help="a spec file; :NAME picks one spec by its variable name")
    show.add_argument("--stage", default="ir", choices=list(pipeline.STAGES),
                      help="the stage whose output to print (default: ir)")
    show.set_defaults(run=cmd_show)

    inspect = sub.add_parser("inspect", help="the CUDA kernels of a spec: launch shape, registers, spills "
                                            "(no GPU needed)")
    inspect.add_argument("spec", metavar="SPEC.py[:NAME]")
    inspect.add_argument("--sizes", help="axis sizes, e.g. b=8,d=1536,n=16 (others: 16)")
    inspect.add_argument("--length", type=int, default=1024, help="number of time steps (default: 1024)")
    inspect.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    inspect.add_argument("--arch", default="sm_90", help="GPU architecture for ptxas (default: sm_90)")
    inspect.add_argument("--forward-only", action="store_true", help="skip the gradient's kernels")
    inspect.add_argument("--time-contiguous", action="store_true",
                         help="sequences with time as their contiguous axis (layouts like \"b d t\")")
    inspect.set_defaults(run=cmd_inspect)

    check = sub.add_parser("check", help="run every spec in the files on random inputs")
    check.add_argument("specs", nargs="+", metavar="SPEC.py")
    check.add_argument("--length", type=int, default=64, help="number of time steps (default: 64)")
    check.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    check.set_defaults(run=cmd_check)

    bench = sub.add_parser("bench", help="check a spec against the interpreter, then time its forward and gradient")
    bench.add_argument("spec", metavar="SPEC.py[:NAME]", help="a spec file; :NAME picks one spec by its variable name")
    bench.add_argument("--backend", choices=api.BACKENDS, help="default: the fastest available")
    bench.add_argument("--sizes", help="axis sizes, e.g. b=8,d=1536,n=16 (others: 16)")
    bench.add_argument("--length", type=int, default=1024, help="number of time steps (default: 1024)")
    bench.add_argument("--layout", default="t ...",
                       help='where time sits in sequence arrays, e.g. "b t ..." or "b d t" (default: "t ...")')
    bench.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                       help="the inputs' and the computation's type (default: float32)")
    bench.add_argument("--repeat", type=int, default=10, help="timed calls after the first (default: 10)")
    bench.add_argument("--forward-only", action="store_true", help="time the forward alone")
    bench.add_argument("--check-length", type=int, default=None,
                       help="steps of the check against the interpreter (default: --length; fewer check faster, "
                            "but a length can pick other kernels than those timed)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    bench.add_argument("--scale", type=float, default=0.5,
                       help="the random inputs' standard deviation (default: 0.5)")
    bench.set_defaults(run=cmd_bench)

    demo = sub.add_parser("demo", help="run the bundled examples and compare them with their references")
    demo.add_argument("--backend", choices=api.BACKENDS, help="default: the fastest available")
    demo.set_defaults(run=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, usage errors: return the status instead
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 2)
    try:
        return args.run(args)
    except (SpecError, UsageError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `ssmc show spec.py | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
