"""Which format is at a location, and open it as a :class:`~xckpt.source.Source`.

Every format is a source (DESIGN.md section 6). The xckpt reader lives in the
core; each foreign format is one module of :mod:`xckpt.converters` with:

* ``FORMAT``: its name (``torch-dcp``, ``orbax``, ``safetensors``, ``torch``);
* ``detect(path: str) -> bool``: a cheap look at a *local* path (file names, a
  few magic bytes), never a full parse; called in the order of :data:`FORMATS`;
* ``open(path: str, *, allow_pickle: bool) -> Source``: parse the format's
  metadata and return the source, or raise an :class:`~xckpt.errors.XckptError`
  that says what is wrong with the location.

:func:`open` detects, opens, and applies ``rules`` (a view over the source).
Foreign formats are read from local paths (or ``file://`` URLs); xckpt
checkpoints from any tensorstore location.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from xckpt.errors import CheckpointNotFoundError, XckptError
from xckpt.manifest import paused_gc
from xckpt.reader import Checkpoint
from xckpt.rules import apply_rules
from xckpt.source import Source, local_path, readable_objects

__all__ = ["FORMATS", "open", "opened", "load", "detect"]

#: Format name -> module implementing it, in detection order.
FORMATS: dict[str, str] = {
    "xckpt": "xckpt.reader",
    "torch-dcp": "xckpt.converters.torch_dcp",
    "orbax": "xckpt.converters.orbax",
    "safetensors": "xckpt.converters.safetensors",
    "torch": "xckpt.converters.torch_save",
}


def _module(fmt: str) -> Any:
    return importlib.import_module(FORMATS[fmt])


def _has_xckpt(path: str) -> bool:
    # data/ alone is a save that never committed: the xckpt reader says so.
    return any(os.path.exists(os.path.join(path, p)) for p in ("xckpt.json", "ranks", "data"))


def _listing(path: str) -> str:
    if not os.path.exists(path):
        return "nothing (the path does not exist)"
    if os.path.isfile(path):
        return f"a file of {os.path.getsize(path)} bytes"
    try:
        entries = sorted(os.listdir(path))
    except OSError as e:
        return f"an unreadable directory ({e.strerror})"
    if not entries:
        return "an empty directory"
    shown = ", ".join(entries[:12]) + (f", ... ({len(entries)} entries)" if len(entries) > 12 else "")
    return f"a directory holding {shown}"


def detect(path: Any) -> str:
    """The name of the format at ``path`` (a local path, URL or kvstore spec).

    Raises:
        CheckpointNotFoundError: nothing recognised; the message lists what was
            found and the formats known.
    """
    local = local_path(path)
    if local is None:
        return "xckpt"  # kvstore URLs and specs hold xckpt checkpoints
    if os.path.isdir(local) and _has_xckpt(local):
        return "xckpt"
    for fmt in FORMATS:
        if fmt == "xckpt":
            continue
        if _module(fmt).detect(local):
            return fmt
    raise CheckpointNotFoundError(
        f"no checkpoint recognised at {local!r}: found {_listing(local)}. Known formats: "
        f"{', '.join(FORMATS)} (xckpt: xckpt.json or ranks/; torch-dcp: .metadata or "
        "__<r>.metadata beside *.distcp; orbax: _METADATA or _CHECKPOINT_METADATA; safetensors: "
        "a .safetensors file or a directory of them; torch: a torch.save zip file). Pass "
        "format= to force one"
    )


def open(  # noqa: A001
    path: Any,
    *,
    format: str | None = None,  # noqa: A002
    allow_pickle: bool = False,
    rules: Sequence[Mapping[str, Any]] | str | os.PathLike[str] | None = None,
    context: Any = None,
) -> Source:
    """Open the checkpoint at ``path``, of any format, for reading (metadata only).

    Args:
        path: a local directory or file, a kvstore URL (``file://``, ``memory://``,
            ``gs://``, ``s3://``), a tensorstore kvstore spec dict, or an open
            :class:`~xckpt.source.Source` (returned as is, seen through ``rules``).
        format: force a format (``xckpt``, ``torch-dcp``, ``orbax``, ``safetensors``,
            ``torch``) instead of detecting it.
        allow_pickle: let pickled objects (DCP's non-tensor values) be read. Tensor
            metadata is always read with a restricted unpickler; nothing runs code.
        rules: rename/transpose/stack rules (a list of dicts, or a JSON/TOML file),
            applied as a view: reads still touch only the bytes they need.
        context: a tensorstore Context for xckpt checkpoints.

    Raises:
        CheckpointNotFoundError: nothing recognised at ``path``.
        XckptError: ``format`` does not fit what is there, or the metadata is bad.
    """
    if isinstance(path, Source):  # already open: only the rules view is added
        if format is not None and format != path.format:
            raise XckptError(f"{path.path!r} is open as {path.format}, not {format}")
        return path if rules is None else _with_rules(path, rules)
    fmt = detect(path) if format is None else format
    if fmt not in FORMATS:
        raise XckptError(f"unknown format {fmt!r}; known formats: {', '.join(FORMATS)}")
    if fmt == "xckpt":
        src: Source = Checkpoint(path, context=context)
    else:
        local = local_path(path)
        if local is None:
            raise XckptError(
                f"{path!r}: {fmt} checkpoints are read from local paths (or file:// URLs); copy it "
                "locally, or convert it to xckpt, which reads from any kvstore"
            )
        src = _module(fmt).open(local, allow_pickle=allow_pickle)
    return src if rules is None else _with_rules(src, rules)


def _with_rules(src: Source, rules: Any) -> Source:
    """``src`` seen through ``rules``; a bad rule closes the source it was given."""
    try:
        return apply_rules(src, rules)
    except BaseException:
        src.close()
        raise


@contextlib.contextmanager
def opened(path: Any, **options: Any) -> Iterator[Source]:
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
    path: Any,
    *,
    format: str | None = None,  # noqa: A002
    allow_pickle: bool = False,
    rules: Any = None,
    per_rank: str = "error",
    show_progress: bool | None = None,
) -> dict[str, Any]:
    """Every tensor (numpy) and object of a checkpoint of any format, by name, in one process.

    Pickled objects (DCP's non-tensor values) are left out, with a warning naming them,
    unless ``allow_pickle=True``.
    """
    # The manifest's objects and the outputs hold no cycles: no collections while they are built.
    with paused_gc(), open(path, format=format, allow_pickle=allow_pickle, rules=rules) as src:
        out: dict[str, Any] = dict(src.read_all(show_progress=show_progress))
        out.update(
            src.objects(
                readable_objects(src, allow_pickle),
                world_size=1 if per_rank == "error" else None,
                per_rank=per_rank,
            )
        )
    return out
