"""The `xckpt` command: look into checkpoints of any format from a terminal.

Every command reads all seven formats: xckpt, torch DCP, orbax, safetensors (a file or
a Hugging Face directory), torch.save (Lightning .ckpt included), DeepSpeed (ZeRO 1/2/3
and universal) and Megatron-Core; the format is detected (`--format` forces one). A
checkpoint manager's root takes `--step N` or `--step latest`.

Examples:

    xckpt --version                      # also python -m xckpt --version
    xckpt ls /ckpt/step-100              # tensors: dtype, shape, chunks, bytes
    xckpt ls /runs/exp1                  # a manager root: its steps
    xckpt ls /runs/exp1 --step latest    # ... and the tensors of its latest step
    xckpt show /ckpt/step-100 layers.0.w # one tensor: placement and every chunk box
    xckpt verify /ckpt/step-100          # read every chunk; exit 1 if any is damaged
    xckpt diff /ckpt/a /ckpt/b           # names, dtypes and shapes that differ
    xckpt diff --values dcp/ conv/       # ... and every element (exit 0 equal, 1 differ)
    xckpt ls model.safetensors           # foreign formats alike
    xckpt plan /ckpt --world-size 8      # dry run: what each of 8 ranks would read (Shard(0))
    xckpt plan /ckpt --mesh 2,4 --placement "Shard(0), Shard(1)" --json
    xckpt convert /ckpt/dcp hf-model --to safetensors   # any format to any (see convert --help)

Exit codes: 0 success (diff: equal), 1 damage found (verify), a difference (diff) or
an output that does not read back as its source (convert),
2 an error (the message says what and how to fix it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence

import numpy as np

from xckpt._version import __version__
from xckpt.convert import VerifyMismatchError, guess_format
from xckpt.convert_parallel import convert, torchrun_env
from xckpt.errors import CheckpointNotFoundError, XckptError
from xckpt.formats import FORMATS
from xckpt.formats import open as open_source
from xckpt.inspect import human_bytes, plural
from xckpt.layout import Shard, parse_placements
from xckpt.native.steps import manager_steps, read_tiers, steps_table
from xckpt.plan import plan_load
from xckpt.rules import shipped_rule_sets
from xckpt.source import Source


def _ls(ck: Source, args: argparse.Namespace) -> int:
    rows = [("name", "dtype", "shape", "chunks", "bytes")]
    total = 0
    for name in ck.names():
        t = ck.info(name)
        total += t.nbytes
        rows.append((name, t.dtype, str(list(t.shape)), str(len(t.chunks)), human_bytes(t.nbytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    objs = ck.object_names()
    print(
        f"\n{ck.format} checkpoint: {plural(len(ck.names()), 'tensor')} ({human_bytes(total)}), {plural(len(objs), 'object')}, "
        f"world size {ck.world_size}" + (f", save {ck.save_id}" if ck.save_id else "")
    )
    if objs:
        print("objects:", ", ".join(objs))
    return 0


def _ls_location(args: argparse.Namespace) -> int:
    """`xckpt ls PATH`: a checkpoint's tensors, or a checkpoint manager root's steps."""
    try:
        ck = open_source(args.path, format=args.format, allow_pickle=args.allow_pickle, step=args.step)
    except CheckpointNotFoundError:
        root = args.format in (None, "xckpt") and args.step is None  # a manager root, perhaps
        infos = manager_steps(args.path) if root else []
        if not infos and (not root or read_tiers(args.path) is None):
            raise
        print(steps_table(args.path, infos))
        return 0
    with ck:
        return _ls(ck, args)


def _show(ck: Source, args: argparse.Namespace) -> int:
    t = ck.info(args.name)
    print(f"{t.name}: {t.dtype}{list(t.shape)}, {plural(len(t.chunks), 'chunk')}, {human_bytes(t.nbytes)}")
    if t.placement is not None:
        print("placement:", json.dumps(t.placement.to_json()))
    if t.value_range is not None:
        print("value_range:", json.dumps(t.value_range.to_json()))
    for c in t.chunks[: args.limit]:
        at = c.byte_offset or 0
        where = c.key if c.form == "array" else f"{c.key}[{at}:{at + c.nbytes}]"
        print(f"  {c.box}  rank {c.rank}  {human_bytes(c.nbytes)}  {where}")
    if len(t.chunks) > args.limit:
        print(f"  ... {plural(len(t.chunks) - args.limit, 'more chunk')} (--limit to see them)")
    return 0


def _verify(ck: Source, args: argparse.Namespace) -> int:
    problems = ck.verify()
    for p in problems:
        print("PROBLEM:", p)
    n = sum(len(ck.info(n).chunks) for n in ck.names())
    print(f"{ck.path}: {plural(n, 'chunk')} checked, {plural(len(problems), 'problem')}")
    return 1 if problems else 0


#: Bytes of each tensor compared at a time by `diff --values` (per side).
_DIFF_SLAB = 64 << 20


def _slabs(shape: tuple[int, ...], itemsize: int) -> list[tuple[slice, ...]]:
    """Row ranges of dim 0 of at most about `_DIFF_SLAB` bytes each (the whole tensor for 0-d)."""
    if not shape or shape[0] == 0:
        return [tuple(slice(0, s) for s in shape)]
    row = itemsize * math.prod(shape[1:])
    step = max(1, _DIFF_SLAB // max(1, row))
    return [(slice(lo, min(lo + step, shape[0])),) for lo in range(0, shape[0], step)]


def _values_differ(a: Source, b: Source, name: str) -> str | None:
    """Where the values of tensor `name` first differ (bit for bit), or None when equal."""
    t = a.info(name)
    for index in _slabs(t.shape, t.np_dtype.itemsize):
        va, vb = a.read(name, index), b.read(name, index)
        if va.tobytes() != vb.tobytes():  # bit for bit: NaNs and -0.0 compare as stored
            ba = va.reshape(-1).view(np.uint8).reshape(va.size, -1)
            bb = vb.reshape(-1).view(np.uint8).reshape(vb.size, -1)
            i = int(np.flatnonzero((ba != bb).any(axis=1))[0])
            where = [int(x) for x in np.unravel_index(i, va.shape)]
            if where and index:
                where[0] += index[0].start
            return f"values differ, first at {where}"
    return None


def _diff(a: Source, b: Source, values: bool = False) -> int:
    differ = 0
    for name in sorted(set(a.names()) | set(b.names())):
        if name not in b:
            print(f"- {name}")
        elif name not in a:
            print(f"+ {name}")
        else:
            ta, tb = a.info(name), b.info(name)
            if (ta.dtype, ta.shape) != (tb.dtype, tb.shape):
                print(f"~ {name}: {ta.dtype}{list(ta.shape)} -> {tb.dtype}{list(tb.shape)}")
            elif values and (why := _values_differ(a, b, name)) is not None:
                print(f"~ {name}: {why}")
            else:
                continue
        differ += 1
    objects = 0
    names_a, names_b = set(a.object_names()), set(b.object_names())
    for name in sorted(names_a ^ names_b):
        print(f"{'-' if name in names_a else '+'} {name} (object)")
        objects += 1
    if values:
        readable = sorted((names_a & names_b) - a.pickled_objects() - b.pickled_objects())
        va = a.objects(readable, per_rank="list")
        vb = b.objects(readable, per_rank="list")
        for name in readable:
            if va[name] != vb[name]:
                print(f"~ {name} (object): {va[name]!r} -> {vb[name]!r}")
                objects += 1
    what = "values compared" if values else "names, dtypes and shapes compared; --values compares elements"
    print(f"{plural(differ, 'tensor')} and {plural(objects, 'object')} differ ({what})")
    return 1 if differ or objects else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="xckpt",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"xckpt {__version__}")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bars (default: bars on a terminal for work of 64 MiB or more)",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    where = (
        "checkpoint: a directory, a file (.safetensors, torch.save), a kvstore URL, or a kvstore "
        'spec as JSON (\'{"driver": "s3", "bucket": ..., "path": ..., "endpoint": ...}\')'
    )

    def source_args(s: argparse.ArgumentParser) -> None:
        s.add_argument(
            "--format",
            choices=list(FORMATS),
            help="read as this format instead of detecting it",
        )
        s.add_argument(
            "--allow-pickle",
            action="store_true",
            help="read pickled objects (DCP's non-tensor values); tensors never need it",
        )
        s.add_argument(
            "--step",
            type=_step,
            help="PATH is a checkpoint manager's root: use its step N, or 'latest' (the highest complete one)",
        )

    s = sub.add_parser("ls", help="list tensors and objects")
    s.add_argument("path", help=where + " (file://, memory://, gs://, s3://)")
    source_args(s)
    s = sub.add_parser("show", help="one tensor's placement and chunk boxes")
    s.add_argument("path", help=where)
    s.add_argument("name", help="tensor name, as `xckpt ls` prints it")
    s.add_argument("--limit", type=int, default=50, help="chunks to print (default 50)")
    source_args(s)
    s = sub.add_parser("verify", help="read every chunk and check its checksum; exit 1 on damage")
    s.add_argument("path", help=where)
    source_args(s)
    s = sub.add_parser(
        "diff",
        help="compare two checkpoints (any formats): names, dtypes, shapes; --values: every element",
    )
    s.add_argument("a", help=where)
    s.add_argument("b", help=where)
    s.add_argument("--values", action="store_true", help="also compare every element, bit for bit, and objects")
    source_args(s)
    s = sub.add_parser(
        "plan",
        help="dry-run a load: bytes, reads and over-read per rank, from metadata alone",
        description="Plan a load of every tensor onto a mesh of ranks, each tensor laid out "
        "with the same placements (a shard of a dim a tensor lacks replicates it). Nothing "
        "but metadata is read.",
    )
    s.add_argument("path", help=where)
    s.add_argument("--world-size", type=int, help="ranks on a 1-D mesh (or give --mesh)")
    s.add_argument("--mesh", help="mesh shape, e.g. 2,4 (default: the world size)")
    s.add_argument(
        "--placement",
        default=None,
        help='one placement per mesh axis, e.g. "Shard(0)", "Shard(0), Replicate()", '
        '"_StridedShard(0, sf=2), Shard(0)" (default: Shard(0) on every axis)',
    )
    s.add_argument("--include", default="*", help="glob of tensor names to plan (default: all)")
    s.add_argument("--json", action="store_true", help="print the plan as JSON (for scripts)")
    source_args(s)
    _convert_parser(sub)
    return p


_CONVERT_EPILOG = """\
The output format comes from --to, else from DST: *.safetensors is one safetensors
file, *.pt / *.pth / *.bin a torch.save file, anything else an xckpt checkpoint.
--to safetensors with a DST not ending in .safetensors writes a Hugging Face
directory (model.safetensors.index.json and shards of at most --max-shard-size).

Tensors stream chunk by chunk (memory stays near the largest chunk, never the
checkpoint); a sharded source keeps its writers' layout where the output can hold
it. The output is written beside DST, re-read and checked (crc32 of every box),
then renamed into place: an interrupted or failed run leaves nothing at DST.

examples:
  xckpt convert /ckpt/dcp/step-1000 /ckpt/xckpt/step-1000        # DCP -> xckpt, same 4 writers
  xckpt convert /ckpt/dcp/step-1000 hf-model --to safetensors \\
      --exclude 'optim.*' --max-shard-size 5GB                    # model only, HF directory
  xckpt convert model.safetensors model.pt                        # one torch.save file
  xckpt convert hf-model scanned --to orbax --rules hf_llama_to_scanned  # layers stacked
  xckpt convert deepseek-v3 deepseek-v3-bf16 --to safetensors \\
      --rules fp8_block_dequant                                   # fp8 -> bf16, no GPU needed
  xckpt convert old.pt new.safetensors --overwrite --no-verify
  xckpt convert hf-model model-xckpt --workers 8                 # 8 local processes
  torchrun --nnodes 4 --nproc-per-node 8 -m xckpt.cli convert \
      /shared/dcp /shared/hf --to safetensors                     # every rank a worker
  xckpt convert hf-model model-xckpt --workers 8 --resume        # continue a killed run

In parallel (--workers, torchrun) the output is cut into parts of about
--max-shard-size bytes (safetensors shards; for xckpt and torch-dcp, default 1GiB),
one file each, the same for any number of workers; a journal beside DST records
finished parts for --resume.

exit codes: 0 converted, 1 the written output does not read back as the source
(nothing at DST), 2 an error (the message says what and how to fix it).
"""


def _convert_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser(
        "convert",
        help="convert a checkpoint of any format to xckpt, torch-dcp, orbax, safetensors or torch",
        description="Convert SRC (any format) into DST, streaming with bounded memory.",
        epilog=_CONVERT_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("src", help="checkpoint to read (any format; detected unless --from)")
    s.add_argument("dst", help="local output path (must not exist unless --overwrite)")
    s.add_argument("--from", dest="from_format", choices=list(FORMATS), help="read SRC as this format")
    s.add_argument("--to", dest="to_format", choices=list(FORMATS), help="output format (default: from DST)")
    s.add_argument(
        "--rules",
        metavar="FILE",
        help="rename/transpose/stack/dequantize rules: a .json or .toml file, or a shipped set "
        f"({', '.join(shipped_rule_sets())})",
    )
    s.add_argument(
        "--include",
        action="append",
        metavar="GLOB",
        help="convert only source names matching GLOB (fnmatch, * crosses dots; repeatable)",
    )
    s.add_argument(
        "--exclude", action="append", metavar="GLOB", help="leave out source names matching GLOB (repeatable)"
    )
    s.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help="largest shard of a Hugging Face directory: bytes, or 5GB (10^9), 500MiB (2^20); default 5GB",
    )
    s.add_argument(
        "--compression",
        choices=["zstd", "shuffle-zstd"],
        help="xckpt output: compress array chunks (shuffle-zstd: byte shuffle, then zstd; best for floats)",
    )
    s.add_argument("--no-verify", action="store_true", help="skip re-reading the output (faster)")
    s.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST (after success)")
    s.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="convert in parallel with N local processes (the output is the same for any N); under "
        "torchrun leave it out: every rank is a worker",
    )
    s.add_argument(
        "--resume",
        action="store_true",
        help="continue a killed or failed conversion to DST: finished parts that still match the journal "
        "are kept, the rest written again",
    )
    s.add_argument(
        "--allow-pickle",
        action="store_true",
        help="convert pickled objects of a DCP source (unpickling runs code); else they are skipped",
    )


def _convert(args: argparse.Namespace) -> int:
    size: int | str | None = args.max_shard_size
    if isinstance(size, str) and size.strip().isdigit():
        size = int(size)
    workers: int | str | None = args.workers
    if torchrun_env():
        if workers is not None:
            raise XckptError(
                "--workers is for local processes; under torchrun every rank is a worker: drop --workers, or "
                "run without torchrun"
            )
        workers = "torchrun"
    try:
        out = convert(
            args.src,
            args.dst,
            from_format=args.from_format,
            to_format=args.to_format,
            rules=args.rules,
            include=args.include,
            exclude=args.exclude,
            overwrite=args.overwrite,
            verify=not args.no_verify,
            max_shard_size=size,
            allow_pickle=args.allow_pickle,
            compression=args.compression,
            workers=workers,
            resume=args.resume,
        )
    except VerifyMismatchError as e:
        print(f"xckpt convert: verify failed: {e}", file=sys.stderr)
        return 1
    fmt = args.to_format or guess_format(out)
    if workers == "torchrun" and os.environ.get("RANK", "0") != "0":
        return 0
    print(f"{args.src} -> {out} ({fmt}{', verified' if not args.no_verify else ''})")
    return 0


def _plan(ck: Source, args: argparse.Namespace) -> int:
    if args.mesh:
        mesh = tuple(int(x) for x in args.mesh.split(","))
    elif args.world_size:
        mesh = (args.world_size,)
    else:
        raise XckptError("give --world-size N or --mesh A,B: the layout to plan for")
    placements = parse_placements(args.placement) if args.placement else tuple(Shard(0) for _ in mesh)
    plan = plan_load(ck, {args.include: (mesh, placements)})
    print(json.dumps(plan.to_json(), indent=1) if args.json else plan.table())
    return 0


def _step(arg: str) -> int | str:
    """A `--step` value: "latest" or a step number."""
    if arg == "latest":
        return arg
    if arg.isascii() and arg.isdigit():
        return int(arg)
    raise argparse.ArgumentTypeError(f"{arg!r} is neither 'latest' nor a step number")


def _location(arg: str) -> object:
    """A path argument: a tensorstore kvstore spec when it is JSON (starts with `{`), e.g.
    `'{"driver": "s3", "bucket": "b", "path": "ckpt/", "endpoint": "http://host:9000"}'`."""
    if not isinstance(arg, str) or not arg.lstrip().startswith("{"):
        return arg
    try:
        spec = json.loads(arg)
    except json.JSONDecodeError as e:
        raise XckptError(f"{arg!r} starts with '{{' but is not a JSON kvstore spec ({e})") from None
    if not isinstance(spec, dict):
        raise XckptError(f"{arg!r} is not a JSON object (a kvstore spec)")
    return spec


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    saved = os.environ.get("XCKPT_PROGRESS")
    if args.no_progress:
        os.environ["XCKPT_PROGRESS"] = "0"
    try:
        return _run(args)
    except BrokenPipeError:
        # The reader of our output went away (`xckpt ls CKPT | head`): stop quietly, as
        # `ls | head` does. stdout is pointed at /dev/null so the flush at exit cannot
        # raise again; 141 is what a shell reports for a process ended by SIGPIPE.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141
    finally:
        if args.no_progress:
            if saved is None:
                os.environ.pop("XCKPT_PROGRESS", None)
            else:
                os.environ["XCKPT_PROGRESS"] = saved


def _run(args: argparse.Namespace) -> int:
    try:
        for attr in ("path", "a", "b", "src"):
            if hasattr(args, attr):
                setattr(args, attr, _location(getattr(args, attr)))
        if args.cmd == "convert":
            return _convert(args)
        opts = {"format": args.format, "allow_pickle": args.allow_pickle, "step": getattr(args, "step", None)}
        if args.cmd == "ls":
            return _ls_location(args)
        if args.cmd == "diff":
            with open_source(args.a, **opts) as a, open_source(args.b, **opts) as b:
                return _diff(a, b, values=args.values)
        with open_source(args.path, **opts) as ck:
            return {"ls": _ls, "show": _show, "verify": _verify, "plan": _plan}[args.cmd](ck, args)
    except XckptError as e:
        print(f"xckpt {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
