"""orbax checkpoints as an xckpt source (format `orbax`), read with tensorstore alone.

Neither jax nor orbax is imported: the layout is read from what is on disk
(REFERENCE.md sections 3 and 9). What is read:

* one pytree item (`StandardCheckpointer`, `PyTreeCheckpointer`): arrays in
  an OCDBT database (`manifest.ocdbt` + `d/`, per-process databases
  `ocdbt.process_<i>/` merged into the root) or one zarr directory per leaf
  (`use_ocdbt=False`); zarr v2 (`.zarray`) and zarr3 (`zarr.json`) alike;
* a composite checkpoint (a `CheckpointManager` step: items in subdirectories):
  each item's names are prefixed by the item's name (`state.b.c`). An item's
  directory opened alone has bare names (`b.c`), and so has a step holding
  only the `default` item (a manager saving one unnamed item), as orbax's
  `restore` returns that tree bare.

Decisions (where the design is silent, what an orbax user would expect):

* Names are orbax's parameter names: the key path joined with `"."`. Each
  zarr chunk of an array is one box, so a reader of a slice opens only the zarr
  chunks it touches. A chunk's `rank` is the process whose OCDBT database
  lists its key (several `ocdbt.process_<i>`), else 0.
* orbax's metadata files are helpers, not the truth: the tensors are the
  arrays the OCDBT database lists (or the zarr directories present);
  `_METADATA` tells python scalars, strings and empty containers (objects)
  from arrays. Without it a python scalar reads as a 0-d tensor. A
  `_METADATA` entry whose array is absent, a missing `manifest.ocdbt` or
  `d/`, or a missing zarr chunk is an
  [`IncompleteCheckpointError`][xckpt.errors.IncompleteCheckpointError] at open (chunks are checked
  against the keys stored, so nothing reads as zeros); bytes that do not
  decode are a [`CorruptChunkError`][xckpt.errors.CorruptChunkError] at read. Only an item
  whose `_METADATA` says `store_array_data_equal_to_fill_value: false`
  (an older orbax, which skipped chunks equal to the fill value) reads missing
  chunks as the fill value, as orbax itself does.
* `_sharding` becomes `TensorEntry.placement` (`framework="jax"`) for
  a `NamedSharding`; other shardings go to `metadata["shardings"]`.
* Objects: python scalars (stored by orbax as 0-d zarr arrays) as python
  `int`/`float`/`bool`; strings from `_strings.json`; empty containers
  and `None` as saved; a JSON item (`JsonCheckpointHandler`'s `metadata`
  file) flattened into one object per leaf (`extra.x`). Items of other
  handlers are skipped with a warning and listed in `metadata["skipped_items"]`.
* A dtype outside `xckpt.manifest.DTYPES` (int4, strings, structured) is
  an [`XckptError`][xckpt.errors.XckptError] at open naming the tensor.
* A directory of numbered steps (a `CheckpointManager` root) is an
  [`XckptError`][xckpt.errors.XckptError] that lists the steps: open one of them.
"""

from __future__ import annotations

import ast
import base64
import copy
import json
import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from itertools import product
from types import EllipsisType
from typing import Any, NamedTuple

import numpy as np

from xckpt.errors import CorruptChunkError, IncompleteCheckpointError, ManifestError, XckptError
from xckpt.layout import check_coverage
from xckpt.manifest import DTYPES, Chunk, PlacementInfo, TensorEntry, numpy_dtype
from xckpt.source import ChunkRead, Source, whole_request
from xckpt.storage import Place, as_place, corrupt, default_context

from ._nesting import KeyPath, group_by_prefix, nest

__all__ = ["FORMAT", "detect", "open", "OrbaxCheckpoint"]

FORMAT = "orbax"

#: Files whose presence marks an orbax item (a pytree's directory).
_ITEM_MARKS = ("_METADATA", "_sharding", "array_metadatas", "manifest.ocdbt", "_strings.json")
_STEP_RE = re.compile(r"^(?:.*_)?(\d+)$")
_ZARR_META = {".zarray": "zarr", "zarr.json": "zarr3"}
_EMPTY: dict[str, Any] = {"None": None, "Dict": {}, "List": [], "Tuple": (), "NamedTuple": ()}
#: The file of a JSON item: JsonCheckpointHandler's default name (v0), the v1 handler's.
_JSON_ITEM_FILES = ("metadata", "data.json")
#: Chunks an array may claim beyond those stored (an old orbax skipped fill-value chunks).
_MAX_SPARSE_CHUNKS = 1 << 24
_OCDBT_NODE_CACHE = 64 << 20
_OCDBT_DATA_DIRS = ("d", "ocdbt_data", "ocdbt_meta")


def _process_dirs(d: Place, entries: Sequence[str]) -> dict[int, str]:
    """`ocdbt.process_<i>` directories by process index."""
    out = {}
    for e in entries:
        m = re.fullmatch(r"ocdbt\.process_(\d+)", e)
        if m and d.isdir(e):
            out[int(m.group(1))] = e
    return out


def _is_item(d: Place) -> bool:
    """A pytree item: orbax's files, an OCDBT database, or zarr arrays in subdirectories."""
    entries = d.entries()
    if any(e in entries for e in _ITEM_MARKS) or _process_dirs(d, entries):
        return True
    return any(_zarr_meta_file(d, e) for e in entries)


def _zarr_meta_file(d: Place, rel: str = "") -> str | None:
    for f in _ZARR_META:
        if d.isfile(f"{rel}/{f}" if rel else f):
            return f
    return None


def _json_item_file(d: Place) -> str | None:
    """The file of a JSON item in `d` (the v0 handler's `metadata`, the v1 one's `data.json`)."""
    return next((f for f in _JSON_ITEM_FILES if d.isfile(f)), None)


def _subdirs(d: Place) -> list[str]:
    return [e for e in d.entries() if not e.startswith(".") and "orbax-checkpoint-tmp" not in e and d.isdir(e)]


def _is_step(d: Place) -> bool:
    """A checkpoint (item, or items in subdirectories) as a manager's step holds it."""
    if d.isfile("_CHECKPOINT_METADATA") or _is_item(d):
        return True
    return any(_is_item(d.child(s)) for s in _subdirs(d))


def _manager_steps(d: Place) -> list[str]:
    """Numbered step directories (a CheckpointManager's root), in step order."""
    steps = [(int(m.group(1)), s) for s in _subdirs(d) if (m := _STEP_RE.match(s)) and _is_step(d.child(s))]
    return [s for _, s in sorted(steps, key=lambda p: p[0])]


def detect(path: str | Place) -> bool:
    """`_METADATA` / `_CHECKPOINT_METADATA` (or orbax's other files) here or in item
    subdirectories, or a manager root of such steps (so that opening it says what to do),
    at any location that can be listed."""
    d = as_place(path)
    try:
        if not d.listable or d.kind() != "dir":
            return False
        if "_CHECKPOINT_METADATA" in d.entries() or _is_item(d):
            return True
        if any(_is_item(d.child(s)) for s in _subdirs(d)):
            return True
        return bool(_manager_steps(d))
    except XckptError:
        return False


def open(path: str | Place, *, allow_pickle: bool = False) -> OrbaxCheckpoint:  # noqa: A001
    """Open the orbax checkpoint (a step, or one item) at `path`: a local directory, a kvstore
    URL or spec (an S3-compatible endpoint, `gs://`, `memory://`).

    `allow_pickle` is accepted for the common signature; orbax stores no pickles.
    """
    return OrbaxCheckpoint(path)


def _read_json(d: Place, rel: str, what: str) -> Any:
    """The parsed JSON file `rel` in `d`, or None when it does not exist."""
    try:
        data = d.read(rel)
    except XckptError as e:
        raise XckptError(f"orbax checkpoint: cannot read {what} in {d.name!r}: {e}") from None
    if data is None:
        return None
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        shown = f"{d.name}/{rel}" if d.local is None else os.path.join(d.name, rel)
        raise ManifestError(f"orbax checkpoint: {what} {shown!r} is not valid JSON ({e}); the file is damaged") from None


def _dtype_of(meta: Mapping[str, Any], driver: str) -> str | None:
    """The xckpt dtype name of a zarr array's metadata, or None when xckpt cannot hold it."""
    raw = meta.get("dtype") if driver == "zarr" else meta.get("data_type")
    if not isinstance(raw, str):
        return None
    if raw in DTYPES:
        return raw
    if driver == "zarr":
        try:
            dt = np.dtype(raw)
        except (TypeError, ValueError):
            return None
        if dt.kind in "biufc" and dt.name in DTYPES:
            return dt.name
    return None


def _grid(meta: Mapping[str, Any], driver: str, shape: tuple[int, ...], where: str) -> tuple[int, ...]:
    if driver == "zarr":
        grid = meta.get("chunks")
    else:
        cg = meta.get("chunk_grid")
        conf = cg.get("configuration") if isinstance(cg, dict) and cg.get("name") == "regular" else None
        grid = conf.get("chunk_shape") if isinstance(conf, dict) else None
    if (
        not isinstance(grid, list)
        or len(grid) != len(shape)
        or not all(type(g) is int and g > 0 for g in grid)
    ):
        raise ManifestError(f"{where}: zarr metadata has no regular chunk grid for shape {shape}")
    return tuple(grid)


def _key_scheme(meta: Mapping[str, Any], driver: str, where: str) -> tuple[str, str]:
    """How chunk keys are spelled: (`"v2"` ("0.1"; "0" when 0-d) or `"default"` ("c/0/1"), separator)."""
    kind: object
    sep: object
    if driver == "zarr":
        kind, sep = "v2", meta.get("dimension_separator", ".")
        sep = "." if sep is None else sep
    else:
        enc = meta.get("chunk_key_encoding", {"name": "default"})
        kind = enc.get("name") if isinstance(enc, dict) else None
        conf = enc.get("configuration") if isinstance(enc, dict) else None
        sep = (conf if isinstance(conf, dict) else {}).get("separator", "." if kind == "v2" else "/")
    known = kind in ("v2", "default") and sep in (".", "/")
    if not (isinstance(kind, str) and isinstance(sep, str) and known):
        raise ManifestError(f"{where}: unknown zarr chunk key encoding {kind!r} / separator {sep!r:.20}")
    return kind, sep


def _chunk_key(kind: str, sep: str, idx: tuple[int, ...]) -> str:
    """The zarr key of chunk `idx` inside its array's directory."""
    if kind == "v2":
        return sep.join(map(str, idx)) if idx else "0"
    return "c" + "".join(sep + str(i) for i in idx)


def _placement(raw: Any, ndim: int) -> tuple[PlacementInfo | None, Any]:
    """A NamedSharding's provenance, or (None, the parsed value) for any other sharding."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None, raw
    if not isinstance(raw, dict) or raw.get("sharding_type") != "NamedSharding":
        return None, raw
    try:
        spec: list[Any] = []
        for e in raw.get("partition_spec") or []:
            if e is None or isinstance(e, str):
                spec.append(e)
            else:
                axes = tuple(str(a) for a in e)
                spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        spec.extend([None] * (ndim - len(spec)))
        mesh_shape = tuple(int(s) for s in raw["shape"])
        names = tuple(str(a) for a in raw["axis_names"])
        pi = PlacementInfo(framework="jax", mesh_shape=mesh_shape, axis_names=names, partition_spec=(*spec,))
        return pi, None
    except (KeyError, TypeError, ValueError):
        return None, raw


class _Array(NamedTuple):
    """Where one tensor's (or scalar's) zarr array lives: its tensorstore spec, and its name for messages."""

    spec: dict[str, Any]
    where: str


class OrbaxCheckpoint(Source):
    """An orbax checkpoint (one item, or a composite step) read through the Source protocol."""

    format = FORMAT

    def __init__(self, path: str | Place) -> None:
        d = as_place(path)
        self._place = d
        self.path = d.name
        self._entries: dict[str, TensorEntry] = {}
        self._arrays: dict[str, _Array] = {}
        # Object leaves: name -> (key path, ("value", v) | ("scalar", _Array)); grouped into
        # objects (a tensor-free subtree is one object) once every item is read.
        self._leaves: dict[str, tuple[KeyPath, tuple[str, Any]]] = {}
        self._tensor_paths: list[KeyPath] = []
        self._objects: dict[str, list[tuple[KeyPath, str]]] = {}
        self._stores: dict[str, Any] = {}
        self._world = 1
        self._meta: dict[str, Any] = {}
        self._ts: Any = None
        if d.kind() != "dir" or not d.listable:
            raise XckptError(
                f"{self.path!r} is not a directory: an orbax checkpoint is a directory holding _METADATA "
                "(or a CheckpointManager step holding item directories)"
                + ("; an http(s) location cannot be listed" if not d.listable else "")
            )
        if "orbax-checkpoint-tmp" in d.base:
            raise IncompleteCheckpointError(
                f"{self.path!r} is an unfinished orbax save (orbax renames its temporary directory when the "
                "save commits): wait for the save to finish, or open the last committed step"
            )
        import tensorstore as ts

        self._ts = ts
        # B-tree nodes of OCDBT databases are cached (as orbax does); chunk data is not.
        cache = {"cache_pool#ocdbt": {"total_bytes_limit": _OCDBT_NODE_CACHE}}
        self._context = ts.Context(cache, parent=default_context())
        ckpt_meta = _read_json(d, "_CHECKPOINT_METADATA", "_CHECKPOINT_METADATA")
        if isinstance(ckpt_meta, dict):
            self._meta["checkpoint_metadata"] = ckpt_meta
        subs = _subdirs(d)
        if _is_item(d):
            self._load_item(d, "", "", ())
        elif ckpt_meta is None and _manager_steps(d):
            self._not_orbax()  # a manager's root: say which steps to open
        elif _json_item_file(d) and not any(_is_item(d.child(s)) for s in subs):
            self._load_json_item(d, "")  # a JSON item's directory opened alone
        else:
            self._load_items(subs, ckpt_meta)
        leaves = {n: p for n, (p, _) in self._leaves.items()}
        self._objects = group_by_prefix(leaves, self._tensor_paths, f"orbax checkpoint {self.path!r}")

    def _load_items(self, subs: list[str], ckpt_meta: Any) -> None:
        """The items of a composite step (one subdirectory each).

        An item `_CHECKPOINT_METADATA` does not register (its `item_handlers`) whose metadata
        cannot be read is skipped with a warning naming it; a registered one is an error.
        """
        d = self._place
        items = [s for s in subs if _is_item(d.child(s))]
        json_items = [s for s in subs if s not in items and _json_item_file(d.child(s))]
        if not items and not json_items:
            self._not_orbax()
        handlers = ckpt_meta.get("item_handlers") if isinstance(ckpt_meta, dict) else None
        registered = set(handlers) if isinstance(handlers, dict) else None
        damaged: list[str] = []
        for s in list(items):
            if registered is not None and s not in registered:
                try:
                    _read_json(d.child(s), "_METADATA", "_METADATA")
                except ManifestError as e:
                    damaged.append(s)
                    items.remove(s)
                    warnings.warn(
                        f"orbax checkpoint {self.path!r}: item {s!r} is not registered in "
                        f"_CHECKPOINT_METADATA's item_handlers ({sorted(registered)}) and cannot be read "
                        f"({e}); it is skipped, the registered items are read",
                        stacklevel=6,  # xckpt.open's caller
                    )
        # A manager step of one unnamed item ("default"): orbax restores its tree bare.
        bare = items + json_items == ["default"]
        for s in items:
            self._load_item(d.child(s), "" if bare else s + ".", s, () if bare else (s,))
        for s in json_items:
            self._load_json_item(d.child(s), "" if bare else s)
        skipped = sorted(set(subs) - set(items) - set(json_items) - set(damaged))
        if damaged:
            self._meta["skipped_items"] = sorted(skipped + damaged)
        if skipped:
            self._meta["skipped_items"] = sorted(skipped + damaged)
            warnings.warn(
                f"orbax checkpoint {self.path!r}: items {skipped} are neither pytrees nor JSON; they "
                "are not read (restore them with orbax)",
                stacklevel=6,
            )

    def _not_orbax(self) -> None:
        d = self._place
        steps = _manager_steps(d)
        if steps:
            raise XckptError(
                f"{self.path!r} is a CheckpointManager's root holding steps {steps}, not one "
                f"checkpoint: open one step, e.g. xckpt.open({d.child(steps[-1]).name!r})"
            )
        entries = d.entries()
        raise XckptError(
            f"{self.path!r} holds no orbax checkpoint (found {entries[:12] or 'an empty directory'}): "
            "an orbax checkpoint directory holds _METADATA and its arrays (manifest.ocdbt and d/, or "
            "one zarr directory per array), or item directories holding them. Check the path, or "
            "open it without format= to detect its format"
        )

    # -- opening ----------------------------------------------------------------

    def _leaf(self, name: str, path: KeyPath, value: tuple[str, Any]) -> None:
        self._leaves[name] = (path, value)

    def _load_item(self, d: Place, prefix: str, rel: str, item: KeyPath) -> None:
        """The pytree item in `d` (`rel` below the checkpoint), its names prefixed by
        `prefix` and its key paths by `item`."""
        where = f"orbax checkpoint {self.path!r}" + (f", item {prefix[:-1]!r}" if prefix else "")
        meta = _read_json(d, "_METADATA", "_METADATA")
        meta = meta if isinstance(meta, dict) else {}
        entries = d.entries()
        procs = _process_dirs(d, entries)
        use_ocdbt = meta.get("use_ocdbt")
        if use_ocdbt is None:
            use_ocdbt = "manifest.ocdbt" in entries or bool(procs)
        # orbax >= 0.6 stores every chunk; only an older orbax skipped fill-value chunks.
        fill_missing = meta.get("store_array_data_equal_to_fill_value") is False
        info = {k: meta[k] for k in ("use_ocdbt", "use_zarr3", "custom_metadata") if k in meta}
        if info:
            self._meta.setdefault("items", {})[prefix[:-1]] = info
        owners: dict[str, int] = {}
        if use_ocdbt:
            arrays = self._ocdbt_arrays(d, entries, procs, owners, where)
        else:
            arrays = self._dir_arrays(d, where)
        n_meta = len(d.entries("array_metadatas"))
        self._world = max(self._world, len(procs), n_meta, 1)
        shardings = _read_json(d, "_sharding", "_sharding")
        shardings = shardings if isinstance(shardings, dict) else {}
        strings = _read_json(d, "_strings.json", "_strings.json")
        strings = strings if isinstance(strings, dict) else {}

        # _METADATA's leaves tell objects from arrays; arrays it does not list are still tensors.
        scalars: set[str] = set()
        order: dict[str, int] = {}  # names follow the tree's order where _METADATA gives it
        paths: dict[str, KeyPath] = {}
        tree = meta.get("tree_metadata")
        for key, leaf in tree.items() if isinstance(tree, dict) else ():
            param, ppath = _param_name(key, leaf), _param_path(key, leaf)
            order.setdefault(param, len(order))
            paths.setdefault(param, ppath)
            vm = leaf.get("value_metadata") if isinstance(leaf, dict) else None
            vm = vm if isinstance(vm, dict) else {}
            vtype = vm.get("value_type") if isinstance(vm.get("value_type"), str) else None
            if vtype in _EMPTY:  # no data: orbax rebuilds these from _METADATA alone
                self._leaf(prefix + param, item + ppath, ("value", _EMPTY[vtype]))
            elif vm.get("skip_deserialize"):
                continue
            elif vtype == "string":
                if param not in strings:
                    raise IncompleteCheckpointError(
                        f"{where}: _METADATA lists the string {param!r} but _strings.json does not "
                        "hold it; the checkpoint is incomplete: restore _strings.json from a copy"
                    )
                self._leaf(prefix + param, item + ppath, ("value", strings[param]))
            elif param not in arrays:
                held = "the OCDBT database" if use_ocdbt else repr(d.child(param).name)
                raise IncompleteCheckpointError(
                    f"{where}: _METADATA lists {param!r} ({vtype}) but its array is missing from "
                    f"{held}; the checkpoint is incomplete: restore it from a copy or load another step"
                )
            elif vtype == "scalar":
                scalars.add(param)
        for param in sorted(arrays, key=lambda p: order.get(p, len(order))):
            kv, driver, zmeta, stored = arrays[param]
            name = prefix + param
            path = item + paths.get(param, tuple(param.split(".")))
            spec = {"driver": driver, "kvstore": kv, "fill_missing_data_reads": fill_missing}
            arr = _Array(spec, f"{where}, {'object' if param in scalars else 'tensor'} {name!r}")
            if param in scalars:
                self._leaf(name, path, ("scalar", arr))
                continue
            raw_sh = shardings.get(base64.urlsafe_b64encode(param.encode()).decode())
            keypath = f"{rel}/{param}" if prefix else param
            self._add_tensor(name, param, keypath, (zmeta, driver, stored, fill_missing), arr, raw_sh, owners)
            self._tensor_paths.append(path)

    def _ocdbt_arrays(
        self, d: Place, entries: list[str], procs: dict[int, str], owners: dict[str, int], where: str
    ) -> dict[str, tuple[Any, str, Any, set[str]]]:
        """Arrays the item's OCDBT database lists: param -> (kvstore spec, driver, zarr
        metadata, the zarr chunk keys stored).

        Fills `owners` (chunk key -> writing process) when several processes wrote.
        """
        for sub, label in [("", "root"), *((p, p) for p in procs.values())]:
            if not sub and "manifest.ocdbt" not in entries:
                raise IncompleteCheckpointError(
                    f"{where}: the OCDBT database has no manifest.ocdbt in {d.name!r} (found {entries[:12]}); "
                    "the checkpoint is incomplete (an unfinished save?): restore it from a copy or load "
                    "another step"
                )
            here = d.child(sub) if sub else d
            has_manifest = here.isfile("manifest.ocdbt")
            # Data files live in d/ (or ocdbt_data/ + ocdbt_meta/ when orbax splits them).
            if has_manifest and not any(here.isdir(x) for x in _OCDBT_DATA_DIRS):
                raise IncompleteCheckpointError(
                    f"{where}: the {label} OCDBT database in {here.name!r} has a manifest.ocdbt but no d/ "
                    "directory (its data files); the checkpoint is incomplete: restore it from a copy"
                )
        base = d.kvstore()
        keys = self._list(base, d.name, where)
        futs = {}
        kv = self._kv(base, d.name, where)
        for k in keys:
            param, _, last = k.rpartition("/")
            if last in _ZARR_META and param:
                futs[param] = (_ZARR_META[last], kv.read(k))
        stored: dict[str, set[str]] = {p: set() for p in futs}
        for k in keys:
            # A zarr chunk key sits below its array's key (the first prefix that is an array).
            head, _, tail = k.partition("/")
            while head not in stored and "/" in tail:
                more, _, tail = tail.partition("/")
                head = f"{head}/{more}"
            if head in stored and tail not in _ZARR_META:
                stored[head].add(tail)
        arrays = {}
        for param, (driver, fut) in futs.items():
            try:
                zmeta = json.loads(fut.result().value)
            except ValueError as e:
                raise ManifestError(
                    f"{where}: the zarr metadata of {param!r} cannot be read ({_msg(e)}); the checkpoint "
                    "is damaged: restore it from a copy"
                ) from None
            kvspec = {"driver": "ocdbt", "base": base, "path": param + "/", "cache_pool": "cache_pool#ocdbt"}
            arrays[param] = (kvspec, driver, zmeta, stored[param])
        if len(procs) > 1:
            for i, p in procs.items():
                for k in self._list(d.kvstore(p), d.child(p).name, where):
                    owners[k] = i
        return arrays

    def _kv(self, base: Any, shown: str, where: str) -> Any:
        try:
            spec = {"driver": "ocdbt", "base": base, "cache_pool": "cache_pool#ocdbt"}
            return self._ts.KvStore.open(spec, context=self._context).result()
        except ValueError as e:
            raise IncompleteCheckpointError(
                f"{where}: the OCDBT database in {shown!r} cannot be opened ({_msg(e)}); the "
                "checkpoint is incomplete or damaged: restore it from a copy or load another step"
            ) from None

    def _list(self, base: Any, shown: str, where: str) -> list[str]:
        try:
            return [k.decode() for k in self._kv(base, shown, where).list().result()]
        except ValueError as e:
            raise IncompleteCheckpointError(
                f"{where}: the OCDBT database in {shown!r} cannot be read ({_msg(e)}); its data files "
                "(d/) are missing or damaged: restore the checkpoint from a copy or load another step"
            ) from None

    def _dir_arrays(self, d: Place, where: str) -> dict[str, tuple[Any, str, Any, set[str]]]:
        """Arrays stored one zarr directory per leaf (`use_ocdbt=False`)."""
        arrays = {}
        for e in _subdirs(d):
            top = d.child(e)
            f = _zarr_meta_file(top)
            if f is not None:
                zmeta = _read_json(top, f, f"zarr metadata of {e!r}")
                stored = set(top.files())
                arrays[e] = (top.kvstore(), _ZARR_META[f], zmeta, stored - set(_ZARR_META))
        return arrays

    def _load_json_item(self, d: Place, item: str) -> None:
        """A JSON item (JsonCheckpointHandler's, v0 or v1): one object `item` in a composite
        step; opened alone (or as the one `default` item), one object per top-level key."""
        f = _json_item_file(d) or _JSON_ITEM_FILES[0]
        value = _read_json(d, f, f"JSON item {item or d.name!r}")
        if item:
            self._leaf(item, (item,), ("value", value))
        elif isinstance(value, dict) and value:
            for k, v in value.items():
                self._leaf(str(k), (str(k),), ("value", v))
        else:
            self._leaf(d.base or "value", (d.base or "value",), ("value", value))

    def _add_tensor(
        self,
        name: str,
        param: str,
        keypath: str,
        stored_as: tuple[Any, str, set[str], bool],
        arr: _Array,
        raw_sh: Any,
        owners: Mapping[str, int],
    ) -> None:
        zmeta, driver, stored, fill_missing = stored_as
        where = arr.where
        if not isinstance(zmeta, dict) or not isinstance(zmeta.get("shape"), list):
            raise ManifestError(f"{where}: its zarr metadata does not describe an array ({zmeta!r:.200})")
        shape = tuple(zmeta["shape"])
        if not all(type(s) is int and s >= 0 for s in shape):
            raise ManifestError(f"{where}: zarr shape {shape} is invalid")
        dtype = _dtype_of(zmeta, driver)
        if dtype is None:
            raw = zmeta.get("dtype", zmeta.get("data_type"))
            raise XckptError(
                f"{where} has dtype {raw!r}, which xckpt cannot hold (supported: {', '.join(DTYPES)}). "
                "Re-save it with orbax as a supported dtype (e.g. int4 as int8), or restore it with orbax"
            )
        grid = _grid(zmeta, driver, shape, where)
        scheme = _key_scheme(zmeta, driver, where)
        itemsize = numpy_dtype(dtype).itemsize
        n = math.prod(-(-s // g) for s, g in zip(shape, grid))
        if n > max(_MAX_SPARSE_CHUNKS, len(stored)):  # checked before anything is enumerated
            raise IncompleteCheckpointError(
                f"{where}: its zarr metadata claims {n} chunks of {grid} for shape {shape}, but "
                f"{len(stored)} are stored; the checkpoint is incomplete or its metadata damaged: "
                "restore it from a copy or load another step"
            )
        chunks = []
        for idx in product(*(range(-(-s // g)) for s, g in zip(shape, grid))):
            off = tuple(i * g for i, g in zip(idx, grid))
            cshape = tuple(min(g, s - o) for g, s, o in zip(grid, shape, off))
            ck = _chunk_key(*scheme, idx)
            if ck not in stored and not fill_missing:
                raise IncompleteCheckpointError(
                    f"{where}: zarr chunk {ck!r} (box at {off}) is missing; orbax stores every chunk, so "
                    "the checkpoint is incomplete: restore it from a copy or load another step"
                )
            rank = owners.get(f"{param}/{ck}", 0)
            nbytes = math.prod(cshape) * itemsize
            chunks.append(Chunk(offset=off, shape=cshape, key=f"{keypath}/{ck}", rank=rank, nbytes=nbytes))
        placement, other = _placement(raw_sh, len(shape)) if raw_sh is not None else (None, None)
        if other is not None:
            self._meta.setdefault("shardings", {})[name] = other
        entry = TensorEntry(name=name, dtype=dtype, shape=shape, chunks=tuple(chunks), placement=placement)
        check_coverage(shape, entry.boxes, name, self.path)
        self._entries[name] = entry
        self._arrays[name] = arr

    # -- the read protocol ------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def metadata(self) -> Mapping[str, Any]:
        return self._meta

    def _store(self, name: str, arr: _Array) -> Any:
        fut = self._stores.get(name)
        if fut is None:
            fut = self._ts.open(arr.spec, open=True, read=True, context=self._context)
            self._stores[name] = fut
        return fut

    def _read_chunks(self, jobs: Sequence[ChunkRead], bar: Any) -> None:
        writes = []
        for name, c, req, out in jobs:
            req = req if req is not None else whole_request(c)
            where = f"{self._arrays[name].where}, chunk {c.box} ({c.key})"
            idx = tuple(slice(o + s.start, o + s.stop) for o, s in zip(c.offset, req.chunk_slices))
            try:
                src = self._store(name, self._arrays[name]).result()[idx]
            except ValueError as e:
                raise corrupt(where, e) from None
            sel: tuple[slice | EllipsisType, ...] = (*req.target_slices, Ellipsis)
            view = out[sel]  # a view even for 0-d tensors
            dst = self._ts.array(view, copy=False, write=True, context=self._context)
            # tensorstore decodes straight into the caller's buffer: no extra copy.
            writes.append((where, req.box.volume * out.itemsize, dst.write(src)))
        for where, nbytes, fut in writes:
            try:
                fut.result()
            except ValueError as e:
                raise corrupt(where, e) from None
            bar.update(nbytes)

    def object_names(self) -> list[str]:
        return list(self._objects)

    def _has_object(self, name: str) -> bool:
        return name in self._objects

    def _leaf_value(self, leaf: str) -> Any:
        kind, v = self._leaves[leaf][1]
        if kind == "scalar":
            try:
                v = self._store(leaf, v).result().read().result().item()
            except ValueError as e:
                raise corrupt(v.where, e) from None
        return copy.deepcopy(v) if isinstance(v, (dict, list)) else v

    def _object_value(self, name: str, rank: int | None) -> Any:
        """Python scalars read from their 0-d arrays, strings, JSON values, nested back into the
        tensor-free subtree they were saved in (a copy: callers may mutate)."""
        values = [(sub, self._leaf_value(leaf)) for sub, leaf in self._objects[name]]
        return nest(values, name, f"orbax checkpoint {self.path!r}")

    def _verify_objects(self) -> list[str]:
        problems = []
        for n in (n for n, (_, (kind, _)) in self._leaves.items() if kind == "scalar"):
            try:
                self._leaf_value(n)
            except CorruptChunkError as e:
                problems.append(str(e))
        return problems

    def close(self) -> None:
        self._stores.clear()


def _msg(e: Exception) -> str:
    return str(e).split("[source locations=")[0].split(" [tensorstore_spec=")[0].strip()


def _param_path(key: str, leaf: Any) -> KeyPath:
    """The key path of a `_METADATA` leaf: dict keys as strings, sequence positions as ints."""
    km = leaf.get("key_metadata") if isinstance(leaf, dict) else None
    if isinstance(km, list) and all(isinstance(k, dict) and "key" in k for k in km):
        out: list[Any] = []
        for k in km:
            raw = k["key"]
            seq = k.get("key_type") == 1 and (type(raw) is int or (isinstance(raw, str) and raw.isdigit()))
            out.append(int(raw) if seq else str(raw))
        return tuple(out)
    return tuple(_param_name(key, leaf).split("."))


def _param_name(key: str, leaf: Any) -> str:
    """orbax's parameter name of a `_METADATA` leaf: its key path joined with "."."""
    km = leaf.get("key_metadata") if isinstance(leaf, dict) else None
    if isinstance(km, list) and all(isinstance(k, dict) and "key" in k for k in km):
        return ".".join(str(k["key"]) for k in km)
    try:
        parts = ast.literal_eval(key)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return str(key)
    return ".".join(map(str, parts)) if isinstance(parts, tuple) else str(parts)


