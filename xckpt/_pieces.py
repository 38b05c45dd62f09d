"""How one source tensor lands in a rules view's output, and the parameter expressions rules use
(helpers of `xckpt.rules`; pure arithmetic, no I/O).

`Landing` maps boxes between a source tensor and the output it lands in: unstacked
(one slice of an axis), split or joined (a `Cut` of one axis), transposed, stacked.

`split` cuts one tensor into named parts along an axis of an optional reshape of it;
`join` is its inverse, placing each part into the whole. Either way one axis `a` of
the (un-reshaped) tensor carries a `Cut`: the whole axis is a sequence of blocks of
`stride` elements, and the part holds elements `[start, start + block)` of each block.
Megatron's fused QKV, reshaped `(groups, (q + 2) * d, hidden)` and split along axis 1
into `q * d, d, d`, gives the part `q_proj` the cut `block = q * d`, `stride =
(q + 2) * d`, `start = 0` on axis 0: rows `g * stride + [0, q * d)` of every group.

A contiguous range of the whole holds a contiguous range of the part (the part's order is
the whole's), and a contiguous range of the part is a run of pieces, one per block it
touches, each contiguous in the whole: `Cut.whole_to_part` and `Cut.part_runs`.

Parameter expressions are a small safe subset of Python expressions (integers, names,
`.attribute` / `.key` access, `+ - * // %`, comparisons, `and or not`, `x if c
else y`), evaluated by walking the syntax tree; no Python code is run.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from xckpt.errors import XckptError
from xckpt.layout import Box

__all__ = ["Cut", "Landing", "ScaledBar", "make_cut", "evaluate", "ExpressionError", "Parameters"]


class ExpressionError(XckptError, ValueError):
    """A parameter expression is not allowed, or names something that is not there."""


@dataclass(frozen=True)
class Cut:
    """Landing elements `x` of axis `axis` are whole elements `(x // block) * stride + start + x % block`.

    `join` says which side the rule's source is: False (split) the source is the whole and the
    output the part; True (join) the reverse.
    """

    axis: int
    block: int
    stride: int
    start: int
    join: bool = False

    def part_runs(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Landing `[lo, hi)` as pieces `(part_lo, part_hi, whole_lo)`, each contiguous in the whole."""
        out = []
        x = lo
        while x < hi:
            b = x // self.block
            end = min(hi, (b + 1) * self.block)
            out.append((x, end, b * self.stride + self.start + x - b * self.block))
            x = end
        return out

    def whole_to_part(self, lo: int, hi: int) -> tuple[int, int] | None:
        """The part elements lying in whole `[lo, hi)`: one range (or None)."""

        def first_at_or_after(w: int) -> int:
            b, r = divmod(w, self.stride)
            if r <= self.start:
                return b * self.block
            if r >= self.start + self.block:
                return (b + 1) * self.block
            return b * self.block + r - self.start

        a, z = first_at_or_after(lo), first_at_or_after(hi)
        return (a, z) if a < z else None

    def to_output(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The output ranges the source range `[lo, hi)` of the cut axis fills."""
        if self.join:
            return [(w, w + b - a) for a, b, w in self.part_runs(lo, hi)]
        got = self.whole_to_part(lo, hi)
        return [] if got is None else [got]

    def to_source(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Output `[lo, hi)` as pieces `(out_lo, out_hi, source_lo)`, each contiguous in the source."""
        if not self.join:
            return self.part_runs(lo, hi)
        got = self.whole_to_part(lo, hi)
        if got is None or got[1] - got[0] != hi - lo:
            raise XckptError(f"output range [{lo}, {hi}) is not inside one part of {self}")
        return [(lo, hi, got[0])]


def make_cut(
    shape: Sequence[int],
    axis: int,
    sizes: Sequence[int],
    index: int,
    reshape: Sequence[int] | None,
    join: bool,
) -> tuple[Cut, tuple[int, ...]]:
    """The cut of part `index` and the shape of the rule's output, for a source of `shape`.

    `reshape` (one entry may be -1) applies to the source: the whole for a split, the part
    for a join. `axis` is an axis of the reshape (of `shape` without one). A split's
    `sizes` may hold one -1, the rest of the axis.

    Raises:
        ValueError: the reshape does not fit, merges axes, or the sizes do not fill the axis;
            the message says which (the caller adds the rule and tensor).
    """
    shape = tuple(shape)
    dims = list(reshape) if reshape is not None else list(shape)
    if not shape or 0 in shape:
        raise ValueError(f"a tensor of shape {shape} cannot be split")
    if dims.count(-1) > 1 or any(d == 0 or d < -1 for d in dims):
        raise ValueError(f"reshape {list(dims)} may hold one -1 and positive sizes")
    if -1 in dims:
        known = math.prod(d for d in dims if d != -1)
        if math.prod(shape) % known:
            raise ValueError(f"reshape {list(dims)} does not fit shape {shape}")
        dims[dims.index(-1)] = math.prod(shape) // known
    if math.prod(dims) != math.prod(shape):
        raise ValueError(f"reshape {list(dims)} does not fit shape {shape} ({math.prod(shape)} elements)")
    if not -len(dims) <= axis < len(dims):
        raise ValueError(f"axis {axis} is out of range for {len(dims)} axes {tuple(dims)}")
    k = axis % len(dims)
    extent = dims[k]
    parts = list(sizes)
    if not join and parts.count(-1) == 1:
        rest = extent - sum(s for s in parts if s != -1)
        parts[parts.index(-1)] = rest
    if any(s <= 0 for s in parts):
        raise ValueError(f"sizes {list(sizes)} must be positive (a split may hold one -1)")
    if join:
        if extent != parts[index]:
            raise ValueError(f"the part's extent {extent} along axis {axis} is not its size {parts[index]}")
        extent = sum(parts)
    elif sum(parts) != extent:
        raise ValueError(f"sizes {parts} add up to {sum(parts)}, not the axis's extent {extent}")
    # The reshape axis k lies inside one axis `a` of the tensor when its stride and span do.
    inner = math.prod(dims[k + 1 :])
    span = inner * dims[k]
    strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
    for a, st in enumerate(strides):
        if inner % st == 0 and (st * shape[a]) % span == 0 and inner >= st and span <= st * shape[a]:
            break
    else:
        raise ValueError(
            f"reshape {tuple(dims)} of shape {shape} merges axes at axis {axis}; a split or join's "
            "reshape may only split axes"
        )
    unit = inner // st
    cut = Cut(a, parts[index] * unit, extent * unit, sum(parts[:index]) * unit, join)
    out = list(shape)
    out[a] = shape[a] // dims[k] * (extent if join else parts[index])
    return cut, tuple(out)


@dataclass(frozen=True)
class Landing:
    """How one source tensor (or one slice of it) lands in an output tensor.

    `take = (k, i)`: the source's slice `i` along axis `k` (unstack); `cut`: then
    only a part of one axis (split), or placed as a part of a larger axis (join); `perm`:
    then transposed; `put = (a, i)`: then placed at position `i` of a new axis `a` (stack).
    """

    src: str
    take: tuple[int, int] | None = None
    perm: tuple[int, ...] | None = None
    put: tuple[int, int] | None = None
    cut: Cut | None = None

    def _unplace(self, box: Box) -> Box:
        """An output box -> the same elements in piece axes (before perm and put)."""
        off, shp = list(box.offset), list(box.shape)
        if self.put is not None:
            del off[self.put[0]], shp[self.put[0]]
        if self.perm is not None:
            o, s = [0] * len(off), [0] * len(off)
            for j, p in enumerate(self.perm):
                o[p], s[p] = off[j], shp[j]
            off, shp = o, s
        return Box(tuple(off), tuple(shp))

    def _place(self, box: Box) -> Box:
        """A box in piece axes -> the output box (perm, then put)."""
        off, shp = list(box.offset), list(box.shape)
        if self.perm is not None:
            off, shp = [off[p] for p in self.perm], [shp[p] for p in self.perm]
        if self.put is not None:
            off.insert(self.put[0], self.put[1])
            shp.insert(self.put[0], 1)
        return Box(tuple(off), tuple(shp))

    def _untake(self, box: Box) -> Box:
        if self.take is None:
            return box
        off, shp = list(box.offset), list(box.shape)
        off.insert(self.take[0], self.take[1])
        shp.insert(self.take[0], 1)
        return Box(tuple(off), tuple(shp))

    def to_source(self, box: Box) -> Box:
        """An output box inside this part -> the source box holding its elements (no cut)."""
        return self._untake(self._unplace(box))

    def to_sources(self, box: Box) -> list[tuple[Box, Box]]:
        """An output box -> `(source box, output box)` pairs covering it; several when a split
        part's box spans blocks of the whole (each contiguous in the source)."""
        if self.cut is None:
            return [(self.to_source(box), box)]
        mid = self._unplace(box)
        a = self.cut.axis
        out = []
        for lo, hi, src in self.cut.to_source(mid.offset[a], mid.end[a]):
            piece = Box(_at(mid.offset, a, lo), _at(mid.shape, a, hi - lo))
            out.append((self._untake(Box(_at(mid.offset, a, src), piece.shape)), self._place(piece)))
        return out

    def to_output(self, box: Box) -> list[Box]:
        """A source box -> the output boxes its elements fill (none: outside an unstacked slice or
        a split part; several: a joined part's box spread over the whole's blocks)."""
        off, shp = list(box.offset), list(box.shape)
        if self.take is not None:
            k, i = self.take
            if not off[k] <= i < off[k] + shp[k]:
                return []
            del off[k], shp[k]
        mid = Box(tuple(off), tuple(shp))
        if self.cut is None:
            return [self._place(mid)]
        a = self.cut.axis
        ranges = self.cut.to_output(mid.offset[a], mid.end[a])
        return [self._place(Box(_at(mid.offset, a, lo), _at(mid.shape, a, hi - lo))) for lo, hi in ranges]

    def map_grid(self, grid: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """A chunk's inner grid in output axes (a stacked axis has extent 1; none across a cut)."""
        if grid is None or self.cut is not None:
            return None
        off = [self.take[1] if self.take and d == self.take[0] else 0 for d in range(len(grid))]
        outs = self.to_output(Box(tuple(off), grid))
        return outs[0].shape if outs else None  # (the grid's box always holds the taken index)

    def piece_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape a source tensor of `shape` has in the output, before any stack axis."""
        out = list(shape)
        if self.take is not None:
            del out[self.take[0]]
        if self.cut is not None:
            c, n = self.cut, out[self.cut.axis]
            out[c.axis] = n // c.block * c.stride if c.join else n // c.stride * c.block
        if self.perm is not None:
            out = [out[p] for p in self.perm]
        return tuple(out)

    def source_view(self, arr: np.ndarray) -> np.ndarray:
        """A view of `arr` (output box) with the source box's axes: reads land straight in `arr`."""
        if self.put is not None:
            arr = arr[(slice(None),) * self.put[0] + (0, Ellipsis)]  # Ellipsis: a 0-d view, not a scalar
        if self.perm is not None:
            arr = arr.transpose(np.argsort(self.perm))
        if self.take is not None:
            arr = np.expand_dims(arr, self.take[0])
        return arr


class ScaledBar:
    """A progress bar fed source bytes, counting view bytes (a cast changes the item size)."""

    def __init__(self, bar: Any, ratio: float) -> None:
        self.bar, self.ratio = bar, ratio

    def update(self, n: int = 1) -> None:
        self.bar.update(n * self.ratio)


def _at(t: tuple[int, ...], i: int, v: int) -> tuple[int, ...]:
    return t[:i] + (v,) + t[i + 1 :]


# ---------------------------------------------------------------------------
# Parameter expressions

_BIN: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CMP: dict[type, Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}


def _member(obj: Any, key: str, text: str) -> Any:
    """`obj.key`: a mapping's key, or an instance attribute (never a property or method)."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
    else:
        d = getattr(obj, "__dict__", None)  # an argparse.Namespace's attributes
        if isinstance(d, dict) and key in d:
            return d[key]
    raise ExpressionError(f"expression {text!r}: {type(obj).__name__} has no {key!r}")


def evaluate(text: str, lookup: Callable[[str], Any]) -> Any:
    """Evaluate parameter expression `text`; names come from `lookup` (which raises when absent).

    Raises:
        ExpressionError: syntax outside the allowed subset, or a missing attribute.
    """
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ExpressionError(f"expression {text!r} is not valid: {e.msg}") from None

    def ev(n: ast.AST) -> Any:
        if isinstance(n, ast.Constant) and (n.value is None or isinstance(n.value, (int, float, str, bool))):
            return n.value
        if isinstance(n, ast.Name):
            return lookup(n.id)
        if isinstance(n, ast.Attribute):
            return _member(ev(n.value), n.attr, text)
        if isinstance(n, ast.BinOp) and type(n.op) in _BIN:
            return _BIN[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.Not)):
            v = ev(n.operand)
            return -v if isinstance(n.op, ast.USub) else not v
        if isinstance(n, ast.BoolOp):
            v = ev(n.values[0])
            for x in n.values[1:]:
                if (not v) if isinstance(n.op, ast.And) else v:
                    return v
                v = ev(x)
            return v
        if isinstance(n, ast.IfExp):
            return ev(n.body) if ev(n.test) else ev(n.orelse)
        if isinstance(n, ast.Compare) and all(type(op) in _CMP for op in n.ops):
            left = ev(n.left)
            for op, right in zip(n.ops, n.comparators):
                r = ev(right)
                if not _CMP[type(op)](left, r):
                    return False
                left = r
            return True
        raise ExpressionError(
            f"expression {text!r}: {type(n).__name__} is not allowed (integers, names, .attributes, "
            "+ - * // %, comparisons, and/or/not, x if c else y)"
        )

    try:
        return ev(tree.body)
    except (TypeError, ZeroDivisionError) as e:
        raise ExpressionError(f"expression {text!r} cannot be evaluated: {e}") from None


class Parameters:
    """A rule set's parameters (name -> an integer or an expression), evaluated when first needed.

    Names in expressions are other parameters, then the checkpoint's objects (`args`): read
    through `read_object` (which raises `ExpressionError` when it cannot be read).
    """

    def __init__(
        self,
        given: Mapping[str, int | str | None],
        object_names: Callable[[], list[str]],
        read_object: Callable[[str], Any],
    ) -> None:
        self.given = dict(given)
        self._object_names = object_names
        self._read_object = read_object
        self.values: dict[str, Any] = {}
        self._busy: list[str] = []

    def _lookup(self, name: str) -> Any:
        if name in self.given:
            return self.value(name)
        if name in self._object_names():
            return self._read_object(name)
        raise ExpressionError(
            f"{name!r} is neither a parameter of the rule set ({sorted(self.given)}) nor an object of "
            f"the checkpoint ({self._object_names()[:8]})"
        )

    def value(self, name: str) -> Any:
        """Parameter `name`'s value (evaluated once)."""
        if name in self.values:
            return self.values[name]
        if name in self._busy:
            raise ExpressionError(
                f"parameters refer to each other in a circle: {' -> '.join([*self._busy, name])}"
            )
        expr = self.given[name]
        if expr is None:
            raise ExpressionError(f"parameter {name!r} has no value in the rule set; give it")
        self._busy.append(name)
        try:
            v = expr if not isinstance(expr, str) else evaluate(expr, self._lookup)
        finally:
            self._busy.pop()
        self.values[name] = v
        return v

    def evaluate(self, text: str) -> Any:
        """An expression over the parameters and the checkpoint's objects."""
        return evaluate(text, self._lookup)
