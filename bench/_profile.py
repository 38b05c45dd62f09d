"""cProfile and strace helpers of ``bench/io.py --profile`` (kept apart to keep io.py short).

- :func:`profiled` -- run a step under cProfile inside the benchmark's own timer;
  returns its value, the timer's measurements and a report: cumulative seconds of
  xckpt's main functions (those that ran) and the top functions by own time.
- :func:`strace_prefix` / :func:`strace_counts` -- run a child under ``strace -f -y``
  and count the file syscalls that name the checkpoint.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import re
from pathlib import Path
from typing import Any

from _common import markdown_table

PHASES = {
    "save": [
        ("xckpt.save (total)", "xckpt.native.writer.save"),
        ("xckpt.torch.save (total)", "xckpt.torch._save.save"),
        ("Writer.__init__ (claim the location)", "xckpt.native.writer.Writer.__init__"),
        ("Writer.write (per tensor: checks, crc32, pack)", "xckpt.native.writer.Writer.write"),
        ("Writer._flush (open + write + commit arrays)", "xckpt.native.writer.Writer._flush"),
        ("Writer.commit (packed array, manifests)", "xckpt.native.writer.Writer.commit"),
        ("Writer.manifest (build dataclasses)", "xckpt.native.writer.Writer.manifest"),
        ("Manifest.to_json", "xckpt.manifest.Manifest.to_json"),
        ("NativeStorage.create_array (spec + open)", "xckpt.native._zarr.NativeStorage.create_array"),
        ("Storage.write_key (manifest files)", "xckpt.storage.KvPlace.write_key"),
    ],
    "load": [
        ("xckpt.load (total)", "xckpt.formats.load"),
        ("xckpt.torch.load (total)", "xckpt.torch._load.load"),
        ("xckpt.open (detect + open)", "xckpt.formats.open"),
        ("Checkpoint.__init__ (read + validate manifest)", "xckpt.native.reader.Checkpoint.__init__"),
        ("Manifest.loads (parse + validate)", "xckpt.manifest.Manifest.loads"),
        ("reader.validate (coverage)", "xckpt.native.reader.validate"),
        ("Source.read_all (allocate + read)", "xckpt.source.Source.read_all"),
        ("Checkpoint.read_all", "xckpt.native.reader.Checkpoint.read_all"),
        ("Source.read_into (plan + read)", "xckpt.source.Source.read_into"),
        ("layout.plan_reads", "xckpt.layout.plan_reads"),
        ("Checkpoint._read_chunks", "xckpt.native.reader.Checkpoint._read_chunks"),
        ("Checkpoint._read_arrays", "xckpt.native.reader.Checkpoint._read_arrays"),
        ("Checkpoint._read_packed", "xckpt.native.reader.Checkpoint._read_packed"),
        ("Checkpoint.objects", "xckpt.native.reader.Checkpoint.objects"),
    ],
}


def code_key(dotted: str) -> tuple[str, int, str] | None:
    """cProfile's key (file, first line, name) of a function given by dotted path."""
    import importlib
    import inspect

    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        code = getattr(inspect.unwrap(obj), "__code__", None) if obj is not None else None
        return (code.co_filename, code.co_firstlineno, code.co_name) if code else None
    return None


def phase_table(stats: pstats.Stats, op: str) -> str:
    """Cumulative seconds and call counts of xckpt's main functions (those that ran)."""
    rows = []
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    for label, dotted in PHASES[op]:
        hit = raw.get(code_key(dotted))
        if hit:
            rows.append((label, hit[1], hit[3]))
    return markdown_table(["phase", "calls", "cumulative s"], rows)


def profiled(fn: Any, timer: Any, op: str, top: int = 15) -> tuple[Any, dict[str, float], str]:
    """``timer(g)`` where ``g`` runs ``fn`` under cProfile: (value, measurements, report)."""
    prof = cProfile.Profile()

    def g() -> Any:
        prof.enable()
        try:
            return fn()
        finally:
            prof.disable()

    value, measured = timer(g)
    report = io.StringIO()
    stats = pstats.Stats(prof, stream=report)
    report.write(phase_table(stats, op) + "\n\n```\n")
    stats.sort_stats("tottime").print_stats(top)
    report.write("```\n")
    return value, measured, report.getvalue()


def strace_prefix(log: Path) -> list[str]:
    """Command prefix tracing file syscalls of a child and its threads into ``log``."""
    return ["strace", "-f", "-y", "-o", str(log), "-e",
            "trace=openat,fsync,fdatasync,rename,renameat,renameat2,pwrite64,pwritev,pwritev2,write,"
            "writev,pread64,preadv,preadv2,read,readv,mmap"]


def strace_counts(log: Path, path: Path) -> dict[str, int]:
    """Syscall name -> calls in ``log`` naming ``path`` (the log is removed)."""
    counts: dict[str, int] = {}
    for line in log.read_text().splitlines():
        if str(path) not in line:
            continue
        m = re.match(r"\d+\s+(\w+)\(", line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    log.unlink()
    return counts
