"""The xckpt format itself, a package like any converter.

Its read side is [Checkpoint][xckpt.Checkpoint] (a [Source][xckpt.Source]), its write
side [Writer][xckpt.Writer] with [save][xckpt.save] and [finalize][xckpt.finalize], and
[XckptSink][xckpt.native.sink.XckptSink] for conversions into it. The modules:

* `reader`, `writer`: one checkpoint read, one rank's side of a save;
* `commit`: the commit protocol's read side (rank manifests read, checked, merged);
* `steps`: a checkpoint manager's root as stored (steps, completeness, metrics);
* `_zarr`: its zarr arrays' metadata and the data key spaces that hold them;
* `_fileio`, `_filemeta`, `_packedio`: "files" storage read and written with plain file
  I/O on a local disk (and those arrays' metadata), and spans of a rank's packed byte array;
* `_codecs`: lossless codecs of array chunks (format version 6);
* `_refs`, `_deltas`: chunks stored in another step of a manager root, and row patches
  of 2-D chunks (format version 6);
* `sink`: the [Sink][xckpt.Sink] that writes xckpt in conversions.

[xckpt.formats][] registers it beside the foreign formats.
"""

from __future__ import annotations

from xckpt.native.reader import Checkpoint
from xckpt.native.writer import Writer, finalize, save

__all__ = ["Checkpoint", "Writer", "finalize", "save"]
