"""Megatron-Core dist checkpoints (torch_dist backend) as an xckpt source (format `megatron`),
read without torch or Megatron, from every location a DCP checkpoint opens from (a local path,
a kvstore URL or spec).

A Megatron-Core dist checkpoint is a torch DCP directory plus `metadata.json`
(`{"sharded_backend": "torch_dist", ...}`). It is read as `torch_dcp` reads DCP
(this source *is* a `DcpSource`: same metadata parsing, byte-range chunk
reads, merging of duplicate replicas), and adds what Megatron puts around the tensors:

* tensors keep their ShardedTensor keys (`decoder.layers.self_attention.linear_qkv.weight`,
  layers stacked on a leading axis; no `model.` prefix); TP- and DP-split tensors are
  assembled by their chunk offsets, as DCP records them. The `fully_reshardable`
  distributed-optimizer state is per parameter already:
  `optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>`.
* `dp_reshardable` optimizer buckets (`optimizer.distributed.*`) are flat buffers of a
  gradient bucket's parameters laid end to end; the checkpoint does not record which
  parameter sits where (Megatron rebuilds that from the live model), so they are listed
  as the flat tensors they are, and opening warns once saying so (also in
  `metadata["notes"]`).
* common state: megatron-core 0.16 writes `common.pt` (a torch.save file); 0.19 writes the
  DCP bytes item `common_state/shard_0_1`. Either way its entries are objects by name
  (`iteration`, `checkpoint_version`, `args`, `opt_param_scheduler`, ...); an entry
  whose name is also a prefix of tensor names (`optimizer`, beside the
  `optimizer.state.*` tensors) is split into its children (`optimizer.optimizer`,
  `optimizer.param_state_sharding_type`), so no object shadows a tensor subtree.
* ShardedObjects (DCP bytes items `<key>/shard_<offsets>_<global shape>`, e.g.
  `rng_state/shard_0.1_1.2`) are one object per key whose value maps each shard's offsets,
  joined by ",", to its value: `{"0,0": ..., "0,1": ...}` (Megatron stores each as a
  one-element list; the element is the value).

Every pickle is read by the restricted unpickler with placeholders (`_foreign`:
classes outside torch.save's allow-list are recorded, nothing runs). An object whose value
holds such a class (`args`, an `argparse.Namespace`; `rng_state`, numpy RNG states) is
listed by `pickled_objects` and read only with `allow_pickle=True` (then its classes
are made for real, `_foreign.rebuild`); plain ones (`iteration`, a dict of numbers)
read without it.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from xckpt.errors import ObjectError, XckptError
from xckpt.manifest import MAX_OBJECT_DEPTH
from xckpt.storage import Blob, Place, as_place

from ._dcp_items import read_value
from ._foreign import describe, find_foreign, holds_foreign, rebuild
from ._torchzip import Archive
from ._unpickle import TORCH_SAVE_GLOBALS, TensorRef, restricted_load
from .torch_dcp import DcpSource
from .torch_dcp import detect as dcp_detect

__all__ = ["FORMAT", "detect", "open", "MegatronSource", "INSTEAD"]

FORMAT = "megatron"

_SHARD = re.compile(r"^(.+)/shard_(\d+(?:\.\d+)*)_(\d+(?:\.\d+)*)$")
_COMMON_ITEM = "common_state"
_DP_BUCKETS = re.compile(r"(^|\.)optimizer\.distributed\.")


def detect(path: str | Place) -> bool:
    """A torch DCP directory with Megatron-Core's `metadata.json` (a `sharded_backend` key)."""
    try:
        place = as_place(path)
        md = _metadata_json(place) if place.kind() == "dir" else None
    except XckptError:
        return False
    return md is not None and "sharded_backend" in md and dcp_detect(place)


def _metadata_json(place: Place) -> dict[str, Any] | None:
    raw = place.read("metadata.json", limit=1 << 20)
    if raw is None or len(raw) > 1 << 20:
        return None
    try:
        md = json.loads(raw)
    except ValueError:
        return None
    return md if isinstance(md, dict) else None


@dataclass(frozen=True)
class _Payload:
    """One pickle: `common.pt` or a DCP bytes item (a torch.save archive), read inert."""

    archive: Archive
    root: Any  # restricted, foreign classes as placeholders
    where: str


@dataclass(frozen=True)
class _ObjectSite:
    """Where an object's value (or one shard of it) is: `payload`'s root, at `path`."""

    payload: _Payload
    path: tuple[Any, ...]
    shard: str | None  # the ShardedObject offsets, "0,1"; None for a plain entry


class MegatronSource(DcpSource):
    """A Megatron-Core torch_dist checkpoint opened for reading (metadata only)."""

    format = FORMAT

    def __init__(self, path: str | Place, *, allow_pickle: bool = False) -> None:
        place = as_place(path)
        where = f"Megatron-Core checkpoint {place.name!r}"
        md = _metadata_json(place)
        if md is None or "sharded_backend" not in md:
            raise XckptError(
                f"{place.name!r} is not a Megatron-Core dist checkpoint: no metadata.json with a "
                "'sharded_backend' key (megatron.core.dist_checkpointing writes one)"
            )
        if md.get("sharded_backend") != "torch_dist":
            raise XckptError(
                f"{where}: sharded backend {md.get('sharded_backend')!r} is not read by xckpt (only "
                "torch_dist, Megatron's default). Re-save with dist_checkpointing.save(..., "
                "sharded_strategy='torch_dist') or Megatron-LM's --ckpt-format torch_dist"
            )
        self._md_json = md
        self._commons: list[Blob] = []
        super().__init__(place, allow_pickle=allow_pickle)
        try:
            self._where = where
            self._parts: dict[str, list[_ObjectSite]] = {}
            self._layout = self._read_common()
            self._read_sharded_objects()
            self._notes = self._dp_buckets()
        except BaseException:
            self.close()
            raise

    # -- objects, built at open -------------------------------------------------------------

    def _payload(self, f: Blob, base: int | None, length: int, where: str) -> _Payload:
        a = (
            Archive(f, base, length, where, unpickle=False)
            if base is not None
            else Archive.of_file(f, where, unpickle=False)
        )
        root = restricted_load(
            a.record_bytes(f"{a.prefix}/data.pkl"), TORCH_SAVE_GLOBALS, where, storages=True, foreign=True
        )
        a.drop_blob()
        return _Payload(a, root, where)

    def _read_common(self) -> str:
        items = [k for k in self._parsed.objects if k.split("/")[0] == _COMMON_ITEM]
        if self._place.isfile("common.pt"):
            f = self._place.open("common.pt", f"{self._where} (common.pt)")
            self._commons.append(f)
            payload = self._payload(f, None, 0, f"{self._where} (common.pt)")
            root, layout = payload.root, "common.pt (megatron-core <= 0.18)"
        elif items:
            it = self._parsed.objects[items[0]][0]
            payload = self._payload(self.file(it.rel), it.offset, it.length, f"{self._where} ({items[0]})")
            root, layout = _unwrap(payload.root), "common_state item (megatron-core >= 0.19)"
        else:
            return "no common state"
        if not isinstance(root, dict):
            raise XckptError(f"{payload.where}: the common state is a {type(root).__name__}, not a dict")
        prefixes: set[str] = set()
        for n in self._entries:
            parts = n.split(".")
            prefixes.update(".".join(parts[:i]) for i in range(1, len(parts)))
        base = () if payload.root is root else (0,)

        def walk(d: Mapping[Any, Any], prefix: str, path: tuple[Any, ...], depth: int) -> None:
            for k, v in d.items():
                name = f"{prefix}{k}"
                if isinstance(v, dict) and name in prefixes and depth < MAX_OBJECT_DEPTH:
                    walk(v, f"{name}.", (*path, k), depth + 1)
                elif name in self._entries:
                    raise XckptError(f"{payload.where}: common state entry {name!r} is also a tensor's key")
                else:
                    self._parts[name] = [_ObjectSite(payload, (*path, k), None)]

        walk(root, "", base, 0)
        return layout

    def _read_sharded_objects(self) -> None:
        for fqn, its in self._parsed.objects.items():
            if fqn.split("/")[0] == _COMMON_ITEM:
                continue
            m = _SHARD.match(fqn)
            name = m.group(1) if m else fqn
            payload = self._payload(
                self.file(its[0].rel), its[0].offset, its[0].length, f"{self._where} ({fqn})"
            )
            if name in self._entries or (name in self._parts and not self._parts[name][0].shard):
                raise XckptError(f"{self._where}: object {name!r} is also a tensor or a common state entry")
            shard = m.group(2).replace(".", ",") if m else None
            wrapped = m is not None and isinstance(payload.root, list) and len(payload.root) == 1
            self._parts.setdefault(name, []).append(_ObjectSite(payload, (0,) if wrapped else (), shard))

    def _dp_buckets(self) -> list[str]:
        flat = [n for n in self._entries if _DP_BUCKETS.search(n)]
        if not flat:
            return []
        note = (
            f"{len(flat)} distributed-optimizer tensors ({', '.join(flat[:3])}{', ...' if len(flat) > 3 else ''}) "
            "are dp_reshardable buckets: flat buffers holding a gradient bucket's parameters end to end, "
            "with no record in the checkpoint of which parameter sits where (Megatron rebuilds that from "
            "the live model), so they are listed as the flat tensors they are, not per parameter. For "
            "per-parameter optimizer state, re-save with distrib_optim_sharding_type='fully_reshardable' "
            "(Megatron-LM: --dist-ckpt-optim-fully-reshardable)"
        )
        warnings.warn(f"{self._where}: {note}", UserWarning, stacklevel=4)
        return [note]

    # -- metadata ---------------------------------------------------------------------------

    @property
    def metadata(self) -> Mapping[str, Any]:
        content = self._parts.get("content_metadata")
        sharding = None
        if content and not _needs_pickle(content[0]):
            value = _at(content[0].payload.root, content[0].path)
            sharding = value.get("distrib_optim_sharding_type") if isinstance(value, dict) else None
        return {
            **super().metadata,
            "sharded_backend": self._md_json.get("sharded_backend"),
            "common_state": self._layout,
            "distrib_optim_sharding_type": sharding,
            "notes": list(self._notes),
        }

    # -- objects ------------------------------------------------------------------------------

    def object_names(self) -> list[str]:
        return list(self._parts)

    def _has_object(self, name: str) -> bool:
        return name in self._parts

    def pickled_objects(self) -> set[str]:
        return {n for n, parts in self._parts.items() if any(_needs_pickle(p) for p in parts)}

    def per_rank_objects(self) -> set[str]:
        return set()

    def _object_value(self, name: str, rank: int | None) -> Any:
        parts = self._parts[name]
        if parts[0].shard is None:
            return self._value(parts[0])
        return {p.shard: self._value(p) for p in parts}

    def _per_rank_values(self, name: str) -> list[Any]:
        return [self._object_value(name, None)]

    def _value(self, part: _ObjectSite) -> Any:
        p = part.payload
        value = _at(p.root, part.path)
        if _needs_pickle(part):  # allow_pickle: the foreign classes are made for real (runs code)
            return rebuild(
                value, p.where, lambda x: read_value(x, p.archive) if isinstance(x, TensorRef) else x
            )
        return read_value(value, p.archive)

    def _pickle_refused(self, names: Sequence[str]) -> ObjectError:
        classes = sorted(
            {
                describe(find_foreign(_at(p.payload.root, p.path)))
                for n in names
                for p in self._parts[n]
                if _needs_pickle(p)
            }
        )
        return ObjectError(
            f"{self._where}: object {names[0]!r}"
            + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")
            + f" is a pickle holding {', '.join(classes[:4])}, outside xckpt's allow-list; reading it runs that "
            "code: read it only from a trusted checkpoint, by opening with allow_pickle=True"
        )

    def close(self) -> None:
        super().close()
        for f in getattr(self, "_commons", []):
            f.close()


def _unwrap(v: Any) -> Any:
    return v[0] if isinstance(v, list) and len(v) == 1 else v


def _at(root: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        root = root[k]
    return root


def _needs_pickle(part: _ObjectSite) -> bool:
    return holds_foreign(_at(part.payload.root, part.path))


#: What to do instead of writing this format, which xckpt reads but does not write.
INSTEAD = (
    "convert to torch-dcp, whose tensors keep Megatron's keys (and, with the hf_llama_to_megatron_gpt "
    "rules, Hugging Face Llama weights get them), and load it with torch.distributed.checkpoint"
)


def open(path: str | Place, *, allow_pickle: bool = False) -> MegatronSource:  # noqa: A001
    """Open a Megatron-Core dist checkpoint (torch_dist backend; 0.16 or 0.19 layout)."""
    return MegatronSource(path, allow_pickle=allow_pickle)
