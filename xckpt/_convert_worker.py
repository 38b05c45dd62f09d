"""A parallel conversion's worker: one process's side of `xckpt.convert_parallel`.

`_Worker` opens the source once and writes and verifies parts of a plan. The other
workers of a conversion are `_Child` processes, started before the caller opens the
source or plans, so that they are ready when the parts are handed out: forked where
that is safe (this process runs no thread that was started after `xckpt` was imported,
in particular none of tensorstore's, whose threads do not survive a fork), which costs
neither a fresh interpreter nor its imports; else a fresh interpreter, which imports
`xckpt` while the caller plans. A child is sent the spec and the plan once they are
known, then one request at a time (parts to write, results to verify); its progress and
errors come back over the same socket.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from xckpt import formats
from xckpt._parts import Journal, PartResult, Plan, fingerprint, kept_part, make_plan, options_of, write_part
from xckpt._stream import crc32c
from xckpt.convert import VerifyMismatchError, _globs, _open, _read_back
from xckpt.converters.safetensors_write import metadata_of
from xckpt.errors import CorruptChunkError, XckptError
from xckpt.layout import Box
from xckpt.sink import WriteJob
from xckpt.source import Source

__all__ = ["_Spec", "_Worker", "_BatchedBar", "_Child", "start_children", "can_fork"]


@dataclass(frozen=True)
class _Spec:
    """Everything a worker needs (picklable): where to read, what to write, where."""

    src: Any
    from_format: str | None
    rules: Any
    include: Any
    exclude: Any
    allow_pickle: bool
    fmt: str
    hf_dir: bool
    part_size: int | None
    tmp: Any  # a local path, or (xckpt in object storage, written in place) the destination
    journal: str | None  # None: the destination is in object storage (no resume)
    verify: bool
    compression: str | None = None


class _Worker:
    """One process's side: the source opened once, the plan, jobs for parts."""

    def __init__(self, spec: _Spec, bar: Any, plan: Plan | None = None) -> None:
        self.spec = spec
        self.bar = bar
        self.src: Source = _open(
            spec.src, spec.from_format, spec.rules, spec.include, spec.exclude, spec.allow_pickle
        )
        try:
            self.names = tuple(self.src.names())
            obj_names = self.src.object_names()
            self.skipped = [] if spec.allow_pickle else sorted(self.src.pickled_objects() & set(obj_names))
            wanted = [n for n in obj_names if n not in set(self.skipped)]
            self.objects = self.src.objects(wanted, per_rank="list") if wanted else {}
            self.per_rank = frozenset(self.src.per_rank_objects() & set(wanted))
            self.plan = plan if plan is not None else self._plan()
        except BaseException:
            self.src.close()
            raise
        self.journal = Journal(spec.journal) if spec.journal is not None else None

    def _plan(self) -> Plan:
        s = self.spec
        opts = options_of(
            s.fmt,
            hf_dir=s.hf_dir,
            part_size=s.part_size,
            rules=s.rules,
            include=_globs(s.include, "include"),
            exclude=_globs(s.exclude, "exclude"),
            allow_pickle=s.allow_pickle,
            layout="parts",
            compression=s.compression,
        )
        fp = fingerprint(self.src, self.names, self.objects, opts)
        return make_plan(self.src, self.names, s.fmt, hf_dir=s.hf_dir, part_size=s.part_size or 0, fp=fp)

    def job(self, record: bool | None = None) -> WriteJob:
        s = self.spec
        return WriteJob(
            self.src,
            s.tmp,
            self.names,
            self.objects,
            s.part_size if s.hf_dir else None,
            self.bar,
            self.per_rank,
            record=s.verify if record is None else record,
            save_id=self.plan.save_id,
            compression=s.compression,
        )

    def write(self, p: int) -> PartResult:
        """Part `p`: kept when the journal says it is finished and its bytes match, else written."""
        part = self.plan.parts[p]
        kept = kept_part(self.plan, p, self.spec.tmp, self.journal) if self.journal is not None else None
        if kept is not None:
            self.bar.update(part.nbytes)
            return kept
        job = self.job()
        meta = metadata_of(job) if self.plan.kind == "hf-dir" and p == 0 else {}
        return write_part(job, self.plan, part, self.journal, meta)

    def verify(self, results: Sequence[PartResult]) -> None:
        """Re-read every box of `results` through the output's reader; compare crc32c."""
        fmt = self.spec.fmt
        keys = {(n, tuple(o), tuple(s)): c for r in results for n, o, s, c in r["crcs"]}
        if not keys:
            return
        with formats.open(self.spec.tmp, format=fmt) as back:
            try:
                crc = 0
                for key, buf, last in _read_back(back, list(keys), split=fmt != "xckpt"):
                    crc = crc32c(buf, crc)
                    if last:
                        crc, got = 0, crc
                        if got != keys[key]:
                            raise VerifyMismatchError(self._mismatch(key, got, keys[key]))
            except VerifyMismatchError:
                raise
            except CorruptChunkError as e:
                raise VerifyMismatchError(
                    f"conversion of {self.src.path!r} to {fmt} does not read back as written: {e}; nothing "
                    "was written to the destination. Check the disk and convert again"
                ) from None

    def _mismatch(self, key: tuple[str, tuple[int, ...], tuple[int, ...]], got: int, want: int) -> str:
        name, offset, shape = key
        return (
            f"conversion of {self.src.path!r} to {self.spec.fmt}: tensor {name!r}, box {Box(offset, shape)} "
            f"reads back with crc32c {got:08x}, the source's is {want:08x}; nothing was written to the "
            "destination. Check the disk and convert again"
        )

    def close(self) -> None:
        self.src.close()


class _BatchedBar:
    """Progress passed on by `send(bytes)` in steps of 64 MiB: a rank's to the process
    group's store, a rank's child's to the rank."""

    def __init__(self, send: Callable[[int], Any]) -> None:
        self._send, self._held = send, 0

    def update(self, n: int = 1) -> None:
        self._held += n
        if self._held >= 64 << 20:
            self.flush()

    def flush(self) -> None:
        if self._held:
            self._send(self._held)
        self._held = 0




# -- child processes ------------------------------------------------------------------------------


def _threads() -> int:
    """This process's OS threads (Linux); -1 where it cannot tell, or where one of them is
    tensorstore's (named `ts_...`; started before `xckpt` was imported)."""
    try:
        tasks = os.listdir("/proc/self/task")
        for t in tasks:
            with open(f"/proc/self/task/{t}/comm") as f:
                if f.read().startswith("ts_"):
                    return -1
    except OSError:
        return -1
    return len(tasks)


#: The threads this process ran when `xckpt` was imported: those the libraries below it
#: start at their import (numpy's BLAS pool, which forks safely), none of tensorstore's.
_BASE_THREADS = _threads()

#: The caller's ends of the sockets to children started by fork: a child closes every other
#: child's, so that each sees its caller's end close when the caller is gone.
_OURS: set[int] = set()


def can_fork() -> bool:
    """Whether a child may be forked from this process: on Linux, when no thread runs but
    the main one and those that ran when `xckpt` was imported (a thread started since, a
    tensorstore pool's above all, would be missing in the child, its locks held)."""
    return (
        "fork" in mp.get_all_start_methods()
        and threading.active_count() == 1
        and 0 < _threads() <= _BASE_THREADS
    )


def _child(fd: int, close: Sequence[int] = ()) -> None:
    """A child's loop: `("start", spec, plan)`, then `("write", parts)` and `("verify",
    results)` until `("close", None)`; each answered `("done", value)` or `("error", text)`,
    with `("bytes", n)` of progress before."""
    for other in close:
        os.close(other)
    conn = Connection(fd)
    bar = _BatchedBar(lambda n: conn.send(("bytes", n)))
    worker: _Worker | None = None
    failed: str | None = None
    try:
        while (msg := conn.recv())[0] != "close":
            try:
                if msg[0] == "start":
                    worker = _Worker(msg[1], bar, msg[2])
                    continue
                if worker is None:
                    raise XckptError(failed or "this conversion process was sent no plan")
                done = [worker.write(p) for p in msg[1]] if msg[0] == "write" else None
                if msg[0] == "verify":
                    worker.verify(msg[1])
                bar.flush()
                conn.send(("done", done))
            except Exception as e:  # noqa: BLE001 - sent to the caller, raised there as an XckptError
                text = f"{type(e).__name__}: {e}"
                if msg[0] == "start":
                    failed = text
                else:
                    conn.send(("error", text))
    except EOFError:
        pass  # the caller is gone
    finally:
        if worker is not None:
            worker.close()


class _Child:
    """A worker process: forked (`fork=True`; see `can_fork`) or a fresh interpreter.
    `who` names it in the error that says it died."""

    def __init__(self, bar: Any, *, fork: bool, who: str = "a conversion worker process") -> None:
        ours, theirs = socket.socketpair()
        self.bar, self.who = bar, who
        self.proc: Any
        if fork:
            _OURS.add(ours.fileno())
            self.proc = mp.get_context("fork").Process(
                target=_child, args=(theirs.fileno(), sorted(_OURS)), daemon=True
            )
            self.proc.start()
        else:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            code = f"from xckpt._convert_worker import _child; _child({theirs.fileno()})"
            self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        self._fd = ours.fileno()
        self.conn = Connection(ours.detach())

    def start(self, spec: _Spec, plan: Plan) -> None:
        """Send the child what to convert (it opens the source on receipt)."""
        self._send(("start", spec, plan))

    def call(self, what: str, arg: Any) -> Any:
        """Send the child `what` ("write": part indices; "verify": their results); its answer."""
        self._send((what, arg))
        try:
            while True:
                kind, value = self.conn.recv()
                if kind == "bytes":
                    self.bar.update(value)
                elif kind == "error":
                    raise XckptError(value)
                else:
                    return value
        except (EOFError, OSError):
            raise self._died() from None

    def _send(self, msg: Any) -> None:
        try:
            self.conn.send(msg)
        except OSError:
            raise self._died() from None

    def _died(self) -> XckptError:
        return XckptError(
            f"{self.who} died (exit code {self._wait()}); the parts finished so far are kept: run the same "
            "conversion again with resume=True (--resume)"
        )

    def _wait(self) -> int | None:
        if isinstance(self.proc, subprocess.Popen):
            return self.proc.wait()
        self.proc.join()
        return self.proc.exitcode

    def close(self) -> None:
        """Tell the child to stop; wait for it."""
        try:
            self.conn.send(("close", None))
        except OSError:
            pass
        self.conn.close()
        _OURS.discard(self._fd)
        self._wait()


def start_children(n: int, bar: Any) -> list[_Child]:
    """`n` children, forked when `can_fork` says so, else fresh interpreters."""
    fork = can_fork()
    out: list[_Child] = []
    try:
        for _ in range(n):
            out.append(_Child(bar, fork=fork))
    except BaseException:
        for c in out:
            c.close()
        raise
    return out
