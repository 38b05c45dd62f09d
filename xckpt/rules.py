"""Rules: rename, transpose, cast, drop, stack, unstack, split and join tensors as a lazy view over a source.

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
* ``split: {"axis": k, "sizes": [...], "names": [...], "reshape": [...]}``: the
  tensor is cut into named parts along axis ``k`` of its ``reshape`` (optional; one
  entry may be -1; a reshape may only split axes), one size per name (a split's sizes
  may hold one -1, the rest of the axis); each part keeps the tensor's rank (the
  reshape's axes merge back); ``rename`` must contain ``{part}``, the part's name.
  Megatron's fused QKV ``(groups * (q + 2) * d, hidden)`` split per query group is
  ``"reshape": ["num_query_groups", -1, "hidden_size"], "axis": 1, "sizes": [q * d, d, d]``.
* ``join: {"axis": k, "sizes": [...], "names": [...], "reshape": [...], "part": "\\2"}``:
  the inverse of ``split``: every tensor renamed to the same name is the part ``part``
  expands to (one of ``names``), placed along axis ``k`` of the whole (the reshape
  applies to each part); every part must come exactly once (with ``stack``: once at
  every position).
* ``ndim``: an int or list of ints; the rule applies only to tensors of that
  rank (so torch's 1-D norm ``weight`` and 2-D Linear ``weight`` can get
  different rules, as transformers' torch -> flax rules decide by shape).
* ``dequant: {"kind": "fp8_block" | "mxfp4", "scale": "\\1_scale_inv", "block": [128, 128]}``:
  a tensor stored as float8 (uint8 for mxfp4) is read dequantized with the scale tensor
  ``scale`` names, to the rule's ``dtype`` (bfloat16 by default), the scale leaving the view
  (`xckpt._dequant`); ``ndim`` counts stored axes, other keys act on the result; never an object.
* ``comment``: ignored (JSON has no comments).

The first matching rule wins; names no rule matches pass unchanged; a rule
with ``match`` alone passes its names unchanged (and shields them from later
rules). ``rules`` is a list of such dicts, a mapping ``{"rules": [...]}``, the
path of a ``.json`` or ``.toml`` file holding ``{"rules": [...]}`` (the suffix
decides), or the name of a shipped rule set in ``xckpt/rulesets/``
(``"torch_to_flax"``, ``"megatron_gpt_to_hf_llama"``, ``"fp8_block_dequant"``, ...);
:func:`shipped_rule_sets` lists them.

Order inside one rule: ``unstack`` splits first, then each piece is split (or
joined), transposed and cast, then ``stack`` inserts the new axis; so a rule and
its inverse name the same per-piece permutation (``transpose: [1, 0]`` both ways).

Parameters. Sizes and reshape entries are integers or expressions (strings) in a
small safe subset of Python (:func:`xckpt._pieces.evaluate`: integers, names,
``.attribute`` / key access, ``+ - * // %``, comparisons, ``and or not``, ``x if c
else y``; nothing is called) over the rule set's parameters and the checkpoint's
objects. A rule set declares its parameters beside its rules, ``{"parameters":
{"num_query_groups": "args.num_query_groups if args.group_query_attention else
args.num_attention_heads", ...}, "rules": [...]}`` (``null``: the caller must give
it); the caller gives or overrides them as ``rules={"rules": "<shipped name or
file>", "parameters": {...}}``. A parameter is evaluated when a rule first needs it;
reading an object that is a pickle needs the source opened with
``allow_pickle=True``, and the error says so and how to give the value instead.

A split part's chunk is the image of one stored chunk (a contiguous range of the
whole holds a contiguous range of the part); reading a box of it reads, from that
stored chunk, one run per block of the whole it spans (per query group), only the
part's elements. A joined tensor's chunks are one per stored chunk of a part and
block of the whole; each reads one box of the part.

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

from xckpt._dequant import Dequant, Dequantized, parse_dequant
from xckpt._pieces import ExpressionError, Landing, Parameters, ScaledBar, make_cut
from xckpt.errors import ObjectError, RuleError
from xckpt.layout import Box, ReadRequest
from xckpt.manifest import DTYPES, Chunk, TensorEntry, numpy_dtype
from xckpt.source import ChunkRead, Source
from xckpt.views import SourceView

__all__ = ["Rules", "RuleError", "Rule", "Landing", "RuledSource", "apply_rules", "load_rules", "shipped_rule_sets", "RULESETS_DIR", "Split", "load_rule_set"]

#: Where the shipped rule sets live (installed as package data).
RULESETS_DIR = Path(__file__).with_name("rulesets")

_KEYS = ("match", "rename", "transpose", "dtype", "drop", "stack", "unstack", "split", "join", "ndim", "dequant", "comment")
_TENSOR_ONLY = ("transpose", "dtype", "stack", "unstack", "split", "join", "dequant")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


#: The ``rules=`` option of every verb: a list of rule dicts, ``{"rules": [...]}``, the
#: path of a JSON or TOML file, the name of a shipped rule set, or None (no rules).
Rules = Union[Sequence[Mapping[str, Any]], Mapping[str, Any], str, "os.PathLike[str]", None]


#: Where a piece goes in an output made of several: (stack position, join part index).
_Slot = tuple[int, int]


# ---------------------------------------------------------------------------
# Parsing


@dataclass(frozen=True)
class Split:
    """A rule's ``split`` (or ``join``): parts ``names`` of ``sizes`` along ``axis`` of ``reshape``.

    Sizes and reshape entries are ints or parameter expressions (strings), resolved per tensor;
    ``part`` (join only) is the template naming the part a source tensor is.
    """

    axis: int
    sizes: tuple[int | str, ...]
    names: tuple[str, ...]
    reshape: tuple[int | str, ...] | None = None
    part: str | None = None


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
    split: Split | None = None
    join: Split | None = None
    dequant: Dequant | None = None

    @property
    def label(self) -> str:
        """How messages name the rule: ``rule 2 (match '...')``, with its file when it has one."""
        at = "" if self.where == "rules" else f"{self.where}: "
        return f"{at}rule {self.index} (match {self.pattern.pattern!r})"

    def tensor_ops(self) -> list[str]:
        """The keys that act on axes or dtypes (meaningless for objects)."""
        ops: list[tuple[str, object]] = [("transpose", self.transpose), ("dtype", self.dtype)]
        ops += [("stack", self.stack), ("unstack", self.unstack), ("split", self.split), ("join", self.join)]
        ops.append(("dequant", self.dequant))
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
            "dtype, drop, stack, unstack, split, join, ndim, dequant (and an ignored comment)"
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
    split = _parse_split(head, "split", d.get("split"), rename)
    join = _parse_split(head, "join", d.get("join"), rename)
    if split is not None and (join is not None or stack is not None):
        raise RuleError(f"{head}: a rule that splits cannot also join or stack (split in one rule, stack in another)")
    if drop and (split or join):
        raise RuleError(f"{head}: a rule that drops cannot also split or join")
    try:
        dequant = parse_dequant(d.get("dequant"))
    except ValueError as e:
        raise RuleError(f"{head}: {e}") from None
    return Rule(i, pattern, rename, perm, dtype, drop, stack, unstack, nd, where, split, join, dequant)


def _parse_split(head: str, key: str, v: Any, rename: str | None) -> Split | None:
    if v is None:
        return None
    form = (
        '{"axis": k, "sizes": [...], "names": [...], "reshape": [...] (optional)'
        + (', "part": "\\\\2"' if key == "join" else "")
        + "}"
    )
    allowed = {"axis", "sizes", "names", "reshape"} | ({"part"} if key == "join" else set())
    if not isinstance(v, Mapping) or not {"axis", "sizes", "names"} <= set(v) <= allowed:
        raise RuleError(f"{head}: {key!r} must be {form}, got {v!r}")

    def sizes(x: Any, what: str) -> tuple[int | str, ...]:
        if not isinstance(x, (list, tuple)) or not x or not all(_int(s) or isinstance(s, str) for s in x):
            raise RuleError(f"{head}: {key} {what} must be a list of integers or parameter expressions, got {x!r}")
        return tuple(x)

    names = v["names"]
    if not _int(v["axis"]):
        raise RuleError(f"{head}: {key} axis must be an integer, got {v['axis']!r}")
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
        raise RuleError(f"{head}: {key} names must be a list of part names, got {names!r}")
    if len(set(names)) != len(names) or len(names) != len(v["sizes"] if isinstance(v["sizes"], list) else ()):
        raise RuleError(f"{head}: {key} needs one size per name and distinct names, got {names!r} / {v['sizes']!r}")
    reshape = sizes(v["reshape"], "reshape") if v.get("reshape") is not None else None
    part = v.get("part")
    if key == "split" and (rename is None or "{part}" not in rename):
        raise RuleError(f"{head}: 'split' needs a 'rename' containing {{part}} (the part's name), got {rename!r}")
    if key == "join" and (rename is None or not isinstance(part, str)):
        raise RuleError(f"{head}: 'join' needs a 'rename' (the joined tensor) and a 'part' template, got {form}")
    return Split(v["axis"], sizes(v["sizes"], "sizes"), tuple(names), reshape, part)


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
    return load_rule_set(rules)[0]


def load_rule_set(
    rules: Rules | Sequence[Rule], depth: int = 0
) -> tuple[list[Rule], dict[str, int | str | None]]:
    """:func:`load_rules` and the rule set's parameters (the file's, overridden by the caller's).

    ``{"rules": "<shipped name or file>", "parameters": {...}}`` loads that rule set with
    those parameters over its own.

    Raises:
        RuleError: as :func:`load_rules`; a parameter that is not a name -> int or expression.
    """
    where = "rules"
    params: dict[str, int | str | None] = {}
    data: Any = rules
    if isinstance(rules, (str, os.PathLike)):
        path = _resolve(rules)
        where = f"rules file {str(path)!r}"
        data = _read_file(path)
        if not isinstance(data, Mapping):
            raise RuleError(f"{where}: expected {{\"rules\": [...]}}, got a {type(data).__name__}")
    if isinstance(data, Mapping):
        extra = sorted(set(data) - {"rules", "description", "parameters"})
        if "rules" not in data or extra:
            raise RuleError(
                f"{where}: expected {{\"rules\": [...]}} (and an optional description and parameters), got "
                f"keys {sorted(data)}"
            )
        params = _parse_parameters(data.get("parameters"), where)
        data = data["rules"]
        if isinstance(data, (str, os.PathLike)) and depth == 0:
            inner, inner_params = load_rule_set(data, depth + 1)
            return inner, {**inner_params, **params}
    if not isinstance(data, (list, tuple)):
        raise RuleError(f"{where}: 'rules' must be a list of rules, got {type(data).__name__}")
    return [r if isinstance(r, Rule) else _parse_rule(i, r, where) for i, r in enumerate(data)], params


def _parse_parameters(v: Any, where: str) -> dict[str, int | str | None]:
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise RuleError(f"{where}: 'parameters' must map names to integers or expressions, got {v!r}")
    for k, x in v.items():
        if not isinstance(k, str) or not _IDENT.fullmatch(k) or not (x is None or _int(x) or isinstance(x, str)):
            raise RuleError(
                f"{where}: parameter {k!r} = {x!r}: a parameter is a name -> an integer, an expression "
                "such as 'args.num_attention_heads', or null (the caller must give it)"
            )
    return dict(v)


# ---------------------------------------------------------------------------
# Box arithmetic: one source tensor -> one piece of an output tensor


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
    """Sizes or reshape entries of ``rule`` for ``tensor``: integers, or parameter expressions resolved."""
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
        if not _int(v):
            raise RuleError(f"{rule.label}, tensor {tensor!r}: {what} {x!r} is {v!r}, not an integer")
        out.append(v)
    return out


# ---------------------------------------------------------------------------
# The view


class RuledSource(SourceView):
    """A :class:`Source` seen through rules: transformed names, shapes, dtypes and boxes.

    Built by :func:`apply_rules`. Every view chunk is one stored chunk of the
    wrapped :attr:`source` (or an unstacked slice of it, the part of it a split
    keeps, or one block of a joined part), so each read job maps to jobs of the
    source's ``_read_chunks`` in that one chunk, covering only the requested
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
        self._names = order
        self._name_set = set(order)

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
        """The source's storage reads for ``box`` of an output chunk (plan_load's byte counts)."""
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
    parsed, parameters = load_rule_set(rules)
    if not parsed:
        return src
    if not any(r.dequant is not None for r in parsed):
        return RuledSource(src, parsed, parameters)
    params = Parameters(parameters, src.object_names, _object_reader(src))
    under = Dequantized(src, parsed, lambda rule, name, items: _ints(params, rule, name, "block size", items))
    return RuledSource(under, parsed, parameters, under.taken)
