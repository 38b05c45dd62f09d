"""Locations and bytes: where a checkpoint lives, and reading and writing its files.

It knows no format. One location model, `Place`: a location
seen as a tree of files, opened from whatever a user passes by
`as_place` (a path, a URL, a kvstore spec dict, an
`os.PathLike`). Its kinds:

* `LocalPlace`: a local path (plain file I/O);
* `KvPlace`: a tensorstore kvstore location, the kind that
  writes: keys read, written, listed and deleted (conditional writes included).
  `Storage` is the same class, the name the xckpt format and the manager use;
  `Storage(location)` opens any location as keys (plain file reads on a local disk);
* `HttpPlace`: an `http(s)://` location, read-only, found by probing (`http_place`
  parses one; a `Storage` of an http location reads through it too).

The family: `_location` (what a location is: parsing, names, joins, the tensorstore
context, storage errors), `_place` (the model), `_blob` and `_http` (one stored file
read by byte range, `Blob`: local, kvstore key, http(s)).
"""

from __future__ import annotations

from xckpt.storage._blob import Blob, KvBlob, LocalBlob
from xckpt.storage._location import (
    Location,
    corrupt,
    default_context,
    fsync_dir,
    local_root,
    location_name,
    location_spec,
    location_url,
    storage_error,
)
from xckpt.storage._place import HttpPlace, KvPlace, LocalPlace, Place, Storage, as_place, file_to_detect

__all__ = [
    "Blob",
    "HttpPlace",
    "KvBlob",
    "KvPlace",
    "LocalBlob",
    "LocalPlace",
    "Place",
    "as_place",
    "file_to_detect",
    "Location",
    "Storage",
    "corrupt",
    "default_context",
    "fsync_dir",
    "local_root",
    "location_name",
    "location_spec",
    "location_url",
    "storage_error",
]
