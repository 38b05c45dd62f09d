"""DeepSpeed ZeRO and universal checkpoints as an xckpt source (format `deepspeed`), read without
torch or DeepSpeed.

What is opened (REFERENCE section 9; fixtures in `tests/fixtures_foreign/deepspeed`):

* a ZeRO stage 1, 2 or 3 checkpoint, fp32 or bf16: the directory holding `latest` (its
  tag names the `global_step*` directory), or that directory itself, which holds the
  model states (`mp_rank_00_model_states.pt`; stage 3: `zero_pp_rank_<r>_mp_rank_00_model_states.pt`)
  and one `[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt` per data-parallel rank;
* a universal checkpoint (`ds_to_universal`'s output): the directory holding
  `latest_universal`, or its tag directory, which holds `zero/<name>/{fp32,exp_avg,
  exp_avg_sq,step}.pt` per parameter beside the model states.

A directory holding both `latest` and `latest_universal` opens the ZeRO checkpoint
(open the tag directory to read the other).

Names and values:

* the weights are the fp32 master weights exactly as DeepSpeed's `zero_to_fp32` recovers
  them (`_deepspeed_layout`), under the model's parameter names, in its order:
  buffers first (floating buffers as float32, as zero_to_fp32 casts them), frozen
  parameters, trainable parameters, then tied aliases (`shared_params`) under their own
  names, reading the bytes of the parameter they alias;
* each flat per-group optimizer state of the ranks' files that has the partition's shape
  (Adam's `exp_avg` / `exp_avg_sq`) is presented per parameter as
  `optimizer.state.<name>.<key>`, unflattened and unpadded, the values `ds_to_universal`
  writes (the last rank's state may hold the group's alignment padding that its saved fp32
  partition lacks: ZeRO 1/2's optimizer strips it from the partition only); scalar state
  (Adam's `step`) is an object `optimizer.state.<name>.<key>` (a Python number) for every
  parameter of the group; state that is neither is named in a warning at open and in
  `metadata["notes"]`, as are a universal checkpoint's files that are not read;
* objects: the model states' own entries (`global_steps`, `ds_config`, `ds_version`,
  client state such as `my_epoch`, ...; not the structural `module`, `param_shapes`,
  `buffer_names`, `shared_params`, `frozen_param_*`, `optimizer`), and
  `optimizer.param_groups` (the base optimizer's groups, `params` as parameter names).
  An entry holding a class outside the allow-list (e.g. an `argparse.Namespace` of
  Megatron-DeepSpeed) is a pickled object: read only with `allow_pickle=True`.

Reading: every pickle goes through the restricted unpickler (torch.save's list plus
DeepSpeed's `LossScaler`, `ZeroStageEnum` and `fragment_address` as inert records:
`_unpickle.DEEPSPEED_GLOBALS`); tensor bytes are read by byte range from the
torch.save zips (`_torchzip`), never whole files. A parameter split across ranks'
flat partitions is one chunk per rank piece (its writer `rank`) when every piece is a
box of its shape (whole rows, a part of one row); otherwise it is one chunk whose reads
assemble the pieces, reading only the elements between the first and last one a box needs.
Only model-parallel rank 0 (`mp_rank_00`) files exist in the checkpoints this reads;
others are refused with a message. Every location that can be listed opens (a local path, a
kvstore URL or spec: `Place`); an `http(s)://` one cannot be listed.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from xckpt.errors import IncompleteCheckpointError, XckptError
from xckpt.layout import Box, c_strides, check_coverage
from xckpt.manifest import Chunk, TensorEntry, numpy_dtype
from xckpt.source import ChunkRead, Source, group_bytes, slice_pairs
from xckpt.storage import Place, as_place

from ._deepspeed_files import (
    File,
    Span,
    Spec,
    Stored,
    assemble,
    assembled_units,
    is_floating,
    open_file,
    read_object,
    read_stored,
    state_kind,
    stored,
)
from ._deepspeed_layout import FlatRange, range_box, zero3_pieces, zero12_pieces
from ._foreign import holds_foreign, rebuild
from ._unpickle import DEEPSPEED_GLOBALS, TORCH_SAVE_GLOBALS, TensorRef
from .torch_save import run_jobs

__all__ = ["FORMAT", "detect", "open", "DeepSpeedSource", "INSTEAD"]

FORMAT = "deepspeed"

_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_TAG = re.compile(r"^[A-Za-z0-9_.\-]+$")
#: Model-state entries that describe the layout (read here, not objects).
_STRUCTURAL = {
    "module",
    "optimizer",
    "buffer_names",
    "param_shapes",
    "frozen_param_shapes",
    "frozen_param_fragments",
    "shared_params",
}
#: The per-parameter files of a universal checkpoint that are read.
_UNIVERSAL_FILES = ("fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt")


def detect(path: str | Place) -> bool:
    """A directory with `latest` / `latest_universal` naming a tag directory, or a tag
    directory holding DeepSpeed model states beside ZeRO optimizer files or `zero/`."""
    try:
        place = as_place(path)
        if not place.listable or place.kind() != "dir":
            return False
        for marker in ("latest", "latest_universal"):
            tag = _read_tag(place, marker)
            if tag is not None and _is_tag_dir(place.child(tag)):
                return True
        return _is_tag_dir(place)
    except XckptError:
        return False


def _read_tag(place: Place, marker: str) -> str | None:
    data = place.read(marker, limit=4096)
    if data is None or len(data) > 4096:
        return None
    tag = data.decode("utf-8", "replace").strip()
    return tag if _TAG.match(tag) and tag not in (".", "..") else None


def _is_tag_dir(place: Place) -> bool:
    entries = place.entries()
    if not any(_MODEL.match(e) for e in entries):
        return False
    return any(_OPTIM.match(e) for e in entries) or "zero" in entries


# ---------------------------------------------------------------------------------------------
# The source


class DeepSpeedSource(Source):
    """A DeepSpeed ZeRO or universal checkpoint opened for reading (metadata only)."""

    format = FORMAT

    def __init__(self, path: str | Place, *, allow_pickle: bool = False) -> None:
        place = as_place(path)
        self.path = place.name
        self.allow_pickle = allow_pickle
        self._where = f"DeepSpeed checkpoint {self.path!r}"
        self._files: dict[str, File] = {}
        self._specs: dict[str, Spec] = {}
        self._pieces: dict[tuple[str, tuple[int, ...]], Span] = {}
        self._entries: dict[str, TensorEntry] = {}
        self._objects: dict[str, Any] = {}  # name -> value, or (file, key) of a pickled entry
        self._pickled: set[str] = set()
        self._notes: list[str] = []
        self._world = 1
        try:
            self._tag, self.universal = self._resolve(place)
            self.tag_dir = self._tag.name
            if self.universal:
                self._open_universal()
            else:
                self._open_zero()
            for name, spec in self._specs.items():
                self._entries[name] = self._entry(name, spec)
        except BaseException:
            self.close()
            raise
        for note in self._notes:
            warnings.warn(f"{self._where}: {note}", UserWarning, stacklevel=5)  # xckpt.open's caller

    # -- locating ---------------------------------------------------------------------------

    def _resolve(self, place: Place) -> tuple[Place, bool]:
        kind = place.kind() if place.listable else None
        if kind != "dir":
            raise XckptError(
                f"{self.path!r} is not a DeepSpeed checkpoint: "
                + (
                    "a file"
                    if kind == "file"
                    else "nothing is there"
                    if place.listable
                    else "it cannot be listed"
                )
                + "; give the directory holding 'latest' (or 'latest_universal') or a global_step* directory"
            )
        for marker in ("latest", "latest_universal"):
            if place.isfile(marker):
                tag = _read_tag(place, marker)
                if tag is None:
                    raise XckptError(f"{self._where}: {marker!r} does not name a tag directory")
                d = place.child(tag)
                if not place.isdir(tag):
                    raise IncompleteCheckpointError(
                        f"{self._where}: {marker!r} names {tag!r}, which is missing; the save did not "
                        "finish or the directory was removed"
                    )
                return d, marker == "latest_universal" or not any(_OPTIM.match(e) for e in d.entries())
        entries = place.entries()
        if not any(_MODEL.match(e) for e in entries):
            raise XckptError(
                f"{self.path!r} is not a DeepSpeed checkpoint: no *_model_states.pt (found "
                f"{entries[:10]}); give the directory holding 'latest' or a global_step* directory"
            )
        return place, not any(_OPTIM.match(e) for e in entries)

    def _file(self, rel: str, allowed: dict[tuple[str, str], Any]) -> File:
        got = self._files.get(rel)
        if got is None:
            got = self._files[rel] = open_file(self._tag, rel, f"{self._where} ({rel})", allowed)
        return got

    # -- ZeRO stages 1-3 --------------------------------------------------------------------

    def _open_zero(self) -> None:
        entries = self._tag.entries()
        optim = self._rank_files(entries, _OPTIM, "optimizer")
        self._world = len(optim)
        osds = []
        for rel in optim:
            f = self._file(rel, DEEPSPEED_GLOBALS)
            osd = f.root.get("optimizer_state_dict") if isinstance(f.root, dict) else None
            if not isinstance(osd, dict):
                raise XckptError(f"{self._where} ({rel}): no optimizer_state_dict; not a ZeRO optimizer file")
            osds.append((f, osd))
        first = osds[0][1]
        stage = first.get("zero_stage", 1)  # BF16_Optimizer (bf16 with ZeRO 1) records none
        count = first.get("partition_count")
        world = max(count) if isinstance(count, list) and count else count
        if type(stage) is not int or not 1 <= stage <= 3 or type(world) is not int:
            raise XckptError(
                f"{self._where}: zero_stage {stage!r} / partition_count {count!r} is not a ZeRO checkpoint"
            )
        if world != len(optim):
            raise IncompleteCheckpointError(
                f"{self._where}: the optimizer state is partitioned over {world} ranks but {len(optim)} "
                f"*_optim_states.pt files are there; a rank's save is missing or an older save was overwritten"
            )
        self.stage = stage
        model_files = self._rank_files(entries, _MODEL, "model states")
        if stage <= 2:
            model_files = [m for m in model_files if not m.startswith("zero_pp_rank_")][:1] or model_files[:1]
        models = [self._file(rel, TORCH_SAVE_GLOBALS) for rel in model_files]
        ms = self._model_states(models[0])
        shapes = self._param_shapes(ms, models[0])
        self._buffers(ms, models[0])
        self._frozen(ms, models)
        key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
        flats = [
            [stored(f, t, f"{key}[{g}]") for g, t in enumerate(self._list(osd, key, f))] for f, osd in osds
        ]
        for r, row in enumerate(flats):
            for g, s in enumerate(row):
                if len(s.ref.size) != 1 or s.ref.stride != (1,):
                    raise XckptError(
                        f"{self._where} ({osds[r][0].rel}): {key}[{g}] is not a flat tensor ({s.ref.size})"
                    )
        numels = [[s.ref.size[0] for s in row] for row in flats]
        if stage <= 2:
            pads = first.get("param_alignment_paddings")
            pieces = zero12_pieces(shapes, numels, pads if isinstance(pads, list) else None, self._where)
        else:
            pieces = zero3_pieces({n: s for g in shapes for n, s in g.items()}, numels, self._where)
        group_of = {n: g for g, group in enumerate(shapes) for n in group}
        for name, ps in pieces.items():
            self._put(
                name, self._param_spec(shapes[group_of[name]][name], [self._span(p, flats) for p in ps])
            )
        self._moments(osds, shapes, pieces, numels)
        self._aliases(ms)
        self._model_objects(ms, models[0])

    def _rank_files(self, entries: list[str], pattern: re.Pattern[str], what: str) -> list[str]:
        found = sorted((int(m.group(1) or 0), int(m.group(2)), e) for e in entries if (m := pattern.match(e)))
        if any(mp != 0 for _, mp, _ in found):
            raise XckptError(
                f"{self._where}: files of model-parallel ranks other than 0 ({[e for _, mp, e in found if mp][:3]}); "
                "xckpt reads ZeRO checkpoints of one model-parallel rank (as zero_to_fp32 does). Convert it "
                "with DeepSpeed's ds_to_universal, or save without tensor/pipeline parallelism"
            )
        ranks = [r for r, _, _ in found]
        if not found or ranks != list(range(len(ranks))):
            missing = sorted(set(range(max(ranks, default=-1) + 1)) - set(ranks))
            raise IncompleteCheckpointError(
                f"{self._where}: the {what} files of ranks {missing or [0]} are missing (found "
                f"{[e for _, _, e in found][:8]}); the save did not finish on every rank"
            )
        return [e for _, _, e in found]

    def _list(self, d: Mapping[str, Any], key: str, f: File) -> list[Any]:
        v = d.get(key)
        if not isinstance(v, list):
            raise XckptError(f"{self._where} ({f.rel}): {key!r} is {type(v).__name__}, expected a list")
        return v

    def _model_states(self, f: File) -> dict[str, Any]:
        if not isinstance(f.root, dict) or "buffer_names" not in f.root or "param_shapes" not in f.root:
            raise XckptError(
                f"{self._where} ({f.rel}): not DeepSpeed model states (no buffer_names / param_shapes)"
            )
        return f.root

    def _param_shapes(self, ms: Mapping[str, Any], f: File) -> list[dict[str, tuple[int, ...]]]:
        raw = ms["param_shapes"]
        groups = raw if isinstance(raw, list) else [raw]
        out = []
        for g in groups:
            if not isinstance(g, dict) or not all(type(k) is str for k in g):
                raise XckptError(f"{self._where} ({f.rel}): param_shapes holds {type(g).__name__}")
            out.append({k: self._shape(v, k, f) for k, v in g.items()})
        return out

    def _shape(self, v: Any, name: str, f: File) -> tuple[int, ...]:
        if not isinstance(v, (tuple, list)) or any(type(x) is not int or x < 0 for x in v):
            raise XckptError(f"{self._where} ({f.rel}): the shape of {name!r} is {v!r}")
        return tuple(v)

    def _buffers(self, ms: Mapping[str, Any], f: File) -> None:
        names = ms.get("buffer_names") or []
        module = ms.get("module")
        if not isinstance(module, dict) or not isinstance(names, list):
            raise XckptError(f"{self._where} ({f.rel}): module / buffer_names are not a dict and a list")
        for name, t in module.items():
            if name in names:
                s = stored(f, t, f"buffer {name!r}")
                kept = s.ref.dtype.xckpt or ""
                self._put(name, Spec(s.ref.size, "float32" if is_floating(kept) else kept, kept, whole=s))

    def _frozen(self, ms: Mapping[str, Any], models: list[File]) -> None:
        shapes = ms.get("frozen_param_shapes") or {}
        if not isinstance(shapes, dict):
            raise XckptError(f"{self._where} ({models[0].rel}): frozen_param_shapes is not a dict")
        for name, raw in shapes.items():
            shape = self._shape(raw, name, models[0])
            if self.stage <= 2:  # the whole parameter, as the module saved it
                frag = (models[0].root.get("frozen_param_fragments") or {}).get(name)
                s = stored(models[0], frag, f"frozen parameter {name!r}")
                if math.prod(s.ref.size) != math.prod(shape) or (
                    s.ref.size != shape and s.ref.stride != c_strides(s.ref.size)
                ):
                    raise XckptError(
                        f"{self._where}: frozen parameter {name!r} holds {s.ref.size}, not {shape}"
                    )
                view = TensorRef(
                    s.ref.storage,
                    s.ref.offset,
                    shape,
                    s.ref.stride if s.ref.size == shape else c_strides(shape),
                    s.ref.dtype,
                )
                dtype = s.ref.dtype.xckpt or ""
                self._put(name, Spec(shape, dtype, dtype, whole=Stored(s.file, view, s.start)))
                continue
            spans, pos, numel = [], 0, math.prod(shape)
            for r, m in enumerate(models):  # stage 3: every rank's fragment, concatenated, cut to numel
                frag = stored(m, (m.root.get("frozen_param_fragments") or {}).get(name), f"frozen {name!r}")
                n = min(math.prod(frag.ref.size), numel - pos)
                if n > 0:
                    spans.append(Span(r, frag, 0, n, pos))
                    pos += n
            if pos != numel:
                raise XckptError(
                    f"{self._where}: the fragments of frozen parameter {name!r} hold {pos} of {numel} elements"
                )
            self._put(name, self._param_spec(shape, spans))

    def _span(self, p: FlatRange, flats: list[list[Stored]]) -> Span:
        flat = flats[p.rank][p.group]
        return Span(p.rank, flat, p.start, p.length, p.at)

    def _param_spec(self, shape: tuple[int, ...], spans: list[Span]) -> Spec:
        dtypes = {s.flat.ref.dtype.xckpt or "" for s in spans}
        dtype = dtypes.pop() if len(dtypes) == 1 else "float32"
        boxes = [range_box(shape, s.at, s.at + s.length) for s in spans]
        return Spec(shape, dtype, dtype, spans=tuple(spans), assembled=None in boxes)

    def _moments(
        self,
        osds: list[tuple[File, dict[str, Any]]],
        shapes: list[dict[str, tuple[int, ...]]],
        pieces: Mapping[str, list[FlatRange]],
        numels: list[list[int]],
    ) -> None:
        """Per-group optimizer state: flat tensors laid out like the partitions become per-parameter
        tensors, plain values (Adam's step) per-parameter objects; anything else is noted."""
        inner = "base_optimizer_state" if self.stage <= 2 else "optimizer_state_dict"
        states = self._states(osds, inner)
        if states is None:
            return
        ngroups = len(numels[0])
        pads = [self._paddings(osd, ngroups) for _, osd in osds]
        keys: dict[Any, None] = {}
        extra: dict[Any, list[str]] = {}
        for f, st in states:
            for k in st:
                if k not in range(ngroups):
                    extra.setdefault(k, []).append(f.rel)
            for g in range(ngroups):
                keys.update(dict.fromkeys(st.get(g) or {}))
        if extra:
            where = sorted({rel for rels in extra.values() for rel in rels})
            self._note(
                f"optimizer state entries {list(extra)[:5]} ({where[0]}"
                f"{f' and {len(where) - 1} more' if len(where) > 1 else ''}) belong to no ZeRO "
                f"parameter group (there are {ngroups}) and are not read"
            )
        for key in keys:
            vals = [[(st.get(g) or {}).get(key) for g in range(ngroups)] for _, st in states]
            kinds = [
                [state_kind(v, numels[r][g], pads[r][g]) for g, v in enumerate(row)]
                for r, row in enumerate(vals)
            ]
            self._state_key(key, vals, kinds, [f for f, _ in states], shapes, pieces)
        self._param_groups(osds[0][1].get(inner) or {}, shapes)

    def _states(
        self, osds: list[tuple[File, dict[str, Any]]], inner: str
    ) -> list[tuple[File, dict[Any, Any]]] | None:
        states = []
        for f, osd in osds:
            base = osd.get(inner)
            state = base.get("state") if isinstance(base, dict) else None
            if not isinstance(state, dict) or not all(isinstance(v, dict) for v in state.values()):
                self._note(
                    f"no optimizer state is read: {inner} of {f.rel} holds no per-group 'state' dict "
                    f"({type(base).__name__}; an elastic or offloaded optimizer state?); xckpt reads the "
                    "flat per-group state ZeRO saves by default"
                )
                return None
            states.append((f, state))
        return states

    def _paddings(self, osd: Mapping[str, Any], ngroups: int) -> list[int]:
        """The rank's alignment padding per group (ZeRO 1/2 save the last rank's partition without it)."""
        pads = osd.get("group_paddings")
        if isinstance(pads, list) and len(pads) == ngroups and all(type(p) is int and p >= 0 for p in pads):
            return pads
        return [0] * ngroups

    def _state_key(
        self,
        key: Any,
        vals: list[list[Any]],
        kinds: list[list[str]],
        files: list[File],
        shapes: list[dict[str, tuple[int, ...]]],
        pieces: Mapping[str, list[FlatRange]],
    ) -> None:
        """One optimizer state key over the ranks and groups: presented where it can be, noted where not."""
        ngroups = len(kinds[0])
        named = type(key) is str
        flat = {g for g in range(ngroups) if named and all(row[g] == "flat" for row in kinds)}
        bad: dict[int, str] = {}
        for g in range(ngroups):
            col = [row[g] for row in kinds]
            if g in flat or all(k == "absent" for k in col) or named and col[0] == "object":
                continue
            r = next(r for r, k in enumerate(col) if k != "flat") if named else 0
            phrase = {"absent": "nothing", "object": "a plain value", "flat": "a flat tensor"}.get(
                col[r], col[r]
            )
            bad[g] = f"group {g}: rank {r} holds {phrase}" if named else f"group {g}: the key is not a name"
        flats = {
            (r, g): stored(files[r], vals[r][g], f"optimizer state {key!r} of group {g}")
            for r in range(len(kinds))
            for g in flat
        }
        group_of = {n: g for g, group in enumerate(shapes) for n in group}
        lost = []
        for name, ps in pieces.items():
            groups = {p.group for p in ps} or {group_of[name] if self.stage <= 2 else 0}
            if groups <= flat:
                spans = [Span(p.rank, flats[(p.rank, p.group)], p.start, p.length, p.at) for p in ps]
                self._put(f"optimizer.state.{name}.{key}", self._param_spec(self._specs[name].shape, spans))
                continue
            if groups & set(bad):
                lost.append(name)
                continue
            g = group_of[name] if self.stage <= 2 else min(groups)  # its group's value (all ranks' agree)
            if named and kinds[0][g] == "object":
                self._objects[f"optimizer.state.{name}.{key}"] = ("scalar", files[0], vals[0][g])
        if bad:
            self._note(
                f"optimizer state {key!r} of {len(lost)} parameter{'s' if len(lost) != 1 else ''} "
                f"({', '.join(lost[:4])}"
                f"{', ...' if len(lost) > 4 else ''}) is not read: "
                + "; ".join(bad.values())
                + ". xckpt reads per-group state that is flat like the ranks' partitions (Adam's exp_avg, "
                "exp_avg_sq) or a plain value (step)"
            )

    def _param_groups(self, base: Mapping[str, Any], shapes: list[dict[str, tuple[int, ...]]]) -> None:
        groups = [pg for pg in (base.get("param_groups") or []) if isinstance(pg, dict)]
        if groups:
            named = len(groups) == len(shapes)  # else (ZeRO-3 sub-groups) params stay as saved
            self._objects["optimizer.param_groups"] = [
                {**pg, "params": list(shapes[g])} if named else dict(pg) for g, pg in enumerate(groups)
            ]

    def _note(self, note: str) -> None:
        """Something of the checkpoint that is not presented: warned at open, kept in `metadata["notes"]`."""
        self._notes.append(note)

    def _aliases(self, ms: Mapping[str, Any]) -> None:
        shared = ms.get("shared_params") or {}
        if isinstance(shared, dict):
            for alias, src in shared.items():
                if type(alias) is str and src in self._specs and alias not in self._specs:
                    self._specs[alias] = self._specs[src]

    def _model_objects(self, ms: Mapping[str, Any], f: File) -> None:
        for k, v in ms.items():
            if type(k) is str and k not in _STRUCTURAL and k not in self._specs:
                self._objects[k] = ("entry", f, k)
                if holds_foreign(v):
                    self._pickled.add(k)

    # -- universal ----------------------------------------------------------------------------

    def _open_universal(self) -> None:
        entries = self._tag.entries()
        model_files = self._rank_files(entries, _MODEL, "model states")
        model = self._file(model_files[0], TORCH_SAVE_GLOBALS)
        ms = self._model_states(model)
        shapes = self._param_shapes(ms, model)
        flat_shapes = {n: s for g in shapes for n, s in g.items()}
        if not self._tag.isdir("zero"):
            raise XckptError(f"{self._where}: no zero/ directory; not a universal checkpoint")
        dirs = sorted(d for d in self._tag.entries("zero") if self._tag.isdir(f"zero/{d}"))
        buffers = [b for b in (ms.get("buffer_names") or []) if b in dirs]
        order = buffers + [n for n in flat_shapes if n in dirs and n not in buffers]
        order += [d for d in dirs if d not in order]
        self.stage = 0
        for name in order:
            files = self._tag.entries(f"zero/{name}")
            if "fp32.pt" not in files:
                self._note(f"zero/{name} holds no fp32.pt; its files {files[:5]} are not read")
                continue
            other = [e for e in files if e not in _UNIVERSAL_FILES]
            if other:
                self._note(
                    f"zero/{name}: {other[:5]} are not read (xckpt reads {', '.join(_UNIVERSAL_FILES)}, "
                    "the files ds_to_universal writes)"
                )
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                rel = f"zero/{name}/{key}.pt"
                if not self._tag.isfile(rel):
                    continue
                f = self._file(rel, TORCH_SAVE_GLOBALS)
                ref = f.root.get("param") if isinstance(f.root, dict) else f.root
                s = stored(f, ref, f"{key} of {name!r}")
                shape = flat_shapes.get(name, s.ref.size)
                if s.ref.size != shape:  # stage 3 writes flat tensors
                    if math.prod(s.ref.size) != math.prod(shape) or s.ref.stride != c_strides(s.ref.size):
                        raise XckptError(
                            f"{self._where} ({rel}): holds {s.ref.size}, the parameter is {shape}"
                        )
                    s = Stored(
                        f,
                        TensorRef(s.ref.storage, s.ref.offset, shape, c_strides(shape), s.ref.dtype),
                        s.start,
                    )
                dtype = s.ref.dtype.xckpt or ""
                out = name if key == "fp32" else f"optimizer.state.{name}.{key}"
                self._put(out, Spec(shape, dtype, dtype, whole=s))
            step = f"zero/{name}/step.pt"
            if self._tag.isfile(step):
                f = self._file(step, TORCH_SAVE_GLOBALS)
                self._objects[f"optimizer.state.{name}.step"] = ("scalar", f, f.root)
        opt = "zero/optimizer_state.pt"
        if self._tag.isfile(opt):
            f = self._file(opt, DEEPSPEED_GLOBALS)
            groups = f.root.get("param_groups") if isinstance(f.root, dict) else None
            if isinstance(groups, list):
                self._objects["optimizer.param_groups"] = [
                    {**pg, "params": list(shapes[g]) if g < len(shapes) else pg.get("params")}
                    for g, pg in enumerate(groups)
                    if isinstance(pg, dict)
                ]
        self._model_objects(ms, model)

    # -- entries ------------------------------------------------------------------------------

    def _put(self, name: str, spec: Spec) -> None:
        if name in self._specs:
            raise XckptError(f"{self._where}: {name!r} appears twice (as a buffer and a parameter?)")
        self._specs[name] = spec

    def _entry(self, name: str, spec: Spec) -> TensorEntry:
        itemsize = numpy_dtype(spec.dtype).itemsize
        chunks: list[Chunk] = []
        if not math.prod(spec.shape):
            pass
        elif spec.whole is not None:
            key = f"{spec.whole.file.rel}:{name}"
            chunks.append(
                Chunk(
                    offset=(0,) * len(spec.shape),
                    shape=spec.shape,
                    key=key,
                    rank=0,
                    nbytes=math.prod(spec.shape) * itemsize,
                )
            )
        elif spec.assembled:
            key = f"{len(spec.spans)} pieces: " + ", ".join(
                f"{s.flat.file.rel}[{s.start * itemsize}:{(s.start + s.length) * itemsize}]" for s in spec.spans[:4]
            )
            chunks.append(
                Chunk(
                    offset=(0,) * len(spec.shape),
                    shape=spec.shape,
                    key=key,
                    rank=spec.spans[0].rank,
                    nbytes=math.prod(spec.shape) * itemsize,
                )
            )
        else:
            for s in spec.spans:
                box = range_box(spec.shape, s.at, s.at + s.length)
                if box is None:  # (assembled specs never get here)
                    raise XckptError(f"{self._where}: {name!r} piece is not a box")
                # a byte range of the rank's flat partition (bytes, as every format's keys say)
                key = f"{s.flat.file.rel}[{s.start * itemsize}:{(s.start + s.length) * itemsize}]"
                chunks.append(
                    Chunk(
                        offset=box.offset, shape=box.shape, key=key, rank=s.rank, nbytes=box.volume * itemsize
                    )
                )
                self._pieces[(name, box.offset)] = s
        check_coverage(spec.shape, [c.box for c in chunks], name=name, where=self.path)
        return TensorEntry(name=name, dtype=spec.dtype, shape=spec.shape, chunks=tuple(chunks))

    # -- metadata ---------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Data-parallel ranks that wrote the optimizer partitions (1 for a universal checkpoint)."""
        return self._world

    @property
    def metadata(self) -> Mapping[str, Any]:
        """`tag_dir`, `universal`, `zero_stage` (None for a universal checkpoint) and `notes`: what the
        checkpoint holds that is not presented (optimizer state xckpt cannot read), each also warned
        at open."""
        return {
            "tag_dir": self.tag_dir,
            "universal": self.universal,
            "zero_stage": self.stage or None,
            "notes": list(self._notes),
        }

    @property
    def bytes_read(self) -> int:
        """Bytes read from the checkpoint's files so far (their headers and pickles included)."""
        return sum(f.bytes.bytes_read for f in self._files.values())

    # -- reading ------------------------------------------------------------------------------------

    def _read_chunks(self, jobs: Sequence[ChunkRead], bar: Any) -> None:
        groups: dict[tuple[str, tuple[int, ...]], list[ChunkRead]] = {}
        for job in jobs:
            groups.setdefault((job.name, job.chunk.offset), []).append(job)

        def one(group: list[ChunkRead]) -> None:
            name, chunk = group[0].name, group[0].chunk
            spec = self._specs[name]
            items = slice_pairs(group)
            if spec.whole is not None:
                read_stored(spec, spec.whole, items)
            elif spec.assembled:
                for slices, out in items:
                    assemble(spec, slices, out)
            else:
                s = self._pieces[(name, chunk.offset)]
                ref = s.flat.ref
                view = TensorRef(
                    ref.storage, ref.offset + s.start, chunk.shape, c_strides(chunk.shape), ref.dtype
                )
                read_stored(spec, Stored(s.flat.file, view, s.flat.start), items)

        run_jobs(one, list(groups.values()), bar, group_bytes)

    def read_units(self, name: str, chunk: Chunk, box: Box, itemsize: int) -> dict[Hashable, int]:
        """An assembled parameter reads, from each piece, the elements between the box's first and
        last; everything else reads the box's bytes."""
        spec = self._specs.get(name)
        if spec is None or not spec.assembled:
            return super().read_units(name, chunk, box, itemsize)
        return assembled_units(name, spec, box)

    # -- objects ------------------------------------------------------------------------------------

    def object_names(self) -> list[str]:
        return list(self._objects)

    def _has_object(self, name: str) -> bool:
        return name in self._objects

    def pickled_objects(self) -> set[str]:
        return set(self._pickled)

    def _object_value(self, name: str, rank: int | None) -> Any:
        v = self._objects[name]
        if isinstance(v, tuple) and len(v) == 3 and v[0] == "scalar":
            return self._scalar(v[1], v[2], name)
        if isinstance(v, tuple) and len(v) == 3 and v[0] == "entry":
            f, key = v[1], v[2]
            if name in self._pickled:  # allow_pickle: the foreign classes are made for real (runs code)
                return rebuild(
                    f.root[key],
                    f"{self._where} ({f.rel}), object {name!r}",
                    lambda x: read_object(x, f),
                )
            return read_object(f.root[key], f)
        return read_object(v, None)

    def _scalar(self, f: File, v: Any, name: str) -> Any:
        if not isinstance(v, TensorRef):
            return v
        arr = read_object(v, f)
        return arr.item()

    def close(self) -> None:
        for f in self._files.values():
            f.bytes.close()


#: What to do instead of writing this format, which xckpt reads but does not write.
INSTEAD = (
    "convert to torch-dcp (or xckpt) and load it into the model and optimizer DeepSpeed wraps with "
    "torch.distributed.checkpoint (or xckpt.torch.load)"
)


def open(path: str | Place, *, allow_pickle: bool = False) -> DeepSpeedSource:  # noqa: A001
    """Open a DeepSpeed ZeRO (stage 1-3) or universal checkpoint directory."""
    return DeepSpeedSource(path, allow_pickle=allow_pickle)
