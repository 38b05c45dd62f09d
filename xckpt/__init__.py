"""xckpt: a framework-neutral checkpoint format on tensorstore.

Save from PyTorch or JAX, load into either at any world size and layout,
convert from and to torch DCP, orbax, safetensors and torch.save, and inspect
chunks in a notebook. `import xckpt` imports neither torch nor jax: the
adapters live in `xckpt.torch` and `xckpt.jax`.
"""

from __future__ import annotations

from xckpt import errors, layout
from xckpt._version import __version__
from xckpt.convert_parallel import convert
from xckpt.formats import load, open
from xckpt.layout import Box
from xckpt.manager import CheckpointManager
from xckpt.manifest import Manifest, TensorEntry
from xckpt.native import Checkpoint, Writer, finalize, save
from xckpt.plan import LoadPlan, RankPlan, plan_load
from xckpt.rules import Rules
from xckpt.sink import Sink
from xckpt.source import Source
from xckpt.storage import Location

__all__ = [
    "Box",
    "Checkpoint",
    "CheckpointManager",
    "LoadPlan",
    "Location",
    "Manifest",
    "RankPlan",
    "Rules",
    "Sink",
    "Source",
    "TensorEntry",
    "convert",
    "Writer",
    "errors",
    "finalize",
    "layout",
    "load",
    "open",
    "plan_load",
    "save",
    "__version__",
]
