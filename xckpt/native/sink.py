"""xckpt output of `xckpt.convert`, keeping the source layout: one [`Writer`][xckpt.Writer] per source writer.

Ranks are written one after another (each commits before the next starts), each
Writer holding at most `xckpt.sink.CONVERT_INFLIGHT_BYTES` of chunks in
flight, so one writer's budget bounds memory; rank 0 finalizes. Chunks come fresh
from [`WriteJob.chunks`][xckpt.sink.WriteJob.chunks] (the Writer keeps them until it flushes them).
Verify needs no checksums from here: the driver re-reads every stored chunk
through the xckpt reader, which checks each one's crc32c.
"""

from __future__ import annotations

import json
import secrets
import warnings
from typing import Any

from xckpt.errors import ObjectError
from xckpt.manifest import encode_value
from xckpt.native.writer import Writer, finalize
from xckpt.sink import CONVERT_INFLIGHT_BYTES, Sink, WriteJob

__all__ = ["XckptSink", "json_metadata"]

FORMAT = "xckpt"


def json_metadata(job: WriteJob) -> dict[str, Any] | None:
    """The source's metadata when it is JSON (it travels), else None (it stays behind)."""
    meta = dict(job.src.metadata)
    try:
        json.dumps(meta)
    except (TypeError, ValueError):
        return None
    return meta


class XckptSink(Sink):
    """xckpt output keeping the source layout: one [`Writer`][xckpt.Writer] per source writer."""

    format = FORMAT

    def check(self, job: WriteJob) -> None:
        """Objects must be storable (JSON values, bytes, numpy scalars) and not tensor names;
        metadata that is not JSON stays behind, with a warning."""
        tensors = set(job.names)
        for name, value in job.objects.items():
            if name in tensors:
                raise ObjectError(
                    f"xckpt output of {job.src.path!r}: {name!r} is both a tensor and an object; "
                    "rename or exclude one of them"
                )
            values = value if name in job.per_rank_objects and isinstance(value, list) else [value]
            for v in values:
                encode_value(v, name)
        if json_metadata(job) is None:
            warnings.warn(
                f"convert {job.src.path!r}: the source's metadata is not JSON and stays behind", stacklevel=3
            )

    def write(self, job: WriteJob) -> None:
        """Ranks are written one after another (each commits before the next starts), so
        one writer's in-flight budget bounds memory; rank 0 finalizes."""
        src = job.src
        infos = {n: src.info(n) for n in job.names}
        world = max([src.world_size] + [int(t.ranks_column.max()) + 1 for t in infos.values() if len(t.chunks)])
        save_id = job.save_id or "convert-" + secrets.token_hex(8)
        meta = json_metadata(job) or {}
        for r in range(world):
            w = Writer(
                job.dst,
                rank=r,
                world_size=world,
                save_id=save_id,
                progress=False,
                metadata=meta,
                inflight_bytes=CONVERT_INFLIGHT_BYTES,
                compression=job.compression,
            )
            for name, t in infos.items():
                w.declare(name, t.dtype, t.shape, placement=t.placement, value_range=t.value_range)
                for c, arr in job.chunks(name, rank=r):
                    w.write(name, arr, global_shape=t.shape, offset=c.offset, chunk_value_range=c.value_range)
                    job.bar.update(arr.nbytes)
                    del arr  # the Writer holds it until flushed; drop ours before the next read
            for oname, value in job.objects.items():
                if oname in job.per_rank_objects and isinstance(value, list) and len(value) == world:
                    w.write_object(oname, value[r], per_rank=True)
                elif r == 0:
                    w.write_object(oname, value)
            w.commit()
        if world > 1:
            finalize(job.dst, world, save_id)
