"""The on-disk model of an xckpt checkpoint, with no I/O: frozen dataclasses <-> JSON.

A manifest never holds framework types or pickles, only ints, strings, tuples and
JSON values, and every claim it makes is checked against fixed bounds while it is
read, before anything is sized from it. The family:

* `_checks`: format constants, bounds, the dtype table and field checks;
* `_entries`: [`TensorEntry`][xckpt.manifest.TensorEntry] (with its `Chunk` boxes), `ObjectEntry`;
* `_rows`: packed rows, the compact form of a whole tensor packed in its rank's array;
* `_table`: a rank manifest's chunk table, its single-chunk tensors as columns (version 6);
* `_objects`: non-tensor values as tagged JSON (never pickle);
* `_signed`: the manifest's own checksum and the claim written before a save;
* `_chunks`: `Chunk`, one stored box and where its bytes live;
* `_grids`: grid entries (version 5; binary columns, version 6), `GridChunks`: chunks
  as a grid, built on demand;
* `_document`: [`Manifest`][xckpt.manifest.Manifest], one rank's or the merged document, and merging;
* `_merge`: `RankMerge`, rank manifests merged as they are parsed (grids recognised);
* `_incremental`: version 6's codecs, references to other steps' arrays, chunk hashes.

Code outside this folder imports from here.
"""

from __future__ import annotations

from xckpt.manifest._checks import (
    COLUMNS_VERSION,
    DTYPES,
    FORMAT,
    GRID_VERSION,
    INCREMENTAL_VERSION,
    MAX_CHUNKS,
    MAX_ELEMENTS,
    MAX_EXTENT,
    MAX_KEY_LEN,
    MAX_NAME_LEN,
    MAX_NDIM,
    MAX_TENSOR_BYTES,
    MAX_WORLD_SIZE,
    READ_VERSIONS,
    ROWS_VERSION,
    STORAGE_KINDS,
    VERSION,
    ZEROS,
    dtype_name,
    numpy_dtype,
    shared_shape,
    unchecked,
)
from xckpt.manifest._chunks import Chunk
from xckpt.manifest._document import (
    Header,
    Manifest,
    merge_manifests,
    parse_document,
    parse_header,
    signed_header,
)
from xckpt.manifest._entries import ObjectEntry, PlacementInfo, TensorEntry, ValueRange, paused_gc
from xckpt.manifest._grids import GRID_MIN_CELLS, GridChunks
from xckpt.manifest._incremental import CODEC_NAMES, Patch, Ref
from xckpt.manifest._merge import RankMerge
from xckpt.manifest._objects import MAX_OBJECT_DEPTH, decode_value, encode_value
from xckpt.manifest._signed import (
    CLAIM_PREFIX,
    Claim,
    claim_bytes,
    dumps_json,
    manifest_bytes,
    parse_claim,
    signed,
)

__all__ = [
    "CLAIM_PREFIX",
    "COLUMNS_VERSION",
    "DTYPES",
    "FORMAT",
    "GRID_MIN_CELLS",
    "GRID_VERSION",
    "INCREMENTAL_VERSION",
    "CODEC_NAMES",
    "Patch",
    "Ref",
    "MAX_CHUNKS",
    "MAX_ELEMENTS",
    "MAX_EXTENT",
    "MAX_KEY_LEN",
    "MAX_NAME_LEN",
    "MAX_NDIM",
    "MAX_OBJECT_DEPTH",
    "MAX_TENSOR_BYTES",
    "MAX_WORLD_SIZE",
    "READ_VERSIONS",
    "ROWS_VERSION",
    "STORAGE_KINDS",
    "VERSION",
    "ZEROS",
    "Chunk",
    "Claim",
    "GridChunks",
    "Header",
    "Manifest",
    "ObjectEntry",
    "PlacementInfo",
    "RankMerge",
    "TensorEntry",
    "ValueRange",
    "claim_bytes",
    "decode_value",
    "dtype_name",
    "dumps_json",
    "encode_value",
    "manifest_bytes",
    "merge_manifests",
    "numpy_dtype",
    "parse_claim",
    "signed",
    "parse_document",
    "parse_header",
    "signed_header",
    "paused_gc",
    "shared_shape",
    "unchecked",
]
