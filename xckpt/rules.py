"""Rules: rename, transpose, cast, drop, stack and unstack tensors as a lazy view over a source.

``xckpt.open(path, rules=...)``, ``xckpt.torch.load`` and ``xckpt.jax.load`` call
:func:`apply_rules`, which wraps any :class:`~xckpt.source.Source` in a
:class:`RuledSource`: a source whose names, shapes, dtypes and chunk boxes are
the transformed ones, and whose reads map every requested box back to the
boxes of the source tensors it comes from. Nothing is copied up front: a device
loading a slice of a transposed kernel reads only that slice's bytes.

A rule is a dict (DESIGN.md section 6)::

    {"match": r"(.*)\\.weight", "ndim": 2, "rename": r"\\1.kernel", "transpose": [1, 0]}

* ``match``: a regular expression that must match the whole source name.
* ``rename``: a template expanded with ``re.Match.expand`` (``\\1``, ``\\g<name>``).
* ``transpose``: an axis permutation (numpy's ``transpose(axes)``).
* ``dtype``: cast on read to a dtype of :data:`xckpt.manifest.DTYPES`; rounds as
  numpy's ``astype`` does.
* ``drop: true``: the tensor (or object) disappears from the view.
* ``stack: {"axis": k, "index": "\\1"}``: every tensor renamed to the same name
  is stacked along a new axis ``k`` at the integer position ``index`` expands
  to; the positions must be exactly ``0..n-1`` and the pieces agree in shape
  and dtype.
* ``unstack: {"axis": k}``: the tensor is split along axis ``k`` into one
  tensor per position; ``rename`` must contain ``{i}``, the position.
* ``ndim``: an int or list of ints; the rule applies only to tensors of that
  rank (so torch's 1-D norm ``weight`` and 2-D Linear ``weight`` can get
  different rules, as transformers' torch -> flax rules decide by shape).
* ``comment``: ignored (JSON has no comments).

The first matching rule wins; names no rule matches pass unchanged; a rule
with ``match`` alone passes its names unchanged (and shields them from later
rules). ``rules`` is a list of such dicts, a mapping ``{"rules": [...]}``, the
path of a ``.json`` or ``.toml`` file holding ``{"rules": [...]}`` (the suffix
decides), or the name of a shipped rule set in ``xckpt/rulesets/``
(``"torch_to_flax"``, ``"flax_to_torch"``, ``"hf_llama_to_scanned"``,
``"scanned_to_hf_llama"``); :func:`shipped_rule_sets` lists them.

Order inside one rule: ``unstack`` splits first, then each piece is
transposed and cast, then ``stack`` inserts the new axis; so a rule and its
inverse name the same per-piece permutation (``transpose: [1, 0]`` both ways).

Decisions where the design is silent:

* Every mistake is a :class:`RuleError` (an ``XckptError`` and ``ValueError``)
  raised by :func:`apply_rules`, before anything is read; its message names
  the rule (index and ``match``) and the tensors.
* Objects (non-tensor values) are renamed and dropped by the same rules; a
  rule that matches an object but transposes, casts, stacks or unstacks is an
  error (objects have no axes), and a rule with ``ndim`` never matches one.
* Tensors of a value group (``value_range`` set) may only pass unchanged or be
  dropped: the group's structure is keyed by name and axis 0.
* A renamed-only tensor keeps its placement provenance; a transformed one
  (transposed, cast, stacked, unstacked) drops it, since it describes the old axes.
* :meth:`RuledSource.verify` verifies the underlying source (checksums live on
  the stored bytes, dropped tensors included).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Union

import numpy as np

from xckpt.errors import XckptError
from xckpt.layout import Box, ReadRequest
from xckpt.manifest import DTYPES, Chunk, TensorEntry, numpy_dtype
from xckpt.source import ChunkRead, Source
from xckpt.views import SourceView

__all__ = ["Rules", "RuleError", "Rule", "Part", "RuledSource", "apply_rules", "load_rules", "shipped_rule_sets"]
__all__ += ["RULESETS_DIR"]

#: Where the shipped rule sets live (installed as package data).
RULESETS_DIR = Path(__file__).with_name("rulesets")

_KEYS = ("match", "rename", "transpose", "dtype", "drop", "stack", "unstack", "ndim", "comment")
_TENSOR_ONLY = ("transpose", "dtype", "stack", "unstack")


#: The ``rules=`` option of every verb: a list of rule dicts, ``{"rules": [...]}``, the
#: path of a JSON or TOML file, the name of a shipped rule set, or None (no rules).
Rules = Union[Sequence[Mapping[str, Any]], Mapping[str, Any], str, "os.PathLike[str]", None]


class RuleError(XckptError, ValueError):
    """A rule or rules file is invalid, or the rules do not fit the checkpoint."""


# ---------------------------------------------------------------------------
# Parsing


@dataclass(frozen=True)
class Rule:
    """One parsed rule; see the module docstring for the keys."""

    index: int
    pattern: re.Pattern[str]
    rename: str | None = None
    transpose: tuple[int, ...] | None = None
    dtype: str | None = None
    drop: bool = False
    stack: tuple[int, str] | None = None  # (axis, index template)
    unstack: int | None = None  # axis
    ndim: frozenset[int] | None = None
    where: str = "rules"

    @property
    def label(self) -> str:
        """How messages name the rule: ``rule 2 (match '...')``, with its file when it has one."""
        at = "" if self.where == "rules" else f"{self.where}: "
        return f"{at}rule {self.index} (match {self.pattern.pattern!r})"

    def tensor_ops(self) -> list[str]:
        """The keys that act on axes or dtypes (meaningless for objects)."""
        ops: list[tuple[str, object]] = [("transpose", self.transpose), ("dtype", self.dtype)]
        ops += [("stack", self.stack), ("unstack", self.unstack)]
        return [k for k, v in ops if v is not None]


def shipped_rule_sets() -> list[str]:
    """Names of the rule sets shipped with xckpt (usable as ``rules="<name>"``)."""
    return sorted(p.stem for p in RULESETS_DIR.glob("*.json"))


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_rule(i: int, d: Any, where: str) -> Rule:
    if not isinstance(d, Mapping):
        raise RuleError(f"{where}: rule {i} must be a table/object with a 'match' key, got {d!r}")
    m = d.get("match")
    head = f"{where}: rule {i} (match {m!r})"
    unknown = sorted(set(d) - set(_KEYS))
    if unknown:
        raise RuleError(
            f"{head}: unknown key(s) {unknown}; a rule has 'match' and any of rename, transpose, "
            "dtype, drop, stack, unstack, ndim (and an ignored comment)"
        )
    if not isinstance(m, str):
        raise RuleError(f"{head}: 'match' must be a regular expression string")
    try:
        pattern = re.compile(m)
    except re.error as e:
        raise RuleError(f"{head}: bad regular expression: {e}") from None
    rename = d.get("rename")
    if rename is not None and not isinstance(rename, str):
        raise RuleError(f"{head}: 'rename' must be a template string like '\\1.kernel', got {rename!r}")
    perm = d.get("transpose")
    if perm is not None:
        if not isinstance(perm, (list, tuple)) or not all(map(_int, perm)):
            raise RuleError(f"{head}: 'transpose' must be a list of axes, got {perm!r}")
        if sorted(perm) != list(range(len(perm))):
            raise RuleError(
                f"{head}: transpose {list(perm)} is not a permutation of 0..{len(perm) - 1}; list "
                "every axis exactly once"
            )
        perm = tuple(perm)
    dtype = d.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise RuleError(f"{head}: unknown dtype {dtype!r}; dtypes are {', '.join(DTYPES)}")
    drop = d.get("drop", False)
    if not isinstance(drop, bool):
        raise RuleError(f"{head}: 'drop' must be true or false, got {drop!r}")
    if drop and any(k in d for k in ("rename", *_TENSOR_ONLY)):
        raise RuleError(f"{head}: a rule that drops cannot also rename, transpose, cast, stack or unstack")
    stack = d.get("stack")
    if stack is not None:
        if not isinstance(stack, Mapping) or set(stack) != {"axis", "index"}:
            raise RuleError(
                f"{head}: 'stack' must be {{\"axis\": k, \"index\": \"\\\\1\"}} (exactly those keys), "
                f"got {stack!r}"
            )
        if not _int(stack["axis"]) or not isinstance(stack["index"], str):
            raise RuleError(f"{head}: stack axis must be an integer and index a template, got {stack!r}")
        if rename is None:
            raise RuleError(f"{head}: 'stack' needs a 'rename' that maps the pieces to one name")
        stack = (stack["axis"], stack["index"])
    unstack = d.get("unstack")
    if unstack is not None:
        if not isinstance(unstack, Mapping) or set(unstack) != {"axis"} or not _int(unstack["axis"]):
            raise RuleError(f"{head}: 'unstack' must be {{\"axis\": k}}, got {unstack!r}")
        if stack is not None:
            raise RuleError(f"{head}: a rule cannot both stack and unstack")
        if rename is None or "{i}" not in rename:
            raise RuleError(
                f"{head}: 'unstack' needs a 'rename' containing {{i}} (the position), e.g. "
                "'layers.{i}.w'; got " + repr(rename)
            )
        unstack = unstack["axis"]
    nd = d.get("ndim")
    if nd is not None:
        nds = [nd] if _int(nd) else nd
        if not isinstance(nds, (list, tuple)) or not nds or not all(_int(x) and x >= 0 for x in nds):
            raise RuleError(f"{head}: 'ndim' must be a rank or a list of ranks, got {nd!r}")
        nd = frozenset(nds)
    return Rule(i, pattern, rename, perm, dtype, drop, stack, unstack, nd, where)


def _resolve(spec: str | os.PathLike[str]) -> Path:
    text = os.fspath(spec)
    if isinstance(spec, str) and re.fullmatch(r"[A-Za-z0-9_\-]+", text) and not os.path.exists(text):
        shipped = RULESETS_DIR / f"{text}.json"
        if shipped.is_file():
            return shipped
        raise RuleError(
            f"rules {text!r}: no such file and no shipped rule set of that name; shipped rule sets: "
            f"{', '.join(shipped_rule_sets())}; or give the path of a .json or .toml file"
        )
    path = Path(text)
    if path.suffix.lower() not in (".json", ".toml"):
        raise RuleError(
            f"rules file {text!r}: unknown suffix {path.suffix!r}; a rules file is .json or .toml "
            "holding {\"rules\": [...]}"
        )
    if not path.is_file():
        raise RuleError(f"rules file {text!r} does not exist")
    return path


def _read_file(path: Path) -> Any:
    raw = path.read_bytes()
    if path.suffix.lower() == ".json":
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RuleError(f"rules file {str(path)!r} is not valid JSON: {e}") from None
    import tomllib

    try:
        return tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise RuleError(f"rules file {str(path)!r} is not valid TOML: {e}") from None


def load_rules(rules: Rules | Sequence[Rule]) -> list[Rule]:
    """Parse and check rules: a list of dicts, ``{"rules": [...]}``, a file path or a shipped name.

    Raises:
        RuleError: a bad file (suffix, syntax, layout) or a bad rule (unknown
            key, bad regular expression, not a permutation, ...).
    """
    where = "rules"
    data: Any = rules
    if isinstance(rules, (str, os.PathLike)):
        path = _resolve(rules)
        where = f"rules file {str(path)!r}"
        data = _read_file(path)
        if not isinstance(data, Mapping):
            raise RuleError(f"{where}: expected {{\"rules\": [...]}}, got a {type(data).__name__}")
    if isinstance(data, Mapping):
        extra = sorted(set(data) - {"rules", "description"})
        if "rules" not in data or extra:
            raise RuleError(
                f"{where}: expected {{\"rules\": [...]}} (and an optional description), got keys "
                f"{sorted(data)}"
            )
        data = data["rules"]
    if not isinstance(data, (list, tuple)):
        raise RuleError(f"{where}: 'rules' must be a list of rules, got {type(data).__name__}")
    return [r if isinstance(r, Rule) else _parse_rule(i, r, where) for i, r in enumerate(data)]


# ---------------------------------------------------------------------------
# Box arithmetic: one source tensor -> one piece of an output tensor


@dataclass(frozen=True)
class Part:
    """How one source tensor (or one slice of it) lands in an output tensor.

    ``take = (k, i)``: the source's slice ``i`` along axis ``k`` (unstack);
    ``perm``: then transposed; ``put = (a, i)``: then placed at position ``i``
    of a new axis ``a`` (stack).
    """

    src: str
    take: tuple[int, int] | None = None
    perm: tuple[int, ...] | None = None
    put: tuple[int, int] | None = None

    def to_source(self, box: Box) -> Box:
        """An output box inside this part -> the source box holding its elements."""
        off, shp = list(box.offset), list(box.shape)
        if self.put is not None:
            del off[self.put[0]], shp[self.put[0]]
        if self.perm is not None:
            o, s = [0] * len(off), [0] * len(off)
            for j, p in enumerate(self.perm):
                o[p], s[p] = off[j], shp[j]
            off, shp = o, s
        if self.take is not None:
            off.insert(self.take[0], self.take[1])
            shp.insert(self.take[0], 1)
        return Box(tuple(off), tuple(shp))

    def to_output(self, box: Box) -> Box | None:
        """A source box -> the output box its elements fill (None: outside an unstacked slice)."""
        off, shp = list(box.offset), list(box.shape)
        if self.take is not None:
            k, i = self.take
            if not off[k] <= i < off[k] + shp[k]:
                return None
            del off[k], shp[k]
        if self.perm is not None:
            off, shp = [off[p] for p in self.perm], [shp[p] for p in self.perm]
        if self.put is not None:
            off.insert(self.put[0], self.put[1])
            shp.insert(self.put[0], 1)
        return Box(tuple(off), tuple(shp))

    def map_grid(self, grid: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """A chunk's inner grid in output axes (a stacked axis has extent 1)."""
        if grid is None:
            return None
        off = [self.take[1] if self.take and d == self.take[0] else 0 for d in range(len(grid))]
        out = self.to_output(Box(tuple(off), grid))
        return None if out is None else out.shape  # (the grid's box always holds the taken index)

    def source_view(self, arr: np.ndarray) -> np.ndarray:
        """A view of ``arr`` (output box) with the source box's axes: reads land straight in ``arr``."""
        if self.put is not None:
            arr = arr[(slice(None),) * self.put[0] + (0, Ellipsis)]  # Ellipsis: a 0-d view, not a scalar
        if self.perm is not None:
            arr = arr.transpose(np.argsort(self.perm))
        if self.take is not None:
            arr = np.expand_dims(arr, self.take[0])
        return arr


@dataclass(frozen=True)
class _View:
    entry: TensorEntry
    parts: tuple[Part, ...]  # one, or one per stacked position (position order)
    src_dtype: np.dtype  # the source tensors' dtype (differs from entry's when cast)
    src_chunks: Mapping[tuple[int, ...], tuple[int, Chunk]]  # output chunk offset -> source (index, chunk)

    def part(self, box: Box) -> Part:
        p0 = self.parts[0]
        return p0 if p0.put is None else self.parts[box.offset[p0.put[0]]]


# ---------------------------------------------------------------------------
# The view


class RuledSource(SourceView):
    """A :class:`Source` seen through rules: transformed names, shapes, dtypes and boxes.

    Built by :func:`apply_rules`. Every view chunk is one stored chunk of the
    wrapped :attr:`source` (or an unstacked slice of it), so each read job maps to
    one job of the source's ``_read_chunks`` covering only the requested elements,
    read straight into a transposed view of the output (through a temporary
    buffer when cast).
    """

    def __init__(self, source: Source, rules: Sequence[Rule]) -> None:
        super().__init__(source)
        self.rules = tuple(rules)
        self._views: dict[str, _View] = {}
        self._passed: set[str] = set()  # unmatched tensors: info/read go straight to the source
        # output name -> [(source name, rule or None, stack position or None)], for collisions
        claims: dict[str, list[tuple[str, Rule | None, int | None]]] = {}
        pieces: dict[str, list[tuple[int, Part, Rule, TensorEntry]]] = {}
        order: list[str] = []
        for name in source.names():
            entry: TensorEntry | None = None
            hit = None
            for rule in self.rules:
                m = rule.pattern.fullmatch(name)
                if m is None:
                    continue
                if rule.ndim is not None:
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
            for out, part, pos in self._parts(rule, m, name, new, entry):
                claims.setdefault(out, []).append((name, rule, pos))
                if out not in pieces:
                    order.append(out)
                pieces.setdefault(out, []).append((pos if pos is not None else 0, part, rule, entry))
        self._objects = {}  # output object name -> source object name
        for name in source.object_names():
            renamed = self._object_name(name)
            if renamed is not None:
                claims.setdefault(renamed, []).append((name, None, None))
                self._objects[renamed] = name
        for out, who in claims.items():
            if len(who) > 1 and not all(pos is not None for _, _, pos in who):
                raise RuleError(_collision(out, who, set(self._objects.values())))
        for out, ps in pieces.items():
            self._views[out] = self._build(out, ps)
        self._names = order
        self._name_set = set(order)

    # -- construction -----------------------------------------------------------

    def _parts(
        self, rule: Rule, m: re.Match[str], name: str, new: str, entry: TensorEntry
    ) -> list[tuple[str, Part, int | None]]:
        nd = len(entry.shape)
        if rule.unstack is not None:
            k = _axis(rule, rule.unstack, nd, name, "unstack", entry.shape)
            _check_perm(rule, name, nd - 1, "after unstacking, ")
            return [
                (new.replace("{i}", str(i)), Part(name, (k, i), rule.transpose), None)
                for i in range(entry.shape[k])
            ]
        _check_perm(rule, name, nd, "")
        if rule.stack is None:
            return [(new, Part(name, None, rule.transpose), None)]
        axis_raw, template = rule.stack
        a = _axis(rule, axis_raw, nd + 1, name, "stack", entry.shape)
        text = _expand(rule, m, template, name)
        if not re.fullmatch(r"[0-9]+", text):
            raise RuleError(
                f"{rule.label}: stack index {template!r} expands to {text!r} for {name!r}, not a "
                "non-negative integer; point it at the group holding the layer number"
            )
        pos = int(text)
        return [(new, Part(name, None, rule.transpose, (a, pos)), pos)]

    def _object_name(self, name: str) -> str | None:
        for rule in self.rules:
            if rule.ndim is not None:
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

    def _build(self, out: str, ps: list[tuple[int, Part, Rule, TensorEntry]]) -> _View:
        ps.sort(key=lambda p: p[0])
        rule0, first = ps[0][2], ps[0][3]
        if ps[0][1].put is not None:
            positions = [p for p, *_ in ps]
            if positions != list(range(len(ps))):
                dup = sorted({p for p in positions if positions.count(p) > 1})
                missing = sorted(set(range(max(positions) + 1)) - set(positions))
                what = f"position {dup[0]} twice" if dup else f"no piece at positions {missing[:10]}"
                raise RuleError(
                    f"{rule0.label}: stacking {len(ps)} tensors into {out!r} ({[p[3].name for p in ps][:6]}) "
                    f"finds {what}; positions must be exactly 0..{len(ps) - 1}"
                )
            axes = {p[1].put[0] if p[1].put is not None else None for p in ps}
            for _, part, rule, e in ps[1:]:
                same = _describe(e, part, rule) == _describe(first, ps[0][1], rule0)
                if not same or len(axes) > 1:
                    raise RuleError(
                        f"{rule.label}: stacked pieces of {out!r} disagree: {first.name!r} is "
                        f"{_describe(first, ps[0][1], rule0)} and {e.name!r} is {_describe(e, part, rule)}; "
                        "every piece must have the same shape and dtype (and stack axis)"
                    )
        dtype = _out_dtype(rule0, first)
        itemsize = numpy_dtype(dtype).itemsize
        chunks: list[Chunk] = []
        src_chunks: dict[tuple[int, ...], tuple[int, Chunk]] = {}
        for _, part, _, e in ps:
            for ci, c in enumerate(e.chunks):
                box = part.to_output(c.box)
                if box is None:
                    continue
                chunks.append(Chunk(offset=box.offset, shape=box.shape, grid=part.map_grid(c.grid), key=c.key,
                                    rank=c.rank, nbytes=box.volume * itemsize))
                src_chunks[box.offset] = (ci, c)
        p0 = ps[0][1]
        shape = _piece_shape(first, p0)
        if p0.put is not None:
            shape = shape[: p0.put[0]] + (len(ps),) + shape[p0.put[0] :]
        if p0.take is None and p0.perm is None and p0.put is None and dtype == first.dtype:
            entry = first if out == first.name else replace(first, name=out)  # placement kept
        else:
            entry = TensorEntry(name=out, dtype=dtype, shape=shape, chunks=tuple(chunks))
        return _View(entry, tuple(p for _, p, _, _ in ps), first.np_dtype, src_chunks)

    # -- metadata ---------------------------------------------------------------

    def names(self) -> list[str]:
        """Tensor names after the rules, in the source's order (a stack where its first piece was)."""
        return list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._name_set

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
            target = out if req is None else out[req.target_slices]
            part = v.part(box)
            ci, src_chunk = v.src_chunks[chunk.offset]
            sbox = part.to_source(box)
            dst = part.source_view(target)
            if v.src_dtype != out.dtype:
                tmp = np.empty(dst.shape, dtype=v.src_dtype)
                casts.append((dst, tmp))
                dst = tmp
            view_bytes, src_bytes = view_bytes + target.nbytes, src_bytes + dst.nbytes
            req = ReadRequest(ci, sbox, sbox.slices(src_chunk.box), tuple(slice(0, n) for n in sbox.shape))
            mapped.append(ChunkRead(part.src, src_chunk, req, dst))
        scaled = view_bytes != src_bytes and src_bytes > 0
        self.source._read_chunks(mapped, _Scaled(bar, view_bytes / src_bytes) if scaled else bar)
        for dst, tmp in casts:
            np.copyto(dst, tmp, casting="unsafe")  # the same conversion loops as astype

    def read_units(self, name: str, chunk: Chunk, box: Box, itemsize: int) -> dict[Hashable, int]:
        """The source's storage reads for ``box`` of an output chunk (plan_load's byte counts)."""
        v = self._views.get(name)
        if v is None:
            return self.source.read_units(name, chunk, box, itemsize)
        part = v.part(box)
        src_chunk = v.src_chunks[chunk.offset][1]
        return self.source.read_units(
            part.src, src_chunk, part.to_source(box), v.src_dtype.itemsize
        )


# ---------------------------------------------------------------------------
# Helpers


class _Scaled:
    """A progress bar fed source bytes, counting view bytes (a cast changes the item size)."""

    def __init__(self, bar: Any, ratio: float) -> None:
        self.bar, self.ratio = bar, ratio

    def update(self, n: int = 1) -> None:
        self.bar.update(n * self.ratio)


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


def _piece_shape(e: TensorEntry, part: Part) -> tuple[int, ...]:
    shape = list(e.shape)
    if part.take is not None:
        del shape[part.take[0]]
    if part.perm is not None:
        shape = [shape[p] for p in part.perm]
    return tuple(shape)


def _out_dtype(rule: Rule, e: TensorEntry) -> str:
    return rule.dtype or e.dtype


def _describe(e: TensorEntry, part: Part, rule: Rule) -> str:
    return f"{_piece_shape(e, part)} {_out_dtype(rule, e)}"


def _collision(out: str, who: list[tuple[str, Rule | None, int | None]], objects: set[str]) -> str:
    def one(src: str, rule: Rule | None) -> str:
        kind = "object" if src in objects else "tensor"
        return f"{kind} {src!r} ({rule.label if rule else 'no rule matches it: unchanged'})"

    listed = "; ".join(one(s, r) for s, r, _ in who[:6])
    return (
        f"{len(who)} names map to one name {out!r}: {listed}. Each name must come from one tensor; "
        "use stack to combine tensors, or change a rename"
    )


def apply_rules(src: Source, rules: Rules | Sequence[Rule]) -> Source:
    """``src`` seen through ``rules``: a lazy view, checked against the source before any read.

    Args:
        src: any opened source.
        rules: a list of rule dicts, ``{"rules": [...]}``, the path of a ``.json``
            or ``.toml`` rules file, or a shipped rule set's name.

    Returns:
        A :class:`RuledSource` (``src`` itself for an empty rule list).

    Raises:
        RuleError: a bad rule or file, or rules that do not fit the checkpoint
            (two names onto one, a permutation of the wrong length, stacked
            pieces that disagree, positions that are not 0..n-1, ...).
    """
    parsed = load_rules(rules)
    if not parsed:
        return src
    return RuledSource(src, parsed)
