"""The ``xckpt`` command: look into checkpoints from a terminal.

Examples::

    xckpt ls /ckpt/step-100              # tensors: dtype, shape, chunks, bytes
    xckpt show /ckpt/step-100 layers.0.w # one tensor: placement and every chunk box
    xckpt verify /ckpt/step-100          # read every chunk; exit 1 if any is damaged
    xckpt diff /ckpt/a /ckpt/b           # names, dtypes and shapes that differ
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from xckpt.errors import XckptError
from xckpt.formats import open as open_source
from xckpt.source import Source


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _ls(ck: Source, args: argparse.Namespace) -> int:
    rows = [("name", "dtype", "shape", "chunks", "bytes")]
    total = 0
    for name in ck.names():
        t = ck.info(name)
        total += t.nbytes
        rows.append((name, t.dtype, str(list(t.shape)), str(len(t.chunks)), _human(t.nbytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    objs = ck.object_names()
    print(
        f"\n{len(ck.names())} tensors ({_human(total)}), {len(objs)} objects, world size "
        f"{ck.world_size}, save {ck.save_id}"
    )
    if objs:
        print("objects:", ", ".join(objs))
    return 0


def _show(ck: Source, args: argparse.Namespace) -> int:
    t = ck.info(args.name)
    print(f"{t.name}: {t.dtype}{list(t.shape)}, {len(t.chunks)} chunks, {_human(t.nbytes)}")
    if t.placement is not None:
        print("placement:", json.dumps(t.placement.to_json()))
    if t.value_range is not None:
        print("value_range:", json.dumps(t.value_range.to_json()))
    for c in t.chunks[: args.limit]:
        where = c.key if c.form == "array" else f"{c.key}[{c.byte_offset}:{c.byte_offset + c.nbytes}]"
        print(f"  {c.box}  rank {c.rank}  {_human(c.nbytes)}  {where}")
    if len(t.chunks) > args.limit:
        print(f"  ... {len(t.chunks) - args.limit} more chunks (--limit to see them)")
    return 0


def _verify(ck: Source, args: argparse.Namespace) -> int:
    problems = ck.verify()
    for p in problems:
        print("PROBLEM:", p)
    n = sum(len(ck.info(n).chunks) for n in ck.names())
    print(f"{ck.path}: {n} chunks checked, {len(problems)} problems")
    return 1 if problems else 0


def _diff(a: Source, b: Source) -> int:
    differ = 0
    for name in sorted(set(a.names()) | set(b.names())):
        if name not in b:
            print(f"- {name}")
        elif name not in a:
            print(f"+ {name}")
        else:
            ta, tb = a.info(name), b.info(name)
            if (ta.dtype, ta.shape) == (tb.dtype, tb.shape):
                continue
            print(f"~ {name}: {ta.dtype}{list(ta.shape)} -> {tb.dtype}{list(tb.shape)}")
        differ += 1
    print(f"{differ} tensors differ")
    return 1 if differ else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xckpt",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("ls", help="list tensors and objects")
    s.add_argument("path", help="checkpoint directory or kvstore URL (file://, memory://, gs://, s3://)")
    s = sub.add_parser("show", help="one tensor's placement and chunk boxes")
    s.add_argument("path")
    s.add_argument("name", help="tensor name, as `xckpt ls` prints it")
    s.add_argument("--limit", type=int, default=50, help="chunks to print (default 50)")
    s = sub.add_parser("verify", help="read every chunk and check its checksum; exit 1 on damage")
    s.add_argument("path")
    s = sub.add_parser("diff", help="compare names, dtypes and shapes of two checkpoints")
    s.add_argument("a")
    s.add_argument("b")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "diff":
            return _diff(open_source(args.a), open_source(args.b))
        ck = open_source(args.path)
        return {"ls": _ls, "show": _show, "verify": _verify}[args.cmd](ck, args)
    except XckptError as e:
        print(f"xckpt {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
