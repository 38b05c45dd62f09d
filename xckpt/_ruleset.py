"""Rule sets parsed: the rule model (`Rule`, `Split`), rule files and shipped sets.

[xckpt.rules][] applies them as a view over a source; this module only reads and checks
them, so a bad rule is a `RuleError` before any source is opened.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from xckpt._dequant import Dequant, parse_dequant
from xckpt.errors import RuleError
from xckpt.manifest import DTYPES

__all__ = ["is_int", "RULESETS_DIR", "Rules", "Rule", "Split", "load_rules", "load_rule_set", "shipped_rule_sets"]

#: Where the shipped rule sets live (installed as package data).
RULESETS_DIR = Path(__file__).with_name("rulesets")

_KEYS = ("match", "rename", "transpose", "dtype", "drop", "stack", "unstack", "split", "join", "ndim", "dequant", "comment")
_TENSOR_ONLY = ("transpose", "dtype", "stack", "unstack", "split", "join", "dequant")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


#: The `rules=` option of every verb: a list of rule dicts, `{"rules": [...]}`, the
#: path of a JSON or TOML file, the name of a shipped rule set, or None (no rules).
Rules = Union[Sequence[Mapping[str, Any]], Mapping[str, Any], str, "os.PathLike[str]", None]




# ---------------------------------------------------------------------------
# Parsing


@dataclass(frozen=True)
class Split:
    """A rule's `split` (or `join`): parts `names` of `sizes` along `axis` of `reshape`.

    Sizes and reshape entries are ints or parameter expressions (strings), resolved per tensor;
    `part` (join only) is the template naming the part a source tensor is.
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
        """How messages name the rule: `rule 2 (match '...')`, with its file when it has one."""
        at = "" if self.where == "rules" else f"{self.where}: "
        return f"{at}rule {self.index} (match {self.pattern.pattern!r})"

    def tensor_ops(self) -> list[str]:
        """The keys that act on axes or dtypes (meaningless for objects)."""
        ops: list[tuple[str, object]] = [("transpose", self.transpose), ("dtype", self.dtype)]
        ops += [("stack", self.stack), ("unstack", self.unstack), ("split", self.split), ("join", self.join)]
        ops.append(("dequant", self.dequant))
        return [k for k, v in ops if v is not None]


def shipped_rule_sets() -> list[str]:
    """Names of the rule sets shipped with xckpt (usable as `rules="<name>"`)."""
    return sorted(p.stem for p in RULESETS_DIR.glob("*.json"))


def is_int(v: Any) -> bool:
    """An int that is not a bool (JSON's integers)."""
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
        if not isinstance(perm, (list, tuple)) or not all(map(is_int, perm)):
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
        if not is_int(stack["axis"]) or not isinstance(stack["index"], str):
            raise RuleError(f"{head}: stack axis must be an integer and index a template, got {stack!r}")
        if rename is None:
            raise RuleError(f"{head}: 'stack' needs a 'rename' that maps the pieces to one name")
        stack = (stack["axis"], stack["index"])
    unstack = d.get("unstack")
    if unstack is not None:
        if not isinstance(unstack, Mapping) or set(unstack) != {"axis"} or not is_int(unstack["axis"]):
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
        nds = [nd] if is_int(nd) else nd
        if not isinstance(nds, (list, tuple)) or not nds or not all(is_int(x) and x >= 0 for x in nds):
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
        if not isinstance(x, (list, tuple)) or not x or not all(is_int(s) or isinstance(s, str) for s in x):
            raise RuleError(f"{head}: {key} {what} must be a list of integers or parameter expressions, got {x!r}")
        return tuple(x)

    names = v["names"]
    if not is_int(v["axis"]):
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
    """Parse and check rules: a list of dicts, `{"rules": [...]}`, a file path or a shipped name.

    Raises:
        RuleError: a bad file (suffix, syntax, layout) or a bad rule (unknown
            key, bad regular expression, not a permutation, ...).
    """
    return load_rule_set(rules)[0]


def load_rule_set(
    rules: Rules | Sequence[Rule], depth: int = 0
) -> tuple[list[Rule], dict[str, int | str | None]]:
    """`load_rules` and the rule set's parameters (the file's, overridden by the caller's).

    `{"rules": "<shipped name or file>", "parameters": {...}}` loads that rule set with
    those parameters over its own.

    Raises:
        RuleError: as `load_rules`; a parameter that is not a name -> int or expression.
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
        if not isinstance(k, str) or not _IDENT.fullmatch(k) or not (x is None or is_int(x) or isinstance(x, str)):
            raise RuleError(
                f"{where}: parameter {k!r} = {x!r}: a parameter is a name -> an integer, an expression "
                "such as 'args.num_attention_heads', or null (the caller must give it)"
            )
    return dict(v)


# ---------------------------------------------------------------------------
# Box arithmetic: one source tensor -> one piece of an output tensor
