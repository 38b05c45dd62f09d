"""The formats table: format name -> how to detect it, open it as a Source, and write it.

Every format is a source and a sink (DESIGN.md section 6). [FORMATS][xckpt.formats.FORMATS]
holds one [Format][xckpt.formats.Format] per format, in detection order (`xckpt`,
`megatron`, `torch-dcp`, `deepspeed`, `orbax`, `safetensors`, `torch`); `detect`,
`open` and `xckpt.convert` use nothing else. A format is:

* `detect(place) -> bool`: a cheap look (file names, a few magic bytes), never a full
  parse, at a [Place][xckpt.storage.Place] (a local path, a kvstore URL or spec,
  `http(s)://`), listed (kvstores) or probed (http); `looks_for` says in words what it
  looks for, so a location where nothing is recognised gets a message naming, per
  format, why it said no;
* `open(place, *, allow_pickle, context) -> Source`: parse the format's metadata and
  return the [Source][xckpt.Source], or raise an [XckptError][xckpt.errors.XckptError]
  that says what is wrong with the location; every format opens from every location a
  checkpoint can live in, reading byte ranges only;
* `sink`: the [Sink][xckpt.Sink] that writes it (`xckpt.convert`'s output; DeepSpeed
  and Megatron are read-only and their sinks refuse with a message);
* `suffixes`: the output names that choose it when `convert` is given no `to_format`
  (the first format whose suffix ends the name; xckpt otherwise);
* `http_probes`: file names that mark a directory of this format at an `http(s)://`
  location, which cannot be listed.

`open` detects, opens, and applies `rules` (a view over the source).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from xckpt.converters import deepspeed, megatron, orbax, safetensors, torch_dcp, torch_save
from xckpt.converters.orbax_write import OrbaxSink
from xckpt.converters.safetensors_write import SafetensorsSink
from xckpt.converters.torch_dcp_write import DcpSink
from xckpt.converters.torch_save_write import TorchSaveSink
from xckpt.errors import CheckpointNotFoundError, XckptError
from xckpt.manifest import paused_gc
from xckpt.native.reader import Checkpoint
from xckpt.native.sink import XckptSink
from xckpt.native.steps import manager_root_error, resolve_step
from xckpt.rules import Rules, apply_rules
from xckpt.sink import ReadOnlySink, Sink
from xckpt.source import Source, readable_objects
from xckpt.storage import Location, Place, as_place

__all__ = ["FORMATS", "Format", "Opener", "open", "opened", "load", "detect", "listing"]


class Opener(Protocol):
    """Open a checkpoint of one format at `location` (see the module docstring)."""

    def __call__(self, location: Any, *, allow_pickle: bool, context: Any) -> Source: ...


@dataclass(frozen=True)
class Format:
    """One row of the formats table: a format's name, detection, source and sink.

    Attributes:
        name: one of the seven format names (the module docstring lists them).
        detect: whether a place holds this format (cheap; never a full parse).
        looks_for: what `detect` looks for, in words (said when it says no).
        kinds: what it can be at a location: `"dir"`, `"file"` or both.
        open: opens a place of this format as a source.
        sink: writes this format (`xckpt.convert`'s output).
        suffixes: output names that choose this format in `convert`.
        http_probes: file names that mark a directory of this format over `http(s)://`.
    """

    name: str
    detect: Callable[[Place], bool]
    looks_for: str
    kinds: frozenset[str]
    open: Opener
    sink: Sink
    suffixes: tuple[str, ...] = ()
    http_probes: tuple[str, ...] = ()

    def why_not(self, where: Location | Place) -> str:
        """Why `detect` said no at `where` (a location or its place), in words."""
        place = as_place(where, probes=HTTP_PROBES)
        kind = place.kind()
        if kind is not None and kind not in self.kinds:
            want = "directories" if self.kinds == {"dir"} else "files"
            return f"{'a directory' if kind == 'dir' else 'a file'}, and {self.name} checkpoints are {want}"
        if not place.listable:
            return (
                f"no {self.looks_for} (an http(s) location cannot be listed: only xckpt.json and a Hugging "
                "Face directory's names are probed)"
            )
        return f"no {self.looks_for}"


def _is_xckpt(place: Place) -> bool:
    local = place.local
    if local is not None:
        # data/ alone is a save that never committed: the xckpt reader says so.
        return os.path.isdir(local) and any(os.path.exists(os.path.join(local, p)) for p in ("xckpt.json", "ranks", "data"))
    # A kvstore: a HEAD of xckpt.json and a listing of ranks/ (never of the data); http(s)
    # cannot list: its merged manifest only (a save without one says so when opened with format=).
    if not place.listable:
        return place.isfile("xckpt.json")
    return place.isfile("xckpt.json") or place.isdir("ranks")


def _open_xckpt(location: Any, *, allow_pickle: bool, context: Any) -> Source:
    if isinstance(location, Place):  # the native reader takes the location itself
        location = location.location
    return Checkpoint(location, context=context)


def _opener(open_at: Callable[..., Source]) -> Opener:
    """An opener that reads from the place detection already looked at."""

    def open_(location: Any, *, allow_pickle: bool, context: Any) -> Source:
        return open_at(as_place(location, context, probes=HTTP_PROBES), allow_pickle=allow_pickle)

    return open_


_DIR, _FILE = frozenset({"dir"}), frozenset({"file"})

#: Format name -> `Format`, in detection order.
FORMATS: Mapping[str, Format] = {
    f.name: f
    for f in (
        Format(
            "xckpt", _is_xckpt, "xckpt.json, ranks/ or data/", _DIR, _open_xckpt, XckptSink(), http_probes=("xckpt.json",)
        ),
        Format(  # before torch-dcp: a Megatron-Core dist checkpoint is a DCP directory plus metadata.json
            "megatron",
            megatron.detect,
            "metadata.json with a sharded_backend beside a DCP checkpoint (Megatron-Core)",
            _DIR,
            _opener(megatron.open),
            ReadOnlySink(megatron.FORMAT, megatron.INSTEAD),
        ),
        Format(
            "torch-dcp",
            torch_dcp.detect,
            ".metadata or __<r>.metadata beside *.distcp files",
            _DIR,
            _opener(torch_dcp.open),
            DcpSink(),
        ),
        Format(
            "deepspeed",
            deepspeed.detect,
            "latest / latest_universal naming a tag directory, nor *_model_states.pt beside "
            "*_optim_states.pt or zero/ (DeepSpeed)",
            _DIR,
            _opener(deepspeed.open),
            ReadOnlySink(deepspeed.FORMAT, deepspeed.INSTEAD),
        ),
        Format(
            "orbax",
            orbax.detect,
            "_METADATA or _CHECKPOINT_METADATA (here or in item subdirectories), nor numbered steps "
            "holding them",
            _DIR,
            _opener(orbax.open),
            OrbaxSink(),
        ),
        Format(
            "safetensors",
            safetensors.detect,
            "*.safetensors file, model.safetensors.index.json, or safetensors header",
            _DIR | _FILE,
            _opener(safetensors.open),
            SafetensorsSink(),
            (".safetensors",),
            safetensors.HTTP_PROBES,
        ),
        Format(
            "torch",
            torch_save.detect,
            "torch.save zip (an archive/data.pkl record) or legacy torch.save pickle",
            _FILE,
            _opener(torch_save.open),
            TorchSaveSink(),
            (".pt", ".pth", ".bin"),
        ),
    )
}

#: Every format's names that mark a directory at an `http(s)://` location.
HTTP_PROBES: tuple[str, ...] = tuple(p for f in FORMATS.values() for p in f.http_probes)


def listing(path: Any) -> str:
    """What is at `path` (any location), in words (for messages)."""
    return as_place(path, probes=HTTP_PROBES).describe()


def detect(path: Any, *, context: Any = None) -> str:
    """The name of the format at `path`: a local path, a kvstore URL or spec, or an
    `http(s)://` URL (`context`: the tensorstore Context of a `memory://` location).

    Each format of `FORMATS` is tried in order: local paths by their files, kvstore
    locations by listing them (xckpt by a probe of `xckpt.json` and a listing of
    `ranks/`), http(s) locations by probing names (they cannot be listed). A kvstore
    location where nothing is recognised is opened as xckpt, whose reader says what is
    missing.

    Raises:
        CheckpointNotFoundError: nothing recognised; the message lists what was
            found, and each format tried with why it said no.
    """
    return _detect(as_place(path, context, probes=HTTP_PROBES))


def _detect(place: Place) -> str:
    tried = []
    for fmt in FORMATS.values():
        if fmt.detect(place):
            return fmt.name
        tried.append(f"\n  {fmt.name}: {fmt.why_not(place)}")
    if place.local is None and place.listable:
        return "xckpt"
    where = place.local if place.local is not None else place.name
    raise CheckpointNotFoundError(
        f"no checkpoint recognised at {where!r}: found {place.describe()}. Known formats: "
        f"{', '.join(FORMATS)}, each tried:{''.join(tried)}\nPass format= to force one"
    )


def open(  # noqa: A001
    path: Location | Source,
    *,
    format: str | None = None,  # noqa: A002
    allow_pickle: bool = False,
    rules: Rules = None,
    context: Any = None,
    step: int | str | None = None,
) -> Source:
    """Open the checkpoint at `path`, of any format, for reading (metadata only).

    Args:
        path: a local directory or file, a kvstore URL (`file://`, `memory://`,
            `gs://`, `s3://`), a tensorstore kvstore spec dict, an `http(s)://` URL
            (safetensors files and Hugging Face directories, torch.save files, xckpt
            checkpoints with an `xckpt.json`), or an open
            [`Source`][xckpt.source.Source] (returned as is, seen through `rules`).
        format: force a format (`xckpt`, `megatron`, `torch-dcp`, `deepspeed`, `orbax`,
            `safetensors`, `torch`) instead of detecting it.
        allow_pickle: let pickled objects (DCP's non-tensor values; torch.save objects of
            classes outside the allow-list) be read. Tensor metadata is always read with a
            restricted unpickler; without this flag nothing runs code.
        rules: rename/transpose/stack rules (a list of dicts, or a JSON/TOML file),
            applied as a view: reads still touch only the bytes they need.
        context: a tensorstore Context for xckpt checkpoints.
        step: `path` is a checkpoint manager's root ([`xckpt.CheckpointManager`][xckpt.CheckpointManager]):
            open its step `step`, a step number or `"latest"` (the highest complete
            step), instead (`xckpt.native.steps.resolve_step`).

    Raises:
        CheckpointNotFoundError: nothing recognised at `path`; at a manager root opened
            without `step`, the message names its steps and how to open one.
        XckptError: `format` does not fit what is there, or the metadata is bad.
    """
    if isinstance(path, Source):  # already open: only the rules view is added
        if step is not None:
            raise XckptError(f"{path.path!r} is an open checkpoint; step= is for a checkpoint manager's root")
        if format is not None and format != path.format:
            raise XckptError(f"{path.path!r} is open as {path.format}, not {format}")
        return path if rules is None else _with_rules(path, rules)
    if step is not None:
        path = resolve_step(path, step, context=context)
    try:
        place = as_place(path, context, probes=HTTP_PROBES)  # detection's listing is kept for the opener
        name = _detect(place) if format is None else format
        fmt = FORMATS.get(name)
        if fmt is None:
            raise XckptError(f"unknown format {name!r}; known formats: {', '.join(FORMATS)}")
        src = fmt.open(place, allow_pickle=allow_pickle, context=context)
    except CheckpointNotFoundError as e:
        # Nothing here; a checkpoint manager's root says so and names its steps (only now is it listed).
        root_error = manager_root_error(path, context=context) if step is None and format in (None, "xckpt") else None
        if root_error is not None:
            raise root_error from e
        raise
    return src if rules is None else _with_rules(src, rules)


def _with_rules(src: Source, rules: Any) -> Source:
    """`src` seen through `rules`; a bad rule closes the source it was given."""
    try:
        return apply_rules(src, rules)
    except BaseException:
        src.close()
        raise


@contextlib.contextmanager
def opened(path: Location | Source, **options: Any) -> Iterator[Source]:
    """[`open`][xckpt.formats.open] as a context manager that closes what it opened.

    A [`Source`][xckpt.source.Source] given as `path` belongs to the caller and
    stays open (a rules view over it is only dropped); anything opened here is
    closed on exit, error or not. Every verb that takes a location uses this.
    """
    src = open(path, **options)
    try:
        yield src
    finally:
        if not isinstance(path, Source):
            src.close()


def load(
    path: Location | Source,
    *,
    format: str | None = None,  # noqa: A002
    allow_pickle: bool = False,
    rules: Rules = None,
    per_rank: str = "error",
    show_progress: bool | None = None,
    context: Any = None,
) -> dict[str, Any]:
    """Every tensor (numpy) and object of a checkpoint of any format, by name, in one process.

    Pickled objects (DCP's non-tensor values) are left out, with a warning naming them,
    unless `allow_pickle=True`. `format`, `allow_pickle`, `rules` and `context`
    are [`open`][xckpt.formats.open]'s; a source opened here is closed before `load` returns, an open
    [`Source`][xckpt.source.Source] passed as `path` stays open.
    """
    # The manifest's objects and the outputs hold no cycles: no collections while they are built.
    options = {"format": format, "allow_pickle": allow_pickle, "rules": rules, "context": context}
    with paused_gc(), opened(path, **options) as src:
        out: dict[str, Any] = dict(src.read_all(show_progress=show_progress))
        out.update(
            src.objects(
                readable_objects(src, allow_pickle),
                world_size=1 if per_rank == "error" else None,
                per_rank=per_rank,
            )
        )
    return out
