"""`ArraySource`: numpy arrays as a [Source][xckpt.source.Source] stored in given chunk boxes.

A fast, fully known source for the rules' property tests (`test_rules_megatron.py`,
`test_rules_quant.py`): every box a view reads is cut from the arrays, and the elements
copied are counted, so a test can check that a view reads only what it needs.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from xckpt.layout import Box, check_coverage
from xckpt.manifest import Chunk, TensorEntry, dtype_name
from xckpt.source import ChunkRead, Source, whole_request


class ArraySource(Source):
    """`arrays` stored as the chunk boxes `boxes` names (default: one whole chunk each), with
    `objects`; `read_elements` counts the elements each read copies."""

    format = "arrays"

    def __init__(self, arrays: dict[str, np.ndarray], boxes: dict[str, list[Box]], objects: Any = None) -> None:
        self.path, self.arrays, self._objs = "arrays", arrays, dict(objects or {})
        self.read_elements = 0
        self._entries = {}
        for n, a in arrays.items():
            bs = boxes.get(n) or [Box.full(a.shape)]
            check_coverage(a.shape, bs)
            chunks = tuple(
                Chunk(offset=b.offset, shape=b.shape, key=f"{n}{b}", rank=i, nbytes=b.volume * a.itemsize)
                for i, b in enumerate(bs)
            )
            self._entries[n] = TensorEntry(name=n, dtype=dtype_name(a.dtype), shape=a.shape, chunks=chunks)

    def _read_chunks(self, jobs: Sequence[ChunkRead], bar: Any) -> None:
        for job in jobs:
            req = job.req if job.req is not None else whole_request(job.chunk)
            part = self.arrays[job.name][req.box.slices()]
            job.out[req.target_slices] = part
            self.read_elements += part.size
            bar.update(part.nbytes)

    def read_units(self, name: str, chunk: Chunk, box: Box, itemsize: int) -> dict[Hashable, int]:
        return {(name, box.offset, box.shape): box.volume * itemsize}

    def object_names(self) -> list[str]:
        return list(self._objs)

    def _object_value(self, name: str, rank: int | None) -> Any:
        return self._objs[name]
