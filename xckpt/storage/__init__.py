"""Bytes in and out of a checkpoint location: kvstores, local files, packed spans.

The only place xckpt touches tensorstore or the OS's files for its own format;
:mod:`xckpt.reader` and :mod:`xckpt.writer` speak to it in keys, boxes and numpy
arrays. The family:

* ``_kvstore``: locations (paths, URLs, spec dicts), the tensorstore
  :class:`Storage` of one checkpoint, zarr array metadata, storage errors;
* ``_fileio``: the ``"files"`` storage read and written with plain file I/O on a
  local disk (the same bytes tensorstore writes, without its open costs);
* ``_packedio``: spans of a rank's packed byte array read beside the array chunks;
* ``_blob``, ``_http``: one stored file read by byte range (:class:`Blob`) from a local
  file, a kvstore key or an ``http(s)://`` URL;
* ``_place``: any location seen as a tree of files (:class:`Place`, :func:`as_place`),
  which the foreign formats (DCP, orbax, safetensors, torch.save) detect and open.

The reader and writer of the xckpt format use ``_fileio`` and ``_packedio``
directly (they are that format's I/O); everyone else imports from here.
"""

from __future__ import annotations

from xckpt.storage._blob import Blob, KvBlob, LocalBlob
from xckpt.storage._kvstore import (
    CODECS,
    CODECS_1,
    INNER_CHUNK_BYTES,
    PACKED_CHUNK_BYTES,
    Location,
    Storage,
    array_metadata,
    array_spec,
    corrupt,
    default_context,
    inner_chunk_shape,
    local_root,
    location_name,
    location_spec,
    location_url,
    packed_grid,
    storage_error,
)
from xckpt.storage._place import HttpPlace, KvPlace, LocalPlace, Place, as_place

__all__ = [
    "Blob",
    "HttpPlace",
    "KvBlob",
    "KvPlace",
    "LocalBlob",
    "LocalPlace",
    "Place",
    "as_place",
    "CODECS",
    "CODECS_1",
    "INNER_CHUNK_BYTES",
    "PACKED_CHUNK_BYTES",
    "Location",
    "Storage",
    "array_metadata",
    "array_spec",
    "corrupt",
    "default_context",
    "inner_chunk_shape",
    "local_root",
    "location_name",
    "location_spec",
    "location_url",
    "packed_grid",
    "storage_error",
]
