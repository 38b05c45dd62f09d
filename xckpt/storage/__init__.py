"""Locations and bytes: where a checkpoint lives, and reading and writing its files.

It knows no format. The family:

* `_kvstore`: locations (paths, URLs, spec dicts), the [Storage][xckpt.storage.Storage]
  of one location (small keys, listing, deletes), storage errors;
* `_blob`, `_http`: one stored file read by byte range ([Blob][xckpt.storage.Blob])
  from a local file, a kvstore key or an `http(s)://` URL;
* `_place`: any location seen as a tree of files ([Place][xckpt.storage.Place],
  [as_place][xckpt.storage.as_place]), which every format detects and opens.
"""

from __future__ import annotations

from xckpt.storage._blob import Blob, KvBlob, LocalBlob
from xckpt.storage._kvstore import (
    Location,
    Storage,
    corrupt,
    default_context,
    fsync_dir,
    local_root,
    location_name,
    location_spec,
    location_url,
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
