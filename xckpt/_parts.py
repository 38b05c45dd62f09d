"""A parallel conversion's plan: the output cut into parts, one output file each, and their writers.

The plan depends on the source, the output format and the options, never on the number
of workers: the same source converted the same way gives the same parts, so the output
is byte-identical whoever writes which part. `make_plan` cuts it;
`write_part` writes one part into the conversion's temporary output (any worker,
any host); `commit_files` writes what completes the output (an index, a
`.metadata`, a merged manifest) once every part is written. The journal beside the
output (`Journal`) records each finished part's files and checksums once they
are durable, so a killed conversion resumes (`kept_part`).

Parts by output format:

* xckpt and torch DCP: the source's chunks grouped by source writer (so the boxes, and
  where they fit one part the writers, are kept), each writer's chunks cut greedily, in
  tensor order, into parts of about `part_size` bytes (a chunk larger than that is a
  part of its own). Part `p` is xckpt writer `p` (`ranks/<p>.json`, `data/<p>/`)
  or DCP's `__<p>_0.distcp`. Part 0 also holds the objects and the tensors with no
  stored bytes.
* a Hugging Face safetensors directory: the shards `huggingface_hub` would cut (greedy
  in source order, at most `part_size` bytes of tensors unless one tensor alone is
  larger); shard `p` is part `p`; the first holds the metadata.
* one file (a `.safetensors` file, torch.save) and orbax: one part, written by the
  format's own sink; orbax by `write_orbax(..., reproducible=True)`, orbax's non-OCDBT
  layout (OCDBT names its data files at random and timestamps its versions).

**The fingerprint** (`fingerprint`) names a conversion: the SHA-256 of a canonical
JSON document of the source's format, its metadata (JSON-able values; others by type
name), its objects (as `xckpt.manifest.encode_value` encodes them), every tensor's
name, dtype, shape and chunk boxes (offset, shape, writer, stored crc32 where the format
keeps one), and the options that change the output's bytes (output format, part size, a
Hugging Face directory or not, rules, include, exclude, allow_pickle; a rules file by
its content). File names, paths, times and sizes on disk are not in it, so a copied
checkpoint converts to the same bytes. Two sources alike in all of that but different
tensor values get the same save id: the id names the conversion, not the values, and each
output is written whole into a fresh directory, so no reader mixes them. The save id is
derived from it (`convert-` and 16 hex digits for xckpt, 32 hex digits for DCP, the
length torch writes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np

from xckpt.converters.orbax_write import write_orbax
from xckpt.converters.safetensors_write import INDEX, plan_shards, write_file
from xckpt.converters.torch_dcp_write import (
    StoredChunk,
    append_tensor,
    flat_objects_of,
    pickled,
    write_metadata,
)
from xckpt.errors import XckptError
from xckpt.formats import FORMATS
from xckpt.manifest import Chunk, encode_value
from xckpt.native.sink import json_metadata
from xckpt.native.writer import Writer, finalize
from xckpt.sink import CONVERT_INFLIGHT_BYTES, WriteJob
from xckpt.source import Source

__all__ = [
    "Plan",
    "Part",
    "PartResult",
    "Journal",
    "make_plan",
    "fingerprint",
    "write_part",
    "kept_part",
    "commit_files",
    "assign",
    "clear_commit",
    "options_of",
    "save_id_for",
    "DEFAULT_PART_SIZE",
]

#: Bytes per part of xckpt and torch DCP outputs when no `max_shard_size` is given.
DEFAULT_PART_SIZE = 1 << 30

#: What a finished part reports (and the journal keeps): JSON values only.
#: `files`: [[path relative to the output, size, crc32c]]; `crcs`: [[name, offset,
#: shape, crc32c]] of every source box it read (for verify); `stored`: DCP's chunks.
PartResult = dict[str, Any]


@dataclass(frozen=True)
class Part:
    """One output file: the source boxes it holds, as (tensor name, chunk index) pairs
    (index -1: the whole tensor), and their bytes."""

    index: int
    items: tuple[tuple[str, int], ...]
    nbytes: int


@dataclass(frozen=True)
class Plan:
    """What a parallel conversion writes: the same for any number of workers.

    Attributes:
        kind: `"xckpt"`, `"torch-dcp"`, `"hf-dir"` or `"single"` (one part by the sink).
        format: the output format's name.
        names: tensors, in source order.
        parts: the parts, in order.
        fingerprint: the source's fingerprint with the options (see the module docstring).
        plan_id: the fingerprint and the parts: a journal of another plan is not resumed.
        save_id: the save id written into xckpt manifests and DCP's `.metadata`.
    """

    kind: str
    format: str
    names: tuple[str, ...]
    parts: tuple[Part, ...]
    fingerprint: str
    plan_id: str
    save_id: str

    def shard_file(self, p: int) -> str:
        """A Hugging Face directory's name of shard `p`."""
        return f"model-{p + 1:05d}-of-{len(self.parts):05d}.safetensors"


# -- the plan ---------------------------------------------------------------------------------


def _jsonable(value: Any, name: str) -> Any:
    try:
        return encode_value(value, name)
    except XckptError:
        return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _rules_text(rules: Any) -> Any:
    if isinstance(rules, (str, os.PathLike)) and os.path.isfile(rules):
        with open(rules, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    return json.loads(json.dumps(rules, sort_keys=True, default=repr))


def fingerprint(
    src: Source, names: Sequence[str], objects: Mapping[str, Any], options: Mapping[str, Any]
) -> str:
    """The SHA-256 (hex) naming this conversion of `src` (see the module docstring)."""
    h = hashlib.sha256()
    head = {
        "format": src.format,
        "metadata": {str(k): _jsonable(v, str(k)) for k, v in dict(src.metadata).items()},
        "objects": {k: _jsonable(v, k) for k, v in objects.items()},
        "options": {k: _rules_text(v) if k == "rules" else v for k, v in options.items()},
    }
    h.update(json.dumps(head, sort_keys=True, default=repr).encode())
    for n in names:
        t = src.info(n)
        boxes = [[list(c.offset), list(c.shape), c.rank, c.crc32] for c in t.chunks]
        h.update(json.dumps([n, t.dtype, list(t.shape), boxes]).encode())
    return h.hexdigest()


def _cut(units: Sequence[tuple[tuple[str, int], int]], size: int) -> list[list[tuple[tuple[str, int], int]]]:
    """Greedy in order: a part closes when the next unit would take it past `size`."""
    parts: list[list[tuple[tuple[str, int], int]]] = []
    cur: list[tuple[tuple[str, int], int]] = []
    total = 0
    for unit in units:
        if cur and total + unit[1] > size:
            parts.append(cur)
            cur, total = [], 0
        cur.append(unit)
        total += unit[1]
    if cur:
        parts.append(cur)
    return parts


def make_plan(src: Source, names: Sequence[str], fmt: str, *, hf_dir: bool, part_size: int, fp: str) -> Plan:
    """The parts of converting `names` of `src` to `fmt` (see the module docstring)."""
    infos = {n: src.info(n) for n in names}
    if fmt in ("xckpt", "torch-dcp"):
        kind = fmt
        by_writer: dict[int, list[tuple[tuple[str, int], int]]] = {}
        for n, t in infos.items():
            for i, c in enumerate(t.chunks):
                if c.box.volume:
                    by_writer.setdefault(c.rank, []).append(((n, i), c.box.volume * t.np_dtype.itemsize))
        cut = [p for r in sorted(by_writer) for p in _cut(by_writer[r], part_size)] or [[]]
    elif fmt == "safetensors" and hf_dir:
        kind = "hf-dir"
        shards = plan_shards([(n, infos[n].nbytes) for n in names], part_size)
        cut = [[((n, -1), infos[n].nbytes) for n in shard] for shard in shards]
    else:
        kind = "single"
        cut = [[((n, -1), infos[n].nbytes) for n in names]]
    parts = tuple(
        Part(index=i, items=tuple(u for u, _ in units), nbytes=sum(b for _, b in units))
        for i, units in enumerate(cut)
    )
    plan_doc = json.dumps([kind, fp, [[list(map(list, p.items)), p.nbytes] for p in parts]])
    plan_id = hashlib.sha256(plan_doc.encode()).hexdigest()
    return Plan(kind, fmt, tuple(names), parts, fp, plan_id, save_id_for(fmt, fp))


def save_id_for(fmt: str, fp: str) -> str:
    """The save id an output of format `fmt` records for a conversion of fingerprint `fp`."""
    return fp[:32] if fmt == "torch-dcp" else "convert-" + fp[:16]


def options_of(
    fmt: str,
    *,
    hf_dir: bool,
    part_size: int | None,
    rules: Any,
    include: Any,
    exclude: Any,
    allow_pickle: bool,
    layout: str,
    compression: str | None = None,
) -> dict[str, Any]:
    """The options a fingerprint holds: those that change the output's bytes. `layout`:
    `"parts"` (a parallel conversion) or `"writers"` (one process, the source's writers)."""
    return {
        "to": fmt,
        "hf_dir": hf_dir,
        "part_size": part_size,
        "rules": rules,
        "include": include,
        "exclude": exclude,
        "allow_pickle": allow_pickle,
        "layout": layout,
        "compression": compression,
    }


def assign(plan: Plan, workers: int) -> list[list[int]]:
    """Parts per worker, byte-balanced: largest first, each to the least loaded worker
    (ties to the lowest rank); deterministic, as every rank computes it alone."""
    loads = [0] * workers
    out: list[list[int]] = [[] for _ in range(workers)]
    for p in sorted(plan.parts, key=lambda p: (-p.nbytes, p.index)):
        w = min(range(workers), key=lambda i: (loads[i], i))
        out[w].append(p.index)
        loads[w] += p.nbytes
    return [sorted(x) for x in out]


# -- the files of a part ------------------------------------------------------------------------


def part_files(plan: Plan, p: int, tmp: str) -> list[str]:
    """Paths (relative to the output; "" for a one-file output) that part `p` wrote."""
    if plan.kind == "hf-dir":
        return [plan.shard_file(p)]
    if plan.kind == "torch-dcp":
        return [f"__{p}_0.distcp"]
    if plan.kind == "xckpt":
        out = [f"ranks/{p}.json"] + _walk(tmp, f"data/{p}")
        return out + (["xckpt.json"] if len(plan.parts) == 1 else [])
    return [""] if os.path.isfile(tmp) else _walk(tmp, "")


def _walk(root: str, rel: str) -> list[str]:
    out = []
    for d, _, files in os.walk(os.path.join(root, rel)):
        out += [os.path.relpath(os.path.join(d, f), root) for f in files]
    return sorted(out)


def _clear(plan: Plan, p: int, tmp: str) -> None:
    """Remove whatever an unfinished attempt at part `p` left."""
    if plan.kind == "single":
        _remove(tmp)
        return
    for rel in part_files(plan, p, tmp):
        _remove(os.path.join(tmp, rel))
    if plan.kind == "hf-dir":
        _remove(os.path.join(tmp, plan.shard_file(p) + ".partial"))
    if plan.kind == "xckpt":
        _remove(os.path.join(tmp, f"data/{p}"))


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def file_digest(path: str) -> tuple[int, int]:
    """(size, crc32c) of a file, fsynced first (so what the journal records is durable)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        while block := f.read(16 << 20):
            crc = google_crc32c.extend(crc, block)
            size += len(block)
    return size, int(crc)


def _digests(plan: Plan, p: int, tmp: str) -> list[list[Any]]:
    return [[rel, *file_digest(os.path.join(tmp, rel) if rel else tmp)] for rel in part_files(plan, p, tmp)]


# -- the journal ----------------------------------------------------------------------------------


class Journal:
    """A directory beside the output: `plan.json` (the plan id) and one `part-<p>.json`
    per finished part (its files' sizes and crc32c, its source boxes' crc32c, what the
    commit needs), each written to a temporary name, fsynced and renamed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def start(self, plan: Plan, resume: bool) -> bool:
        """Begin (or, with `resume`, continue) a journal of `plan`; True when an earlier
        run of the same plan is continued. Another plan's journal is discarded."""
        if resume and self._read("plan.json").get("plan_id") == plan.plan_id:
            return True
        _remove(self.path)
        os.makedirs(self.path)
        self._write("plan.json", {"plan_id": plan.plan_id, "parts": len(plan.parts), "format": plan.format})
        return False

    def record(self, result: PartResult) -> None:
        """Part `result["part"]` is finished and durable."""
        self._write(f"part-{result['part']}.json", result)

    def entry(self, plan: Plan, p: int) -> PartResult | None:
        """What an earlier run recorded of part `p` of `plan` (None: nothing)."""
        doc = self._read(f"part-{p}.json")
        return doc if doc.get("plan_id") == plan.plan_id and doc.get("part") == p else None

    def remove(self) -> None:
        _remove(self.path)

    def _read(self, name: str) -> dict[str, Any]:
        try:
            with open(os.path.join(self.path, name), "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def _write(self, name: str, doc: Mapping[str, Any]) -> None:
        tmp = os.path.join(self.path, f".{name}.tmp")
        with open(tmp, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(self.path, name))


def kept_part(plan: Plan, p: int, tmp: str, journal: Journal) -> PartResult | None:
    """Part `p` as an earlier run finished it, when every file's bytes still match the
    journal (read back whole); else None, and what is left of it is removed."""
    entry = journal.entry(plan, p)
    if entry is not None:
        try:
            now = _digests(plan, p, tmp)
        except OSError:
            now = None
        if now is not None and sorted(map(tuple, now)) == sorted(map(tuple, entry["files"])):
            return entry
    _clear(plan, p, tmp)
    return None


# -- writing a part -------------------------------------------------------------------------------


def _chunks(job: WriteJob, part: Part) -> list[tuple[str, Chunk]]:
    return [(n, job.info(n).chunks[i]) for n, i in part.items]


def _write_xckpt(job: WriteJob, plan: Plan, part: Part) -> dict[str, Any]:
    world, p = len(plan.parts), part.index
    w = Writer(
        job.dst,
        rank=p,
        world_size=world,
        save_id=plan.save_id,
        progress=False,
        metadata=json_metadata(job) or {},
        inflight_bytes=CONVERT_INFLIGHT_BYTES,
        compression=job.compression,
    )
    try:
        # Part 0 declares every tensor (the merged manifest lists them in source order,
        # the empty ones included); the others, the tensors they hold boxes of.
        for n in plan.names if p == 0 else dict.fromkeys(n for n, _ in part.items):
            t = job.info(n)
            w.declare(n, t.dtype, t.shape, placement=t.placement, value_range=t.value_range)
        for name, c, arr in job.pieces(_chunks(job, part)):
            w.write(
                name, arr, global_shape=job.info(name).shape, offset=c.offset, chunk_value_range=c.value_range
            )
            job.bar.update(arr.nbytes)
            del arr  # the Writer holds it until flushed
        if p == 0:
            for oname, value in job.objects.items():
                if oname in job.per_rank_objects and isinstance(value, list) and len(value) == world:
                    w.write_object(oname, value[0], per_rank=True)
                else:
                    w.write_object(oname, value)
        else:
            for oname, value in job.objects.items():
                if oname in job.per_rank_objects and isinstance(value, list) and len(value) == world:
                    w.write_object(oname, value[p], per_rank=True)
        w.commit()
    except BaseException as e:
        w._failed(e)
        raise
    return {}


def _write_dcp(job: WriteJob, plan: Plan, part: Part) -> dict[str, Any]:
    rel = f"__{part.index}_0.distcp"
    stored: list[list[Any]] = []  # [name, chunk index, offset, shape, start, length]
    objs: list[list[Any]] = []
    with open(os.path.join(job.dst, rel), "wb") as f:
        for (_, i), (name, c, data) in zip(part.items, job.pieces(_chunks(job, part), reuse=True)):
            start, length = append_tensor(f, data, job.info(name).dtype)
            stored.append([name, i, list(c.offset), list(c.shape), start, length])
            job.bar.update(data.nbytes)
            del data
        if part.index == 0:
            for name in plan.names:  # a tensor with no stored bytes still gets a chunk, as DCP writes one
                t = job.info(name)
                if not any(c.box.volume for c in t.chunks):
                    start, length = append_tensor(f, np.empty(t.shape, dtype=t.np_dtype), t.dtype)
                    stored.append([name, -1, [0] * len(t.shape), list(t.shape), start, length])
            for key, value in flat_objects_of(job)[0].items():
                start = f.tell()
                f.write(pickled(job, key, value).getbuffer())
                objs.append([key, start, f.tell() - start])
        f.flush()
        os.fsync(f.fileno())
    return {"stored": stored, "objects": objs}


def _write_shard(job: WriteJob, plan: Plan, part: Part, meta: Mapping[str, str]) -> dict[str, Any]:
    path = os.path.join(job.dst, plan.shard_file(part.index))
    size, crc = write_file(
        job,
        path + ".partial",
        [n for n, _ in part.items],
        dict(meta) if part.index == 0 else {"format": "pt"},
        digest=True,
    )
    os.rename(path + ".partial", path)
    return {"files": [[plan.shard_file(part.index), size, crc]]}


def write_part(
    job: WriteJob, plan: Plan, part: Part, journal: Journal | None, meta: Mapping[str, str]
) -> PartResult:
    """Write part `part` of `plan` into `job.dst` (the temporary output, made by the
    caller; for a one-part output, absent; or an xckpt location in object storage, with no
    journal), make it durable, record it in `journal`.

    `meta` is a Hugging Face directory's first shard's `__metadata__`. The job records
    the source's crc32c of every box it reads (with `job.record`), returned for verify."""
    if plan.kind == "xckpt":
        extra = _write_xckpt(job, plan, part)
    elif plan.kind == "torch-dcp":
        extra = _write_dcp(job, plan, part)
    elif plan.kind == "hf-dir":
        extra = _write_shard(job, plan, part, meta)
    elif plan.format == "orbax":  # reproducible: no OCDBT (random file names, commit times)
        write_orbax(job, reproducible=True)
        extra = {}
    else:
        FORMATS[plan.format].sink.write(job)
        extra = {}
    # the files' digests: computed while writing (a shard), else read back (fsynced first)
    files = extra.pop("files", None)
    if journal is None:
        files = []
    elif files is None:
        files = _digests(plan, part.index, job.dst)
    result: PartResult = {
        "plan_id": plan.plan_id,
        "part": part.index,
        "nbytes": part.nbytes,
        "files": files,
        "crcs": [[n, list(o), list(s), c] for (n, o, s), c in job.crcs.items()],
        **extra,
    }
    if journal is not None:  # None: an xckpt output in object storage, written in place (no resume)
        journal.record(result)
    return result


def clear_commit(plan: Plan, tmp: str) -> None:
    """Remove what completed an earlier run's output (it is written again after the parts)."""
    name = {"hf-dir": INDEX, "torch-dcp": ".metadata"}.get(plan.kind)
    if plan.kind == "xckpt" and len(plan.parts) > 1:
        name = "xckpt.json"
    if name is not None:
        _remove(os.path.join(tmp, name))


# -- completing the output ------------------------------------------------------------------------


def commit_files(job: WriteJob, plan: Plan, results: Sequence[PartResult]) -> None:
    """Write what completes the output once every part is written: a Hugging Face
    directory's index, DCP's `.metadata`, xckpt's merged manifest (several parts).
    `results` are the parts' results, in part order."""
    if plan.kind == "hf-dir":
        weight_map = {n: plan.shard_file(p.index) for p in plan.parts for n, _ in p.items}
        index = {"metadata": {"total_size": sum(p.nbytes for p in plan.parts)}, "weight_map": weight_map}
        tmp = os.path.join(job.dst, INDEX + ".partial")
        with open(tmp, "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, os.path.join(job.dst, INDEX))
    elif plan.kind == "torch-dcp":
        _commit_dcp(job, plan, results)
    elif plan.kind == "xckpt" and len(plan.parts) > 1:
        finalize(job.dst, len(plan.parts), plan.save_id)


def _commit_dcp(job: WriteJob, plan: Plan, results: Sequence[PartResult]) -> None:
    chunks: dict[str, list[tuple[int, StoredChunk]]] = {n: [] for n in plan.names}
    objects: list[tuple[str, str, int, int]] = []
    for r in results:
        rel = f"__{r['part']}_0.distcp"
        for name, i, offset, shape, start, length in r["stored"]:
            chunks[name].append((i, (tuple(offset), tuple(shape), rel, start, length)))
        objects += [(key, rel, start, length) for key, start, length in r["objects"]]
    ordered = {n: [c for _, c in sorted(v, key=lambda x: x[0])] for n, v in chunks.items()}
    write_metadata(job.dst, job, ordered, objects, flat_objects_of(job)[1], plan.save_id)
