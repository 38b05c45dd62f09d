"""A restricted unpickler for torch's pickles, working without torch.

torch DCP's `.metadata` and every torch.save archive's `data.pkl` are
pickles. Reading them with the standard unpickler runs whatever callables the
file names. Here every global the pickle asks for is looked up in an
allow-list of exact `(module, name)` pairs (protocol 4 resolves dotted names,
so `("torch", "os.mkdir")` is not "something in torch"), and what comes back
is a small local stand-in built from the pickle's arguments, never the real
torch object: torch is never imported. Anything not on the list is refused
with an [`XckptError`][xckpt.errors.XckptError] in `find_class`, before anything
is called.

Stand-ins:

* dtypes -> `TorchDtype` (its `xckpt` attribute is the manifest name,
  or None for dtypes xckpt cannot hold); `torch.Size` -> a tuple of ints;
  layouts and memory formats -> `TorchEnum`;
* DCP's metadata dataclasses -> `Record` subclasses carrying the
  pickled fields as attributes;
* storages (`persistent_id` tuples) -> `StorageRef`; tensor rebuild
  functions -> `TensorRef` (storage, storage offset, size, stride,
  dtype): the bytes stay in the archive;
* `collections.OrderedDict`, `set`, `frozenset`, `complex`,
  `bytearray`, `slice`, `_codecs.encode` (latin-1 only, how protocol 2
  writes bytes) and `pathlib` paths (as pure paths) are the real, inert types.

The one place that unpickles *without* the allow-list is
`unrestricted_load`, used only for DCP's pickled objects when the caller
opened the checkpoint with `allow_pickle=True`.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xckpt.errors import XckptError
from xckpt.manifest import MAX_OBJECT_DEPTH

from ._foreign import placeholder

__all__ = [
    "materialize",
    "TorchDtype",
    "TorchEnum",
    "Record",
    "field",
    "StorageRef",
    "TensorRef",
    "METADATA_GLOBALS",
    "TORCH_SAVE_GLOBALS",
    "restricted_load",
    "unrestricted_load",
]

# torch dtype name -> xckpt dtype name (None: torch has it, xckpt cannot hold it).
_DTYPES: dict[str, str | None] = {
    "float32": "float32",
    "float64": "float64",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "complex64": "complex64",
    "complex128": "complex128",
    "uint8": "uint8",
    "uint16": "uint16",
    "uint32": "uint32",
    "uint64": "uint64",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "bool": "bool",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "float8_e4m3fnuz": "float8_e4m3fnuz",
    "float8_e5m2fnuz": "float8_e5m2fnuz",
}
for _n in (
    "complex32 qint8 quint8 qint32 quint4x2 quint2x4 float8_e8m0fnu float4_e2m1fn_x2 bits1x8 bits2x4 "
    "bits4x2 bits8 bits16 int1 int2 int3 int4 int5 int6 int7 uint1 uint2 uint3 uint4 uint5 uint6 uint7"
).split():
    _DTYPES[_n] = None

# Legacy typed storage classes (the first element of a storage persistent id).
_STORAGES: dict[str, str] = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
    "QInt8Storage": "qint8",
    "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
}

_ITEMSIZE = {
    "float32": 4,
    "float64": 8,
    "float16": 2,
    "bfloat16": 2,
    "complex64": 8,
    "complex128": 16,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}


class _Frozen:
    """Shared stand-ins are immutable: a pickle's BUILD cannot alter them for later files."""

    __slots__ = ()

    def __setattr__(self, key: str, value: Any) -> None:
        raise XckptError(f"pickle tried to set attribute {key!r} on {self!r}; refused")

    def __setstate__(self, state: Any) -> None:
        raise XckptError(f"pickle tried to set the state of {self!r}; refused")

    def __reduce__(self) -> Any:
        raise TypeError(f"{self!r} is a read-only stand-in and cannot be pickled")


class TorchDtype(_Frozen):
    """A torch dtype named in a pickle (`torch.float32` -> `TorchDtype("float32")`)."""

    __slots__ = ("name",)
    name: str

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)

    @property
    def xckpt(self) -> str | None:
        """The xckpt dtype name, or None when xckpt cannot hold this dtype."""
        return _DTYPES.get(self.name)

    @property
    def itemsize(self) -> int | None:
        x = self.xckpt
        return None if x is None else _ITEMSIZE[x]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TorchDtype) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("TorchDtype", self.name))

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class TorchEnum(_Frozen):
    """A torch layout, memory format or enum value (only its name is kept)."""

    __slots__ = ("name",)
    name: str

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TorchEnum) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("TorchEnum", self.name))

    def __repr__(self) -> str:
        return self.name


class _StorageType(_Frozen):
    """A storage class named in a persistent id (`torch.FloatStorage`, `UntypedStorage`)."""

    __slots__ = ("dtype",)
    dtype: str | None

    def __init__(self, dtype: str | None) -> None:
        object.__setattr__(self, "dtype", dtype)

    def __repr__(self) -> str:
        return f"<storage type {self.dtype or 'untyped'}>"


@dataclass(frozen=True)
class StorageRef:
    """A storage of a torch.save archive: record `data/<key>`, `numel` elements of `dtype`.

    `dtype` is None for an untyped storage (numel then counts bytes).
    """

    key: str
    dtype: TorchDtype | None
    numel: int
    location: str


@dataclass(frozen=True)
class TensorRef:
    """A tensor of a torch.save archive, as its rebuild function described it."""

    storage: StorageRef
    offset: int  # storage offset, in elements of dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: TorchDtype


class Record:
    """A pickled dataclass (DCP metadata): the pickle's fields become attributes."""

    def __setstate__(self, state: Any) -> None:
        slots = None
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state, slots = state
        for part in (state, slots):
            if part is None:
                continue
            if not isinstance(part, dict) or not all(type(k) is str for k in part):
                raise XckptError(f"bad state for {type(self).__name__}: {type(part).__name__}")
            self.__dict__.update(part)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


def materialize(value: Any, read_tensor: Callable[[TensorRef], Any], where: str, depth: int = 0) -> Any:
    """An unpickled value as its user sees it: tensors read (`read_tensor(ref)`, a numpy
    array), records as dicts of their fields, containers walked to `MAX_OBJECT_DEPTH`.

    The one walker of every format's pickled objects (DCP, Megatron, DeepSpeed).

    Raises:
        XckptError: the value is nested deeper than `MAX_OBJECT_DEPTH` levels.
    """
    if depth > MAX_OBJECT_DEPTH:
        raise XckptError(f"{where}: an object is nested deeper than {MAX_OBJECT_DEPTH} levels")
    if isinstance(value, TensorRef):
        return read_tensor(value)
    d = depth + 1
    if isinstance(value, Record):
        return {k: materialize(x, read_tensor, where, d) for k, x in value.__dict__.items()}
    if isinstance(value, dict):
        return {k: materialize(x, read_tensor, where, d) for k, x in value.items()}
    if type(value) is list:
        return [materialize(x, read_tensor, where, d) for x in value]
    if type(value) is tuple:
        return tuple(materialize(x, read_tensor, where, d) for x in value)
    return value


class _TensorProperties(Record):
    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 5:
            keys = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
            self.__dict__.update(zip(keys, state))
            return
        super().__setstate__(state)


class _MetadataIndex(Record):
    """Hashed by identity: duplicates are found by the reader, not merged by a dict."""


def field(rec: Any, key: str) -> Any:
    """Field `key` of a `Record` (None when absent or `rec` is not a record).

    Read from the instance dict, so a pickled field can never shadow a method.
    """
    if not isinstance(rec, Record):
        return None
    return rec.__dict__.get(key)


def _record(name: str, base: type = Record) -> type:
    return type(name, (base,), {"__module__": __name__})


def _size(value: Any = ()) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or any(type(v) is not int for v in value):
        raise XckptError(f"torch.Size holds {value!r}; expected integers")
    return tuple(value)


def _mem_format(value: Any) -> TorchEnum:
    names = {0: "contiguous_format", 1: "channels_last", 2: "preserve_format"}
    if value not in names or type(value) is not int:
        raise XckptError(f"unknown memory format encoding {value!r}")
    return TorchEnum(names[value])


def _get_layout(name: Any) -> TorchEnum:
    if name not in ("torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch._mkldnn"):
        raise XckptError(f"unknown torch layout {name!r}")
    return TorchEnum(name)


def _codecs_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    # Protocol 2 writes bytes as _codecs.encode(str, "latin1"); any other codec is a lookup we refuse.
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise XckptError(f"_codecs.encode with encoding {encoding!r} is not allowed")
    return text.encode("latin-1")


def _tensor(storage: Any, offset: Any, size: Any, stride: Any, dtype: Any) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise XckptError(f"a tensor's storage is {type(storage).__name__}, not a storage reference")
    ok = (
        type(offset) is int
        and offset >= 0
        and isinstance(size, tuple)
        and isinstance(stride, tuple)
        and len(size) == len(stride)
        and all(type(v) is int and v >= 0 for v in size + stride)
        and isinstance(dtype, TorchDtype)
    )
    if not ok:
        raise XckptError(
            f"tensor rebuild arguments are not valid (offset {offset!r}, size {size!r}, stride "
            f"{stride!r}, dtype {dtype!r})"
        )
    return TensorRef(storage, offset, size, stride, dtype)


def _rebuild_v2(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False, hooks: Any = None,
    metadata: Any = None,
) -> TensorRef:
    if not isinstance(storage, StorageRef) or storage.dtype is None:
        raise XckptError("_rebuild_tensor_v2 needs a typed storage")
    return _tensor(storage, offset, size, stride, storage.dtype)


def _rebuild_v3(
    storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any,
    metadata: Any = None,
) -> TensorRef:
    return _tensor(storage, offset, size, stride, dtype)


def _rebuild_parameter(data: Any, requires_grad: Any = False, hooks: Any = None, state: Any = None) -> Any:
    if not isinstance(data, TensorRef):
        raise XckptError("a parameter must wrap a tensor")
    return data


_PATHS = {
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("pathlib._local", "PosixPath"): pathlib.PurePosixPath,
    ("pathlib._local", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib._local", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib._local", "PureWindowsPath"): pathlib.PureWindowsPath,
}

_BUILTINS = {
    "set": set,
    "frozenset": frozenset,
    "complex": complex,
    "bytearray": bytearray,
    "slice": slice,
}

_COMMON: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("_codecs", "encode"): _codecs_encode,
    ("torch", "Size"): _size,
    **{("torch", n): TorchDtype(n) for n in _DTYPES},
    **{(m, n): v for m in ("builtins", "__builtin__") for n, v in _BUILTINS.items()},
}

_DCP = "torch.distributed.checkpoint"
_SHARD = "torch.distributed._shard.sharded_tensor.metadata"

#: What DCP's `.metadata` may name (DCP's metadata classes, sizes, dtypes, layouts, paths).
METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **_COMMON,
    **_PATHS,
    (f"{_DCP}.metadata", "Metadata"): _record("Metadata"),
    (f"{_DCP}.metadata", "TensorStorageMetadata"): _record("TensorStorageMetadata"),
    (f"{_DCP}.metadata", "BytesStorageMetadata"): _record("BytesStorageMetadata"),
    (f"{_DCP}.metadata", "ChunkStorageMetadata"): _record("ChunkStorageMetadata"),
    (f"{_DCP}.metadata", "TensorProperties"): _record("TensorProperties", _TensorProperties),
    (f"{_DCP}.metadata", "StorageMeta"): _record("StorageMeta"),
    (f"{_DCP}.metadata", "MetadataIndex"): _record("MetadataIndex", _MetadataIndex),
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"): _mem_format,
    (f"{_DCP}.filesystem", "_StorageInfo"): _record("_StorageInfo"),
    (_SHARD, "TensorProperties"): _record("TensorProperties", _TensorProperties),
    (_SHARD, "MEM_FORMAT_ENCODING"): _mem_format,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("torch", "strided"): TorchEnum("torch.strided"),
    **{("torch", n): TorchEnum(n) for n in ("contiguous_format", "channels_last", "preserve_format")},
}

#: What a torch.save `data.pkl` may name (tensor rebuild functions, storages, plain containers).
TORCH_SAVE_GLOBALS: dict[tuple[str, str], Any] = {
    **_COMMON,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch.storage", "UntypedStorage"): _StorageType(None),
    ("torch", "UntypedStorage"): _StorageType(None),
    **{("torch", n): _StorageType(d) for n, d in _STORAGES.items()},
}


# --- training-framework sources (DeepSpeed, Megatron-Core): begin -----------------------------
# Owner: converters/deepspeed.py and converters/megatron.py. Every entry is an inert stand-in.


class _TensorType(_Frozen):
    """`torch.Tensor` / `torch.nn.Parameter` named as the type of a tensor subclass rebuild."""

    __slots__ = ("name",)
    name: str

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)

    def __repr__(self) -> str:
        return self.name


_TENSOR_REBUILDS = (_rebuild_v2, _rebuild_v3, _rebuild_parameter)


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> TensorRef:
    # torch._tensor._rebuild_from_type_v2(func, type, args, state): DeepSpeed's ZeRO-3 flat groups
    # (a tensor with a `ds_id` attribute). Only our own rebuild stand-ins are ever called.
    if func not in _TENSOR_REBUILDS or not isinstance(new_type, _TensorType) or not isinstance(args, tuple):
        raise XckptError(f"_rebuild_from_type_v2 with {func!r} / {new_type!r} is not allowed")
    t = func(*args)
    if not isinstance(t, TensorRef):
        raise XckptError("_rebuild_from_type_v2 did not rebuild a tensor")
    return t


def _zero_stage(value: Any) -> int:
    # deepspeed.runtime.zero.config.ZeroStageEnum(int): the stage number, nothing else.
    if type(value) is not int or not 0 <= value <= 3:
        raise XckptError(f"ZeroStageEnum({value!r}) is not a ZeRO stage")
    return value


def _write_item_type(value: Any) -> TorchEnum:
    names = {1: "WriteItemType.TENSOR", 2: "WriteItemType.SHARD", 3: "WriteItemType.BYTE_IO"}  # enum.auto()
    if type(value) is not int or value not in names:
        raise XckptError(f"WriteItemType({value!r}) is not a DCP write item type")
    return TorchEnum(names[value])


_DS = "deepspeed"
_PLANNER = f"{_DCP}.planner"

#: What DeepSpeed's `*_optim_states.pt` `data.pkl` may name: torch.save's list, DeepSpeed's loss
#: scaler, ZeRO stage enum and fragment addresses (records of their pickled fields, nothing called),
#: and the tensor-subclass rebuild of ZeRO-3's flat groups.
DEEPSPEED_GLOBALS: dict[tuple[str, str], Any] = {
    **TORCH_SAVE_GLOBALS,
    (f"{_DS}.runtime.fp16.loss_scaler", "LossScaler"): _record("LossScaler"),
    (f"{_DS}.runtime.fp16.loss_scaler", "DynamicLossScaler"): _record("DynamicLossScaler"),
    (f"{_DS}.runtime.zero.config", "ZeroStageEnum"): _zero_stage,
    (f"{_DS}.utils.tensor_fragment", "fragment_address"): _record("fragment_address"),
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch", "Tensor"): _TensorType("torch.Tensor"),
    ("torch.nn.parameter", "Parameter"): _TensorType("torch.nn.Parameter"),
}

# Megatron-Core's torch_dist `.metadata` also pickles the save plans (`all_local_plans`).
METADATA_GLOBALS.update(
    {
        (_PLANNER, "SavePlan"): _record("SavePlan"),
        (_PLANNER, "WriteItem"): _record("WriteItem"),
        (_PLANNER, "TensorWriteData"): _record("TensorWriteData"),
        (_PLANNER, "BytesIOWriteData"): _record("BytesIOWriteData"),
        (_PLANNER, "WriteItemType"): _write_item_type,
    }
)


# --- training-framework sources (DeepSpeed, Megatron-Core): end -------------------------------


def _persistent_load(pid: Any) -> StorageRef:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
        raise XckptError(f"unknown persistent id {str(pid)[:100]!r}; only torch storages are read")
    _, stype, key, location, numel = pid
    if not isinstance(stype, _StorageType) or type(key) is not str or type(numel) is not int or numel < 0:
        raise XckptError(f"bad storage persistent id {str(pid)[:100]!r}")
    return StorageRef(key, None if stype.dtype is None else TorchDtype(stype.dtype), numel, str(location))


class _Restricted(pickle.Unpickler):
    def __init__(
        self, file: Any, allowed: dict[tuple[str, str], Any], storages: bool, where: str, foreign: bool = False
    ) -> None:
        super().__init__(file)
        self._allowed = allowed
        self._storages = storages
        self._where = where
        self._foreign: dict[tuple[str, str], Any] | None = {} if foreign else None

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except (KeyError, TypeError):
            if self._foreign is not None and type(module) is str and type(name) is str:
                # Not allowed: an inert placeholder that records what the pickle does with it.
                got = self._foreign.get((module, name))
                if got is None:
                    got = self._foreign[(module, name)] = placeholder(module, name)
                return got
            raise XckptError(
                f"{self._where}: the pickle asks for {module}.{name}, which is not on xckpt's "
                "allow-list (torch's tensor rebuild functions, DCP metadata classes, dtypes, sizes "
                "and plain containers); refused without calling anything. If you trust this file, "
                "load it with torch and re-save plain tensors"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        if not self._storages:
            raise XckptError(f"{self._where}: unexpected persistent id in the pickle")
        return _persistent_load(pid)


def restricted_load(
    data: bytes,
    allowed: dict[tuple[str, str], Any],
    where: str,
    *,
    storages: bool = False,
    foreign: bool = False,
) -> Any:
    """Unpickle `data` allowing only the globals in `allowed` (exact pairs).

    Args:
        data: the pickle's bytes.
        allowed: `METADATA_GLOBALS` or `TORCH_SAVE_GLOBALS`.
        where: names the file in messages.
        storages: accept torch storage persistent ids (torch.save's `data.pkl`).
        foreign: answer a global outside `allowed` with an inert placeholder class
            (`_foreign.placeholder`, which records and calls nothing) instead
            of refusing the pickle.

    Raises:
        XckptError: a refused global, or bytes that are not a valid pickle. Nothing
            outside `allowed` is ever called.
    """
    try:
        return _Restricted(io.BytesIO(data), allowed, storages, where, foreign).load()
    except XckptError:
        raise
    except Exception as e:  # noqa: BLE001 - untrusted bytes: any failure is a bad file, reported typed
        raise XckptError(f"{where}: not a valid pickle ({type(e).__name__}: {str(e)[:200]})") from None


class _OptIn(pickle.Unpickler):
    def __init__(self, file: Any, persistent: Callable[[Any], Any] | None) -> None:
        super().__init__(file)
        self._persistent = persistent

    def find_class(self, module: str, name: str) -> Any:
        # Tensors inside an object become references (then numpy); everything else is
        # what the standard unpickler would do: the caller opted in to running it.
        if (module, name) in TORCH_SAVE_GLOBALS and module.startswith("torch"):
            return TORCH_SAVE_GLOBALS[(module, name)]
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if self._persistent is None:
            raise pickle.UnpicklingError("unexpected persistent id")
        return self._persistent(pid)


def unrestricted_load(data: bytes, where: str, *, storages: bool = True) -> Any:
    """Unpickle `data` with the standard unpickler: this CAN RUN ARBITRARY CODE.

    The single place xckpt unpickles without its allow-list. It is called only
    for DCP's pickled objects (`BYTE_IO` items such as `step`) and only when
    the caller opened the checkpoint with `allow_pickle=True`, declaring the
    file trusted. torch's tensor rebuild functions still map to
    `TensorRef` (no torch needed); any other global is imported as
    `pickle` would.

    Raises:
        XckptError: the bytes are not a valid pickle.
    """
    try:
        return _OptIn(io.BytesIO(data), _persistent_load if storages else None).load()
    except XckptError:
        raise
    except Exception as e:  # noqa: BLE001 - report a failed opt-in unpickle as a typed error
        raise XckptError(f"{where}: the pickled object cannot be read ({type(e).__name__}: {e})") from None
