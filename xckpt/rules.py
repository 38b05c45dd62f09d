"""Rules: rename, transpose, cast, drop, stack, unstack, split and join tensors as a lazy view over a source.

`xckpt.open(path, rules=...)`, `xckpt.torch.load` and `xckpt.jax.load` call
`apply_rules`, which wraps any [`Source`][xckpt.source.Source] in a
`RuledSource`: a source whose names, shapes, dtypes and chunk boxes are
the transformed ones, and whose reads map every requested box back to the
boxes of the source tensors it comes from. Nothing is copied up front: a device
loading a slice of a transposed kernel reads only that slice's bytes.

A rule is a dict (DESIGN.md section 6):

    {"match": r"(.*)\\.weight", "ndim": 2, "rename": r"\\1.kernel", "transpose": [1, 0]}

* `match`: a regular expression that must match the whole source name.
* `rename`: a template expanded with `re.Match.expand` (`\\1`, `\\g<name>`).
* `transpose`: an axis permutation (numpy's `transpose(axes)`).
* `dtype`: cast on read to a dtype of `xckpt.manifest.DTYPES`; rounds as
  numpy's `astype` does.
* `drop: true`: the tensor (or object) disappears from the view.
* `stack: {"axis": k, "index": "\\1"}`: every tensor renamed to the same name
  is stacked along a new axis `k` at the integer position `index` expands
  to; the positions must be exactly `0..n-1` and the pieces agree in shape
  and dtype.
* `unstack: {"axis": k}`: the tensor is split along axis `k` into one
  tensor per position; `rename` must contain `{i}`, the position.
* `split: {"axis": k, "sizes": [...], "names": [...], "reshape": [...]}`: the
  tensor is cut into named parts along axis `k` of its `reshape` (optional; one
  entry may be -1; a reshape may only split axes), one size per name (a split's sizes
  may hold one -1, the rest of the axis); each part keeps the tensor's rank (the
  reshape's axes merge back); `rename` must contain `{part}`, the part's name.
  Megatron's fused QKV `(groups * (q + 2) * d, hidden)` split per query group is
  `"reshape": ["num_query_groups", -1, "hidden_size"], "axis": 1, "sizes": [q * d, d, d]`.
* `join: {"axis": k, "sizes": [...], "names": [...], "reshape": [...], "part": "\\2"}`:
  the inverse of `split`: every tensor renamed to the same name is the part `part`
  expands to (one of `names`), placed along axis `k` of the whole (the reshape
  applies to each part); every part must come exactly once (with `stack`: once at
  every position).
* `ndim`: an int or list of ints; the rule applies only to tensors of that
  rank (so torch's 1-D norm `weight` and 2-D Linear `weight` can get
  different rules, as transformers' torch -> flax rules decide by shape).
* `dequant: {"kind": "fp8_block" | "mxfp4", "scale": "\\1_scale_inv", "block": [128, 128]}`:
  a tensor stored as float8 (uint8 for mxfp4) is read dequantized with the scale tensor
  `scale` names, to the rule's `dtype` (bfloat16 by default), the scale leaving the view
  (`xckpt._dequant`); `ndim` counts stored axes, other keys act on the result; never an object.
* `comment`: ignored (JSON has no comments).

The first matching rule wins; names no rule matches pass unchanged; a rule
with `match` alone passes its names unchanged (and shields them from later
rules). `rules` is a list of such dicts, a mapping `{"rules": [...]}`, the
path of a `.json` or `.toml` file holding `{"rules": [...]}` (the suffix
decides), or the name of a shipped rule set in `xckpt/rulesets/`
(`"torch_to_flax"`, `"megatron_gpt_to_hf_llama"`, `"fp8_block_dequant"`, ...);
`shipped_rule_sets` lists them.

Order inside one rule: `unstack` splits first, then each piece is split (or
joined), transposed and cast, then `stack` inserts the new axis; so a rule and
its inverse name the same per-piece permutation (`transpose: [1, 0]` both ways).

Parameters. Sizes and reshape entries are integers or expressions (strings) in a
small safe subset of Python (`xckpt._pieces.evaluate`: integers, names,
`.attribute` / key access, `+ - * // %`, comparisons, `and or not`, `x if c
else y`; nothing is called) over the rule set's parameters and the checkpoint's
objects. A rule set declares its parameters beside its rules, `{"parameters":
{"num_query_groups": "args.num_query_groups if args.group_query_attention else
args.num_attention_heads", ...}, "rules": [...]}` (`null`: the caller must give
it); the caller gives or overrides them as `rules={"rules": "<shipped name or
file>", "parameters": {...}}`. A parameter is evaluated when a rule first needs it;
reading an object that is a pickle needs the source opened with
`allow_pickle=True`, and the error says so and how to give the value instead.

A split part's chunk is the image of one stored chunk (a contiguous range of the
whole holds a contiguous range of the part); reading a box of it reads, from that
stored chunk, one run per block of the whole it spans (per query group), only the
part's elements. A joined tensor's chunks are one per stored chunk of a part and
block of the whole; each reads one box of the part.

Decisions where the design is silent:

* Every mistake is a [`RuleError`][xckpt.rules.RuleError] (an `XckptError` and `ValueError`)
  raised by `apply_rules`, before anything is read; its message names
  the rule (index and `match`) and the tensors.
* Objects (non-tensor values) are renamed and dropped by the same rules; a
  rule that matches an object but transposes, casts, stacks or unstacks is an
  error (objects have no axes), and a rule with `ndim` never matches one.
* Tensors of a value group (`value_range` set) may only pass unchanged or be
  dropped: the group's structure is keyed by name and axis 0.
* A renamed-only tensor keeps its placement provenance; a transformed one
  (transposed, cast, stacked, unstacked) drops it, since it describes the old axes.
* `RuledSource.verify` verifies the underlying source (checksums live on
  the stored bytes, dropped tensors included).
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from xckpt._dequant import Dequantized
from xckpt._pieces import ExpressionError, Landing, Parameters, ScaledBar, make_cut
from xckpt._ruleset import (
    RULESETS_DIR,
    Rule,
    Rules,
    Split,
    is_int,
    load_rule_set,
    load_rules,
    shipped_rule_sets,
)
from xckpt.errors import ObjectError, RuleError
from xckpt.layout import Box, ReadRequest
from xckpt.manifest import Chunk, TensorEntry, numpy_dtype
from xckpt.source import ChunkRead, Source
from xckpt.views import SourceView

__all__ = ["Rules", "RuleError", "Rule", "Landing", "RuledSource", "apply_rules", "load_rules", "shipped_rule_sets", "RULESETS_DIR", "Split", "load_rule_set"]

#: Where a piece goes in an output made of several: (stack position, join part index).
_Slot = tuple[int, int]


@dataclass(frozen=True)
class _View:
    entry: TensorEntry
    src_dtype: np.dtype  # the source tensors' dtype (differs from entry's when cast)
    # output chunk offset -> (source chunk index, source chunk, the part it belongs to)
    src_chunks: Mapping[tuple[int, ...], tuple[int, Chunk, Landing]]
    renamed: Landing | None = None  # a rename: the source's chunks, each found by its offset when asked

    def source_chunk(self, offset: tuple[int, ...]) -> tuple[int, Chunk, Landing]:
        if self.renamed is None:
            return self.src_chunks[offset]
        return (*self.entry.chunk_at(offset), self.renamed)


def _ints(params: Parameters, rule: Rule, tensor: str, what: str, items: Sequence[int | str]) -> list[int]:
    """Sizes or reshape entries of `rule` for `tensor`: integers, or parameter expressions resolved."""
    out = []
    for x in items:
        try:
            v = params.evaluate(x) if isinstance(x, str) else x
        except ExpressionError as e:
            given = ", ".join(f"{k!r}: ..." for k in params.given) or "'name': value"
            raise RuleError(
                f"{rule.label}, tensor {tensor!r}: {what} {x!r} cannot be resolved: {e}. Give the "
                f"parameters with the rule set: rules={{'rules': ..., 'parameters': {{{given}}}}}"
            ) from None
        if not is_int(v):
            raise RuleError(f"{rule.label}, tensor {tensor!r}: {what} {x!r} is {v!r}, not an integer")
        out.append(v)
    return out


# ---------------------------------------------------------------------------
# The view


class RuledSource(SourceView):
    """A [`Source`][xckpt.rules.Source] seen through rules: transformed names, shapes, dtypes and boxes.

    Built by `apply_rules`. Every view chunk is one stored chunk of the
    wrapped `source` (or an unstacked slice of it, the part of it a split
    keeps, or one block of a joined part), so each read job maps to jobs of the
    source's `_read_chunks` in that one chunk, covering only the requested
    elements (one per block of the whole for a split part), read straight into a
    transposed view of the output (through a temporary buffer when cast).
    """

    def __init__(self, source: Source, rules: Sequence[Rule], parameters: Mapping[str, int | str | None] | None = None,
                 taken: Mapping[str, Any] | None = None) -> None:
        super().__init__(source)
        taken = taken or {}  # name -> the dequant rule that took it (in the Dequantized view beneath)
        self.rules = tuple(rules)
        self.parameters = Parameters(parameters or {}, source.object_names, _object_reader(source))
        self._views: dict[str, _View] = {}
        self._passed: set[str] = set()  # unmatched tensors: info/read go straight to the source
        # output name -> [(source name, rule or None, slot or None)], for collisions; a slot
        # (stack position, join part) says where a piece goes in a tensor made of several
        claims: dict[str, list[tuple[str, Rule | None, _Slot | None]]] = {}
        pieces: dict[str, list[tuple[_Slot, Landing, Rule, TensorEntry]]] = {}
        order: list[str] = []
        for name in source.names():
            entry: TensorEntry | None = None
            hit = None
            forced: Rule | None = taken.get(name)
            for rule in self.rules if forced is None else [forced]:
                m = rule.pattern.fullmatch(name)
                if m is None or (rule.dequant is not None and rule is not forced):
                    continue
                if rule.ndim is not None and forced is None:
                    entry = entry or source.info(name)
                    if len(entry.shape) not in rule.ndim:
                        continue
                hit = (rule, m)
                break
            if hit is None:
                claims.setdefault(name, []).append((name, None, None))
                order.append(name)
                self._passed.add(name)
                continue
            rule, m = hit
            if rule.drop:
                continue
            entry = entry or source.info(name)
            if entry.value_range is not None and (rule.rename or rule.tensor_ops()):
                raise RuleError(
                    f"{rule.label} renames or reshapes {name!r}, a tensor of value group "
                    f"{entry.value_range.group!r}; value-group tensors can only pass unchanged or be "
                    "dropped: make the pattern exclude them"
                )
            new = _expand(rule, m, rule.rename, name) if rule.rename else name
            for out, part, slot in self._parts(rule, m, name, new, entry):
                claims.setdefault(out, []).append((name, rule, slot))
                if out not in pieces:
                    order.append(out)
                pieces.setdefault(out, []).append((slot or (0, 0), part, rule, entry))
        self._objects = {}  # output object name -> source object name
        for name in source.object_names():
            renamed = self._object_name(name)
            if renamed is not None:
                claims.setdefault(renamed, []).append((name, None, None))
                self._objects[renamed] = name
        for out, who in claims.items():
            if len(who) > 1 and not all(slot is not None for _, _, slot in who):
                raise RuleError(_collision(out, who, set(self._objects.values())))
        for out, ps in pieces.items():
            self._views[out] = self._build(out, ps)
        self._show(order)  # the source's order; a stack where its first piece was

    # -- construction -----------------------------------------------------------

    def _parts(
        self, rule: Rule, m: re.Match[str], name: str, new: str, entry: TensorEntry
    ) -> list[tuple[str, Landing, _Slot | None]]:
        """The output pieces of one matched source tensor: (output name, how it lands, slot)."""
        nd = len(entry.shape)
        if rule.unstack is not None:
            k = _axis(rule, rule.unstack, nd, name, "unstack", entry.shape)
            takes: list[tuple[str, tuple[int, int] | None]] = [
                (new.replace("{i}", str(i)), (k, i)) for i in range(entry.shape[k])
            ]
            piece = entry.shape[:k] + entry.shape[k + 1 :]
        else:
            takes, piece = [(new, None)], entry.shape
        _check_perm(rule, name, len(piece), "after unstacking, " if rule.unstack is not None else "")
        pos = None
        put = None
        if rule.stack is not None:
            axis_raw, template = rule.stack
            a = _axis(rule, axis_raw, nd + 1, name, "stack", entry.shape)
            text = _expand(rule, m, template, name)
            if not re.fullmatch(r"[0-9]+", text):
                raise RuleError(
                    f"{rule.label}: stack index {template!r} expands to {text!r} for {name!r}, not a "
                    "non-negative integer; point it at the group holding the layer number"
                )
            pos = int(text)
            put = (a, pos)
        spec = rule.split or rule.join
        if spec is None:
            slot = None if pos is None else (pos, 0)
            return [(out, Landing(name, take, rule.transpose, put), slot) for out, take in takes]
        sizes = _ints(self.parameters, rule, name, "size", spec.sizes)
        reshape = None if spec.reshape is None else _ints(self.parameters, rule, name, "reshape entry", spec.reshape)
        if rule.join is not None:
            label = _expand(rule, m, spec.part, name)
            if label not in spec.names:
                raise RuleError(
                    f"{rule.label}: join part {spec.part!r} expands to {label!r} for {name!r}, which is not "
                    f"one of the parts {list(spec.names)}"
                )
            indexes = [(spec.names.index(label), "")]
        else:
            indexes = [(i, n) for i, n in enumerate(spec.names)]
        out = []
        for i, label in indexes:
            try:
                cut, _ = make_cut(piece, spec.axis, sizes, i, reshape, rule.join is not None)
            except ValueError as e:
                raise RuleError(
                    f"{rule.label}: cannot {'join' if rule.join else 'split'} {name!r} {piece}"
                    f"{' (each piece)' if rule.unstack is not None else ''}: {e}; check the rule's sizes, "
                    "reshape and parameters against the checkpoint"
                ) from None
            slot = (pos or 0, i) if rule.join is not None else None
            for o, take in takes:
                out.append((o.replace("{part}", label), Landing(name, take, rule.transpose, put, cut), slot))
        return out

    def _object_name(self, name: str) -> str | None:
        for rule in self.rules:
            if rule.ndim is not None or rule.dequant is not None:
                continue
            m = rule.pattern.fullmatch(name)
            if m is None:
                continue
            if rule.drop:
                return None
            if rule.tensor_ops():
                raise RuleError(
                    f"{rule.label} matches {name!r}, an object (a non-tensor value), but "
                    f"{' and '.join(rule.tensor_ops())} need a tensor; make the pattern exclude it "
                    "(objects can only be renamed or dropped)"
                )
            return _expand(rule, m, rule.rename, name) if rule.rename else name
        return name

    def _build(self, out: str, ps: list[tuple[_Slot, Landing, Rule, TensorEntry]]) -> _View:
        ps.sort(key=lambda p: p[0])
        rule0, first, p0 = ps[0][2], ps[0][3], ps[0][1]
        joined = p0.cut is not None and p0.cut.join
        stacked = p0.put is not None
        if stacked or joined:
            slots = [p[0] for p in ps]
            n_pos = max(pos for pos, _ in slots) + 1
            n_part = len(rule0.join.names if rule0.join else ("",))
            want = [(pos, i) for pos in range(n_pos) for i in range(n_part)]
            if slots != want:
                raise RuleError(_slots_error(rule0, out, ps, want, joined))
            axes = {(p[1].put[0] if p[1].put is not None else None, p[1].cut.axis if p[1].cut else None) for p in ps}
            for _, part, rule, e in ps[1:]:
                same = _describe(e, part, rule) == _describe(first, p0, rule0)
                if not same or len(axes) > 1:
                    raise RuleError(
                        f"{rule.label}: {'joined' if joined else 'stacked'} pieces of {out!r} disagree: "
                        f"{first.name!r} is {_describe(first, p0, rule0)} and {e.name!r} is "
                        f"{_describe(e, part, rule)}; every piece must have the same shape and dtype (and stack "
                        "and join axes)"
                    )
        dtype = _out_dtype(rule0, first)
        plain = p0.take is None and p0.perm is None and p0.put is None and p0.cut is None
        if plain and dtype == first.dtype and len(ps) == 1:  # a rename: no chunk built here
            return _View(first if out == first.name else replace(first, name=out), first.np_dtype, {}, p0)
        itemsize = numpy_dtype(dtype).itemsize
        chunks: list[Chunk] = []
        src_chunks: dict[tuple[int, ...], tuple[int, Chunk, Landing]] = {}
        for _, part, _, e in ps:
            for ci, c in enumerate(e.chunks):
                for box in part.to_output(c.box):
                    chunks.append(Chunk(offset=box.offset, shape=box.shape, grid=part.map_grid(c.grid), key=c.key,
                                        rank=c.rank, nbytes=box.volume * itemsize))
                    src_chunks[box.offset] = (ci, c, part)
        shape = p0.piece_shape(first.shape)
        if p0.put is not None:
            positions = len({p[0][0] for p in ps})
            shape = shape[: p0.put[0]] + (positions,) + shape[p0.put[0] :]
        if plain and dtype == first.dtype:
            entry = first if out == first.name else replace(first, name=out)  # placement kept
        else:
            entry = TensorEntry(name=out, dtype=dtype, shape=shape, chunks=tuple(chunks))
        return _View(entry, first.np_dtype, src_chunks)

    # -- metadata ---------------------------------------------------------------

    def info(self, name: str) -> TensorEntry:
        """The transformed tensor: dtype, shape and chunk boxes in the view's axes."""
        v = self._views.get(name)
        if v is not None:
            return v.entry
        if name in self._passed:
            return self.source.info(name)
        raise self._missing(name)

    # -- tensors ----------------------------------------------------------------

    def _read_chunks(self, jobs: Sequence[ChunkRead], bar: Any) -> None:
        # Each view chunk is one source chunk (or a slice of it), so every job maps to exactly one
        # source job: no re-planning against the source's chunks (that is quadratic in chunks).
        mapped: list[ChunkRead] = []
        casts: list[tuple[np.ndarray, np.ndarray]] = []
        view_bytes = src_bytes = 0
        for job in jobs:
            v = self._views.get(job.name)
            if v is None:  # an unmatched name: the source's own chunk and request
                mapped.append(job)
                continue
            name, chunk, req, out = job
            box = chunk.box if req is None else req.box
            target = out if req is None else req.target_view(out)
            ci, src_chunk, part = v.source_chunk(chunk.offset)
            for sbox, obox in part.to_sources(box):
                dst = part.source_view(target if obox == box else target[obox.slices(box)])
                if v.src_dtype != out.dtype:
                    tmp = np.empty(dst.shape, dtype=v.src_dtype)
                    casts.append((dst, tmp))
                    dst = tmp
                view_bytes, src_bytes = view_bytes + dst.size * out.itemsize, src_bytes + dst.nbytes
                req = ReadRequest(ci, sbox, sbox.slices(src_chunk.box), tuple(slice(0, n) for n in sbox.shape))
                mapped.append(ChunkRead(part.src, src_chunk, req, dst))
        scaled = view_bytes != src_bytes and src_bytes > 0
        self.source._read_chunks(mapped, ScaledBar(bar, view_bytes / src_bytes) if scaled else bar)
        for dst, tmp in casts:
            np.copyto(dst, tmp, casting="unsafe")  # the same conversion loops as astype

    def read_units(self, name: str, chunk: Chunk, box: Box, itemsize: int) -> dict[Hashable, int]:
        """The source's storage reads for `box` of an output chunk (plan_load's byte counts)."""
        v = self._views.get(name)
        if v is None:
            return self.source.read_units(name, chunk, box, itemsize)
        _, src_chunk, part = v.source_chunk(chunk.offset)
        units: dict[Hashable, int] = {}
        for sbox, _ in part.to_sources(box):
            units.update(self.source.read_units(part.src, src_chunk, sbox, v.src_dtype.itemsize))
        return units


# ---------------------------------------------------------------------------
# Helpers


def _expand(rule: Rule, m: re.Match[str], template: str | None, name: str) -> str:
    try:
        return m.expand(template or "")
    except (re.error, IndexError) as e:
        raise RuleError(f"{rule.label}: template {template!r} does not expand for {name!r}: {e}") from None


def _axis(rule: Rule, axis: int, n: int, name: str, what: str, shape: tuple[int, ...]) -> int:
    if not -n <= axis < n:
        raise RuleError(
            f"{rule.label}: {what} axis {axis} is out of range for {name!r} of shape {shape} "
            f"(valid: {-n}..{n - 1})"
        )
    return axis % n


def _check_perm(rule: Rule, name: str, nd: int, when: str) -> None:
    if rule.transpose is not None and len(rule.transpose) != nd:
        raise RuleError(
            f"{rule.label}: transpose {list(rule.transpose)} has {len(rule.transpose)} axes but "
            f"{name!r} has {nd} {when.strip()}".rstrip() + "; give one entry per axis (or add 'ndim' to "
            "the rule so it only matches tensors of that rank)"
        )


def _out_dtype(rule: Rule, e: TensorEntry) -> str:
    return rule.dtype or e.dtype


def _describe(e: TensorEntry, part: Landing, rule: Rule) -> str:
    return f"{part.piece_shape(e.shape)} {_out_dtype(rule, e)}"


def _object_reader(source: Source) -> Any:
    def read(name: str) -> Any:
        try:
            return source.objects([name])[name]
        except ObjectError as e:
            raise ExpressionError(str(e)) from None

    return read


def _slots_error(
    rule: Rule, out: str, ps: list[tuple[_Slot, Landing, Rule, TensorEntry]], want: list[_Slot], joined: bool
) -> str:
    """The message for stacked positions that are not 0..n-1, or joined parts missing or repeated."""
    slots = [p[0] for p in ps]
    dup = sorted({x for x in slots if slots.count(x) > 1})
    missing = sorted(set(want) - set(slots))
    names = [p[3].name for p in ps][:6]
    if not joined:
        what = f"position {dup[0][0]} twice" if dup else f"no piece at positions {[m[0] for m in missing][:10]}"
        return (
            f"{rule.label}: stacking {len(ps)} tensors into {out!r} ({names}) finds {what}; positions must be "
            f"exactly 0..{len(ps) - 1}"
        )
    parts = rule.join.names if rule.join is not None else ()

    def text(slot: _Slot) -> str:
        return f"part {parts[slot[1]]!r}" + (f" at position {slot[0]}" if rule.stack is not None else "")

    what = f"{text(dup[0])} twice" if dup else f"no {', '.join(text(x) for x in missing[:6])}"
    return (
        f"{rule.label}: joining {len(ps)} tensors into {out!r} ({names}) finds {what}; each of the parts "
        f"{list(parts)} must come exactly once" + (" at every stacked position" if rule.stack is not None else "")
    )


def _collision(out: str, who: list[tuple[str, Rule | None, _Slot | None]], objects: set[str]) -> str:
    def one(src: str, rule: Rule | None) -> str:
        kind = "object" if src in objects else "tensor"
        return f"{kind} {src!r} ({rule.label if rule else 'no rule matches it: unchanged'})"

    listed = "; ".join(one(s, r) for s, r, _ in who[:6])
    return (
        f"{len(who)} names map to one name {out!r}: {listed}. Each name must come from one tensor; "
        "use stack to combine tensors, or change a rename"
    )


def apply_rules(src: Source, rules: Rules | Sequence[Rule]) -> Source:
    """`src` seen through `rules`: a lazy view, checked against the source before any read.

    Args:
        src: any opened source.
        rules: a list of rule dicts, `{"rules": [...]}`, the path of a `.json`
            or `.toml` rules file, or a shipped rule set's name.

    Returns:
        A `RuledSource` (`src` itself for an empty rule list).

    Raises:
        RuleError: a bad rule or file, or rules that do not fit the checkpoint
            (two names onto one, a permutation of the wrong length, stacked
            pieces that disagree, positions that are not 0..n-1, ...).
    """
    parsed, parameters = load_rule_set(rules)
    if not parsed:
        return src
    if not any(r.dequant is not None for r in parsed):
        return RuledSource(src, parsed, parameters)
    params = Parameters(parameters, src.object_names, _object_reader(src))
    under = Dequantized(src, parsed, lambda rule, name, items: _ints(params, rule, name, "block size", items))
    return RuledSource(under, parsed, parameters, under.taken)
