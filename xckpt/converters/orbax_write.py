"""orbax output of `xckpt.convert`: a pytree checkpoint written directly, chunk by chunk.

orbax's own writer (`StandardCheckpointer().save`) needs every array in memory
as a `jax.Array`; this writer lays out what its restore reads (orbax 0.12.8,
REFERENCE.md sections 3 and 9) with tensorstore and json alone, no jax or orbax:

* one OCDBT database at the root (`manifest.ocdbt`, `d/`), configured as
  orbax configures its own (`max_inline_value_bytes` 1024, single-file
  manifest); orbax writes per-process databases and merges them into the root,
  a converter writes from one process straight into the root. A reproducible
  output (`write_orbax(job, reproducible=True)`, what a parallel conversion
  writes) uses orbax's non-OCDBT layout instead, a zarr directory per leaf,
  because OCDBT names its data files at random and timestamps its versions;
* a zarr v2 array per leaf at key `<param name>/` (`.zarray`, chunk keys
  `i.j`), zstd level 1 and `fill_value: null`, as orbax's v0 handlers write
  by default; every chunk is stored, equal to the fill value or not, as
  `_METADATA`'s `store_array_data_equal_to_fill_value: true` promises;
* `_METADATA` (the tree: `key_metadata` per level, `value_metadata` with
  `jax.Array` / `scalar` / `string` / `np.ndarray` / empty values),
  `_sharding`, `array_metadatas/process_0`, `_strings.json` (string
  leaves), `_CHECKPOINT_METADATA`; `commit_success.txt` last (the marker
  orbax checks on object stores).

Decisions (where the design is silent):

* Names become a nested tree: `a.b` -> `{"a": {"b": ...}}` (orbax's
  parameter name is the key path joined with `"."`, so the zarr keys keep the
  flat name). A name that is both a leaf and a node (`a` and `a.b`), an
  empty or `/`-holding component, or two leaves with one parameter name, is an
  [`XckptError`][xckpt.errors.XckptError] before anything is written.
* zarr chunk grid: zarr needs one regular grid per array, so per dimension the
  grid step is the gcd of the source boxes' non-zero starts (the whole extent
  when the tensor is not split along it): the uneven `Shard(0)` boxes of torch
  (multiples of `ceil(n/W)`) and orbax's own shards map one to one onto zarr
  chunks, and each box is written as whole chunks. Where that step would be
  under 1/8 of the largest box's extent (irregular splits), the step is that
  largest extent instead and boxes share chunks (tensorstore merges them
  within one transaction). Chunks larger than `MAX_CHUNK_BYTES` (16 MiB,
  xckpt's own inner chunk size) are split along their leading dimensions, by
  divisors of the step so boxes stay whole chunks (orbax likewise splits shards
  by `chunk_byte_size`): zstd holds about two copies of the chunk it is
  compressing, so this bounds the writer's memory whatever the source's boxes.
  `write_shape` in `_METADATA` is that grid.
* `_sharding`: every array on a one-device mesh of the device with id 0
  (`NamedSharding`, replicated), so `restore(path)` without a target works
  on any machine, putting each array on the first device; restoring onto a
  sharding takes a target (abstract `ShapeDtypeStruct` tree, or
  `ArrayRestoreArgs`), as orbax recommends in any case.
* `_CHECKPOINT_METADATA` names `StandardCheckpointHandler`; both
  `StandardCheckpointer` and `PyTreeCheckpointer` restore it.
* Objects: nested dicts (str keys) and lists/tuples become subtrees (tuples come
  back as lists, as orbax restores them without a target); python and numpy
  scalars become `scalar` leaves (0-d arrays, restored as python scalars);
  strings go to `_strings.json`; numpy arrays become `np.ndarray` leaves;
  `None` and empty containers are recorded as orbax records them. Anything
  else (bytes, ints outside 64 bits, custom classes) cannot be held: the object
  is dropped with a warning naming it.
* An empty selection (no tensors, no objects) is an error: orbax cannot
  restore an empty tree.
* Memory: the source is read in bands of whole grid rows of about
  `TXN_BYTES` ([`WriteJob.bands`][xckpt.sink.WriteJob.bands], recycled buffers), written into a
  tensorstore transaction committed every `TXN_BYTES`, so a large source
  chunk is never held whole: about two bands, two transactions and the zarr chunks
  being compressed (measured: 172-199 MiB of RSS growth for bench/convert.py's
  1 GiB HF directory, whose largest tensor is one 128 MiB chunk; 219-250 MiB when
  whole chunks were read).
* Speed: every array is created in a first transaction; then a full transaction
  commits (compresses) in the background while the next one fills, so two commits
  can compress at once: 1 GiB HF -> orbax 5.3-5.7 -> 3.4-5.2 s on 2 busy cores.
"""

from __future__ import annotations

import base64
import ctypes
import json
import math
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from xckpt.errors import XckptError
from xckpt.manifest import MAX_OBJECT_DEPTH, dtype_name
from xckpt.sink import Sink, WriteJob
from xckpt.storage import default_context

__all__ = ["OrbaxSink", "write_orbax", "reproducible_times", "choose_grid", "MAX_CHUNK_BYTES", "TXN_BYTES"]

FORMAT = "orbax"

#: Largest zarr chunk written; bigger ones are split along leading dimensions.
MAX_CHUNK_BYTES = 16 << 20
#: Bytes of writes held in one tensorstore transaction before it is committed.
TXN_BYTES = 16 << 20
#: OCDBT data file size (a writer-side knob; orbax uses 2 GiB on local disk).
DATA_FILE_BYTES = 256 << 20

_HANDLER = "orbax.checkpoint._src.handlers.standard_checkpoint_handler.StandardCheckpointHandler"
_DICT, _SEQ = 2, 1  # orbax's KeyType values
_SHARDING = json.dumps(
    {
        "sharding_type": "NamedSharding",
        "shape": [1],
        "axis_names": ["d"],
        "partition_spec": [],
        "device_mesh": {"mesh": [{"id": 0}]},
    }
)


class _Leaf:
    """One orbax leaf: a tensor of the source, or a value taken from an object."""

    __slots__ = ("keys", "kind", "tensor", "value", "grid", "dtype", "shape")

    def __init__(self, keys: tuple[tuple[str, int], ...], kind: str, tensor: str | None = None, value: Any = None):
        self.keys = keys  # ((name, key type), ...)
        self.kind = kind  # "jax.Array", "np.ndarray", "scalar", "string", or an empty typestr
        self.tensor = tensor
        self.value = value
        self.grid: list[int] | None = None
        self.dtype: str | None = None
        self.shape: tuple[int, ...] | None = None

    @property
    def param(self) -> str:
        return ".".join(k for k, _ in self.keys)


# -- grid ---------------------------------------------------------------------------------------


def choose_grid(shape: Sequence[int], boxes: Sequence[Any], itemsize: int, max_bytes: int = MAX_CHUNK_BYTES) -> list[int]:
    """The zarr chunk shape for a tensor stored as `boxes` (see the module docstring).

    Per dimension: the gcd of the boxes' non-zero starts, so every box is a union
    of whole chunks; the largest extent where that gcd would make chunks tiny;
    then leading dimensions divided (by factors of the step when boxes constrain
    it) until a chunk holds at most `max_bytes`. zarr forbids 0: empty dims get 1.
    """
    grid: list[int] = []
    aligned: list[bool] = []
    for d, n in enumerate(shape):
        starts = [b.offset[d] for b in boxes if b.volume and 0 < b.offset[d] < n]
        widest = max([b.shape[d] for b in boxes if b.volume] or [n])
        if not starts:
            grid.append(max(1, n))
            aligned.append(False)
            continue
        g = math.gcd(*starts)
        if g * 8 < widest:
            grid.append(max(1, widest))
            aligned.append(False)
        else:
            grid.append(g)
            aligned.append(True)
    for d in range(len(grid)):
        rest = itemsize * math.prod(grid[d + 1 :])
        if rest * grid[d] <= max_bytes:
            break
        want = max(1, max_bytes // max(1, rest))
        if aligned[d]:
            # A divisor of the step keeps boxes made of whole chunks.
            grid[d] = max(f for f in _divisors(grid[d]) if f <= want)
        else:
            pieces = -(-grid[d] // want)
            grid[d] = -(-grid[d] // pieces)
    return grid


def _divisors(n: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return small + [n // i for i in small]


# -- the tree -----------------------------------------------------------------------------------


def _split(name: str, what: str) -> tuple[tuple[str, int], ...]:
    parts = name.split(".")
    if any(p == "" for p in parts) or "/" in name:
        raise XckptError(
            f"orbax output: {what} {name!r} cannot be an orbax tree path (empty component or '/'); "
            "rename it with a rule (rules=[{'match': ..., 'rename': ...}]) or exclude it"
        )
    return tuple((p, _DICT) for p in parts)


class _Drop(Exception):
    """An object value orbax cannot hold (the object is dropped with a warning)."""


def _object_leaves(keys: tuple[tuple[str, int], ...], value: Any, depth: int = 0) -> list[_Leaf]:
    if depth > MAX_OBJECT_DEPTH:
        raise _Drop(f"nesting deeper than {MAX_OBJECT_DEPTH} levels")
    if value is None:
        return [_Leaf(keys, "None")]
    if isinstance(value, (bool, np.bool_)):
        return [_Leaf(keys, "scalar", value=np.asarray(bool(value)))]
    if isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 63):
            raise _Drop(f"the int {value} does not fit 64 bits")
        return [_Leaf(keys, "scalar", value=np.asarray(value, dtype=np.int64))]
    if isinstance(value, float):
        return [_Leaf(keys, "scalar", value=np.asarray(value, dtype=np.float64))]
    if isinstance(value, np.generic) or isinstance(value, np.ndarray):
        arr = np.asarray(value)
        try:
            dtype_name(arr.dtype)
        except XckptError:
            raise _Drop(f"numpy dtype {arr.dtype} has no zarr equivalent") from None
        return [_Leaf(keys, "scalar" if isinstance(value, np.generic) else "np.ndarray", value=arr)]
    if isinstance(value, str):
        if any("~" in k for k, _ in keys):
            raise _Drop("a string under a key holding '~' (orbax reads strings by JSON pointer)")
        return [_Leaf(keys, "string", value=value)]
    if isinstance(value, Mapping):
        if not value:
            return [_Leaf(keys, "Dict")]
        out = []
        for k, v in value.items():
            if not isinstance(k, str) or k == "" or "/" in k:
                raise _Drop(f"dict key {k!r} (orbax dict keys are non-empty strings without '/')")
            out.extend(_object_leaves(keys + ((k, _DICT),), v, depth + 1))
        return out
    if isinstance(value, (list, tuple)):
        if not value:
            return [_Leaf(keys, "List")]
        out = []
        for i, v in enumerate(value):
            out.extend(_object_leaves(keys + ((str(i), _SEQ),), v, depth + 1))
        return out
    raise _Drop(f"a value of type {type(value).__name__}")


def _plan(job: WriteJob, *, warn: bool) -> list[_Leaf]:
    """Every leaf, checked: no name both a leaf and a node, no parameter name twice, not
    empty. With `warn`, a warning names the objects orbax cannot hold (they are dropped)."""
    leaves = [_Leaf(_split(n, "tensor"), "jax.Array", tensor=n) for n in job.names]
    dropped = []
    for name, value in job.objects.items():
        keys = _split(name, "object")
        try:
            leaves.extend(_object_leaves(keys, value))
        except _Drop as e:
            dropped.append(f"{name!r} ({e})")
    if dropped and warn:
        warnings.warn(
            f"orbax output of {job.src.path!r}: dropping objects orbax cannot hold: {', '.join(dropped)}; "
            "convert to xckpt or torch-dcp to keep them",
            UserWarning,
            stacklevel=4,
        )
    if not leaves:
        raise XckptError(
            f"orbax output of {job.src.path!r}: nothing to write (no tensors or objects selected); "
            "orbax cannot restore an empty tree. Check include/exclude"
        )
    paths: dict[tuple[str, ...], _Leaf] = {}
    params: dict[str, _Leaf] = {}
    for leaf in leaves:
        path = tuple(k for k, _ in leaf.keys)
        what = leaf.tensor if leaf.tensor is not None else leaf.param
        if path in paths or leaf.param in params:
            other = paths.get(path) or params[leaf.param]
            raise XckptError(
                f"orbax output: {what!r} and {other.tensor or other.param!r} are the same orbax parameter "
                f"{leaf.param!r}; rename one with a rule or exclude it"
            )
        paths[path] = leaf
        params[leaf.param] = leaf
    for path, leaf in paths.items():
        for i in range(1, len(path)):
            if path[:i] in paths:
                node = paths[path[:i]]
                raise XckptError(
                    f"orbax output: {node.tensor or node.param!r} is a leaf and also a node of "
                    f"{leaf.tensor or leaf.param!r} (orbax nests names at '.'); rename one with a rule "
                    "or exclude it"
                )
    return sorted(leaves, key=_order)


def _order(leaf: _Leaf) -> tuple:
    # jax flattens dicts in sorted key order and sequences by index.
    return tuple((int(k), "") if t == _SEQ else (-1, k) for k, t in leaf.keys)


# -- writing ------------------------------------------------------------------------------------


class _Txn:
    """A tensorstore transaction committed every `TXN_BYTES` of writes.

    A full transaction is committed in the background while the next one fills;
    before committing that one, the previous commit is waited for. So two commits
    (their zstd compression, on tensorstore's threads) can run at once, and at
    most two transactions' writes are held.
    """

    def __init__(self, ts: Any) -> None:
        self._ts = ts
        self.txn = ts.Transaction()
        self._pending = 0
        self._committing: Any = None

    def add(self, nbytes: int) -> None:
        self._pending += nbytes
        if self._pending >= TXN_BYTES:
            self.commit(wait=False)

    def commit(self, *, wait: bool = True) -> None:
        fut = self.txn.commit_async()
        self.txn = self._ts.Transaction()
        self._pending = 0
        self._wait()
        self._committing = fut
        if wait:
            self._wait()

    def _wait(self) -> None:
        if self._committing is not None:
            fut, self._committing = self._committing, None
            fut.result()
            _trim()

    def abandon(self) -> None:
        """After a failure: let a background commit finish, so nothing writes under the
        output once the driver removes it (its own error is the lesser one)."""
        fut, self._committing = self._committing, None
        if fut is not None:
            try:
                fut.result()
            except (ValueError, OSError):
                pass


def _trim() -> None:
    """Return freed memory to the OS (glibc only).

    tensorstore compresses on its worker threads, whose freed buffers stay in
    per-thread malloc arenas: without this, resident memory grows by a few MiB
    per commit (measured: 126 MiB after 16 commits of 16 MiB, 64 MiB with it).
    """
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - glibc only
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None


def _array_spec(kv: dict[str, Any], param: str, dtype: str, shape: Sequence[int], grid: Sequence[int]) -> dict[str, Any]:
    return {
        "driver": "zarr",
        "kvstore": {**kv, "path": kv["path"] + param + "/"} if kv["driver"] == "file" else {**kv, "path": param + "/"},
        "metadata": {
            "dtype": _zarr_dtype(dtype),
            "shape": list(shape),
            "chunks": list(grid),
            "compressor": {"id": "zstd", "level": 1},
            "dimension_separator": ".",
            "fill_value": None,
            "filters": None,
            "order": "C",
        },
        "store_data_equal_to_fill_value": True,
        "create": True,
    }


def _zarr_dtype(dtype: str) -> str:
    # zarr v2 names: numpy's typestr, tensorstore's extension names for bf16 and float8.
    if dtype == "bfloat16" or dtype.startswith("float8"):
        return dtype
    return np.dtype(dtype).str


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _value_metadata(leaf: _Leaf) -> dict[str, Any]:
    if leaf.kind in ("None", "Dict", "List"):
        return {"value_type": leaf.kind, "skip_deserialize": True}
    vm: dict[str, Any] = {"value_type": leaf.kind, "skip_deserialize": False}
    if leaf.kind == "jax.Array":
        vm["write_shape"] = list(leaf.grid or [])
    return vm


class OrbaxSink(Sink):
    """An orbax pytree checkpoint (OCDBT, zarr v2 leaves), as `StandardCheckpointer` writes one."""

    format = FORMAT

    def check(self, job: WriteJob) -> None:
        """Names nest into a tree (no name both a leaf and a node, no two names one parameter)
        and the tree is not empty; objects orbax cannot hold are named in a warning (dropped).

        Raises:
            XckptError: a name cannot be an orbax tree path, or two names collide.
        """
        _plan(job, warn=True)

    def write(self, job: WriteJob) -> None:
        """orbax's default layout: one OCDBT database (see `write_orbax`)."""
        write_orbax(job)


def reproducible_times() -> tuple[int | None, int | None]:
    """`_CHECKPOINT_METADATA`'s (init, commit) timestamps of a reproducible output:
    `SOURCE_DATE_EPOCH` (seconds; the reproducible-builds convention) when set, else None
    (orbax's "not recorded", which it reads as such).

    Raises:
        XckptError: `SOURCE_DATE_EPOCH` is set but not a non-negative integer.
    """
    v = os.environ.get("SOURCE_DATE_EPOCH")
    if v is None or v == "":
        return None, None
    if not v.isdigit():
        raise XckptError(
            f"SOURCE_DATE_EPOCH={v!r} is not a number of seconds since 1970 (a non-negative integer); set it "
            "to one (e.g. the source's commit time, `git log -1 --format=%ct`) or unset it"
        )
    t = int(v) * 1_000_000_000
    return t, t


def write_orbax(job: WriteJob, *, reproducible: bool = False) -> None:
    """Write `job` as an orbax pytree checkpoint at `job.dst`: arrays created, then filled
    band by band in transactions; the tree's metadata files after the data,
    `commit_success.txt` last.

    Args:
        job: what to write.
        reproducible: the same source converted the same way gives the same bytes. OCDBT
            cannot (tensorstore names its data files at random and stamps each version
            with its commit time), so each leaf is its own zarr directory
            (`<param name>/.zarray`, `<param name>/i.j`, `use_ocdbt: false`: orbax's
            non-OCDBT layout, which it detects by the absence of `manifest.ocdbt`);
            `_CHECKPOINT_METADATA`'s timestamps come from `reproducible_times`, and
            `commit_success.txt` names no path.
    """
    import tensorstore as ts  # imported when used, as the storage layer does (import time)

    leaves = _plan(job, warn=False)
    init, fixed = time.time_ns(), reproducible_times() if reproducible else None
    dst = os.path.abspath(job.dst)
    os.makedirs(dst)
    if reproducible:
        kv: dict[str, Any] = {"driver": "file", "path": dst + "/"}
    else:
        kv = {
            "driver": "ocdbt",
            "base": {"driver": "file", "path": dst + "/"},
            "config": {"max_inline_value_bytes": 1024, "max_decoded_node_bytes": 100000000, "manifest_kind": "single"},
            "target_data_file_size": DATA_FILE_BYTES,
        }
    ctx = default_context()
    txn = _Txn(ts)
    # Every tensor's array is created in the first transaction, committed before any data
    # is written: a handle of a committed transaction can be bound to each later one.
    opened = {}
    for leaf in leaves:
        if leaf.tensor is not None:  # a jax.Array leaf
            t = job.info(leaf.tensor)
            leaf.dtype, leaf.shape = t.dtype, tuple(t.shape)
            leaf.grid = choose_grid(t.shape, t.boxes, t.np_dtype.itemsize, MAX_CHUNK_BYTES)
            spec = _array_spec(kv, leaf.param, t.dtype, t.shape, leaf.grid)
            opened[leaf.param] = ts.open(spec, context=ctx, transaction=txn.txn)
    handles = {param: fut.result() for param, fut in opened.items()}
    strings: dict[str, str] = {}
    try:
        for leaf in leaves:
            if leaf.kind == "string":
                strings[leaf.param] = leaf.value
            elif leaf.kind in ("scalar", "np.ndarray"):
                arr = leaf.value
                leaf.dtype, leaf.shape, leaf.grid = dtype_name(arr.dtype), arr.shape, [max(1, s) for s in arr.shape]
                spec = _array_spec(kv, leaf.param, leaf.dtype, arr.shape, leaf.grid)
                store = ts.open(spec, context=ctx, transaction=txn.txn).result()
                store.write(arr).result()
                txn.add(arr.nbytes)
        txn.commit()
        for leaf in leaves:
            if leaf.tensor is not None:
                _write_tensor(job, leaf.tensor, leaf, handles.pop(leaf.param), txn)
        txn.commit()
    except BaseException:
        txn.abandon()
        raise

    _write_tree_metadata(dst, leaves, strings, fixed or (init, time.time_ns()), ocdbt=not reproducible)
    with open(os.path.join(dst, "commit_success.txt"), "w") as f:
        f.write("Checkpoint commit was successful" if reproducible else f"Checkpoint commit was successful to {dst}")


def _write_tree_metadata(
    dst: str, leaves: list[_Leaf], strings: dict[str, str], times: tuple[int | None, int | None], *, ocdbt: bool
) -> None:
    """orbax's files beside the data, as its own PyTreeCheckpointHandler writes them:
    `_strings.json`, `_sharding`, `array_metadatas/`, `_METADATA`, `_CHECKPOINT_METADATA`."""
    if strings:
        _write_json(os.path.join(dst, "_strings.json"), strings)
    arrays = [leaf for leaf in leaves if leaf.kind == "jax.Array"]
    _write_json(
        os.path.join(dst, "_sharding"),
        {base64.urlsafe_b64encode(leaf.param.encode()).decode(): _SHARDING for leaf in arrays},
    )
    os.makedirs(os.path.join(dst, "array_metadatas"))
    _write_json(
        os.path.join(dst, "array_metadatas", "process_0"),
        {
            "array_metadatas": [
                {
                    "array_metadata": {
                        "param_name": leaf.param,
                        "write_shape": leaf.grid,
                        "chunk_shape": leaf.grid,
                        "ext_metadata": None,
                    }
                }
                for leaf in arrays
            ]
        },
    )
    tree = {
        str(tuple(k for k, _ in leaf.keys)): {
            "key_metadata": [{"key": k, "key_type": t} for k, t in leaf.keys],
            "value_metadata": _value_metadata(leaf),
        }
        for leaf in leaves
    }
    _write_json(
        os.path.join(dst, "_METADATA"),
        {
            "tree_metadata": tree,
            "use_ocdbt": ocdbt,
            "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True,
            "custom_metadata": None,
        },
    )
    _write_json(
        os.path.join(dst, "_CHECKPOINT_METADATA"),
        {
            "item_handlers": _HANDLER,
            "metrics": {},
            "performance_metrics": {},
            "init_timestamp_nsecs": times[0],
            "commit_timestamp_nsecs": times[1],
            "custom_metadata": {},
        },
    )


def _write_tensor(job: WriteJob, name: str, leaf: _Leaf, base: Any, txn: _Txn) -> None:
    """Write tensor `name`'s chunks through `base` (its array, created in a committed transaction)."""
    if 0 in (leaf.shape or ()):
        # zarr stores nothing for an empty array; orbax restores it from .zarray alone.
        return
    arr: Any = None
    bound: Any = None
    # Bands of whole grid rows of about TXN_BYTES (starting on each chunk's own offset, so aligned
    # boxes stay whole zarr chunks), read one at a time into recycled buffers: each is written
    # (copied into the transaction) before the next is asked for, so a large source chunk is
    # never in memory whole.
    step0 = leaf.grid[0] if leaf.grid else 1
    for _chunk, offset, piece in job.bands(name, max_bytes=TXN_BYTES, multiple=step0):
        if bound is not txn.txn:  # a new transaction since the last write
            arr, bound = base.with_transaction(txn.txn), txn.txn
        box = tuple(slice(o, o + n) for o, n in zip(offset, piece.shape))
        arr[box].write(piece).result()
        job.bar.update(piece.nbytes)
        txn.add(piece.nbytes)
        del piece  # before the next band is read
