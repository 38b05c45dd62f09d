"""A checkpoint manager's root: its numbered steps, read from storage and deleted safely.

[`xckpt.CheckpointManager`][xckpt.CheckpointManager] writes each step as an ordinary xckpt checkpoint at
`<root>/<step>/` (the step's plain decimal number). Everything that looks at such a
root from storage alone lives here, below `xckpt.formats` and the CLI, so that
`xckpt.open(root, step="latest")`, `xckpt ls ROOT` and the manager itself read a
root the same way:

* `manager_steps` lists the numbered steps, each a `StepInfo` that says
  whether the step is complete (a reader accepts it: `xckpt.json`, or rank manifests
  `0..W-1` of one save that tile every tensor) and, when it is, its metrics;
* `resolve_step` turns `"latest"` or a number into the step's location;
* `manager_root_error` is the error for opening a root as one checkpoint;
* `delete_step` removes a step manifests first (`xckpt.json`, then
  `ranks/*.json`, then the data), so a step whose deletion stops part way is
  incomplete, never a complete-looking step with missing data;
* `encode_metrics` / `decode_metrics`: metrics as stored in the step's
  manifest metadata (`metadata["manager"]`), non-finite floats included (JSON has
  no NaN, so they are stored as `{"float": "nan"}`).

Locations are anything a checkpoint path may be: a directory, a kvstore URL or a
kvstore spec dict. A local root is listed with `os.listdir`; any other is listed
through its tensorstore kvstore (one listing of the keys under the root). Nothing
here talks to other ranks.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from xckpt.errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    ManifestError,
    StorageError,
    XckptError,
)
from xckpt.manifest import MAX_OBJECT_DEPTH, Manifest
from xckpt.native.commit import read_rank_manifests, validate
from xckpt.storage import Location, Storage, fsync_dir, location_name, location_spec

__all__ = [
    "MANAGER_KEY",
    "StepInfo",
    "step_location",
    "step_numbers",
    "read_step",
    "manager_steps",
    "resolve_step",
    "manager_root_error",
    "delete_step",
    "delete_checkpoint",
    "steps_table",
    "TIERS_KEY",
    "read_tiers",
    "tiers_lines",
    "encode_metrics",
    "decode_metrics",
    "check_step",
]

#: The key of a step's manifest metadata that the manager owns:
#: `{"step": 12, "metrics": {...} | None, "saved_at": <unix time>}`.
MANAGER_KEY = "manager"
#: Longest step number (digits) a root listing accepts as a step directory.
_MAX_DIGITS = 19


@dataclass(frozen=True)
class StepInfo:
    """One numbered step under a manager root, as storage holds it.

    Attributes:
        step: the step number (the directory's name).
        location: where the step's checkpoint is (a path, URL or kvstore spec dict).
        complete: whether a reader accepts the checkpoint.
        metrics: the metrics saved with the step (None: saved without metrics, or
            the step is incomplete).
        saved_at: when the step was saved (Unix seconds, from the saving rank 0's clock).
        save_id: the id of the complete save.
        world_size: the ranks that wrote it.
        problem: why an incomplete step is incomplete (the reader's message).
    """

    step: int
    location: Any
    complete: bool
    metrics: Mapping[str, Any] | None = None
    saved_at: float | None = None
    save_id: str | None = None
    world_size: int | None = None
    problem: str | None = None


def check_step(step: Any) -> int:
    """`step` as a Python int: a Python or numpy integer >= 0 (not a bool).

    Raises:
        XckptError: anything else, naming it.
    """
    ok = isinstance(step, int) and not isinstance(step, bool)
    if not ok and type(step).__module__ == "numpy" and hasattr(step, "dtype"):
        ok = getattr(step.dtype, "kind", "") in "iu" and getattr(step, "ndim", 1) == 0
    if not ok or int(step) < 0:
        raise XckptError(
            f"step {step!r} ({type(step).__name__}) is not a step number: a step is a Python or numpy "
            "integer >= 0 (its directory is <root>/<step>/); pass e.g. int(step)"
        )
    return int(step)


def _is_step_name(name: str) -> bool:
    """A plain decimal number as the manager names steps (`12`, not `012` or `+12`)."""
    return (
        0 < len(name) <= _MAX_DIGITS and name.isascii() and name.isdigit() and (name == "0" or name[0] != "0")
    )


def step_location(root: Location, step: int) -> Location:
    """The location of step `step` under `root` (the same kind: path, URL or spec dict)."""
    if isinstance(root, Mapping):
        spec = location_spec(root)
        if not isinstance(spec, dict):  # (a Mapping always gives a dict; this narrows the type)
            raise XckptError(f"{root!r} is not a kvstore spec")
        return {**spec, "path": f"{spec['path']}{step}/"}
    text = os.fspath(root)
    if "://" in text:
        return f"{text.rstrip('/')}/{step}/"
    return os.path.join(text, str(step))


def step_numbers(root: Location, *, context: Any = None) -> list[int]:
    """The numbered step directories under `root` (complete or not), ascending.

    A root that does not exist yet holds no steps.
    """
    storage = Storage(root, context)
    if storage.root is not None:
        try:
            names = os.listdir(storage.root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise StorageError(e.errno, f"cannot list the manager root {storage.path!r}: {e.strerror}") from e
        return sorted(
            int(n) for n in names if _is_step_name(n) and os.path.isdir(os.path.join(storage.root, n))
        )
    found = {k.split("/", 1)[0] for k in storage.list_prefix("") if "/" in k}
    return sorted(int(n) for n in found if _is_step_name(n))


def _manifest_of(storage: Storage) -> Manifest:
    """The step's accepted manifest, exactly as [`xckpt.Checkpoint`][xckpt.Checkpoint] accepts one."""
    data = storage.read_key("xckpt.json")
    if data is None:
        return read_rank_manifests(storage)
    m = Manifest.loads(data, f"{storage.path}/xckpt.json")
    if m.rank is not None:
        raise ManifestError(f"{storage.path}/xckpt.json has rank {m.rank}; expected null")
    validate(m, storage.path)
    return m


def read_step(root: Location, step: int, *, context: Any = None) -> StepInfo:
    """What storage holds for step `step` of `root` (see `StepInfo`)."""
    loc = step_location(root, step)
    storage = Storage(loc, context)
    try:
        m = _manifest_of(storage)
    except StorageError:
        raise
    except XckptError as e:  # incomplete, claimed, damaged: a reader would refuse it
        return StepInfo(step, loc, False, problem=str(e))
    own = m.metadata.get(MANAGER_KEY)
    metrics = saved_at = None
    if isinstance(own, Mapping):
        metrics = decode_metrics(own.get("metrics"))
        t = own.get("saved_at")
        saved_at = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None
    return StepInfo(
        step, loc, True, metrics=metrics, saved_at=saved_at, save_id=m.save_id, world_size=m.world_size
    )


def manager_steps(
    root: Location, *, context: Any = None, known: Mapping[int, StepInfo] | None = None
) -> list[StepInfo]:
    """Every numbered step under `root`, complete or not, ascending by step.

    Args:
        root: the manager root (a directory, kvstore URL or kvstore spec dict).
        context: a tensorstore Context (default: xckpt's process-wide one).
        known: complete steps read before (by step): a listed step found here is
            not read again (the manager passes what it has read and written itself).
    """
    out = []
    for s in step_numbers(root, context=context):
        info = known.get(s) if known is not None else None
        out.append(info if info is not None and info.complete else read_step(root, s, context=context))
    return out


def _complete(infos: Sequence[StepInfo]) -> list[int]:
    return [i.step for i in infos if i.complete]


def resolve_step(root: Location, step: Any, *, context: Any = None) -> Location:
    """The location of a complete step of a manager root.

    Args:
        root: the manager root.
        step: `"latest"` (the highest complete step), or a step number (an int,
            or its decimal string as typed on a command line).

    Raises:
        CheckpointNotFoundError: the root holds no complete step (`"latest"`), or
            no step `step` at all; the message lists the complete steps.
        IncompleteCheckpointError: step `step` exists but is incomplete.
        XckptError: `step` is neither `"latest"` nor a step number.
    """
    name = location_name(root)
    if isinstance(step, str) and step != "latest":
        if not _is_step_name(step):
            raise XckptError(f"step {step!r} is neither 'latest' nor a step number (e.g. step=12)")
        step = int(step)
    if step == "latest":
        infos = manager_steps(root, context=context)
        done = _complete(infos)
        if not done:
            raise CheckpointNotFoundError(
                f"{name!r} holds no complete step"
                + (f" (incomplete: {[i.step for i in infos]}: saves that did not finish)" if infos else "")
                + "; save one first (xckpt.CheckpointManager(root).save(step, state)), or check the root"
            )
        return step_location(root, done[-1])
    s = check_step(step)
    info = read_step(root, s, context=context)
    if info.complete:
        return info.location
    done = _complete(manager_steps(root, context=context))
    if s not in step_numbers(root, context=context):
        raise CheckpointNotFoundError(
            f"{name!r} has no step {s}; its complete steps are {done}. Pass one of them, or step='latest'"
        )
    raise IncompleteCheckpointError(
        f"step {s} of {name!r} is incomplete (a save that did not finish: {info.problem}); its complete "
        f"steps are {done}. Open one of them, or step='latest'"
    )


def manager_root_error(root: Any, *, context: Any = None) -> CheckpointNotFoundError | None:
    """The error for opening `root` as one checkpoint when it is a manager root, else None.

    A manager root is a location holding numbered step directories with xckpt
    checkpoints (complete or not) and no checkpoint of its own. Callers ask only
    after opening `root` failed, so ordinary opens never list a location.
    """
    try:
        infos = manager_steps(root, context=context)
    except XckptError:
        return None
    if not infos:
        return None
    name = location_name(root)
    done = _complete(infos)
    partial = [i.step for i in infos if not i.complete]
    held = f"complete steps {done}" if done else "no complete step"
    if partial:
        held += f" and incomplete steps {partial} (saves that did not finish; never opened)"
    if not done:
        return CheckpointNotFoundError(
            f"{name!r} is a checkpoint manager root, not one checkpoint, and holds {held}; nothing to open"
        )
    return CheckpointNotFoundError(
        f"{name!r} is a checkpoint manager root, not one checkpoint: it holds {held}. Open one step: "
        f"xckpt.open(root, step='latest') (step {done[-1]}) or step={done[0]} (`--step latest` or "
        f"`--step {done[0]}` on the command line), or the step's own location "
        f"{location_name(step_location(root, done[-1]))!r}"
    )


def delete_step(root: Location, step: int, *, context: Any = None) -> None:
    """Delete step `step` of `root`: manifests first, then data (`delete_checkpoint`).

    Raises:
        StorageError: storage refused a deletion (the step may be left incomplete).
    """
    delete_checkpoint(
        step_location(root, step),
        context=context,
        what=f"step {step} of manager root {location_name(root)!r}",
        fix="it is left incomplete and a later retention retries; check the permissions of the root",
    )


def delete_checkpoint(
    loc: Location,
    *,
    context: Any = None,
    what: str | None = None,
    fix: str = "it is left incomplete (a reader refuses it); check the permissions and delete it again",
) -> None:
    """Delete the checkpoint at `loc`: manifests first, then data.

    `xckpt.json` goes first, then every `ranks/<r>.json` (claims included), and
    only then the data: a deletion that stops part way leaves an incomplete
    checkpoint (a reader refuses it), never a complete-looking one whose data is
    gone. On a local disk the manifest removals are made durable (directory fsync)
    before any data is removed. Nothing there: nothing to do.

    Raises:
        StorageError: storage refused a deletion (the checkpoint may be left incomplete).
    """
    storage = Storage(loc, context)
    if storage.root is None:
        storage.delete_key("xckpt.json")
        storage.delete_prefix("ranks/")
        storage.delete_prefix("")
        return
    top = storage.root.rstrip("/")
    try:
        try:
            os.unlink(os.path.join(top, "xckpt.json"))
        except FileNotFoundError:
            pass
        fsync_dir(top, missing_ok=True)
        ranks = os.path.join(top, "ranks")
        if os.path.isdir(ranks):
            for n in os.listdir(ranks):
                os.unlink(os.path.join(ranks, n))
            fsync_dir(ranks, missing_ok=True)
        shutil.rmtree(top, ignore_errors=False)
    except FileNotFoundError:
        return
    except OSError as e:
        target = what if what is not None else f"checkpoint {location_name(loc)!r}"
        raise StorageError(e.errno, f"cannot delete {target} ({e}); {fix}") from e
    fsync_dir(os.path.dirname(top), missing_ok=True)


def encode_metrics(metrics: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`metrics` as stored: JSON values, non-finite floats as `{"float": "nan"}`.

    Scalars of numpy, torch or JAX (anything with `.item()` and one element)
    become Python numbers.

    Raises:
        XckptError: `metrics` is not a mapping with string keys, or a value is
            not a JSON value (naming it).
    """
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise XckptError(f"metrics must be a dict of names to values, got {type(metrics).__name__}")
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise XckptError(f"metrics keys must be strings, got {k!r}")
        out[k] = _encode_value(k, v, 0)
    return out


def _encode_value(name: str, v: Any, depth: int) -> Any:
    if depth > MAX_OBJECT_DEPTH:
        raise XckptError(f"metric {name!r} nests deeper than {MAX_OBJECT_DEPTH} levels")
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, Mapping):
        return {str(k): _encode_value(name, x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_encode_value(name, x, depth + 1) for x in v]
    item = getattr(v, "item", None)
    n = v.numel() if callable(getattr(v, "numel", None)) else getattr(v, "size", None)  # torch / numpy, JAX
    if callable(item) and n == 1:
        return _encode_value(name, item(), depth + 1)
    raise XckptError(
        f"metric {name!r} is a {type(v).__name__}, which is not a JSON value; pass a number (e.g. "
        "float(loss)), a string, or a list or dict of them"
    )


def decode_metrics(stored: Any) -> dict[str, Any] | None:
    """The metrics a step was saved with, as `encode_metrics` stored them."""
    if not isinstance(stored, Mapping):
        return None
    return {str(k): _decode_value(v) for k, v in stored.items()}


def _decode_value(v: Any) -> Any:
    if isinstance(v, Mapping):
        if set(v) == {"float"} and v["float"] in ("nan", "inf", "-inf"):
            return float(v["float"])
        return {k: _decode_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_decode_value(x) for x in v]
    return v


def _fmt_metrics(m: Mapping[str, Any] | None) -> str:
    if not m:
        return "-"
    parts = []
    for k, v in m.items():
        parts.append(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)


#: A manager root's record of its local tiers (DESIGN.md section 11), written by the
#: manager's rank 0 when built and after each local step: where each node's local
#: directory is, how often local steps are saved, the latest one. JSON; only read by
#: `xckpt ls` (restores ask the ranks themselves, never this record).
TIERS_KEY = "tiers.json"


def read_tiers(root: Location, *, context: Any = None) -> dict[str, Any] | None:
    """The root's tier record (`TIERS_KEY`), or None when it has none or it is unreadable."""
    try:
        data = Storage(root, context).read_key(TIERS_KEY)
        doc = json.loads(data) if data is not None else None
    except (XckptError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("format") == "xckpt-tiers" else None


def tiers_lines(doc: Mapping[str, Any]) -> list[str]:
    """What `xckpt ls ROOT` says of the local steps, from a tier record."""
    try:
        nodes = [f"{n['host']}:{n['local']} (ranks {n['ranks'][0]}-{n['ranks'][-1]})" for n in doc["nodes"]]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(doc["updated_at"])))
        lines = [
            f"local steps: every {doc['local_every']} steps on {len(nodes)} nodes' local directories "
            f"({doc['replicas']} replicas on other nodes, {doc['local_keep']} kept), not under this root:"
        ]
        lines += [f"  {n}" for n in nodes[:16]] + ([f"  ... ({len(nodes)} nodes)"] if len(nodes) > 16 else [])
        latest = doc.get("latest_local_step")
        lines.append(
            f"  as of {when}: local steps {doc.get('local_steps', [])}"
            + (f", latest {latest}" if latest is not None else "")
            + "; CheckpointManager(root, local=...).restore() uses the newest complete step of both tiers"
        )
    except (KeyError, TypeError, ValueError, IndexError):
        return [f"local steps: the tier record {TIERS_KEY} is unreadable"]
    return lines


def steps_table(root: Location, infos: Sequence[StepInfo]) -> str:
    """The text `xckpt ls ROOT` prints for a manager root: one line a step, then a summary."""
    rows = [("step", "state", "saved", "metrics")]
    for i in infos:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.saved_at)) if i.saved_at else "-"
        state = "complete" if i.complete else "incomplete"
        rows.append((str(i.step), state, when, _fmt_metrics(i.metrics) if i.complete else "-"))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    done = _complete(infos)
    partial = [i for i in infos if not i.complete]
    summary = f"\ncheckpoint manager root {location_name(root)!r}: {len(done)} complete steps"
    summary += f" (latest {done[-1]})" if done else ""
    if partial:
        summary += (
            f", {len(partial)} incomplete (saves that did not finish; never opened, removed by the next save)"
        )
    lines.append(summary)
    for i in partial:
        lines.append(f"  step {i.step}: {(i.problem or '').splitlines()[0][:300]}")
    lines.append("open one with xckpt.open(root, step='latest') or `xckpt ls ROOT/<step>`")
    tiers = read_tiers(root)
    if tiers is not None:
        lines += tiers_lines(tiers)
    return "\n".join(lines)
