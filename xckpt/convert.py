"""Convert a checkpoint of any format into any other, streaming with bounded memory.

`xckpt.convert(src, dst)` opens `src` as a [`Source`][xckpt.source.Source]
(any format, rules applied as a view), decides what to write (names after
`include`/`exclude`, objects), and drives the output format's
[`Sink`][xckpt.sink.Sink] (from `xckpt.formats.FORMATS`) through its call
protocol: `check` the [`WriteJob`][xckpt.sink.WriteJob], `write` it under a fresh
temporary path (the sink reads chunk by chunk through the job), then re-read
every written box through the format's own source (`verify`: crc32c of each
source box, taken as it was read, against the re-read bytes; for xckpt output the
reader's own crc32c check of every stored chunk) and rename the result into
place. Nothing at `dst` is touched before that rename.

Speed: source chunks are read into two recycled buffers (`xckpt._stream`;
the next one in the background while a sink writes the current one), so no page
is faulted in and zeroed per chunk; only the xckpt sink, which holds chunks until
it flushes them, gets fresh ones. No allocator setting is changed (an earlier
fixed glibc mmap threshold cost CPU on every fresh buffer, process-wide).

Decisions where the design is silent (also in the report):

* `include`/`exclude` filter the source's own (un-ruled) names, objects
  included, through a filtering view; the rules are applied to that view, so a
  `stack` rule sees only the selected pieces.
* The temporary output is a hidden sibling `.<dst name>.xckpt-tmp-<hex>`; a
  killed process may leave one behind (never at `dst`; delete it freely).
  `overwrite` moves the old output to `.<dst name>.xckpt-old-<hex>` for the
  instant of the swap and removes it after the new one is in place.
* `dst` is a local path. A non-empty directory that holds no checkpoint is
  never replaced, even with `overwrite` (it may be someone's data); `dst`
  equal to `src`, or holding `src` inside it, is refused.
* `max_shard_size` is only for Hugging Face directories (safetensors output
  whose `dst` does not end in `.safetensors`); default 5 GB as
  `huggingface_hub` splits. Such a directory always gets an index, even for
  one shard.
* Per-rank objects (saved with a value per rank) travel as the list of every
  rank's value, except into xckpt, which keeps them per rank.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from xckpt import formats
from xckpt._parts import fingerprint, options_of, save_id_for
from xckpt._progress import progress
from xckpt._stream import Buffers, aligned, crc32c, read_ahead
from xckpt.errors import CheckpointExistsError, CorruptChunkError, XckptError
from xckpt.formats import Format
from xckpt.layout import Box
from xckpt.manifest import TensorEntry
from xckpt.rules import apply_rules
from xckpt.sink import BoxKey, WriteJob
from xckpt.source import Source, local_path
from xckpt.storage import as_place
from xckpt.views import Selected

__all__ = ["convert_one", "ConvertOptions", "VerifyMismatchError", "guess_format", "parse_size", "destination", "DEFAULT_SHARD_SIZE"]

#: huggingface_hub's default shard size.
DEFAULT_SHARD_SIZE = 5 * 10**9

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


@dataclass(frozen=True, kw_only=True)
class ConvertOptions:
    """One conversion's options: the keyword arguments of [`xckpt.convert`][xckpt.convert]
    but `workers` and `resume`, each as documented there."""

    from_format: str | None = None
    to_format: str | None = None
    rules: Any = None
    include: str | Sequence[str] | None = None
    exclude: str | Sequence[str] | None = None
    overwrite: bool = False
    verify: bool = True
    max_shard_size: int | str | None = None
    allow_pickle: bool = False
    show_progress: bool | None = None
    compression: str | None = None


def parse_size(size: int | str) -> int:
    """Bytes from an int or a size string as `huggingface_hub` reads it.

    `"100KB"` is 100,000 bytes, `"5GB"` 5 * 10**9; binary units as
    transformers reads them (`"5GiB"` is 5 * 2**30); a bare number is bytes.
    """
    if isinstance(size, bool):
        raise XckptError(f"max_shard_size must be bytes or a size string like '5GB', got {size!r}")
    if isinstance(size, int):
        if size <= 0:
            raise XckptError(f"max_shard_size must be positive, got {size}")
        return size
    m = _SIZE.match(str(size))
    if m is None or m.group(2).upper() not in _UNITS:
        raise XckptError(
            f"max_shard_size {size!r} is not a size: write bytes or a number with a unit "
            "(KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024), e.g. '5GB'"
        )
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise XckptError(f"max_shard_size {size!r} is not positive")
    return n


class VerifyMismatchError(CorruptChunkError):
    """A converted output does not read back as its source (`verify=True`); nothing is at `dst`."""


def guess_format(dst: str) -> str:
    """The output format `dst`'s name suggests: the first format of the table whose suffix
    ends it (`.safetensors`: safetensors; `.pt`, `.pth`, `.bin`: torch), else xckpt."""
    low = dst.rstrip("/").lower()
    for fmt in formats.FORMATS.values():
        if fmt.suffixes and low.endswith(fmt.suffixes):
            return fmt.name
    return "xckpt"


# -- the source side ---------------------------------------------------------------


def _globs(v: str | Sequence[str] | None, what: str) -> list[str] | None:
    if v is None:
        return None
    if isinstance(v, str):
        return [v]
    out = list(v)
    if not all(isinstance(g, str) for g in out):
        raise XckptError(f"{what} must be a glob or a list of globs, got {v!r}")
    return out


def _selected(name: str, include: list[str] | None, exclude: list[str] | None) -> bool:
    if include is not None and not any(fnmatch.fnmatchcase(name, g) for g in include):
        return False
    return not (exclude and any(fnmatch.fnmatchcase(name, g) for g in exclude))


def _check_from_format(src: Any, from_format: str) -> None:
    fmt = formats.FORMATS.get(from_format)
    if fmt is None:
        raise XckptError(f"unknown source format {from_format!r}; known formats: {', '.join(formats.FORMATS)}")
    place = as_place(src, probes=formats.HTTP_PROBES)
    if fmt.detect(place):
        return
    if place.local is None and place.listable and from_format == "xckpt":
        return  # a kvstore location: the xckpt reader says what is missing
    where = place.local if place.local is not None else src
    try:
        found = f"it was detected as {formats.detect(place)}"
    except XckptError:
        found = f"it holds {formats.listing(place)}"
    raise XckptError(
        f"{where!r} is not a {from_format} checkpoint ({found}): {fmt.why_not(place)}; drop "
        "--from/from_format to detect the format, or point at the right location. Nothing was written"
    )


def _open(
    src: Any, from_format: str | None, rules: Any, include: Any, exclude: Any, allow_pickle: bool
) -> Source:
    inc, exc = _globs(include, "include"), _globs(exclude, "exclude")
    if inc is None and exc is None:
        return formats.open(src, format=from_format, allow_pickle=allow_pickle, rules=rules)
    raw = formats.open(src, format=from_format, allow_pickle=allow_pickle)
    names = [n for n in raw.names() if _selected(n, inc, exc)]
    objs = [n for n in raw.object_names() if _selected(n, inc, exc)]
    view: Source = Selected(raw, names, objs)
    if rules is not None:
        try:
            view = apply_rules(view, rules)
        except BaseException:
            raw.close()
            raise
    return view


# -- the output side -----------------------------------------------------------------


def _is_checkpoint(path: str) -> bool:
    try:
        formats.detect(path)
    except XckptError:
        return False
    return True


def _check_dst(dst: str, src: Any, overwrite: bool) -> bool:
    """Whether something at `dst` is to be replaced; raises when it must not be."""
    src_local = local_path(src)
    if src_local is not None:
        a, b = os.path.realpath(src_local), os.path.realpath(dst)
        if a == b or (overwrite and a.startswith(b.rstrip(os.sep) + os.sep)):
            raise XckptError(
                f"converting {src!r} to {dst!r} would replace the source; write to another path"
            )
    if not os.path.lexists(dst):
        return False
    if os.path.isdir(dst) and not os.path.islink(dst):
        if not os.listdir(dst):
            return True  # an empty directory is not a checkpoint
        if not _is_checkpoint(dst):
            raise CheckpointExistsError(
                f"{dst!r} is a directory holding files that are not a checkpoint; convert will not "
                "replace it (even with overwrite). Choose another dst, or empty it first"
            )
    if not overwrite:
        raise CheckpointExistsError(
            f"{dst!r} already exists; pass overwrite=True (--overwrite) to replace it, or convert "
            "to a new path"
        )
    return True


def _check(fmt: Format, job: WriteJob) -> None:
    """The sink's check (step 2 of its call protocol); a framework it lacks is an XckptError."""
    try:
        fmt.sink.check(job)
    except ModuleNotFoundError as e:
        raise XckptError(
            f"the {fmt.name} sink needs {e.name}, which is not installed ({e}); install it, or convert to "
            "another format"
        ) from None


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _commit(tmp: str, dst: str, replace: bool) -> None:
    """Move the verified output into place; the old one is removed only afterwards."""
    if not replace:
        os.rename(tmp, dst)
        return
    parent, base = os.path.split(dst)
    old = os.path.join(parent, f".{base}.xckpt-old-{secrets.token_hex(4)}")
    os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except BaseException:
        os.rename(old, dst)
        raise
    _remove(old)


#: Bytes of boxes verify reads back in one `read_into` (the reader runs them concurrently).
_VERIFY_BATCH = 16 << 20


def _verify(job: WriteJob, out: Format) -> None:
    """Check the output at `job.dst` reads back as the source.

    Other formats than xckpt: every box recorded while converting is re-read through
    the format's reader and its crc32c compared with the source's. xckpt output: every
    stored chunk is re-read through the xckpt reader, which checks each one's crc32c
    (and a packed chunk's crc32), and the names, dtypes, shapes and boxes must be the
    source's. Reads go in batches of about `_VERIFY_BATCH` bytes (a larger box of a
    format other than xckpt in bands of rows, its crc32c continued band by band) into the
    two recycled buffers, the next batch read in the background while one is checked.
    """
    out_format = out.name
    with formats.open(job.dst, format=out_format) as back:
        if out_format == "xckpt":
            _check_structure(job, back)
            keys: list[BoxKey] = [
                (n, tuple(c.offset), tuple(c.shape)) for n in job.names for c in back.info(n).chunks if c.box.volume
            ]
        else:
            keys = list(job.crcs)
        try:
            crc = 0
            for key, buf, last in _read_back(back, keys, split=out_format != "xckpt"):
                want = job.crcs.get(key)
                if want is None:
                    continue
                crc = crc32c(buf, crc)
                if not last:
                    continue
                crc, got = 0, crc
                if got != want:
                    name, offset, shape = key
                    raise VerifyMismatchError(
                        f"conversion of {job.src.path!r} to {out_format}: tensor {name!r}, box "
                        f"{Box(offset, shape)} reads back with crc32c {got:08x}, the source's is "
                        f"{want:08x}; nothing was written to the destination. Check the disk "
                        "and convert again"
                    )
            problems = back._verify_objects() if job.objects else []
        except VerifyMismatchError:
            raise
        except CorruptChunkError as e:
            problems = [str(e)]
        if problems:
            raise VerifyMismatchError(
                f"conversion of {job.src.path!r} to {out_format} does not read back as written: "
                f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
                + "; nothing was written to the destination. Check the disk and convert again"
            )


def _read_back(out: Source, keys: Sequence[BoxKey], *, split: bool) -> Iterator[tuple[BoxKey, np.ndarray, bool]]:
    """Each box of `keys` read from `out` in batches (see `_verify`): `(key, piece,
    last)`. With `split`, a box larger than a batch comes as bands of whole rows, in order
    (`last` on its final band), so a reader that decodes every stored chunk a read touches at
    once (tensorstore, for orbax) holds about a batch, not the largest box."""
    dtypes = {name: out.info(name).np_dtype for name in {key[0] for key in keys}}
    buffers = Buffers()
    pieces: list[tuple[BoxKey, Box, int, bool]] = []  # (key, box read, bytes, last)
    for key in keys:
        name, offset, shape = key
        nbytes = dtypes[name].itemsize * int(np.prod(shape, dtype=np.int64))
        if not split or len(shape) == 0 or nbytes <= _VERIFY_BATCH or shape[0] <= 1:
            pieces.append((key, Box(offset, shape), nbytes, True))
            continue
        row = nbytes // shape[0]
        step = max(1, _VERIFY_BATCH // max(1, row))
        for lo in range(0, shape[0], step):
            hi = min(shape[0], lo + step)
            box = Box((offset[0] + lo, *offset[1:]), (hi - lo, *shape[1:]))
            pieces.append((key, box, (hi - lo) * row, hi == shape[0]))

    def read(batch: list[tuple[BoxKey, Box, int, bool]]) -> list[tuple[BoxKey, np.ndarray, bool]]:
        arena = buffers.take((sum(aligned(n) for *_, n, _ in batch),), np.dtype(np.uint8))
        items, at = [], 0
        for key, box, n, last in batch:
            items.append((key, arena[at : at + n].view(dtypes[key[0]]).reshape(box.shape), last))
            at += aligned(n)
        reads = [(key[0], box, buf) for (key, box, _, _), (_, buf, _) in zip(batch, items) if buf.size]
        if reads:
            out.read_into(reads, show_progress=False)
        return items

    batches: list[list[tuple[BoxKey, Box, int, bool]]] = [[]]
    size = 0
    for piece in pieces:
        nbytes = aligned(piece[2])
        if batches[-1] and size + nbytes > _VERIFY_BATCH:
            batches.append([])
            size = 0
        batches[-1].append(piece)
        size += nbytes
    for items in read_ahead([functools.partial(read, batch) for batch in batches if batch]):
        yield from items
        del items


def _boxes(t: TensorEntry) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return sorted((tuple(c.offset), tuple(c.shape)) for c in t.chunks if c.box.volume)


def _check_structure(job: WriteJob, out: Source) -> None:
    """The xckpt output holds the source's tensors, dtypes, shapes and boxes."""
    problems = []
    for name in job.names:
        want = job.src.info(name)
        if name not in out:
            problems.append(f"tensor {name!r} is missing")
            continue
        got = out.info(name)
        if (got.dtype, tuple(got.shape)) != (want.dtype, tuple(want.shape)):
            problems.append(
                f"tensor {name!r} is {got.dtype} {list(got.shape)}, the source's {want.dtype} "
                f"{list(want.shape)}"
            )
        elif _boxes(got) != _boxes(want):
            problems.append(f"tensor {name!r} is stored in other boxes than the source's")
    if problems:
        raise VerifyMismatchError(
            f"conversion of {job.src.path!r} to xckpt does not read back as written: "
            f"{'; '.join(problems[:5])}" + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
            + "; nothing was written to the destination. Check the disk and convert again"
        )


def destination(
    src: Any, dst: Any, opts: ConvertOptions, *, parts: bool = False
) -> tuple[str, str, Format, bool, int | None, bool]:
    """The checks before a conversion writes anything: `(out, format name, format,
    Hugging Face directory?, shard or part size, replace?)`.

    `parts`: a parallel conversion, where `max_shard_size` is also the part size of
    xckpt and torch DCP outputs (None here: the caller's default).
    """
    from_format, to_format, max_shard_size = opts.from_format, opts.to_format, opts.max_shard_size
    out = local_path(dst)
    if out is None:
        raise XckptError(
            f"convert writes to local paths; {dst!r} is a URL. Convert locally, then copy, or convert to "
            "xckpt there with workers=N (--workers N), which writes object storage in place"
        )
    out = out.rstrip(os.sep) or out
    fmt = to_format if to_format is not None else guess_format(out)
    out_fmt = formats.FORMATS.get(fmt)
    if out_fmt is None:
        raise XckptError(f"unknown output format {fmt!r}; known: {', '.join(formats.FORMATS)}")
    hf_dir = fmt == "safetensors" and not out.lower().endswith(".safetensors")
    shard: int | None = None
    if max_shard_size is not None:
        if not hf_dir and not (parts and fmt in ("xckpt", "torch-dcp")):
            raise XckptError(
                "max_shard_size applies to Hugging Face directories (to_format='safetensors' with a "
                "dst not ending in .safetensors)"
                + (" and to the parts of xckpt and torch-dcp outputs" if parts else "")
                + f"; {out!r} is written as {fmt}"
            )
        shard = parse_size(max_shard_size)
    elif hf_dir:
        shard = DEFAULT_SHARD_SIZE
    if from_format is not None:
        _check_from_format(src, from_format)
    replace = _check_dst(out, src, opts.overwrite)
    return out, fmt, out_fmt, hf_dir, shard, replace


def convert_one(src: Any, dst: str | os.PathLike[str], opts: ConvertOptions) -> str:
    """Convert the checkpoint at `src` into `dst` in this process, chunk by chunk:
    [`xckpt.convert`][xckpt.convert] without `workers` or `resume` (its arguments are `opts`).
    """
    out, fmt, out_fmt, hf_dir, shard, replace = destination(src, dst, opts)
    compression, allow_pickle, rules = opts.compression, opts.allow_pickle, opts.rules
    if compression is not None and fmt != "xckpt":
        raise XckptError(
            f"compression={compression!r} is for xckpt output; {out!r} is written as {fmt}, which has no codecs"
        )
    source = _open(src, opts.from_format, rules, opts.include, opts.exclude, allow_pickle)
    try:
        names = tuple(source.names())
        obj_names = source.object_names()
        skipped = [] if allow_pickle else sorted(source.pickled_objects() & set(obj_names))
        if skipped:
            warnings.warn(
                f"convert {source.path!r}: skipping pickled objects {skipped}; pass allow_pickle=True "
                "(--allow-pickle) to convert them (unpickling runs code stored in the checkpoint)",
                stacklevel=2,
            )
        wanted = [n for n in obj_names if n not in set(skipped)]
        objects = source.objects(wanted, per_rank="list") if wanted else {}
        per_rank = frozenset(source.per_rank_objects() & set(wanted))
        parent, base = os.path.split(os.path.abspath(out))
        tmp = os.path.join(parent, f".{base}.xckpt-tmp-{secrets.token_hex(4)}")
        total = sum(source.info(n).nbytes for n in names)
        try:  # the Sink call protocol, steps 2 to 4
            with progress(total, f"convert to {fmt}", opts.show_progress) as bar:
                fp = options_of(fmt, hf_dir=hf_dir, part_size=shard, rules=rules, include=opts.include,
                                exclude=opts.exclude, allow_pickle=allow_pickle, layout="writers",
                                compression=compression)
                save_id = save_id_for(fmt, fingerprint(source, names, objects, fp))
                job = WriteJob(source, tmp, names, objects, shard, bar, per_rank,
                               record=opts.verify and fmt != "xckpt",
                               save_id=save_id, compression=compression)
                _check(out_fmt, job)
                os.makedirs(parent, exist_ok=True)
                out_fmt.sink.write(job)
            if not os.path.lexists(tmp):
                raise XckptError(f"the {fmt} sink wrote nothing at {tmp!r}")
            if opts.verify:
                _verify(job, out_fmt)
            _commit(tmp, os.path.abspath(out), replace)
        except BaseException:
            _remove(tmp)
            raise
    finally:
        source.close()
    return out
