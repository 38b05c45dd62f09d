"""Conversion at scale: `xckpt.convert(..., workers=N)`, the same under `torchrun`, `resume`.

The output is cut into parts by `xckpt._parts.make_plan` (byte-balanced, one
output file each, decided by the source and the options, never by the number of
workers), and the parts are written by workers: `workers=N` local processes (the caller
and `N - 1` children started before it plans, forked where that is safe, see
`xckpt._convert_worker`; each takes the next part when it is free, the largest first), or
every rank of a `torchrun` job (each rank its byte-balanced share, `xckpt._parts.assign`). A
worker opens the source itself (its own connections to object storage) and reads only
the boxes of its parts. Every part goes into a temporary output beside `dst`
(`.<dst name>.xckpt-convert`); a journal beside it (`.<dst name>.xckpt-journal/`)
records each finished part's files and checksums once they are durable.

Then one process (the caller, or rank 0) writes what completes the output (an index,
DCP's `.metadata`, xckpt's merged manifest), every worker re-reads its own parts through
the format's reader and compares each box's crc32c with the source's (`verify`), and
the caller or rank 0 renames the output into place and removes the journal. Until that
rename nothing is at `dst`: a killed conversion never leaves a destination that looks
complete. With `resume=True` a conversion continues the journal of the same plan:
parts whose files still match their recorded checksums are kept (not rewritten), the
rest, a damaged finished file included, are written again. A failed run keeps its
temporary output and journal for a resume (delete both freely); a run without `resume`
starts afresh.

Under `torchrun` (the environment's `RANK`/`WORLD_SIZE`/`MASTER_ADDR`, or a
process group already initialized) the process group only agrees: every rank computes
the plan and all compare its id; after the parts, the results are gathered on rank 0
for the commit; after verify, rank 0 renames. A gloo group is started from the
environment when none is (and destroyed after), with a timeout of
`GROUP_TIMEOUT_S` between collectives. `dst` must be a filesystem every rank
sees. Progress for the whole job shows on rank 0 (the ranks add their bytes to the
group's store).

An xckpt output may also be in object storage (a kvstore URL or spec): there is no
rename, so the parts' writers write their ranks in place, the commit writes the merged
manifest, and xckpt's own commit protocol keeps a killed run from looking complete (a
reader needs every part's manifest); no `overwrite` or `resume` there.
"""

from __future__ import annotations

import datetime
import functools
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from xckpt import formats
from xckpt._convert_worker import _BatchedBar, _Child, _Spec, _Worker, start_children
from xckpt._parts import (
    DEFAULT_PART_SIZE,
    Journal,
    PartResult,
    Plan,
    assign,
    clear_commit,
    commit_files,
)
from xckpt._progress import progress
from xckpt.convert import (
    ConvertOptions,
    VerifyMismatchError,
    _check,
    _check_from_format,
    _check_structure,
    _commit,
    _remove,
    convert_one,
    destination,
    guess_format,
    parse_size,
)
from xckpt.errors import CheckpointExistsError, XckptError
from xckpt.source import local_path
from xckpt.storage import Storage

__all__ = ["convert", "torchrun_env", "GROUP_TIMEOUT_S"]

#: Seconds a rank waits at a collective (for the slowest rank's parts) before gloo gives up.
GROUP_TIMEOUT_S = 4 * 3600


def torchrun_env() -> bool:
    """Whether this process is one rank of a `torchrun` job of more than one rank (the
    `xckpt convert` command then converts with `workers="torchrun"`)."""
    env = os.environ
    return all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")) and env["WORLD_SIZE"] not in ("", "1")


# -- local worker processes ---------------------------------------------------------------------

def _poll(bar: Any, read: Callable[[], int], stop: threading.Event) -> None:
    seen, stopped = 0, False
    while not stopped:
        stopped = stop.wait(0.25)
        now = read()
        bar.update(now - seen)
        seen = now


class _Pool:
    """The caller's worker and its children (started first, see `start_children`), for the
    parts and then their verify: each takes the next task when free."""

    def __init__(self, plan: Plan, own: _Worker, children: Sequence[_Child]) -> None:
        self.plan, self.own, self.children = plan, own, list(children)

    def _share(self, tasks: Sequence[Any], local: Callable[[Any], Any], what: str) -> list[Any]:
        """`local(t)` or a child's `call(what, t)` of every task, in order: this process and
        each child take the next task when free; the first error stops the handing out and
        is raised."""
        out: list[Any] = [None] * len(tasks)
        lock, todo = threading.Lock(), iter(range(len(tasks)))
        errors: list[BaseException] = []

        def take() -> int | None:
            with lock:
                return None if errors else next(todo, None)

        def run(fn: Callable[[Any], Any]) -> None:
            while (i := take()) is not None:
                try:
                    out[i] = fn(tasks[i])
                except BaseException as e:  # noqa: BLE001 - raised by the caller below
                    with lock:
                        errors.append(e)

        feeders = [threading.Thread(target=run, args=(functools.partial(c.call, what),), daemon=True)
                   for c in self.children]
        for t in feeders:
            t.start()
        try:
            run(local)
        finally:
            for t in feeders:
                t.join()
        if errors:
            raise errors[0]
        return out

    def write(self) -> list[PartResult]:
        """Every part, the largest first, each to the next free process."""
        order = [p.index for p in sorted(self.plan.parts, key=lambda p: (-p.nbytes, p.index))]
        done = self._share([[i] for i in order], lambda ps: [self.own.write(p) for p in ps], "write")
        by_part = {r["part"]: r for rs in done for r in rs}
        return [by_part[i] for i in range(len(self.plan.parts))]

    def verify(self, results: list[PartResult]) -> None:
        self._share([[r] for r in results], self.own.verify, "verify")


# -- the driver ---------------------------------------------------------------------------------


def _prepare_tmp(plan: Plan, spec: _Spec, resume: bool) -> None:
    """Start or continue the journal; a fresh run removes a temporary output left behind."""
    if spec.journal is None:
        return  # object storage: the parts' writers claim the destination
    os.makedirs(os.path.dirname(spec.tmp), exist_ok=True)
    continued = Journal(spec.journal).start(plan, resume)
    if not continued:
        _remove(spec.tmp)
    else:
        clear_commit(plan, spec.tmp)
    if plan.kind != "single":
        os.makedirs(spec.tmp, exist_ok=True)


def _finish(spec: _Spec, worker: _Worker, results: list[PartResult], out: str, replace: bool) -> None:
    """Structure and objects checked (xckpt), journal removed, output renamed into place."""
    if spec.verify:
        job = worker.job(record=False)
        with formats.open(spec.tmp, format=spec.fmt) as back:
            if spec.fmt == "xckpt":
                _check_structure(job, back)
            problems = back._verify_objects() if worker.objects else []
        if problems:
            raise VerifyMismatchError(
                f"conversion of {worker.src.path!r} to {spec.fmt} does not read back as written: {problems[0]}; "
                "nothing was written to the destination. Check the disk and convert again"
            )
    if spec.journal is not None:
        Journal(spec.journal).remove()
        _commit(spec.tmp, out, replace)


def _local(
    spec: _Spec, workers: int, out: str, replace: bool, resume: bool, show_progress: bool | None
) -> None:
    # The children first, before this process opens the source (forked while no tensorstore
    # thread runs here; or fresh interpreters, importing while this process plans).
    children = start_children(workers - 1, None)
    worker: _Worker | None = None
    try:
        worker = _Worker(spec, None)
        if worker.skipped:
            _warn_skipped(worker)
        plan = worker.plan
        while len(children) > max(0, len(plan.parts) - 1):  # no more processes than parts
            children.pop().close()
        total = sum(p.nbytes for p in plan.parts)
        with progress(total, f"convert to {spec.fmt} ({workers} workers)", show_progress) as bar:
            worker.bar = bar
            _check(formats.FORMATS[spec.fmt], worker.job())
            _prepare_tmp(plan, spec, resume)
            for c in children:
                c.bar = bar
                c.start(spec, plan)
            pool = _Pool(plan, worker, children)
            results = pool.write()
        commit_files(worker.job(record=False), plan, results)
        try:
            if spec.verify:
                pool.verify(results)
            _finish(spec, worker, results, out, replace)
        except VerifyMismatchError:
            _discard(spec)  # damaged: a resume must not keep it
            raise
    finally:
        for c in children:
            c.close()
        if worker is not None:
            worker.close()


def _discard(spec: _Spec) -> None:
    """Remove a conversion's output that failed verify (and its journal)."""
    if spec.journal is None:
        Storage(spec.tmp).delete_prefix("")
        return
    _remove(spec.tmp)
    Journal(spec.journal).remove()


def _remote(
    src: Any, dst: Any, *, from_format: str | None, to_format: str | None, overwrite: bool, resume: bool
) -> None:
    """The checks before an xckpt output is written in place in object storage."""
    if (to_format or "xckpt") != "xckpt":
        raise XckptError(
            f"convert writes {to_format} to local paths; {dst!r} is not one. Convert to xckpt there, or "
            "convert locally and copy"
        )
    if overwrite or resume:
        raise XckptError(
            f"an xckpt output in object storage ({dst!r}) is written in place: overwrite and resume are for "
            "local outputs. Delete the location first, or convert to a new one"
        )
    if from_format is not None:
        _check_from_format(src, from_format)
    storage = Storage(dst)
    if storage.read_key("xckpt.json") is not None or storage.list_prefix("ranks/"):
        raise CheckpointExistsError(
            f"{dst!r} already holds a checkpoint (or a conversion that was killed there); delete the location, "
            "or convert to a new one"
        )


def _warn_skipped(worker: _Worker) -> None:
    warnings.warn(
        f"convert {worker.src.path!r}: skipping pickled objects {worker.skipped}; pass allow_pickle=True "
        "(--allow-pickle) to convert them (unpickling runs code stored in the checkpoint)",
        stacklevel=4,
    )


# -- torchrun -----------------------------------------------------------------------------------


#: The key of the process group's store under which the ranks add their bytes (progress).
_BAR_KEY = "xckpt/convert/bytes"


def _rank_child(spec: _Spec, plan: Plan, bar: Any) -> _Child:
    """The process that writes and verifies a rank's parts: a fresh interpreter (no torch
    imported, so a rank's working memory is not on top of torch's; and a rank, with torch's
    and gloo's threads, must not fork); the rank only agrees and commits."""
    child = _Child(bar, fork=False, who="this rank's conversion process")
    try:
        child.start(spec, plan)
    except BaseException:
        child.close()
        raise
    return child


def _agree(dist: Any, value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _raise_any(gathered: Sequence[Any], what: str) -> None:
    errors = [(r, e[_ERROR]) for r, e in enumerate(gathered) if isinstance(e, dict) and _ERROR in e]
    if errors:
        r, e = errors[0]
        more = f" (and {len(errors) - 1} more ranks failed)" if len(errors) > 1 else ""
        raise XckptError(f"{what} failed on rank {r}: {e}{more}")


#: The key of a rank's error in what it sends at a collective.
_ERROR = "xckpt-convert-error"


def _attempt(fn: Callable[[], Any]) -> Any:
    """`fn()`, or `{_ERROR: its error}` (so every rank reaches the next collective)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - sent to every rank, raised there as an XckptError
        return {_ERROR: f"{type(e).__name__}: {e}"}


def _group() -> tuple[Any, bool]:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist, False
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    return dist, True


def _store(dist: Any) -> Any:
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return get() if get is not None else None
    except (RuntimeError, ValueError):
        return None


def _torchrun(spec: _Spec, out: str, replace: bool, resume: bool, show_progress: bool | None) -> None:
    dist, own = _group()
    try:
        _torchrun_body(dist, spec, out, replace, resume, show_progress)
    finally:
        if own:
            dist.destroy_process_group()


def _torchrun_body(
    dist: Any, spec: _Spec, out: str, replace: bool, resume: bool, show_progress: bool | None
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _store(dist)
    sbar = _BatchedBar(lambda n: store.add(_BAR_KEY, n) if store is not None else None)
    got = _attempt(lambda: _Worker(spec, sbar))
    child: _Child | None = None
    try:
        ids = _agree(dist, got.plan.plan_id if isinstance(got, _Worker) else got)
        _raise_any(ids, "opening the source and planning")
        worker: _Worker = got
        if len(set(ids)) != 1:
            raise XckptError(
                f"the ranks planned different conversions of {spec.src!r} (plan ids {sorted(set(ids))}): they "
                "must see the same source and options"
            )
        plan = worker.plan
        if rank == 0 and worker.skipped:
            _warn_skipped(worker)
        ready = _attempt(lambda: _rank0_prepare(worker, plan, spec, resume)) if rank == 0 else None
        _raise_any(_agree(dist, ready), "preparing the output")
        mine = assign(plan, world)[rank]
        child = _rank_child(spec, plan, sbar) if mine else None
        with _rank0_bar(rank, store, sum(p.nbytes for p in plan.parts), spec.fmt, world, show_progress):
            results = _attempt(lambda: child.call("write", mine) if child is not None else [])
            sbar.flush()
            gathered = _agree(dist, results)
        _raise_any(gathered, "writing the parts")
        every = sorted((r for rs in gathered for r in rs), key=lambda r: r["part"])
        done = _attempt(lambda: commit_files(worker.job(record=False), plan, every)) if rank == 0 else None
        _raise_any(_agree(dist, done), "completing the output")
        mine_results = [every[p] for p in mine]
        checked = _attempt(lambda: child.call("verify", mine_results) if spec.verify and child is not None else None)
        _raise_any(_agree(dist, checked), "verifying the output")
        final = _attempt(lambda: _finish(spec, worker, every, out, replace)) if rank == 0 else None
        _raise_any(_agree(dist, final), "committing the output")
    finally:
        if child is not None:
            child.close()
        if isinstance(got, _Worker):
            got.close()


def _rank0_prepare(worker: _Worker, plan: Plan, spec: _Spec, resume: bool) -> None:
    _check(formats.FORMATS[spec.fmt], worker.job())
    _prepare_tmp(plan, spec, resume)


class _rank0_bar:  # noqa: N801 - a context manager used like a function
    """Rank 0's bar over every rank's bytes (polled from the store); nothing elsewhere."""

    def __init__(self, rank: int, store: Any, total: int, fmt: str, world: int, show: bool | None) -> None:
        self._on = rank == 0 and store is not None
        self._args = (total, f"convert to {fmt} ({world} ranks)", show)
        self._store = store

    def __enter__(self) -> None:
        if not self._on:
            return
        self._cm = progress(*self._args)
        bar = self._cm.__enter__()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_poll, args=(bar, lambda: int(self._store.add(_BAR_KEY, 0)), self._stop), daemon=True
        )
        self._thread.start()

    def __exit__(self, *exc: Any) -> None:
        if self._on:
            self._stop.set()
            self._thread.join()
            self._cm.__exit__(*exc)


# -- the public verb ----------------------------------------------------------------------------


def _siblings(out: str) -> tuple[str, str]:
    parent, base = os.path.split(os.path.abspath(out))
    return os.path.join(parent, f".{base}.xckpt-convert"), os.path.join(parent, f".{base}.xckpt-journal")


def convert(
    src: Any,
    dst: Any,
    *,
    from_format: str | None = None,
    to_format: str | None = None,
    rules: Any = None,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    overwrite: bool = False,
    verify: bool = True,
    max_shard_size: int | str | None = None,
    allow_pickle: bool = False,
    show_progress: bool | None = None,
    workers: int | str | None = None,
    resume: bool = False,
    compression: str | None = None,
) -> str:
    """Convert the checkpoint at `src` (any format) into `dst`, chunk by chunk; in parallel
    with `workers` or under `torchrun`, resumable with `resume`.

    Args:
        src: checkpoint location of any format: a local path, a kvstore URL or spec
            (`s3://`, `gs://`, an S3-compatible endpoint, `memory://`), or an
            `http(s)://` URL (safetensors, Hugging Face directories, torch.save).
        dst: output path. Format from `to_format`, else from the name:
            `*.safetensors` one safetensors file, `*.pt|*.pth|*.bin` torch.save,
            anything else xckpt (`to_format="safetensors"` with another name
            writes a Hugging Face directory: index and shards). With `workers` (or
            `"torchrun"`), an xckpt output may also be a kvstore URL or spec (object
            storage), written in place (no `overwrite`, no `resume`).
        from_format: force the source format; one that does not fit is an error.
        to_format: `xckpt`, `safetensors`, `torch`, `torch-dcp` or `orbax`.
        rules: rename/transpose/stack rules (list of dicts, or a JSON/TOML file).
        include, exclude: shell globs (`fnmatch`: `*` crosses dots) on the
            source's names, tensors and objects, applied before rules.
        overwrite: replace an existing checkpoint at `dst` (whole, after the new
            one is written and verified).
        verify: re-read every written box and compare crc32s with the source's.
        max_shard_size: bytes or a size string (`"5GB"`, `"500MiB"`) per shard
            of a Hugging Face directory (default 5 GB); in a parallel conversion also
            per part of an xckpt or torch-dcp output (default 1 GiB).
        allow_pickle: convert pickled objects (DCP's non-tensor values); without
            it they are skipped with a warning naming them.
        show_progress: progress bar (default: when stderr is a TTY).
        workers: convert in parallel with this many local processes (1: one, in this
            process), or `"torchrun"`: every rank of the `torchrun` job (or of the
            initialized process group) is a worker, and every rank calls this. The
            output is the same for any number of workers or hosts.
        resume: continue a conversion to `dst` that was killed or failed: parts it
            finished whose files still match the journal are kept.
        compression: xckpt output only: the codec of its array chunks, None (raw),
            `"zstd"` or `"shuffle-zstd"` (format version 6).

    Returns:
        The output path.

    Raises:
        CheckpointExistsError: `dst` exists and `overwrite` is not set.
        CorruptChunkError: `verify` read back bytes that differ from the source's.
        XckptError: the source cannot be read as asked, or the output cannot hold it.
    """
    dist = workers == "torchrun"
    if (
        not dist
        and workers is not None
        and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1)
    ):
        raise XckptError(f"workers must be a positive number of processes or 'torchrun', got {workers!r}")
    opts = ConvertOptions(
        from_format=from_format,
        to_format=to_format,
        rules=rules,
        include=include,
        exclude=exclude,
        overwrite=overwrite,
        verify=verify,
        max_shard_size=max_shard_size,
        allow_pickle=allow_pickle,
        show_progress=show_progress,
        compression=compression,
    )
    if workers is None and not resume:
        return convert_one(src, dst, opts)
    if compression is not None and (to_format or guess_format(str(dst))) != "xckpt":
        raise XckptError(f"compression={compression!r} is for xckpt output; {dst!r} is not written as xckpt")
    if local_path(dst) is None:  # xckpt in object storage: written in place, each worker its own connections
        _remote(src, dst, from_format=from_format, to_format=to_format, overwrite=overwrite, resume=resume)
        part = parse_size(max_shard_size) if max_shard_size is not None else DEFAULT_PART_SIZE
        spec = _Spec(
            src, from_format, rules, include, exclude, allow_pickle, "xckpt", False, part, dst, None, verify, compression
        )
        if dist:
            _torchrun(spec, "", False, False, show_progress)
        else:
            _local(spec, int(workers or 1), "", False, False, show_progress)
        return dst
    out, fmt, _, hf_dir, size, replace = destination(src, dst, opts, parts=True)
    if size is None and fmt in ("xckpt", "torch-dcp"):
        size = DEFAULT_PART_SIZE
    tmp, journal = _siblings(out)
    spec = _Spec(
        src, from_format, rules, include, exclude, allow_pickle, fmt, hf_dir, size, tmp, journal, verify, compression
    )
    if dist:
        _torchrun(spec, os.path.abspath(out), replace, resume, show_progress)
    else:
        _local(spec, int(workers or 1), os.path.abspath(out), replace, resume, show_progress)
    return out
