"""safetensors output of `xckpt.convert`: one file, or a Hugging Face directory.

One file: `job.max_shard_size is None`. A Hugging Face directory (index
`model.safetensors.index.json` and shards `model-0000i-of-0000N.safetensors`,
each at most `max_shard_size` bytes of tensor data unless one tensor alone is
larger, split greedily in source order as `huggingface_hub` splits): otherwise.

The header is written first (every offset is known from the source's metadata),
then each tensor's bytes stream in row-major order: a row-sharded tensor moves
one chunk at a time ([`WriteJob.rows`][xckpt.sink.WriteJob.rows]), so memory stays near the largest
chunk; a column-sharded one is assembled whole. A single file is complete only
with its last byte (its header claims every byte). A directory's shards are
written as `<shard>.partial`; once they all are, the index goes in, then each
shard takes its name: before the index there is no `*.safetensors` file, after
it the index names a missing shard until the last rename, so at no moment does a
reader (xckpt's, `safetensors`', `from_pretrained`) take a part for the whole.

`__metadata__` holds `{"format": "pt"}` (what `save_pretrained` writes and
`from_pretrained` checks), the metadata of a safetensors or xckpt source
(strings as they are, other values as JSON text; an index's `total_size` and
`total_parameters` are not carried over; other formats' metadata is their own
bookkeeping, e.g. orbax's timestamps, and stays behind) and every object as JSON text (`xckpt.manifest.encode_value`,
so bytes and tuples come back tagged); in a directory these go into the first
shard. Dtypes safetensors has no name for are an error naming the tensor.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np

from xckpt._stream import crc32c
from xckpt.errors import XckptError
from xckpt.manifest import encode_value
from xckpt.sink import Sink, WriteJob

__all__ = ["SafetensorsSink", "ST_DTYPES", "plan_shards", "write_file", "metadata_of", "INDEX"]

FORMAT = "safetensors"

#: xckpt dtype name -> safetensors dtype name.
ST_DTYPES: dict[str, str] = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
    "uint64": "U64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "complex64": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}

INDEX = "model.safetensors.index.json"
#: Suffix of a shard being written (no reader takes it for a shard).
_PARTIAL = ".partial"
#: A Hugging Face index's bookkeeping (a source directory's metadata has them): not carried over.
_INDEX_KEYS = frozenset({"total_size", "total_parameters"})


def metadata_of(job: WriteJob) -> dict[str, str]:
    meta: dict[str, str] = {"format": "pt"}
    carried = job.src.metadata if job.src.format in ("safetensors", "xckpt") else {}
    for k, v in dict(carried).items():
        if k not in _INDEX_KEYS:
            meta[str(k)] = v if isinstance(v, str) else json.dumps(encode_value(v, str(k)))
    for k, v in job.objects.items():
        meta[k] = json.dumps(encode_value(v, k))
    return meta


def _header(job: WriteJob, names: list[str], metadata: dict[str, str] | None) -> bytes:
    head: dict[str, Any] = {}
    if metadata:
        head["__metadata__"] = metadata
    off = 0
    for n in names:
        t = job.src.info(n)
        st = ST_DTYPES.get(t.dtype)
        if st is None:
            raise XckptError(
                f"tensor {n!r} of {job.src.path!r} is {t.dtype}, which safetensors cannot hold "
                f"(it knows {', '.join(sorted(ST_DTYPES))}); cast it with a rule "
                f'{{"match": "{n}", "dtype": "float32"}}, exclude it, or convert to xckpt'
            )
        head[n] = {"dtype": st, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_file(
    job: WriteJob, path: str, names: list[str], metadata: dict[str, str] | None, *, digest: bool = False
) -> tuple[int, int]:
    """One safetensors file of `names` at `path` (created; fsynced): header, then each tensor's bytes.

    Returns the file's size and, with `digest`, its crc32c, computed from the bytes as
    they are written (no read back; 0 without `digest`)."""
    header = _header(job, names, metadata)
    crc, size = crc32c(np.frombuffer(header, np.uint8)) if digest else 0, len(header)
    with open(path, "xb", buffering=0) as f:
        _write_all(f, memoryview(header))
        for n in names:
            for piece in job.rows(n):
                crc = _put(f, piece.reshape(-1).view(np.uint8), crc if digest else None)
                size += piece.nbytes
                job.bar.update(piece.nbytes)
                del piece  # free it before the next piece is read: one piece in memory
        os.fsync(f.fileno())
    return size, crc


#: Bytes of a piece written at a time (its crc32c first, while they are in cache).
_SLICE = 4 << 20


def _put(f: Any, flat: np.ndarray, crc: int | None) -> int:
    """`flat` (bytes) to the unbuffered file `f` in slices, each one's crc32c taken first
    (the read leaves it in cache for the write); the crc32c continued, or 0 for None."""
    for at in range(0, flat.nbytes, _SLICE):
        part = flat[at : at + _SLICE]
        if crc is not None:
            crc = crc32c(part, crc)
        _write_all(f, memoryview(part))
    return crc or 0


def _write_all(f: Any, view: memoryview) -> None:
    """All of `view` to the unbuffered file `f` (a raw write may take part of it)."""
    while view.nbytes:
        view = view[f.write(view) :]


def plan_shards(sizes: list[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Names per shard: greedy in order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[str]] = []
    cur: list[str] = []
    size = 0
    for name, n in sizes:
        if cur and size + n > max_shard_size:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += n
    if cur or not shards:
        shards.append(cur)
    return shards


class SafetensorsSink(Sink):
    """One safetensors file, or a Hugging Face directory when `job.max_shard_size` is set."""

    format = FORMAT

    def check(self, job: WriteJob) -> None:
        """Every dtype has a safetensors name; every object and metadata value encodes as JSON."""
        _header(job, list(job.names), metadata_of(job))

    def write(self, job: WriteJob) -> None:
        """Each file's header first, then its tensors' bytes; a directory's shards under
        `.partial` names, then its index, then the shards' renames."""
        names = list(job.names)
        meta = metadata_of(job)
        if job.max_shard_size is None:
            write_file(job, job.dst, names, meta)
            return
        shards = plan_shards([(n, job.src.info(n).nbytes) for n in names], job.max_shard_size)
        os.makedirs(job.dst)
        weight_map: dict[str, str] = {}
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for i, (fname, shard) in enumerate(zip(files, shards)):
            write_file(job, os.path.join(job.dst, fname + _PARTIAL), shard, meta if i == 0 else {"format": "pt"})
            weight_map.update((name, fname) for name in shard)
        total = sum(job.src.info(name).nbytes for name in names)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        tmp = os.path.join(job.dst, INDEX + _PARTIAL)
        with open(tmp, "x") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
        os.rename(tmp, os.path.join(job.dst, INDEX))
        for fname in files:
            os.rename(os.path.join(job.dst, fname + _PARTIAL), os.path.join(job.dst, fname))
