"""The exception hierarchy of xckpt.

Every error raised for bad input or a bad checkpoint is an [`XckptError`][xckpt.errors.XckptError].
Messages name the checkpoint, the tensor (or object) and what to do next.
Built-in bases are added where they fit, so `except ValueError` and
`except FileNotFoundError` keep working for callers that expect them.
"""

from __future__ import annotations

__all__ = [
    "XckptError",
    "CheckpointNotFoundError",
    "CheckpointExistsError",
    "IncompleteCheckpointError",
    "ManifestError",
    "FormatVersionError",
    "CorruptChunkError",
    "LayoutError",
    "ShapeMismatchError",
    "DtypeMismatchError",
    "ValueRangeError",
    "UnsupportedPlacementError",
    "ObjectError",
    "MissingEntryError",
    "StorageError",
    "RuleError",
]


class XckptError(Exception):
    """Base class of every error xckpt raises on purpose."""


class CheckpointNotFoundError(XckptError, FileNotFoundError):
    """No checkpoint (no manifest at all) exists at the location."""


class CheckpointExistsError(XckptError, FileExistsError):
    """A save would overwrite an existing checkpoint without `overwrite=True`."""


class IncompleteCheckpointError(XckptError):
    """Rank manifests are missing or belong to different saves."""


class ManifestError(XckptError, ValueError):
    """A manifest is truncated, not JSON, or fails validation."""


class FormatVersionError(ManifestError):
    """The manifest names a format or version this xckpt cannot read."""


class CorruptChunkError(XckptError):
    """Chunk data failed its checksum or could not be decoded."""


class LayoutError(XckptError, ValueError):
    """Chunks leave gaps, overlap, or do not fit the tensor's shape."""


class ShapeMismatchError(XckptError, ValueError):
    """The target's global shape differs from the saved one."""


class DtypeMismatchError(XckptError, TypeError):
    """The target's dtype differs from the saved one."""


class ValueRangeError(XckptError, ValueError):
    """Value-partitioned state disagrees with its value-range annotation."""


class UnsupportedPlacementError(XckptError, ValueError):
    """A placement cannot be saved (e.g. `Partial`) or is not understood."""


class ObjectError(XckptError, ValueError):
    """A non-tensor object cannot be stored, or cannot be loaded as asked."""


class MissingEntryError(XckptError, LookupError):
    """A name the caller asked for is not in the checkpoint."""


class StorageError(XckptError, OSError):
    """Storage failed under a read or write (disk full, file too large, permission, network).

    The tensorstore or OS error is the `__cause__`; `errno` is set when the
    OS reported one (e.g. `errno.ENOSPC`, `errno.EFBIG`, `errno.EACCES`).
    """


class RuleError(XckptError, ValueError):
    """A rule or rules file is invalid, or the rules do not fit the checkpoint (`xckpt.rules`)."""
