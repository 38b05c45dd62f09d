"""Objects (non-tensor values) as JSON: encoding on save, bounded decoding of untrusted JSON.

JSON values are stored as they are; tuples, bytes, non-string dict keys, integers
beyond 64 bits, non-finite floats and numpy scalars are tagged `{"$xckpt": ...}`
so they come back as they were. `decode_value` reads values from manifests,
which are untrusted: every malformed input (an unknown tag, a tag with fields of
the wrong type, nesting deeper than `MAX_OBJECT_DEPTH`) is a
[`ManifestError`][xckpt.errors.ManifestError], never a raw exception or a recursion error.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

import numpy as np

from xckpt.errors import ManifestError, ObjectError
from xckpt.manifest._checks import DTYPES, dtype_name, numpy_dtype

__all__ = ["MAX_OBJECT_DEPTH", "encode_value", "decode_value", "decode_checked"]

#: JSON nesting of one object's value (tags included); orjson itself stops at 1024,
#: and writes at most 255 levels.
MAX_OBJECT_DEPTH = 200


def encode_value(value: Any, name: str = "<object>", _depth: int = 0) -> Any:
    """A JSON value for `value`; tuples, bytes, non-str dict keys and numpy
    scalars are tagged with `{"$xckpt": ...}` so they come back as they were.

    Values nested deeper than `MAX_OBJECT_DEPTH` JSON levels are refused
    (a reader refuses them too), as are self-referencing containers.
    """
    if _depth > MAX_OBJECT_DEPTH:
        raise ObjectError(
            f"object {name!r} is nested more than {MAX_OBJECT_DEPTH} levels deep (or contains "
            "itself); flatten it before saving"
        )
    d = _depth + 1
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if -(1 << 63) <= value < (1 << 64):
            return value
        return {"$xckpt": "int", "v": str(value)}
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"$xckpt": "float", "v": repr(value)}
    if isinstance(value, np.generic):
        return {"$xckpt": "np", "dtype": dtype_name(value.dtype), "v": encode_value(value.item(), name, d)}
    if isinstance(value, (bytes, bytearray)):
        return {"$xckpt": "bytes", "b64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, tuple):
        return {"$xckpt": "tuple", "items": [encode_value(v, name, d + 1) for v in value]}
    if isinstance(value, list):
        return [encode_value(v, name, d) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and "$xckpt" not in value:
            return {k: encode_value(v, name, d) for k, v in value.items()}
        return {
            "$xckpt": "dict",
            "items": [[encode_value(k, name, d + 2), encode_value(v, name, d + 2)] for k, v in value.items()],
        }
    raise ObjectError(
        f"object {name!r} of type {type(value).__name__} cannot be stored: xckpt stores JSON "
        "values (None, bool, int, float, str, list, tuple, dict), bytes and numpy scalars, and "
        "never pickles. Convert it (e.g. to bytes or a dict) before saving"
    )


def decode_value(value: Any, where: str = "object") -> Any:
    """Inverse of `encode_value`; any malformed input is a [`ManifestError`][xckpt.manifest._objects.ManifestError]
    naming `where` (too deep, unknown tags, tags with fields of the wrong type)."""
    return _decode(value, where, 0)


def _bad_tag(where: str, tag: Any, value: Any) -> ManifestError:
    return ManifestError(f"{where}: malformed {tag!r} value {value!r}"[:300] + "; the manifest is corrupt")


def _decode(value: Any, where: str, depth: int) -> Any:
    if depth > MAX_OBJECT_DEPTH:
        raise ManifestError(f"{where}: the value is nested more than {MAX_OBJECT_DEPTH} levels deep")
    d = depth + 1
    t = type(value)
    if t is list:
        return [_decode(v, where, d) for v in value]
    if t is not dict:
        if value is None or t in (bool, int, float, str):
            return value
        raise ManifestError(f"{where}: {t.__name__} is not a JSON value")
    tag = value.get("$xckpt")
    if tag is None:
        return {k: _decode(v, where, d) for k, v in value.items()}
    if tag == "tuple":
        items = value.get("items")
        if type(items) is not list:
            raise _bad_tag(where, tag, value)
        return tuple(_decode(v, where, d + 1) for v in items)
    if tag == "bytes":
        b64 = value.get("b64")
        if type(b64) is not str:
            raise _bad_tag(where, tag, value)
        try:
            return base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise _bad_tag(where, tag, value) from None
    if tag == "dict":
        items = value.get("items")
        if type(items) is not list or not all(type(kv) is list and len(kv) == 2 for kv in items):
            raise _bad_tag(where, tag, value)
        out = {}
        for k, v in items:
            key = _hashable(_decode(k, where, d + 2))
            try:
                hash(key)
            except TypeError:
                raise _bad_tag(where, tag, value) from None
            out[key] = _decode(v, where, d + 2)
        return out
    if tag in ("float", "int"):
        v = value.get("v")
        if type(v) is not str or len(v) > 4300:
            raise _bad_tag(where, tag, value)
        try:
            return float(v) if tag == "float" else int(v)
        except ValueError:
            raise _bad_tag(where, tag, value) from None
    if tag == "np":
        dt = value.get("dtype")
        if type(dt) is not str or dt not in DTYPES:
            raise _bad_tag(where, tag, value)
        inner = _decode(value.get("v"), where, d)
        if type(inner) not in (bool, int, float, complex):
            raise _bad_tag(where, tag, value)
        try:
            return numpy_dtype(dt).type(inner)
        except (TypeError, ValueError, OverflowError):
            raise _bad_tag(where, tag, value) from None
    raise ManifestError(f"{where}: unknown object tag {tag!r}"[:300])


def _hashable(v: Any) -> Any:
    if type(v) is list:
        return tuple(_hashable(x) for x in v)
    return v




def decode_checked(value: Any, where: str) -> None:
    """Decode `value` only to check it (at open): a [`ManifestError`][xckpt.manifest._objects.ManifestError] if malformed."""
    _decode(value, where, 0)
