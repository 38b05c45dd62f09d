"""JAX adapter: save and load pytrees of jax.Arrays with any sharding.

`save(tree, path)` writes each process's addressable shards (each distinct
box once, writers spread by [`xckpt.layout.choose_writer`][xckpt.layout.choose_writer]);
`load(path, target)` builds jax.Arrays of any sharding from any saved
layout, reading only the chunks each device's box overlaps;
`sharding_for(info, mesh)` proposes the NamedSharding equivalent to a saved
torch or JAX placement. Names are key paths joined with `"."`, the same
strings as torch FQNs, so a PyTorch checkpoint loads into JAX by name.

This module imports jax; `import xckpt` does not.
"""

from __future__ import annotations

from ._load import load
from ._save import save
from ._sharding import sharding_for
from ._tree import key_name

__all__ = ["save", "load", "sharding_for", "key_name"]
