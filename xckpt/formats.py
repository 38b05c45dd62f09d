"""The formats table: format name -> how to detect it, open it as a Source, and write it.

Every format is a source and a sink (DESIGN.md section 6). :data:`FORMATS` holds one
:class:`Format` per format, in detection order; :func:`detect`, :func:`open` and
``xckpt.convert`` use nothing else. A format is:

* ``detect(where) -> bool``: a cheap look (file names, a few magic bytes), never a
  full parse; ``looks_for`` says in words what it looks for, so a location where
  nothing is recognised gets a message naming, per format, why it said no. A format
  whose row says ``anywhere`` is detected and opened at every location a checkpoint
  can live in: ``where`` is a :class:`~xckpt.storage.Place` (a local path, a kvstore
  URL or spec, ``http(s)://``), listed (kvstores) or probed (http) to detect; other
  formats are given a local path (a ``str``) and are read from local paths only;
* ``open(location, *, allow_pickle, context) -> Source``: parse the format's metadata
  and return the :class:`~xckpt.source.Source`, or raise an
  :class:`~xckpt.errors.XckptError` that says what is wrong with the location. xckpt
  checkpoints open from any tensorstore location, and so do the ``anywhere`` formats
  (torch DCP, orbax, safetensors, torch.save; safetensors and torch.save over
  ``http(s)://`` too), reading byte ranges only;
* ``sink``: the :class:`~xckpt.sink.Sink` that writes it (``xckpt.convert``'s output);
* ``suffixes``: the output names that choose it when ``convert`` is given no
  ``to_format`` (the first format whose suffix ends the name; xckpt otherwise).

:func:`open` detects, opens, and applies ``rules`` (a view over the source).
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
from xckpt.sink import Sink
from xckpt.source import Source, local_path, readable_objects
from xckpt.storage import Location, Place, as_place

__all__ = ["FORMATS", "Format", "Opener", "open", "opened", "load", "detect", "listing"]


class Opener(Protocol):
    """Open a checkpoint of one format at ``location`` (see the module docstring)."""

    def __call__(self, location: Any, *, allow_pickle: bool, context: Any) -> Source: ...


@dataclass(frozen=True)
class Format:
    """One row of the formats table: a format's name, detection, source and sink.

    Attributes:
        name: ``xckpt``, ``torch-dcp``, ``orbax``, ``safetensors`` or ``torch``.
        detect: whether a local path holds this format (cheap; never a full parse).
        looks_for: what ``detect`` looks for, in words (said when it says no).
        kinds: what it can be at a location: ``"dir"``, ``"file"`` or both.
        open: opens a location of this format as a source.
        sink: writes this format (``xckpt.convert``'s output).
        suffixes: output names that choose this format in ``convert``.
        anywhere: ``detect`` and ``open`` take any location (a :class:`~xckpt.storage.Place`);
            otherwise the format is read from local paths only and ``detect`` takes a ``str``.
    """

    name: str
    detect: Callable[[Any], bool]
    looks_for: str
    kinds: frozenset[str]
    open: Opener
    sink: Sink
    suffixes: tuple[str, ...] = ()
    anywhere: bool = False

    def detects(self, place: Place) -> bool:
        """Whether ``detect`` says yes at ``place`` (no for a non-local place unless ``anywhere``)."""
        if self.anywhere:
            return self.detect(place)
        return place.local is not None and self.detect(place.local)

    def why_not(self, path: str | Place) -> str:
        """Why ``detect`` said no at ``path``, in words."""
        place = as_place(path)
        if not self.anywhere and place.local is None:
            return f"read from local paths only ({self.name} checkpoints elsewhere: copy them locally)"
        kind = place.kind()
        if kind is not None and kind not in self.kinds:
            want = "directories" if self.kinds == {"dir"} else "files"
            return f"{'a directory' if kind == 'dir' else 'a file'}, and {self.name} checkpoints are {want}"
        if not place.listable:
            return f"no {self.looks_for} (an http(s) location cannot be listed: only a Hugging Face directory's names are probed)"
        return f"no {self.looks_for}"


def _is_xckpt(path: str | Place) -> bool:
    place = as_place(path)
    local = place.local
    if local is not None:
        # data/ alone is a save that never committed: the xckpt reader says so.
        return os.path.isdir(local) and any(os.path.exists(os.path.join(local, p)) for p in ("xckpt.json", "ranks", "data"))
    # A kvstore: a HEAD of xckpt.json and a listing of ranks/ (never of the data).
    return place.listable and (place.isfile("xckpt.json") or place.isdir("ranks"))


def _open_xckpt(location: Any, *, allow_pickle: bool, context: Any) -> Source:
    return Checkpoint(location, context=context)


def _local(name: str, open_local: Callable[..., Source]) -> Opener:
    """An opener for a format read from local paths only."""

    def open_(location: Any, *, allow_pickle: bool, context: Any) -> Source:
        local = local_path(location)
        if local is None:
            raise XckptError(
                f"{location!r}: {name} checkpoints are read from local paths (or file:// URLs); copy "
                "it locally, or convert it to xckpt, which reads from any kvstore"
            )
        return open_local(local, allow_pickle=allow_pickle)

    return open_


def _anywhere(open_at: Callable[..., Source]) -> Opener:
    """An opener for a format read from any location (:func:`~xckpt.storage.as_place`)."""

    def open_(location: Any, *, allow_pickle: bool, context: Any) -> Source:
        return open_at(as_place(location, context), allow_pickle=allow_pickle)

    return open_


_DIR, _FILE = frozenset({"dir"}), frozenset({"file"})

#: Format name -> :class:`Format`, in detection order.
FORMATS: Mapping[str, Format] = {
    f.name: f
    for f in (
        Format("xckpt", _is_xckpt, "xckpt.json, ranks/ or data/", _DIR, _open_xckpt, XckptSink(), anywhere=True),
        Format(  # before torch-dcp: a Megatron-Core dist checkpoint is a DCP directory plus metadata.json
            "megatron",
            megatron.detect,
            "metadata.json with a sharded_backend beside a DCP checkpoint (Megatron-Core)",
            _DIR,
            _anywhere(megatron.open),
            megatron.SINK,  # read-only: refuses with a message
            anywhere=True,
        ),
        Format(
            "torch-dcp",
            torch_dcp.detect,
            ".metadata or __<r>.metadata beside *.distcp files",
            _DIR,
            _anywhere(torch_dcp.open),
            DcpSink(),
            anywhere=True,
        ),
        Format(
            "deepspeed",
            deepspeed.detect,
            "latest / latest_universal naming a tag directory, nor *_model_states.pt beside "
            "*_optim_states.pt or zero/ (DeepSpeed)",
            _DIR,
            _anywhere(deepspeed.open),
            deepspeed.SINK,  # read-only: refuses with a message
            anywhere=True,
        ),
        Format(
            "orbax",
            orbax.detect,
            "_METADATA or _CHECKPOINT_METADATA (here or in item subdirectories), nor numbered steps "
            "holding them",
            _DIR,
            _anywhere(orbax.open),
            OrbaxSink(),
            anywhere=True,
        ),
        Format(
            "safetensors",
            safetensors.detect,
            "*.safetensors file, model.safetensors.index.json, or safetensors header",
            _DIR | _FILE,
            _anywhere(safetensors.open),
            SafetensorsSink(),
            (".safetensors",),
            anywhere=True,
        ),
        Format(
            "torch",
            torch_save.detect,
            "torch.save zip (an archive/data.pkl record) or legacy torch.save pickle",
            _FILE,
            _anywhere(torch_save.open),
            TorchSaveSink(),
            (".pt", ".pth", ".bin"),
            anywhere=True,
        ),
    )
}


def listing(path: Any) -> str:
    """What is at ``path`` (any location), in words (for messages)."""
    return as_place(path).describe()


def detect(path: Any, *, context: Any = None) -> str:
    """The name of the format at ``path``: a local path, a kvstore URL or spec, or an
    ``http(s)://`` URL (``context``: the tensorstore Context of a ``memory://`` location).

    Each format of :data:`FORMATS` is tried in order: local paths by their files, kvstore
    locations by listing them (xckpt by a probe of ``xckpt.json`` and a listing of
    ``ranks/``), http(s) locations by probing names (they cannot be listed). A kvstore
    location where nothing is recognised is opened as xckpt, whose reader says what is
    missing.

    Raises:
        CheckpointNotFoundError: nothing recognised; the message lists what was
            found, and each format tried with why it said no.
    """
    return _detect(as_place(path, context))


def _detect(place: Place) -> str:
    tried = []
    for fmt in FORMATS.values():
        if fmt.detects(place):
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
    """Open the checkpoint at ``path``, of any format, for reading (metadata only).

    Args:
        path: a local directory or file, a kvstore URL (``file://``, ``memory://``,
            ``gs://``, ``s3://``), a tensorstore kvstore spec dict, an ``http(s)://`` URL
            (safetensors files and Hugging Face directories, torch.save files), or an open
            :class:`~xckpt.source.Source` (returned as is, seen through ``rules``).
        format: force a format (``xckpt``, ``torch-dcp``, ``orbax``, ``safetensors``,
            ``torch``) instead of detecting it.
        allow_pickle: let pickled objects (DCP's non-tensor values; torch.save objects of
            classes outside the allow-list) be read. Tensor metadata is always read with a
            restricted unpickler; without this flag nothing runs code.
        rules: rename/transpose/stack rules (a list of dicts, or a JSON/TOML file),
            applied as a view: reads still touch only the bytes they need.
        context: a tensorstore Context for xckpt checkpoints.
        step: ``path`` is a checkpoint manager's root (:class:`xckpt.CheckpointManager`):
            open its step ``step``, a step number or ``"latest"`` (the highest complete
            step), instead (:func:`xckpt.steps.resolve_step`).

    Raises:
        CheckpointNotFoundError: nothing recognised at ``path``; at a manager root opened
            without ``step``, the message names its steps and how to open one.
        XckptError: ``format`` does not fit what is there, or the metadata is bad.
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
        place = as_place(path, context)  # detection's listing is kept for the opener
        name = _detect(place) if format is None else format
        fmt = FORMATS.get(name)
        if fmt is None:
            raise XckptError(f"unknown format {name!r}; known formats: {', '.join(FORMATS)}")
        src = fmt.open(place if fmt.anywhere and name != "xckpt" else path, allow_pickle=allow_pickle, context=context)
    except CheckpointNotFoundError as e:
        # Nothing here; a checkpoint manager's root says so and names its steps (only now is it listed).
        root_error = manager_root_error(path, context=context) if step is None and format in (None, "xckpt") else None
        if root_error is not None:
            raise root_error from e
        raise
    return src if rules is None else _with_rules(src, rules)


def _with_rules(src: Source, rules: Any) -> Source:
    """``src`` seen through ``rules``; a bad rule closes the source it was given."""
    try:
        return apply_rules(src, rules)
    except BaseException:
        src.close()
        raise


@contextlib.contextmanager
def opened(path: Location | Source, **options: Any) -> Iterator[Source]:
    """:func:`open` as a context manager that closes what it opened.

    A :class:`~xckpt.source.Source` given as ``path`` belongs to the caller and
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
    unless ``allow_pickle=True``. ``format``, ``allow_pickle``, ``rules`` and ``context``
    are :func:`open`'s; a source opened here is closed before ``load`` returns, an open
    :class:`~xckpt.source.Source` passed as ``path`` stays open.
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
