"""PyTorch adapter: save and load state dicts of tensors, DTensors and ShardedTensors.

`save` writes each rank's boxes (replicas once), with or without collectives;
`load` fills the caller's tensors in place whatever their layout now (CUDA
targets through a `DeviceRing` of host buffers; `read_once=True` reads each
stored range once for the whole process group);
`load_full` returns whole tensors for one process. Importing this module
imports torch; `import xckpt` does not.

`XckptStorageWriter` / `XckptStorageReader` are torch DCP's storage layer:
`dcp.save` / `dcp.async_save` write an xckpt checkpoint, `dcp.load` reads
any format `xckpt.open` reads.

Value groups (value-partitioned state such as torchrec's managed-collision
modules) are declared with `ManagedCollision` / `managed_collision_groups`
from `xckpt.torch.value_groups`; `redistribute_by_value`
(`xckpt.torch.redistribute`) moves one held in memory. Both are
re-exported here.
"""

from __future__ import annotations

from xckpt.torch._dcp_reader import XckptStorageReader
from xckpt.torch._dcp_writer import XckptStorageWriter
from xckpt.torch._load import DeviceRing, LoadResult, load, load_full
from xckpt.torch._save import save
from xckpt.torch._state_dict import PerRank
from xckpt.torch.redistribute import redistribute_by_value
from xckpt.torch.value_groups import ManagedCollision, ValueGroup, managed_collision_groups

__all__ = [
    "save",
    "load",
    "load_full",
    "PerRank",
    "LoadResult",
    "DeviceRing",
    "ManagedCollision",
    "ValueGroup",
    "managed_collision_groups",
    "redistribute_by_value",
    "XckptStorageWriter",
    "XckptStorageReader",
]
