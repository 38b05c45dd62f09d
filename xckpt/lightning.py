"""Lightning `CheckpointIO` that writes xckpt checkpoints (DESIGN.md section 10).

`Trainer(plugins=[XckptCheckpointIO()])`, or `AsyncCheckpointIO(XckptCheckpointIO())`
to write in a background thread: `ModelCheckpoint` then saves xckpt checkpoints,
`trainer.fit(ckpt_path=...)` resumes from them, and `save_top_k` pruning removes them.

Call protocol (what Lightning does; every call on the rank Lightning chooses):

1. `save_checkpoint(checkpoint, path)`: on global rank 0 only (the strategy's
   `save_checkpoint`), with the whole checkpoint dict (`state_dict`,
   `optimizer_states`, `loops`, `callbacks`, ...) of full tensors. Under
   `AsyncCheckpointIO` the call runs on its single worker thread, with tensors
   already cloned, possibly after later `remove_checkpoint` calls for the same path.
2. `remove_checkpoint(path)`: on global rank 0, from `ModelCheckpoint` pruning
   (`save_top_k`, a replaced `last`), on the trainer's thread.
3. `load_checkpoint(path, map_location)`: on every rank, when resuming or testing.

Decided where Lightning's contract is silent (each tested in tests/test_lightning.py):

- Lightning names a file (`epoch=1-step=8.ckpt`); the checkpoint is a directory of
  that name, so its paths, `ModelCheckpoint`'s bookkeeping and `ckpt_path=` are
  unchanged. As `TorchCheckpointIO` replaces an existing file, an existing
  checkpoint at the path is replaced (the new save is complete or the old stays).
- Names: the dict flattened as `xckpt.torch.save` flattens it, so the weights sit
  under `state_dict.<key>` and the optimizer's under `optimizer_states.0.state.<id>`;
  the containers' key types are recorded, so `load_checkpoint` returns the dict as
  Lightning saved it (int parameter ids, dotted module names as one key).
- Non-tensor values are objects (JSON with tuples, bytes and non-string keys
  tagged); a value that is none of these (a custom class in `hyper_parameters`)
  is an `ObjectError` naming it, never a pickle.
- The save is one process's (rank 0 holds every tensor whole), so it talks to no
  other rank even when a process group is up.
- `remove_checkpoint` deletes manifests first, then data (a removal that stops part
  way leaves a checkpoint no reader accepts). A path whose write is queued or
  running (`AsyncCheckpointIO`) is dropped: a queued write is skipped when its turn
  comes, a running one is deleted as soon as it completes. A path that is neither
  there nor being written, and never gets written, is only remembered by this
  plugin, harmlessly, until it is written (then that write is dropped) or the
  plugin is gone: Lightning removes only paths it has saved.
- `load_checkpoint` puts tensors on CPU, or on `map_location` when it is a device
  or a device name (a callable or dict `map_location` is a `torch.load` hook and
  is not applied: Lightning moves the state onto the model's device itself).
  `weights_only` is accepted and has no effect: nothing is unpickled.
- `storage_options` must be None (as for `TorchCheckpointIO`).
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from xckpt.errors import CheckpointNotFoundError, XckptError
from xckpt.formats import opened
from xckpt.manifest import encode_value
from xckpt.native.steps import delete_checkpoint
from xckpt.native.writer import save as save_mapping
from xckpt.storage import Location, Storage, location_name
from xckpt.torch import load_full
from xckpt.torch._dtypes import as_numpy
from xckpt.torch._state_dict import KEYS_META, flatten, unflatten

__all__ = ["XckptCheckpointIO"]


class XckptCheckpointIO(CheckpointIO):
    """A Lightning `CheckpointIO` whose checkpoints are xckpt checkpoints.

    Example:
        `Trainer(plugins=[XckptCheckpointIO()])`, or
        `Trainer(plugins=[AsyncCheckpointIO(XckptCheckpointIO())])` to write in the background.

    Args:
        storage: how each checkpoint's `data/` is organised (as for `xckpt.Writer`;
            default: the format's default).
        context: a tensorstore context for reads and writes (default: xckpt's).
    """

    def __init__(self, *, storage: str | None = None, context: Any = None) -> None:
        super().__init__()
        self._storage = storage
        self._context = context
        self._lock = threading.Lock()
        self._writing: set[str] = set()  # paths whose write is running
        self._dropped: set[str] = set()  # paths removed before their write started or finished

    # -- save -------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Write `checkpoint` (Lightning's dict) as an xckpt checkpoint at `path`.

        Raises:
            TypeError: `storage_options` is given.
            ObjectError: a value is neither a tensor nor storable as an object.
            XckptError: a tensor is sharded (a DTensor: save it with the torch DCP
                storage layer, `xckpt.torch.XckptStorageWriter`), or storage failed.
        """
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by {type(self).__name__}; "
                "pass storage options to XckptCheckpointIO(storage=..., context=...) instead"
            )
        key = _key(path)
        with self._lock:
            if key in self._dropped:  # removed while its write was queued: never written
                self._dropped.discard(key)
                return
            self._writing.add(key)
        try:
            self._write(checkpoint, path)
        finally:
            with self._lock:
                self._writing.discard(key)
                drop = key in self._dropped
                self._dropped.discard(key)
        if drop:  # removed while it was being written
            delete_checkpoint(path, context=self._context)

    def _write(self, checkpoint: dict[str, Any], path: Any) -> None:
        keys: dict[str, Any] = {}
        flat, _ = flatten(checkpoint, keys)
        mapping = {name: _host(name, v, path) if isinstance(v, torch.Tensor) else v for name, v in flat.items()}
        for name, v in mapping.items():  # refuse what cannot be stored before anything is written
            if not isinstance(v, np.ndarray):
                encode_value(v, name)
        if isinstance(path, (str, os.PathLike)) and "://" not in os.fspath(path):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        options: dict[str, Any] = {"metadata": {KEYS_META: keys, "written_by": "xckpt.lightning"}}
        if self._storage is not None:
            options["storage"] = self._storage
        if self._context is not None:
            options["context"] = self._context
        save_mapping(
            mapping,
            _location(path),
            overwrite=True,
            save_id="lightning-" + secrets.token_hex(8),
            show_progress=False,
            **options,
        )

    # -- load -------------------------------------------------------------------

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict at `path`, as Lightning saved it.

        Raises:
            FileNotFoundError: nothing is at `path` (as `TorchCheckpointIO` raises;
                also an `xckpt.errors.CheckpointNotFoundError`).
            XckptError: the checkpoint is incomplete or damaged.
        """
        device = map_location if isinstance(map_location, (str, torch.device)) else "cpu"
        loc = _location(path)
        try:
            with opened(loc, context=self._context) as src:
                keys = src.metadata.get(KEYS_META)
                values = load_full(src, device=device, show_progress=False)
        except CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(f"Checkpoint file not found: {location_name(loc)} ({e})") from e
        return unflatten(values, keys, location_name(loc))

    # -- remove -----------------------------------------------------------------

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at `path` (manifests first); drop its write when that
        is queued or running (see the module)."""
        key = _key(path)
        with self._lock:
            writing = key in self._writing
            there = _exists(path, self._context)
            if writing or not there:
                self._dropped.add(key)  # queued or running: dropped when its turn comes or it ends
            if writing:
                return
        if there:
            if os.path.isfile(path):  # a torch.save checkpoint from before the switch
                os.remove(path)
            else:
                delete_checkpoint(_location(path), context=self._context)


def _key(path: Any) -> str:
    s = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return s if "://" in s else os.path.abspath(s)


def _location(path: Any) -> Location:
    return os.fspath(path) if isinstance(path, os.PathLike) else path


def _exists(path: Any, context: Any) -> bool:
    s = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    if "://" not in s:
        return os.path.exists(s)
    storage = Storage(s, context)  # one process wrote it: its manifest is ranks/0.json
    return storage.read_key("ranks/0.json") is not None or storage.read_key("xckpt.json") is not None


def _host(name: str, t: torch.Tensor, path: Any) -> Any:
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise XckptError(
            f"checkpoint {str(path)!r}: {name!r} is a {type(t).__name__}, a sharded tensor; Lightning's "
            "CheckpointIO receives whole tensors from one rank. Save sharded state with torch DCP and "
            "xckpt.torch.XckptStorageWriter (strategies that shard call DCP themselves)"
        )
    return as_numpy(t.detach().cpu())


