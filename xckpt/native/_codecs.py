"""Lossless codecs of array chunks (format version 6): `compression=None | "zstd" | "shuffle-zstd"`.

A compressed array is an ordinary zarr v3 array whose codec chain has one bytes-to-bytes
codec between `bytes` and `crc32c`, recorded in its `zarr.json` as zarr v3 names it,
so tensorstore (and zarr-python, for its dtypes) reads it without xckpt:

- `"zstd"`: `{"name": "zstd", "configuration": {"level": 1, "checksum": false}}`: one
  zstd frame per zarr chunk;
- `"shuffle-zstd"`: `{"name": "blosc", "configuration": {"cname": "zstd", "clevel": 1,
  "shuffle": "shuffle", "typesize": <item size>, "blocksize": 1048576}}`: a blosc frame
  whose blocks group the bytes of each item by position (byte shuffle) before zstd, so
  the well-predicted sign and exponent bytes of floats compress apart from the noisy
  mantissa bytes (ZipNN's observation).

crc32c stays the outermost codec: it covers the stored (compressed) bytes. The bytes
are encoded and decoded by numcodecs (c-blosc and libzstd), never by hand. Level 1 and
1 MiB blosc blocks were measured (bench/incremental.py): on bf16 weights higher levels
gain a few percent of size at a third of the speed, and blocks below 256 KiB halve the
decoding speed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numcodecs import Blosc, Zstd

from xckpt.errors import XckptError

__all__ = ["COMPRESSIONS", "check_compression", "codec_json", "compression_of", "encode", "decode"]

#: What `compression=` accepts.
COMPRESSIONS = (None, "zstd", "shuffle-zstd")
#: zstd level of both codecs (1: the fastest that still finds the redundancy there is).
LEVEL = 1
#: blosc block size of "shuffle-zstd".
BLOSC_BLOCK = 1 << 20


def check_compression(compression: Any) -> str | None:
    """`compression` when it is one of `COMPRESSIONS`.

    Raises:
        XckptError: anything else, naming the choices.
    """
    if compression is not None and (not isinstance(compression, str) or compression not in COMPRESSIONS):
        raise XckptError(
            f"compression={compression!r} is not a codec xckpt writes; pass None (raw), 'zstd' or "
            "'shuffle-zstd' (byte shuffle, then zstd: the better one for float weights)"
        )
    return compression


def codec_json(compression: str | None, itemsize: int) -> list[dict[str, Any]]:
    """The zarr v3 bytes-to-bytes codecs of `compression` (empty for raw), as tensorstore writes them."""
    if compression is None:
        return []
    if compression == "zstd":
        return [{"configuration": {"checksum": False, "level": LEVEL}, "name": "zstd"}]
    return [{
        "configuration": {
            "blocksize": BLOSC_BLOCK, "clevel": LEVEL, "cname": "zstd", "shuffle": "shuffle", "typesize": itemsize,
        },
        "name": "blosc",
    }]


def compression_of(codecs: Any, itemsize: int) -> str | None | bool:
    """Which compression a stored codec list (without `bytes` and `crc32c`) is; False when
    it is none xckpt writes (the array is then read through tensorstore, never here)."""
    for c in COMPRESSIONS:
        if codecs == codec_json(c, itemsize):
            return c
    return False


def _codec(compression: str, itemsize: int) -> Any:
    if compression == "zstd":
        return Zstd(level=LEVEL)
    return Blosc(cname="zstd", clevel=LEVEL, shuffle=Blosc.SHUFFLE, blocksize=BLOSC_BLOCK, typesize=itemsize)


def encode(compression: str, data: Any, itemsize: int) -> bytes:
    """The stored bytes of one zarr chunk: `data` (its raw bytes, C order) encoded."""
    buf = np.frombuffer(memoryview(data).cast("B"), np.uint8)
    return bytes(_codec(compression, itemsize).encode(buf))


def decode(compression: str, data: Any, out: np.ndarray, itemsize: int) -> None:
    """Decode one zarr chunk's stored bytes into `out` (a C-contiguous buffer of exactly its
    raw size).

    Raises:
        ValueError: the bytes are not a frame of this codec, or decode to another size.
    """
    flat = out.reshape(-1).view(np.uint8)
    try:
        if compression == "zstd":
            raw = Zstd().decode(data)
            got = memoryview(raw).nbytes
            if got != flat.nbytes:
                raise ValueError(f"zstd frame decodes to {got} bytes, expected {flat.nbytes}")
            flat[...] = np.frombuffer(raw, np.uint8)
            return
        head = memoryview(data).cast("B")
        # A blosc frame's header: 16 bytes, the decoded size at bytes 4..8 (little-endian).
        got = int.from_bytes(head[4:8], "little") if head.nbytes >= 16 else -1
        if got != flat.nbytes:
            raise ValueError(f"blosc frame holds {got} bytes, expected {flat.nbytes}")
        Blosc().decode(data, out=flat)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{compression} frame does not decode ({e})") from None
