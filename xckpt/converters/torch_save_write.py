"""torch.save output of `xckpt.convert`: the zip layout written directly, no torch needed.

The file is what `torch.save(flat_dict, f)` writes and torch's
`weights_only=True` loader reads (`mmap=True` too): a stored (not
compressed) zip whose records live under `archive/`: `data.pkl` (pickle
protocol 2), `.format_version`, `.storage_alignment`, `byteorder`, one
`data/<k>` record per tensor, each 64-byte aligned as torch aligns them, and
`version`. The pickle is written here opcode by opcode: a flat dict from name
to tensor (`torch._utils._rebuild_tensor_v2` over a typed storage, or
`_rebuild_tensor_v3` with the dtype for uint16/32/64 and float8, as torch
itself pickles them) or object (None, bool, int, float, str, bytes, list, tuple,
dict, as the weights-only unpickler accepts them).

A source that says where its names sit in a nested state dict
([`nesting`][xckpt.source.Source.nesting]: torch DCP's `planner_data`) is written as that
nested dict, as `torch.distributed.checkpoint.format_utils.dcp_to_torch_save` writes
it (`torch.load(f)["model"]["layer.weight"]`; integer keys make lists); any other
source, or one whose names a rules view renamed, as the flat dict.

Each tensor's bytes stream into its record in row-major order
([`WriteJob.rows`][xckpt.sink.WriteJob.rows]): a row-sharded tensor moves one chunk at a time. The
zip's central directory is written last, so an interrupted write is not a zip
any reader opens.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from xckpt.errors import ObjectError, XckptError
from xckpt.manifest import numpy_dtype
from xckpt.sink import Sink, WriteJob

from ._nesting import nest_paths

__all__ = ["TorchSaveSink", "pickle_state", "pickle_nested"]

FORMAT = "torch"
ALIGN = 64
PREFIX = "archive"

#: dtype -> typed storage class torch pickles (the rest use UntypedStorage and a dtype).
_TYPED = {
    "float64": "DoubleStorage",
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
    "bfloat16": "BFloat16Storage",
    "complex128": "ComplexDoubleStorage",
    "complex64": "ComplexFloatStorage",
}
#: dtype -> torch dtype attribute, for _rebuild_tensor_v3.
_UNTYPED = {
    "uint16": "uint16",
    "uint32": "uint32",
    "uint64": "uint64",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "float8_e4m3fnuz": "float8_e4m3fnuz",
    "float8_e5m2fnuz": "float8_e5m2fnuz",
}


# -- pickle protocol 2, by opcode --------------------------------------------------------


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _str(s: str) -> bytes:
    b = s.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(b)) + b


def _int(v: int) -> bytes:
    if 0 <= v < 256:
        return b"K" + bytes([v])
    if 0 <= v < 65536:
        return b"M" + struct.pack("<H", v)
    if -(2**31) <= v < 2**31:
        return b"J" + struct.pack("<i", v)
    raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _tuple(items: list[bytes]) -> bytes:
    return b")" if not items else b"(" + b"".join(items) + b"t"


def _value(v: Any, name: str) -> bytes:
    if v is None:
        return b"N"
    if v is True:
        return b"\x88"
    if v is False:
        return b"\x89"
    if isinstance(v, np.generic):
        return _value(v.item(), name)
    if isinstance(v, int):
        return _int(v)
    if isinstance(v, float):
        return b"G" + struct.pack(">d", v)
    if isinstance(v, str):
        return _str(v)
    if isinstance(v, (bytes, bytearray)):
        # As protocol 2 pickles bytes, and torch's weights-only unpickler accepts.
        return _global("_codecs", "encode") + _str(bytes(v).decode("latin1")) + _str("latin1") + b"\x86R"
    if isinstance(v, tuple):
        return _tuple([_value(x, name) for x in v])
    if isinstance(v, list):
        return b"]" + (b"(" + b"".join(_value(x, name) for x in v) + b"e" if v else b"")
    if isinstance(v, dict):
        body = b"".join(_value(k, name) + _value(x, name) for k, x in v.items())
        return b"}" + (b"(" + body + b"u" if v else b"")
    raise ObjectError(
        f"object {name!r} of type {type(v).__name__} cannot go into a torch.save file that "
        "torch's weights_only loader reads (None, bool, int, float, str, bytes, list, tuple, dict "
        "can); exclude it, or convert to xckpt"
    )


def _tensor(key: str, dtype: str, shape: tuple[int, ...]) -> bytes:
    numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * max(shape[i + 1], 1)
    if dtype in _TYPED:
        rebuild, storage, size = "_rebuild_tensor_v2", _global("torch", _TYPED[dtype]), numel
    else:
        rebuild, storage = "_rebuild_tensor_v3", _global("torch.storage", "UntypedStorage")
        size = numel * numpy_dtype(dtype).itemsize
    pid = _tuple([_str("storage"), storage, _str(key), _str("cpu"), _int(size)]) + b"Q"
    args = [
        pid,
        _int(0),
        _tuple([_int(s) for s in shape]),
        _tuple([_int(s) for s in stride]),
        b"\x89",
        _global("collections", "OrderedDict") + b")R",
    ]
    if dtype not in _TYPED:
        args.append(_global("torch", _UNTYPED[dtype]))
    return _global("torch._utils", rebuild) + _tuple(args) + b"R"


class _Tensor(tuple[int, str, tuple[int, ...]]):
    """A tensor leaf of a nested state dict: (storage index, dtype, shape)."""


def _nested(v: Any, name: str) -> bytes:
    """A nested state dict (dicts and lists from `_nesting.nest_paths`) by opcode."""
    if isinstance(v, _Tensor):
        return _tensor(str(v[0]), v[1], v[2])
    if type(v) is dict:
        body = b"".join(_value(k, name) + _nested(x, name) for k, x in v.items())
        return b"}" + (b"(" + body + b"u" if v else b"")
    if type(v) is list:
        return b"]" + (b"(" + b"".join(_nested(x, name) for x in v) + b"e" if v else b"")
    return _value(v, name)


def pickle_nested(
    tensors: list[tuple[str, str, tuple[int, ...]]],
    objects: dict[str, Any],
    paths: Mapping[str, tuple[Any, ...]],
    where: str,
) -> bytes:
    """`data.pkl` of the nested state dict with every tensor (storages "0", "1", ... in order)
    and object at its key path in `paths`."""
    leaves: list[tuple[tuple[Any, ...], Any]] = [
        (paths[n], _Tensor((i, dtype, shape))) for i, (n, dtype, shape) in enumerate(tensors)
    ]
    leaves += [(paths[n], v) for n, v in objects.items()]
    return b"\x80\x02" + _nested(nest_paths(leaves, where), where) + b"."


def pickle_state(tensors: list[tuple[str, str, tuple[int, ...]]], objects: dict[str, Any]) -> bytes:
    """`data.pkl` of a flat dict: `tensors` as (name, dtype, shape) on storages "0", "1", ...
    in order, then `objects`."""
    items = [_str(name) + _tensor(str(i), dtype, shape) for i, (name, dtype, shape) in enumerate(tensors)]
    items += [_str(name) + _value(v, name) for name, v in objects.items()]
    return b"\x80\x02}" + (b"(" + b"".join(items) + b"u" if items else b"") + b"."


# -- the zip --------------------------------------------------------------------------------


def _open_record(zf: zipfile.ZipFile, name: str, size: int) -> Any:
    zi = zipfile.ZipInfo(f"{PREFIX}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
    zi.compress_type = zipfile.ZIP_STORED
    zi.file_size = size
    zip64 = size * 1.05 > zipfile.ZIP64_LIMIT
    # Pad the local header with an extra field so the data starts 64-byte aligned (as torch does).
    head = 30 + len(zi.filename.encode()) + 4 + (20 if zip64 else 0)
    pad = -(zf.start_dir + head) % ALIGN
    zi.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    return zf.open(zi, "w", force_zip64=zip64)


def _data_pkl(job: WriteJob) -> bytes:
    """`data.pkl` of the job's flat dict; raises for what torch's weights-only loader cannot read."""
    for name in job.names:
        t = job.src.info(name)
        if t.dtype not in _TYPED and t.dtype not in _UNTYPED:
            raise ObjectError(f"tensor {name!r}: dtype {t.dtype} has no torch equivalent")
    clash = sorted(set(job.names) & set(job.objects))
    if clash:
        raise XckptError(
            f"torch.save output of {job.src.path!r}: {clash} are both tensors and objects, and one flat "
            "dict holds one value per key; rename or exclude one of them"
        )
    tensors = [(n, job.src.info(n).dtype, tuple(job.src.info(n).shape)) for n in job.names]
    paths = job.src.nesting()
    names = [*job.names, *job.objects]
    if paths is not None and all(n in paths for n in names) and any(len(paths[n]) > 1 for n in names):
        where = f"torch.save output of {job.src.path!r}"
        return pickle_nested(tensors, dict(job.objects), paths, where)
    return pickle_state(tensors, dict(job.objects))


class TorchSaveSink(Sink):
    """One torch.save file of a flat dict (tensors, then objects)."""

    format = FORMAT

    def check(self, job: WriteJob) -> None:
        """Every dtype has a torch name; every object is a plain value the weights-only loader reads."""
        _data_pkl(job)

    def write(self, job: WriteJob) -> None:
        """`data.pkl` first, then each tensor's record streamed in row-major order; the
        zip's central directory last."""
        data_pkl = _data_pkl(job)
        with open(job.dst, "xb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            for rec, data in (
                ("data.pkl", data_pkl),
                (".format_version", b"1"),
                (".storage_alignment", str(ALIGN).encode()),
                ("byteorder", b"little"),
            ):
                with _open_record(zf, rec, len(data)) as w:
                    w.write(data)
            for i, name in enumerate(job.names):
                with _open_record(zf, f"data/{i}", job.src.info(name).nbytes) as w:
                    for piece in job.rows(name):
                        w.write(memoryview(piece.reshape(-1).view(np.uint8)))
                        job.bar.update(piece.nbytes)
                        del piece  # free it before the next piece is read: one piece in memory
            with _open_record(zf, "version", 2) as w:
                w.write(b"3\n")
