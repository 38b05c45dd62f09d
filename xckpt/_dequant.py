"""Dequantizing views: block-scaled fp8 and MXFP4 tensors read as bfloat16, float16 or float32.

A rule with `dequant` (see `xckpt.rules`) takes a quantized tensor and its scale tensor and
presents one tensor of the rule's `dtype` (bfloat16 unless the rule says otherwise); the
scale tensor leaves the view. Two kinds:

- `fp8_block` (DeepSeek-V3): a float8 tensor `w` and a float32 scale `s` with one value
  per block (`block`, one size per axis; 128 x 128 for DeepSeek). Element `i` is
  `float32(w[i]) * s[i // block]` rounded once to the output dtype, exactly DeepSeek's
  `weight_dequant` (its Triton kernel multiplies in float32 and stores to the output
  dtype with round-to-nearest-even). Edges that are not multiples of the block use the
  last, partial block's scale. `s` has shape `ceil(shape / block)`.
- `mxfp4` (gpt-oss experts): `blocks` uint8 of shape `(..., G, B)`, two e2m1 values a
  byte, the low nibble first, and `scales` uint8 of shape `(..., G)`, e8m0 with bias 127:
  value `fp4 * 2 ** (scale - 127)` rounded once to the output dtype, exactly transformers'
  `convert_moe_packed_tensors` (its lookup table in the output dtype, then `torch.ldexp`,
  whose result is the exact product rounded once: scale 255 is `2 ** 128`, finite for 0.5). The
  view's tensor has shape `(..., G * 2 * B)`: transformers' layout before its final
  `transpose(1, 2)`, which the rule's own `transpose` supplies (the shipped rule set
  `mxfp4_dequant` does).

Reads are lazy and bounded: a box of the view reads only the stored bytes of that box (for
MXFP4 the whole groups it touches) and the scale entries of the blocks it touches, in
pieces of at most `PIECE_BYTES` of quantized data, at most `BATCH_BYTES` read at once.
The arithmetic is table lookups in numpy: for fp8, one 256-entry table per scale (the 256
possible products, rounded once); for MXFP4 one 65,536-entry table of value pairs (every
scale and byte). NaN inputs give NaN (their bit patterns are not pinned; torch's own casts
disagree among themselves there).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from xckpt._pieces import ScaledBar
from xckpt.errors import RuleError
from xckpt.layout import Box, plan_reads
from xckpt.manifest import Chunk, TensorEntry, numpy_dtype
from xckpt.source import ChunkRead, Source
from xckpt.views import SourceView

__all__ = ["Dequant", "Dequantized", "parse_dequant", "scale_box", "mxfp4_boxes"]
__all__ += ["dequant_fp8_block", "dequant_mxfp4", "KINDS", "OUT_DTYPES"]

#: The kinds of quantization a `dequant` rule undoes.
KINDS = ("fp8_block", "mxfp4")
#: The output dtypes a `dequant` rule may ask for (its rule's `dtype`; bfloat16 by default).
OUT_DTYPES = ("bfloat16", "float16", "float32")
#: Quantized bytes of one piece of a read (a box is cut along axis 0 into pieces this size).
PIECE_BYTES = 64 << 20
#: Quantized bytes read from the source at once (pieces are read in batches this size).
BATCH_BYTES = 128 << 20
#: Elements of one band of the lookups (its index array is 8 bytes an element).
_BAND = 1 << 17

#: e2m1 values by nibble (transformers' `FP4_VALUES`, the OCP MX spec's table).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_LANES: dict[int, np.dtype[Any]] = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}


@dataclass(frozen=True)
class Dequant:
    """A rule's `dequant`: the `kind`, the `scale` tensor's name template and (fp8) the `block`.

    Block sizes are ints or parameter expressions, resolved per tensor.
    """

    kind: str
    scale: str
    block: tuple[int | str, ...] = ()


def parse_dequant(v: Any) -> Dequant | None:
    """A rule's `dequant` value, checked.

    Raises:
        ValueError: not `{"kind": ..., "scale": ..., "block": [...]}` (block for fp8_block
            only); the message says what is wrong (the caller adds the rule).
    """
    if v is None:
        return None
    form = (
        "'dequant' must be {\"kind\": \"fp8_block\", \"scale\": \"\\\\1_scale_inv\", \"block\": [128, 128]} "
        "or {\"kind\": \"mxfp4\", \"scale\": \"\\\\1_scales\"}"
    )
    if not isinstance(v, Mapping) or not {"kind", "scale"} <= set(v) <= {"kind", "scale", "block"}:
        raise ValueError(f"{form}, got {v!r}")
    kind, scale, block = v["kind"], v["scale"], v.get("block")
    if kind not in KINDS:
        raise ValueError(f"dequant kind {kind!r} is not one of {list(KINDS)}")
    if not isinstance(scale, str) or not scale:
        raise ValueError(f"dequant scale must be a template naming the scale tensor, got {scale!r}")
    if kind == "mxfp4":
        if block is not None:
            raise ValueError("an mxfp4 dequant takes no 'block': its groups are the blocks tensor's last axis")
        return Dequant(kind, scale)
    block = [128, 128] if block is None else block
    ok = isinstance(block, (list, tuple)) and block
    if not ok or not all(isinstance(b, str) or (type(b) is int and b > 0) for b in block):
        raise ValueError(f"dequant block must be a list of positive sizes (one per axis), got {block!r}")
    return Dequant(kind, scale, tuple(block))


# ---------------------------------------------------------------------------
# Box arithmetic


def scale_box(box: Box, block: Sequence[int]) -> Box:
    """The box of the scale tensor holding the scales of every element of `box` (blocks `block`)."""
    lo = tuple(o // b for o, b in zip(box.offset, block))
    hi = tuple(-(-e // b) for e, b in zip(box.end, block))
    return Box(lo, tuple(h - lo_ for lo_, h in zip(lo, hi)))


def mxfp4_boxes(box: Box, group_bytes: int) -> tuple[Box, Box]:
    """For a box of the dequantized `(..., G * 2 * group_bytes)` tensor: the boxes of `blocks`
    `(..., G, group_bytes)` and `scales` `(..., G)` holding it (whole groups along the last axis)."""
    per = 2 * group_bytes
    k0, k1 = box.offset[-1], box.end[-1]
    g0, g1 = k0 // per, -(-k1 // per)
    lead_o, lead_s = box.offset[:-1], box.shape[:-1]
    scales = Box((*lead_o, g0), (*lead_s, g1 - g0))
    return Box((*lead_o, g0, 0), (*lead_s, g1 - g0, group_bytes)), scales


# ---------------------------------------------------------------------------
# The arithmetic


@functools.cache
def _fp8_values(dtype: np.dtype) -> np.ndarray:
    """Every float8 bit pattern's value as float32 (exact)."""
    return np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)


@functools.cache
def _mxfp4_table(dtype: np.dtype) -> np.ndarray:
    """Entry `scale * 256 + byte`: the byte's two values (low nibble first) as one word."""
    # torch.ldexp's result: the exact product (float64 holds it; 2**128 included), rounded once.
    pow2 = np.ldexp(1.0, np.arange(-127, 129))
    with np.errstate(over="ignore"):
        prod = (pow2[:, None] * np.array(FP4_VALUES)[None, :]).astype(np.float32).astype(dtype)  # (scale, nibble)
    byte = np.arange(256)
    pairs = np.empty((256, 256, 2), dtype)
    pairs[:, :, 0] = prod[:, byte & 15]
    pairs[:, :, 1] = prod[:, byte >> 4]
    return pairs.view(_LANES[2 * dtype.itemsize]).reshape(-1)


def _bands(out: np.ndarray, cut: Callable[[int], int]) -> Any:
    """`(lead index, row start, row stop)` over `out` viewed as `(..., rows, cols)`: bands of
    at most `_BAND` elements that never cross a row where `cut(row)` changes."""
    rows, cols = out.shape[-2:]
    per = max(1, _BAND // max(cols, 1))
    for lead in np.ndindex(*out.shape[:-2]):
        r = 0
        while r < rows:
            stop = min(rows, cut(r))
            for a in range(r, stop, per):
                yield lead, a, min(stop, a + per)
            r = stop


def dequant_fp8_block(w: np.ndarray, scale: np.ndarray, offset: Sequence[int], block: Sequence[int], out: np.ndarray) -> None:
    """`out = float32(w) * scale[block of each element]`, rounded once to `out.dtype`.

    Args:
        w: a float8 box of the stored tensor, at global `offset`.
        scale: the scale box covering it (`scale_box(Box(offset, w.shape), block)`), float32.
        offset: where `w` sits in the tensor.
        block: the block size along each axis.
        out: where the result goes (`w`'s shape, any strides).
    """
    if w.ndim == 1:
        w, scale, out, offset, block = w[None], scale[None], out[None], (0, *offset), (1, *block)
    u, lut = w.view(np.uint8), _fp8_values(w.dtype)
    lanes = _LANES[out.dtype.itemsize]
    first = [o // b for o, b in zip(offset, block)]
    n, br, r0 = u.shape[-1], block[-2], offset[-2]
    cols = ((offset[-1] + np.arange(n)) // block[-1] - first[-1]).astype(np.intp) * 256
    idx = np.empty((max(1, _BAND // max(n, 1)), n), np.intp)
    table, at = np.empty(0, lanes), None
    for lead, a, z in _bands(u, lambda r: ((r0 + r) // br + 1) * br - r0):
        srow = tuple((offset[i] + lead[i]) // block[i] - first[i] for i in range(len(lead)))
        srow += ((r0 + a) // br - first[-2],)
        if srow != at:
            at = srow
            with np.errstate(invalid="ignore", over="ignore"):
                table = (lut[None, :] * scale[srow].astype(np.float32)[:, None]).astype(out.dtype).view(lanes).ravel()
        h = z - a
        np.add(u[lead][a:z], cols, out=idx[:h])
        np.take(table, idx[:h], out=out[lead][a:z].view(lanes), mode="clip")


def dequant_mxfp4(blocks: np.ndarray, scales: np.ndarray, out: np.ndarray, start: int = 0) -> None:
    """`out = fp4 * 2 ** (scale - 127)` of `blocks` `(..., G, B)` and `scales` `(..., G)`.

    The values of a row are `(G * 2 * B)`, low nibble first; `out` (`(..., n)`, any strides)
    receives `[start, start + n)` of them.
    """
    if blocks.ndim == 2:
        blocks, scales, out = blocks[None], scales[None], out[None]
    table = _mxfp4_table(out.dtype)
    lanes = table.dtype
    g, nb = blocks.shape[-2:]
    n = out.shape[-1]
    whole = start == 0 and n == g * 2 * nb and out.strides[-1] == out.itemsize
    idx = np.empty((max(1, _BAND // max(g * nb, 1)), g * nb), np.intp)
    by_group = idx.reshape(idx.shape[0], g, nb)  # the same memory, for the ufuncs
    tmp = None if whole else np.empty(idx.shape, lanes)
    for lead, a, z in _bands(out, lambda r: out.shape[-2]):
        h = z - a
        np.left_shift(scales[lead][a:z, :, None], 8, out=by_group[:h], dtype=np.intp)
        np.bitwise_or(by_group[:h], blocks[lead][a:z], out=by_group[:h])
        if tmp is None:
            np.take(table, idx[:h], out=out[lead][a:z].view(lanes), mode="clip")
        else:
            np.take(table, idx[:h], out=tmp[:h], mode="clip")
            out[lead][a:z] = tmp[:h].view(out.dtype)[:, start : start + n]


# ---------------------------------------------------------------------------
# The view


class _Rule(Protocol):
    """What the view needs of a rule (`xckpt.rules.Rule`)."""

    @property
    def pattern(self) -> re.Pattern[str]: ...
    @property
    def ndim(self) -> frozenset[int] | None: ...
    @property
    def dequant(self) -> Dequant | None: ...
    @property
    def dtype(self) -> str | None: ...
    @property
    def label(self) -> str: ...


@dataclass(frozen=True)
class _Quantized:
    """One dequantized tensor: its view entry, the stored tensor `q` and scale `s`, the block
    sizes (fp8) or the group's bytes (mxfp4)."""

    kind: str
    entry: TensorEntry
    q: TensorEntry
    s: TensorEntry
    block: tuple[int, ...]

    def boxes(self, box: Box) -> tuple[Box, Box]:
        """The stored boxes (quantized, scale) that `box` of the view needs."""
        if self.kind == "mxfp4":
            return mxfp4_boxes(box, self.block[0])
        return box, scale_box(box, self.block)

    def pieces(self, box: Box) -> list[Box]:
        """`box` cut along axis 0 into pieces of about `PIECE_BYTES` quantized bytes (fp8: on
        block rows)."""
        rows = box.shape[0]
        per_row = self.boxes(box)[0].volume // max(rows, 1)
        align = self.block[0] if self.kind == "fp8_block" else 1
        step = max(align, PIECE_BYTES // max(per_row, 1) // align * align)
        if rows <= step:
            return [box]
        out, lo, end = [], box.offset[0], box.end[0]
        while lo < end:
            hi = min(end, (lo // align) * align + step)
            out.append(Box((lo, *box.offset[1:]), (hi - lo, *box.shape[1:])))
            lo = hi
        return out


Sizes = Callable[[Any, str, Sequence[int | str]], list[int]]


class Dequantized(SourceView):
    """`source` with the tensors that rules with `dequant` take read dequantized, their scales gone.

    Built by `xckpt.rules.apply_rules` beneath the rules view: a source tensor is taken when
    the first rule that matches it (its name, `ndim`, and for a `dequant` rule its stored
    dtype: float8 for fp8_block, uint8 for mxfp4) has `dequant`; it keeps its name here (the
    rules view above renames and transposes it). `taken` maps each taken name to its rule.

    Raises:
        RuleError: a scale tensor is missing, has the wrong dtype or shape, or is claimed twice.
    """

    def __init__(self, source: Source, rules: Sequence[_Rule], sizes: Sizes) -> None:
        super().__init__(source)
        self.taken: dict[str, _Rule] = {}
        self._quant: dict[str, _Quantized] = {}
        scales: dict[str, str] = {}
        for name in source.names():
            got = self._first(source, rules, name)
            if got is None:
                continue
            rule, m, q = got
            if rule.dequant is None:
                continue
            d = rule.dequant
            try:
                sname = m.expand(d.scale)
            except (re.error, IndexError) as e:
                raise RuleError(f"{rule.label}: scale template {d.scale!r} does not expand for {name!r}: {e}") from None
            if sname not in source:
                raise RuleError(
                    f"{rule.label}: {q.dtype} tensor {name!r} {q.shape} needs its scale tensor {sname!r}, which "
                    f"checkpoint {source.path!r} does not hold; exclude {name!r} (a rule before this one that "
                    "matches it, or --exclude), or fix the rule's scale template"
                )
            if sname in scales:
                raise RuleError(
                    f"{rule.label}: scale tensor {sname!r} is claimed by both {scales[sname]!r} and {name!r}; each "
                    "quantized tensor needs its own scale"
                )
            scales[sname] = name
            s = source.info(sname)
            block = sizes(rule, name, d.block) if d.kind == "fp8_block" else [q.shape[-1]]
            self._quant[name] = _quantized(rule, d.kind, q, s, tuple(block))
            self.taken[name] = rule
        both = sorted(set(scales) & set(self._quant))
        if both:
            raise RuleError(
                f"tensor {both[0]!r} is both dequantized and the scale of {scales[both[0]]!r}; make the dequant "
                "rules' patterns exclude scale tensors"
            )
        self._show(n for n in source.names() if n not in scales)

    @staticmethod
    def _first(source: Source, rules: Sequence[_Rule], name: str) -> tuple[_Rule, re.Match[str], TensorEntry] | None:
        """The first rule that matches tensor `name` (and the match and entry), as the rules view decides."""
        entry = None
        for rule in rules:
            m = rule.pattern.fullmatch(name)
            if m is None:
                continue
            if rule.ndim is not None or rule.dequant is not None:
                entry = entry or source.info(name)
                if rule.ndim is not None and len(entry.shape) not in rule.ndim:
                    continue
                if rule.dequant is not None and not _stored_as(rule.dequant.kind, entry.dtype):
                    continue
            return rule, m, entry or source.info(name)
        return None

    def info(self, name: str) -> TensorEntry:
        q = self._quant.get(name)
        if q is not None:
            return q.entry
        if name not in self._name_set:
            raise self._missing(name)
        return self.source.info(name)

    def _read_chunks(self, jobs: Sequence[ChunkRead], bar: Any) -> None:
        passed: list[ChunkRead] = []
        work: list[tuple[_Quantized, Box, np.ndarray]] = []
        for job in jobs:
            q = self._quant.get(job.name)
            if q is None:
                passed.append(job)
                continue
            box = job.chunk.box if job.req is None else job.req.box
            target = job.out if job.req is None else job.req.target_view(job.out)
            for piece in q.pieces(box):
                dst = target if piece == box else target[piece.slices(box)]
                work.append((q, piece, dst))
        batch: list[tuple[_Quantized, Box, np.ndarray]] = []
        size = 0
        for item in work:
            batch.append(item)
            size += item[0].boxes(item[1])[0].volume
            if size >= BATCH_BYTES:
                self._read_batch(passed, batch, bar)
                passed, batch, size = [], [], 0
        if passed or batch:
            self._read_batch(passed, batch, bar)

    def _read_batch(self, passed: list[ChunkRead], batch: list[tuple[_Quantized, Box, np.ndarray]], bar: Any) -> None:
        """Read the stored boxes of `batch` (and the `passed` jobs) at once, then dequantize."""
        mapped = list(passed)
        view_bytes = src_bytes = sum(j.out.itemsize * (j.chunk.box if j.req is None else j.req.box).volume for j in passed)
        bufs = []
        for q, box, dst in batch:
            qbox, sbox = q.boxes(box)
            qbuf, sbuf = np.empty(qbox.shape, q.q.np_dtype), np.empty(sbox.shape, q.s.np_dtype)
            src_bytes += self.source._plan(q.q.name, q.q, qbox, qbuf, mapped)
            src_bytes += self.source._plan(q.s.name, q.s, sbox, sbuf, mapped)
            view_bytes += dst.nbytes
            bufs.append((qbuf, sbuf))
        scaled = src_bytes > 0 and view_bytes != src_bytes
        self.source._read_chunks(mapped, ScaledBar(bar, view_bytes / src_bytes) if scaled else bar)
        for (q, box, dst), (qbuf, sbuf) in zip(batch, bufs):
            if q.kind == "mxfp4":
                dequant_mxfp4(qbuf, sbuf, dst, box.offset[-1] - q.boxes(box)[1].offset[-1] * 2 * q.block[0])
            else:
                dequant_fp8_block(qbuf, sbuf, box.offset, q.block, dst)

    def read_units(self, name: str, chunk: Chunk, box: Box, itemsize: int) -> dict[Hashable, int]:
        """The stored reads of `box`: its quantized bytes and its scales."""
        q = self._quant.get(name)
        if q is None:
            return self.source.read_units(name, chunk, box, itemsize)
        units: dict[Hashable, int] = {}
        for t, b in zip((q.q, q.s), q.boxes(box)):
            for req in plan_reads(t.chunk_index, b):
                units.update(self.source.read_units(t.name, t.chunk(req.chunk), req.box, t.np_dtype.itemsize))
        return units


def _stored_as(kind: str, dtype: str) -> bool:
    """Whether a tensor stored as `dtype` is what a `kind` dequant takes."""
    return dtype.startswith("float8") if kind == "fp8_block" else dtype == "uint8"


def _quantized(rule: _Rule, kind: str, q: TensorEntry, s: TensorEntry, block: tuple[int, ...]) -> _Quantized:
    """The dequantized tensor of `q` with scale `s`, checked; its chunks are `q`'s (for mxfp4,
    each stored chunk's whole groups)."""
    dtype = rule.dtype or "bfloat16"
    head = f"{rule.label}: {q.dtype} tensor {q.name!r} {q.shape} with scale {s.name!r} ({s.dtype} {s.shape})"
    if dtype not in OUT_DTYPES:
        raise RuleError(f"{head}: a dequant rule's dtype is one of {list(OUT_DTYPES)}, not {dtype!r}")
    if kind == "fp8_block":
        if len(block) != len(q.shape) or not all(type(b) is int and b > 0 for b in block):
            raise RuleError(
                f"{head}: block {list(block)} must give one positive size per axis ({len(q.shape)}); give "
                "the rule's block one entry per axis (1 for an axis without blocks)"
            )
        want = tuple(-(-n // b) for n, b in zip(q.shape, block))
        if s.shape != want or s.dtype not in ("float32", "bfloat16", "float16"):
            raise RuleError(
                f"{head}: in {' x '.join(map(str, block))} blocks the scale must be float32 of shape {want}; "
                "check the rule's block size (the model config's weight_block_size) and scale template"
            )
        shape = q.shape
        size = numpy_dtype(dtype).itemsize
        chunks = [Chunk(offset=c.offset, shape=c.shape, key=c.key, rank=c.rank, nbytes=c.box.volume * size) for c in q.chunks]
    else:
        if len(q.shape) < 2 or s.shape != q.shape[:-1] or s.dtype != "uint8":
            raise RuleError(
                f"{head}: MXFP4 blocks (..., G, B) need uint8 scales of shape (..., G) = {q.shape[:-1]}; check the "
                "rule's scale template"
            )
        per = 2 * q.shape[-1]
        shape = (*q.shape[:-2], q.shape[-2] * per)
        size = numpy_dtype(dtype).itemsize
        if any(c.shape[-1] != q.shape[-1] for c in q.chunks):  # chunks that split groups: one chunk, read across them
            c0 = q.chunks[0]
            chunks = [Chunk(offset=(0,) * len(shape), shape=shape, key=c0.key, rank=c0.rank, nbytes=math.prod(shape) * size)]
        else:
            chunks = [
                Chunk(offset=(*c.offset[:-2], c.offset[-2] * per), shape=(*c.shape[:-2], c.shape[-2] * per), key=c.key,
                      rank=c.rank, nbytes=math.prod(c.shape[:-1]) * per * size)
                for c in q.chunks
            ]
    return _Quantized(kind, TensorEntry(name=q.name, dtype=dtype, shape=shape, chunks=tuple(chunks)), q, s, block)
