"""Every Source runs :class:`conformance.SourceTests` on a checkpoint its own library wrote.

xckpt: two :class:`xckpt.Writer` ranks in this process (``model.multi`` split by rows);
torch DCP: ``torch.distributed.checkpoint.save`` in one process, with a save planner
that stores ``model.multi`` as two row chunks (as two ranks of a ``Shard(0)`` DTensor
would); orbax: ``PyTreeCheckpointHandler`` on 8 simulated CPU devices (``model.multi``
sharded over a (4, 2) mesh); safetensors: ``safetensors.torch.save_file``; torch:
``torch.save``. torch, jax and orbax are imported inside the fixtures.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import warnings
from typing import Any

import numpy as np
import pytest
from conformance import (
    MULTI,
    MULTI_ROWS,
    OBJECTS,
    TRUTH,
    SourceTests,
    Written,
    nest,
    numpy_to_torch,
    write_xckpt,
)

EMPTY = "model.empty"

class TestXckptSource(SourceTests):
    format = "xckpt"

    @pytest.fixture(scope="class")
    @classmethod
    def written(cls, tmp_path_factory: pytest.TempPathFactory) -> Written:
        path = write_xckpt(str(tmp_path_factory.mktemp("xckpt") / "ckpt"), TRUTH, OBJECTS)
        return Written(path, dict(TRUTH), copy.deepcopy(OBJECTS))


def _row_split_planner(split: dict[str, tuple[tuple[int, int], ...]]) -> Any:
    """torch's DefaultSavePlanner, storing the tensors of ``split`` as the given row chunks."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class RowSplit(DefaultSavePlanner):
        def create_local_plan(self) -> Any:
            plan = super().create_local_plan()
            items = []
            for it in plan.items:
                rows = split.get(it.index.fqn)
                if rows is None or it.type != WriteItemType.TENSOR:
                    items.append(it)
                    continue
                size = it.tensor_data.size
                for lo, hi in rows:
                    offsets = torch.Size([lo] + [0] * (len(size) - 1))
                    chunk = ChunkStorageMetadata(offsets, torch.Size([hi - lo, *size[1:]]))
                    data = TensorWriteData(chunk=chunk, properties=it.tensor_data.properties, size=size)
                    items.append(WriteItem(index=MetadataIndex(it.index.fqn, offsets), type=WriteItemType.SHARD, tensor_data=data))
            self.plan = dataclasses.replace(plan, items=items)
            return self.plan

        def resolve_data(self, item: Any) -> Any:
            if item.index.fqn in split:
                c = item.tensor_data.chunk
                return self.state_dict[item.index.fqn].narrow(0, c.offsets[0], c.sizes[0])
            return super().resolve_data(item)

    return RowSplit()


class TestDcpSource(SourceTests):
    format = "torch-dcp"

    @pytest.fixture(scope="class")
    @classmethod
    def written(cls, tmp_path_factory: pytest.TempPathFactory) -> Written:
        import torch.distributed.checkpoint as dcp

        path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
        sd: dict[str, Any] = {n: numpy_to_torch(a) for n, a in TRUTH.items()}
        sd.update(copy.deepcopy(OBJECTS))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
            dcp.save(sd, checkpoint_id=path, planner=_row_split_planner({MULTI: MULTI_ROWS}), no_dist=True)
        return Written(path, dict(TRUTH), copy.deepcopy(OBJECTS), {"allow_pickle": True})


class TestOrbaxSource(SourceTests):
    format = "orbax"
    not_held = {EMPTY: "orbax refuses to save zero-size arrays"}

    @pytest.fixture(scope="class")
    @classmethod
    def written(cls, tmp_path_factory: pytest.TempPathFactory) -> Written:
        import jax
        import orbax.checkpoint as ocp
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        path = str(tmp_path_factory.mktemp("orbax") / "ckpt")
        arrays = {n: a for n, a in TRUTH.items() if n not in cls.not_held}
        with jax.enable_x64(True), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("dp", "tp"))
            flat: dict[str, Any] = {
                n: jax.device_put(a, NamedSharding(mesh, P("dp", "tp") if n == MULTI else P())) for n, a in arrays.items()
            }
            flat.update(copy.deepcopy(OBJECTS))
            ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).save(path, nest(flat))
        return Written(path, arrays, copy.deepcopy(OBJECTS))


class TestSafetensorsSource(SourceTests):
    format = "safetensors"
    multi_chunk = False

    @pytest.fixture(scope="class")
    @classmethod
    def written(cls, tmp_path_factory: pytest.TempPathFactory) -> Written:
        from safetensors.torch import save_file

        path = str(tmp_path_factory.mktemp("st") / "model.safetensors")
        save_file({n: numpy_to_torch(a) for n, a in TRUTH.items()}, path, metadata={"format": "pt"})
        return Written(path, dict(TRUTH))


class TestTorchSaveSource(SourceTests):
    format = "torch"
    multi_chunk = False

    @pytest.fixture(scope="class")
    @classmethod
    def written(cls, tmp_path_factory: pytest.TempPathFactory) -> Written:
        import torch

        path = os.path.join(str(tmp_path_factory.mktemp("pt")), "model.pt")
        sd: dict[str, Any] = {n: numpy_to_torch(a) for n, a in TRUTH.items()}
        sd.update(copy.deepcopy(OBJECTS))
        torch.save(sd, path)
        return Written(path, dict(TRUTH), copy.deepcopy(OBJECTS))
