"""How the ranks of one manager agree: one small exchange at a time, never tensors.

A manager talks to the other ranks only through a `Coordinator`, made once
when it is built (every rank builds its manager at the same point):

* `Single`: one process (nothing is sent);
* `TorchGroup`: `torch.distributed` is initialised with more than one rank
  in the manager's process group. Two gloo groups over its ranks: one for the calling
  thread (`any`, `gather`, `share`) and one for the manager's save thread
  (`bg_share`), so the two never interleave collectives on one group, and neither
  touches the training's own (perhaps NCCL) group;
* `JaxProcesses`: a multi-process JAX job: the distributed client's key-value
  store (the service `jax.distributed.initialize` starts), usable from any thread.

Call protocol: every rank makes the same calls in the same order (the manager's
`should_save`, `save`, `restore` and `wait` are collective for that reason).
The calling thread uses `any`, `gather` and `share`; the save thread only
`bg_share`. Frameworks are imported only when their coordinator is built.
"""

from __future__ import annotations

import itertools
import json
import sys
from typing import Any

from xckpt.errors import XckptError

__all__ = ["Coordinator", "Single", "TorchGroup", "JaxProcesses", "coordinator"]

#: Managers built in this process, numbered (every process builds them in the same
#: order), so each manager's key-value keys are its own.
_managers = itertools.count()
#: How long a JAX process waits for another's value (ms).
JAX_WAIT_MS = 600_000


class Coordinator:
    """One process: every exchange returns at once (the base of the others)."""

    kind = "single"
    rank = 0
    world = 1

    def any(self, flag: bool) -> bool:
        """Whether `flag` is true on any rank (calling thread)."""
        return bool(flag)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, by rank (calling thread)."""
        return [obj]

    def share(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s `obj` on every rank (calling thread)."""
        return obj

    def bg_share(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (the manager's save thread); also a barrier."""
        return obj


class Single(Coordinator):
    """A single process."""


class TorchGroup(Coordinator):
    """The ranks of a torch.distributed process group (see the module)."""

    kind = "torch"

    def __init__(self, process_group: Any) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        if self.rank < 0:
            raise XckptError("this rank is not a member of the process_group given to the CheckpointManager")
        ranks = sorted(dist.get_process_group_ranks(group))
        self._fg = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        self._bg = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)

    def any(self, flag: bool) -> bool:
        t = self._torch.tensor([1 if flag else 0], dtype=self._torch.int32)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self._fg)
        return bool(t.item())

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self._dist.all_gather_object(out, obj, group=self._fg)
        return out

    def share(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, group=self._fg, group_src=src)
        return box[0]

    def bg_share(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, group=self._bg, group_src=0)
        return box[0]


class JaxProcesses(Coordinator):
    """The processes of a multi-process JAX job, through the distributed key-value store."""

    kind = "jax"

    def __init__(self) -> None:
        import jax
        from jax._src import distributed

        self.rank, self.world = jax.process_index(), jax.process_count()
        client = distributed.global_state.client
        if client is None:
            raise XckptError(
                "a multi-process JAX CheckpointManager needs jax.distributed.initialize() (its key-value "
                "store carries the ranks' agreement); call it before building the manager"
            )
        self._client = client
        self._prefix = f"xckpt-manager/{next(_managers)}"
        self._n = {"fg": itertools.count(), "bg": itertools.count()}

    def _exchange(self, lane: str, obj: Any, everyone: bool, src: int = 0) -> list[Any]:
        key = f"{self._prefix}/{lane}/{next(self._n[lane])}"
        if everyone or self.rank == src:
            self._client.key_value_set(f"{key}/{self.rank}", json.dumps(obj))
        ranks = range(self.world) if everyone else [src]
        return [json.loads(self._client.blocking_key_value_get(f"{key}/{r}", JAX_WAIT_MS)) for r in ranks]

    def any(self, flag: bool) -> bool:
        return any(self._exchange("fg", bool(flag), True))

    def gather(self, obj: Any) -> list[Any]:
        return self._exchange("fg", obj, True)

    def share(self, obj: Any, src: int = 0) -> Any:
        return self._exchange("fg", obj, False, src)[0]

    def bg_share(self, obj: Any) -> Any:
        return self._exchange("bg", obj, False)[0]


def coordinator(process_group: Any = None) -> Coordinator:
    """The coordinator for this process: torch's group, JAX's processes, or one process.

    Frameworks are looked up in `sys.modules`: a job whose process group exists has
    imported torch already, so this never imports a framework that is not in use.

    Raises:
        XckptError: `process_group` is given but torch.distributed is not initialised.
    """
    dist = sys.modules.get("torch.distributed")
    torch_up = dist is not None and dist.is_available() and dist.is_initialized()
    if process_group is not None and not torch_up:
        raise XckptError(
            "a process_group was given to the CheckpointManager but torch.distributed is not "
            "initialised; call torch.distributed.init_process_group first, or leave process_group out"
        )
    if torch_up and dist is not None and dist.get_world_size(process_group) > 1:
        return TorchGroup(process_group)
    jax = sys.modules.get("jax")
    if jax is not None and not torch_up and jax.process_count() > 1:
        return JaxProcesses()
    return Single()
