"""Which adapter saves and restores a state, and the calls the manager makes of it.

The adapter is chosen from the state (DESIGN.md section 8): torch tensors, DTensors
and ShardedTensors go through `xckpt.torch`, jax.Arrays (and, for a restore,
`ShapeDtypeStruct`s and shardings) through `xckpt.jax`, and a mapping of numpy
arrays and plain values through [`xckpt.save`][xckpt.save] / [`xckpt.load`][xckpt.load]. A numpy
mapping in a multi-rank job goes through the job's framework (its save writes each
array once, from one rank). Frameworks are recognised through `sys.modules`: a
state cannot hold a torch tensor unless torch is imported, so `import xckpt` never
imports torch or jax; the adapters are imported inside the functions that use them.
"""

from __future__ import annotations

import concurrent.futures as cf
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from xckpt.errors import MissingEntryError, XckptError
from xckpt.formats import opened
from xckpt.layout import Box
from xckpt.manifest import MAX_OBJECT_DEPTH
from xckpt.native.writer import save as save_mapping
from xckpt.storage import Location

from ._staging import HostBuffers, stage_mapping

__all__ = ["framework_of", "start_save", "restore_state"]


def _walk(state: Any, depth: int = 0) -> Iterator[Any]:
    """Leaves of nested dicts, lists and tuples."""
    if depth > MAX_OBJECT_DEPTH:
        raise XckptError(f"the state nests deeper than {MAX_OBJECT_DEPTH} levels of dicts and lists")
    if isinstance(state, Mapping):
        for v in state.values():
            yield from _walk(v, depth + 1)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _walk(v, depth + 1)
    else:
        yield state


def framework_of(state: Any, what: str = "state") -> str:
    """`"torch"`, `"jax"` or `"numpy"`: who saves or restores `state`.

    Raises:
        XckptError: the state mixes torch and JAX values.
    """
    torch = sys.modules.get("torch")
    jax = sys.modules.get("jax")
    jax_types: tuple[type, ...] = ()
    if jax is not None:
        jax_types = (jax.Array, jax.ShapeDtypeStruct, jax.sharding.Sharding)
    kinds = set()
    for leaf in _walk(state):
        if torch is not None and isinstance(leaf, torch.Tensor):
            kinds.add("torch")
        elif jax_types and isinstance(leaf, jax_types):
            kinds.add("jax")
    if not kinds and jax is not None and state is not None and not isinstance(state, Mapping | list | tuple):
        # A pytree of another node type (a flax struct, an optax state): JAX's own flattening.
        if any(isinstance(leaf, jax_types) for leaf in jax.tree_util.tree_leaves(state)):
            kinds.add("jax")
    if len(kinds) > 1:
        raise XckptError(
            f"the {what} mixes torch tensors and JAX arrays; a manager saves one framework's state "
            "at a time (convert one side, e.g. with numpy, or use two managers)"
        )
    return kinds.pop() if kinds else "numpy"


def start_save(
    kind: str,
    state: Any,
    location: Location,
    *,
    save_id: str,
    overwrite: bool,
    metadata: Mapping[str, Any],
    staging: HostBuffers,
    async_save: bool,
    process_group: Any,
    rank_local: bool,
    writer_options: Mapping[str, Any] | None = None,
) -> Callable[[], Any]:
    """Start saving `state` with adapter `kind`; returns what finishes the write.

    With `async_save` everything the caller may change afterwards is copied into
    `staging` before this returns (the adapters' foreground part); the returned
    callable runs the rest (the write, the commit, and in coordinated saves the
    exchange with the other ranks) on the manager's save thread. Without it the save
    is complete when this returns and the callable does nothing. `writer_options`
    (`compression`, `dedup`) go to the adapter's save and on to its writers.
    """
    options: dict[str, Any] = {
        "save_id": save_id,
        "overwrite": overwrite,
        "metadata": metadata,
        "show_progress": False,
        "async_save": async_save,
        "staging": staging if async_save else None,
        **(writer_options or {}),
    }
    extra = dict(writer_options or {})
    if kind == "torch":
        import xckpt.torch as xt

        out = xt.save(state, location, process_group=process_group, rank_local=rank_local, **options)
    elif kind == "jax":
        import xckpt.jax as xj

        out = xj.save(state, location, **options)
    else:
        if not isinstance(state, Mapping):
            raise XckptError(
                f"the state is a {type(state).__name__}: a manager saves torch state dicts, JAX pytrees, "
                "or a mapping of names to numpy arrays and plain values"
            )
        if not async_save:
            save_mapping(
                state, location, save_id=save_id, overwrite=overwrite, metadata=metadata, show_progress=False,
                **extra,
            )
            return _nothing
        staged = stage_mapping(staging, state)

        def write() -> Any:
            return save_mapping(
                staged, location, save_id=save_id, overwrite=overwrite, metadata=metadata, show_progress=False,
                **extra,
            )

        return write
    if not async_save:
        return _nothing
    if not isinstance(out, cf.Future):  # the adapters return a Future for async_save=True
        raise XckptError(f"internal: xckpt.{kind}.save(async_save=True) returned {type(out).__name__}")
    return out.result


def _nothing() -> None:
    return None


def restore_state(
    kind: str, location: Location, target: Any, *, process_group: Any, options: Mapping[str, Any]
) -> Any:
    """Load the checkpoint at `location` into `target` through adapter `kind`.

    torch: `xckpt.torch.load` fills the target in place and its
    [`LoadResult`][xckpt.torch.LoadResult] is returned. JAX: `xckpt.jax.load` returns
    the restored pytree. numpy: with no target, every tensor (numpy) and object by
    name; with a mapping, its numpy arrays are filled in place (shape and dtype as
    saved) and its other values replaced by the saved ones, and the mapping returned.
    """
    if kind == "torch":
        import xckpt.torch as xt

        return xt.load(location, target, process_group=process_group, **options)
    if kind == "jax":
        import xckpt.jax as xj

        return xj.load(location, target, **options)
    if target is None:
        with opened(location, **options) as src:
            out: dict[str, Any] = dict(src.read_all())
            out.update(src.objects(per_rank="list"))
        return out
    if not isinstance(target, Mapping):
        raise XckptError(
            f"restore target is a {type(target).__name__}: pass a torch state dict, a JAX pytree, a mapping "
            "of names to numpy arrays, or None (every tensor and object by name)"
        )
    with opened(location, **options) as src:
        tensors, objects = set(src.names()), set(src.object_names())
        missing = [n for n in target if n not in tensors and n not in objects]
        if missing:
            raise MissingEntryError(
                f"checkpoint {src.path!r} lacks {missing[:10]}{' ...' if len(missing) > 10 else ''}, which "
                f"the restore target asks for; it holds {sorted(tensors | objects)[:10]}. Drop them from the "
                "target, or restore another step"
            )
        arrays = [(n, v) for n, v in target.items() if isinstance(v, np.ndarray) and n in tensors]
        src.read_into([(n, Box.full(src.info(n).shape), v) for n, v in arrays])
        filled: dict[str, Any] = {}
        for n in target:
            if n in objects:
                filled.update(src.objects([n], per_rank="list"))
            elif not isinstance(target[n], np.ndarray):
                filled[n] = src.read(n)  # a tensor where the caller holds a placeholder
    if isinstance(target, dict):
        target.update(filled)
        return target
    return {**target, **filled}
