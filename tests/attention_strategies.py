"""Hypothesis strategies for random attention modifiers, written as a user would write them.

`attention_specs()` writes the source of a random ``score_mod`` and ``mask_mod`` (or leaves either out, or
takes ``ssmc.causal`` / ``ssmc.sliding_window(w)``), saves it to a file and hands the functions to
`ssmc.attention`, so a failing example prints as readable source. A score_mod is the score, maybe times a
temperature (a param) or a constant, plus a random subset of position and param terms, maybe soft-capped::

    s = score * temp                                   # temp: ssmc.Param["" or "h"]
    s = s - slope * (q_idx - kv_idx)                   # ALiBi: a slope per head
    s = s + bias                                       # ssmc.Param["h"], ["b h"] or [""]
    s = s + table[ssmc.clamp(q_idx - kv_idx, 0, R - 1)]   # relative positions (T5), R static or not
    s = s - 0.25 * ssmc.log1p(ssmc.abs(q_idx - kv_idx))   # a log-distance bias
    s = s + gate * ssmc.sigmoid(kv_idx - 0.5 * q_idx)
    s = cap * ssmc.tanh(s / cap)                       # soft-capping, cap a param or a constant

A mask_mod is a conjunction / disjunction of causal ``kv_idx <= q_idx``, windows ``q_idx - kv_idx < w``
(one-sided, or ``abs`` for both sides; a per-head ``width`` param sometimes), prefix-LM ``kv_idx < p``,
document ids ``doc[q_idx] == doc[kv_idx]`` (an ``ssmc.Seq["b"]``), and sometimes a term that leaves rows
with no key (``q_idx < c``, ``q_idx >= c``, strict causal ``kv_idx < q_idx``).

Each drawn `AttentionCase` says which path the flash kernels must take and why (`AttentionCase.path`):
"flash" (forward and backward kernels), "flash forward" (a table whose gradient the kernels do not sum:
more than `MAX_TABLE` entries or a size known only at the call; the tiled backward), "tiled" (a param
with an axis the printer cannot read, the forward refused). `attention_inputs` draws the params' values
in the ranges each kind needs (positive slopes, temperatures and caps, whole-number widths, sorted or
unsorted document ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st
from strategies import run_source

MAX_TABLE = 32  # the flash backward sums a table's entries for a static size up to this (kernels/flash/backward.py)

# what the test expects of the flash kernels: the path, and a phrase of the reason for the one refused
PATHS = {"flash": None, "flash forward": "indexed table", "tiled": "beyond the batch axes"}


@dataclass
class AttentionCase:
    """A generated spec: `spec` (its `source`), the params' kinds (`kinds`: name -> kind for
    `attention_inputs`), a doc sequence or not, whether keys and queries must have one length (`same_length`:
    document ids), grouped-query heads or not, and the path the flash kernels must take (`PATHS`)."""

    spec: object
    source: str
    kinds: dict[str, str]
    table_sizes: dict[str, int] = field(default_factory=dict)
    doc: bool = False
    same_length: bool = False
    gqa: bool = False
    path: str = "flash"

    @property
    def reason(self) -> str | None:
        """A phrase the reason for refusing a kernel must hold (None on the "flash" path)."""
        return PATHS[self.path]


# -- the score_mod ---------------------------------------------------------------------------------------------

def _score_mod(draw, params: list[tuple[str, str]], kinds: dict, tables: dict) -> tuple[list[str], str]:
    """(body lines, path) of a random score_mod; appends its params' (name, annotation) to `params`."""
    path = "flash"
    lines = []
    start = draw(st.sampled_from(["score", "score", "temp", "temp_div", "const"]))
    if start == "score":
        lines.append("s = score")
    elif start == "const":
        lines.append(f"s = {draw(st.sampled_from(['2.0', '0.5', '1.5']))} * score")
    else:
        axes = draw(st.sampled_from(["", "h"]))
        params.append(("temp", axes))
        kinds["temp"] = "temp"
        lines.append("s = score * temp" if start == "temp" else "s = score / temp")
    terms = draw(st.lists(st.sampled_from(["alibi", "bias", "table", "logdist", "gate", "mixed"]), unique=True,
                          max_size=3))
    if "mixed" in terms and draw(st.integers(0, 3)) > 0:
        terms.remove("mixed")  # rare: the one term the flash kernels refuse
    terms = draw(st.permutations(terms))
    for term in terms:
        if term == "alibi":
            params.append(("slope", "h"))
            kinds["slope"] = "slope"
            lines.append(draw(st.sampled_from(["s = s - slope * (q_idx - kv_idx)",
                                               "s = s + slope * (kv_idx - q_idx)"])))
        elif term == "bias":
            params.append(("bias", draw(st.sampled_from(["h", "b h", ""]))))
            kinds["bias"] = "normal"
            lines.append("s = s + bias")
        elif term == "table":
            size = draw(st.sampled_from([4, 8, 16, 32, 40, None]))
            width = size if size is not None else 12
            heads = draw(st.sampled_from(["h ", "h ", ""]))  # a table per head, or one for all
            params.append(("table", f"{heads}r={size}" if size is not None else f"{heads}r"))
            kinds["table"] = "table"
            tables["table"] = width
            index = draw(st.sampled_from([
                f"ssmc.clamp(q_idx - kv_idx, 0, {width - 1})", "q_idx - kv_idx", "ssmc.abs(q_idx - kv_idx)",
                f"kv_idx - q_idx + {width // 2}"]))
            lines.append(f"s = s + table[{index}]")
            if size is None or size > MAX_TABLE:
                path = "flash forward" if path == "flash" else path
        elif term == "logdist":
            lines.append("s = s - 0.25 * ssmc.log1p(ssmc.abs(q_idx - kv_idx))")
        elif term == "gate":
            params.append(("gate", "h"))
            kinds["gate"] = "normal"
            lines.append("s = s + gate * ssmc.sigmoid(kv_idx - 0.5 * q_idx)")
        else:  # a param with an axis of its own read whole: no inline C for it
            params.append(("mix", "h m"))
            kinds["mix"] = "normal"
            lines.append('s = s + mix.mean("m")')
            path = "tiled"
    cap = draw(st.sampled_from([None, None, "param", "5.0", "20.0"]))
    if cap == "param":
        params.append(("cap", draw(st.sampled_from(["h", ""]))))
        kinds["cap"] = "cap"
        lines.append("s = cap * ssmc.tanh(s / cap)")
    elif cap is not None:
        lines.append(f"s = {cap} * ssmc.tanh(s / {cap})")
    return lines, path


# -- the mask_mod ----------------------------------------------------------------------------------------------

def _atom(draw, params: list, kinds: dict, allow_doc: bool) -> str:
    kinds_of_atoms = ["causal", "causal", "window", "window_abs", "prefix", "width"] + (["doc", "doc"] if allow_doc
                                                                                        else [])
    atom = draw(st.sampled_from(kinds_of_atoms))
    if atom == "causal":
        return "(kv_idx <= q_idx)"
    if atom == "window":
        return f"(q_idx - kv_idx < {draw(st.integers(1, 100))})"
    if atom == "window_abs":
        return f"(ssmc.abs(q_idx - kv_idx) < {draw(st.integers(1, 40))})"
    if atom == "prefix":
        return f"(kv_idx < {draw(st.integers(1, 70))})"
    if atom == "width":
        if "width" not in kinds:
            params.append(("width", "h"))
            kinds["width"] = "width"
        return "(q_idx - kv_idx < width)"
    if "doc" not in kinds:
        params.append(("doc", draw(st.sampled_from(["b", "b", "b", ""]))))  # ids per batch row, or shared
        kinds["doc"] = "doc"
    return "(doc[q_idx] == doc[kv_idx])"


def _mask_mod(draw, params: list, kinds: dict, allow_doc: bool) -> list[str] | str | None:
    """Body lines of a random mask_mod, a built-in's source text, or None."""
    form = draw(st.sampled_from(["none", "causal", "sliding", "prefix_lm", "doc", "tree", "tree"]))
    if form == "none":
        return None
    if form == "causal":
        return "ssmc.causal"
    if form == "sliding":
        return f"ssmc.sliding_window({draw(st.integers(1, 100))})"
    if form == "prefix_lm":
        expr = f"(kv_idx < {draw(st.integers(1, 70))}) | (kv_idx <= q_idx)"
    elif form == "doc" and allow_doc:
        params.append(("doc", draw(st.sampled_from(["b", "b", "b", ""]))))
        kinds["doc"] = "doc"
        expr = "(kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])"
    else:
        expr = _atom(draw, params, kinds, allow_doc)
        for _ in range(draw(st.integers(0, 2))):
            op = draw(st.sampled_from(["&", "&", "|"]))
            expr = f"({expr} {op} {_atom(draw, params, kinds, allow_doc)})"
    empty = draw(st.sampled_from([None, None, None, "late", "early", "strict"]))
    if empty == "late":  # queries from c on see no key
        expr = f"{expr} & (q_idx < {draw(st.integers(0, 70))})"
    elif empty == "early":  # queries before c see no key
        expr = f"{expr} & (q_idx >= {draw(st.integers(1, 70))})"
    elif empty == "strict":  # query 0 (and each document's first) sees no key
        expr = f"{expr} & (kv_idx < q_idx)"
    return [f"return {expr}"]


def _signature(params: list[tuple[str, str]], names: set[str]) -> str:
    out = []
    for name, axes in params:
        if name in names:
            role = "Seq" if name == "doc" else "Param"
            out.append(f"{name}: ssmc.{role}[{axes!r}]")
    return "".join(", " + p for p in out)


def _names(lines: list[str]) -> set[str]:
    text = "\n".join(lines)
    return {n for n in ("temp", "slope", "bias", "table", "gate", "mix", "cap", "width", "doc") if n in text}


@st.composite
def attention_specs(draw, allow_doc: bool = True, allow_gqa: bool = True) -> AttentionCase:
    """A random `AttentionCase` (module docstring): its spec written to a file and traced by `ssmc.attention`."""
    params: list[tuple[str, str]] = []
    kinds: dict[str, str] = {}
    tables: dict[str, int] = {}
    score_lines, path = (None, "flash") if draw(st.integers(0, 5)) == 0 else _score_mod(draw, params, kinds, tables)
    mask = _mask_mod(draw, params, kinds, allow_doc)
    text = ["import ssmc", "", ""]
    if score_lines is not None:
        text += [f"def score_mod(score, q_idx, kv_idx{_signature(params, _names(score_lines))}):",
                 *("    " + line for line in score_lines), "    return s", "", ""]
    if isinstance(mask, list):
        text += [f"def mask_mod(q_idx, kv_idx{_signature(params, _names(mask))}):", *("    " + line for line in mask),
                 "", ""]
    gqa = allow_gqa and draw(st.integers(0, 2)) == 0
    args = ["score_mod" if score_lines is not None else "None",
            "mask_mod" if isinstance(mask, list) else (mask or "None")]
    if gqa:
        args.append('kv_heads="h"')
    text.append(f"SPEC = ssmc.attention({', '.join(args)})")
    text = "\n".join(text) + "\n"
    spec = run_source(text, "attention", "ssmc_generated_attention")["SPEC"]
    return AttentionCase(spec, text, dict(kinds), tables, doc="doc" in kinds,
                         same_length="doc" in kinds, gqa=gqa, path=path)


def attention_inputs(case: AttentionCase, sizes: dict[str, int], length: int, rng: np.random.Generator) -> dict:
    """The params' (and ids') values of `case` for batch `sizes` ("b", "h": q's heads), float64 (ids int64):
    ALiBi slopes 2**(-8 u) (positive: a negative one makes far keys the largest scores), temperatures in
    [0.5, 1.5], caps in [1, 3], windows 1..12, tables 0.5 N(0, 1), ids of documents packed in order or (a
    quarter of the time) unsorted."""
    out = {}
    program = case.spec.program
    for d in (*program.params, *program.seqs):
        kind = case.kinds[d.name]
        if kind == "doc":
            ids = rng.integers(0, max(1, length // 8), (*(sizes[a] for a in d.axes), length))
            out[d.name] = np.sort(ids, axis=-1) if rng.random() < 0.75 else ids
            continue
        shape = [sizes[a] if a in sizes else (case.table_sizes.get(d.name) or 3) for a in d.axes]
        if kind == "slope":
            out[d.name] = 2.0 ** (-8.0 * rng.random(shape))
        elif kind == "temp":
            out[d.name] = 0.5 + rng.random(shape)
        elif kind == "cap":
            out[d.name] = 1.0 + 2.0 * rng.random(shape)
        elif kind == "width":
            out[d.name] = rng.integers(1, 13, shape).astype(np.float64)
        elif kind == "table":
            out[d.name] = 0.5 * rng.standard_normal(shape)
        else:
            out[d.name] = rng.standard_normal(shape)
    return out


def document_ids(kind, rows, length, rng):
    """[rows, length] document ids: sorted runs differing between rows, unsorted, one document, each position its
    own document, or runs with ids far apart (sorted, but not 0, 1, 2, ...)."""
    if kind == "sorted":
        return np.sort(rng.integers(0, max(1, length // 9), (rows, length)), axis=1)
    if kind == "unsorted":
        return rng.integers(0, 4, (rows, length))
    if kind == "one":
        return np.zeros((rows, length), int)
    if kind == "each":
        return np.tile(np.arange(length), (rows, 1))
    return np.sort(rng.integers(0, 3, (rows, length)), axis=1) * 1000 - 7
