"""An orbax `CheckpointHandler` that saves and restores items as xckpt checkpoints.

An orbax `CheckpointManager` (or `Checkpointer`) item given `XckptSave(state)` is
written by `xckpt.jax.save` into the item's directory, an ordinary xckpt checkpoint
that `xckpt.open`, `xckpt.jax.load` and `xckpt.torch.load` read; `XckptRestore(target)`
reads it back through `xckpt.jax.load` into any target sharding (another mesh, another
layout, another device count). Both args are registered in orbax's args registry,
so no handler needs to be named:

    mngr = ocp.CheckpointManager(root, item_names=("state", "meta"))
    mngr.save(step, args=ocp.args.Composite(state=XckptSave(state), meta=ocp.args.JsonSave(m)))
    mngr.restore(step, args=ocp.args.Composite(state=XckptRestore(abstract_state)))

Call protocol (orbax's; every process calls each, with the same arguments):

1. `async_save(directory, args)` (async checkpointers, the default for a
   `CheckpointManager`) or `save(directory, args)`: `directory` is the item's
   directory inside orbax's temporary step directory. orbax may still be creating
   that directory in the background; xckpt claims its location when a save starts,
   so the foreground waits for orbax's directory-creation signals first (what
   orbax's own handlers wait for before they write), then copies every shard this
   process writes to host and returns. The write and xckpt's commit run on xckpt's
   save thread; the returned future resolves when the checkpoint is complete on
   every process, after which orbax finalizes and renames the step directory (an
   xckpt checkpoint holds only relative keys, so the rename keeps it whole).
2. `restore(directory, args)`: `xckpt.jax.load(directory, args.target)`.
3. `metadata(directory)`: what is stored, without reading data.

Decided where orbax is silent:
- `metadata` returns a flat dict by name (names are key paths joined with ".", as
  everywhere in xckpt): a `jax.ShapeDtypeStruct` (shape and dtype, no sharding:
  the saved layout binds no reader) per tensor, and each object's value. orbax's
  `StandardCheckpointHandler` returns a tree of array metadata; a flat dict by name
  is what `xckpt.jax.load` takes as a target once shardings are put in.
- `XckptRestore()` without a target gives what `xckpt.jax.load` gives without one:
  a flat dict of numpy arrays and objects by name.
- `finalize` has nothing to do: the xckpt commit (rank manifests, then `xckpt.json`)
  is complete when the save's future resolves.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import future as ocp_future

from xckpt.formats import opened
from xckpt.jax._load import load
from xckpt.jax._save import save
from xckpt.manifest import numpy_dtype

__all__ = ["XckptHandler", "XckptSave", "XckptRestore"]


class _Done:
    """An orbax future over the `concurrent.futures.Future` of an xckpt async save."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def result(self, timeout: float | None = None) -> Any:
        return self._f.result(timeout)

    def cancel(self) -> bool:
        return bool(self._f.cancel())


class XckptHandler(ocp.AsyncCheckpointHandler):
    """Saves an orbax item as an xckpt checkpoint; restores it into any sharding.

    Args:
        storage: how the checkpoint's `data/` is organised (as for `xckpt.jax.save`).
        context: a tensorstore context for reads and writes (default: xckpt's).
    """

    def __init__(self, *, storage: str | None = None, context: Any = None) -> None:
        self._storage = storage
        self._context = context

    async def async_save(self, directory: Any, args: XckptSave) -> list[Any]:
        """Copy this process's shards to host and start the write (see the module)."""
        signals = ocp_future.CommitFutureAwaitingContractedSignals(_nothing(), name="xckpt_wait_dirs")
        signals.result()  # orbax's directory creation for this save, if it runs in the background
        f = save(args.state, os.fspath(str(directory)), storage=self._storage, async_save=True, show_progress=False)
        return [_Done(f)]

    def save(self, directory: Any, args: XckptSave) -> None:
        """Write the item and wait until the checkpoint is complete."""
        save(args.state, os.fspath(str(directory)), storage=self._storage, show_progress=False)

    def restore(self, directory: Any, args: XckptRestore | None = None) -> Any:
        """The item, laid out as `args.target` says (see `xckpt.jax.load`)."""
        target = args.target if args is not None else None
        return load(os.fspath(str(directory)), target, show_progress=False, context=self._context)

    def metadata(self, directory: Any) -> dict[str, Any]:
        """Each tensor's shape and dtype, and each object's value, by name (see the module)."""
        with opened(os.fspath(str(directory)), context=self._context) as src:
            out: dict[str, Any] = {}
            for name in src.names():
                info = src.info(name)
                out[name] = jax.ShapeDtypeStruct(tuple(info.shape), numpy_dtype(info.dtype))
            out.update(src.objects(per_rank="list"))
            return out

    def finalize(self, directory: Any) -> None:
        """Nothing: the checkpoint is committed when the save's future resolves."""

    def close(self) -> None:
        """Nothing held between saves."""


async def _nothing() -> None:
    return None


@ocp.args.register_with_handler(XckptHandler, for_save=True)
@dataclasses.dataclass
class XckptSave(ocp.args.CheckpointArgs):
    """Save `state` (a pytree of jax.Arrays of any sharding, numpy arrays and scalars)
    as an xckpt checkpoint.

    Attributes:
        state: the pytree.
    """

    state: Any


@ocp.args.register_with_handler(XckptHandler, for_restore=True)
@dataclasses.dataclass
class XckptRestore(ocp.args.CheckpointArgs):
    """Restore into `target`: a pytree (or flat dict by name) of `jax.ShapeDtypeStruct`s
    with shardings, shardings alone, or arrays (see `xckpt.jax.load`); None: every
    tensor as numpy and every object, by name.

    Attributes:
        target: the target tree.
    """

    target: Any = None
