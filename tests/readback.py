"""Read a converted output back with its format's own library (tests of the foreign sources).

xckpt through :mod:`xckpt`; torch DCP through ``dcp_to_torch_save`` and ``torch.load``; orbax
through ``PyTreeCheckpointer().restore``; safetensors through ``safetensors.numpy.load_file``;
torch.save through ``torch.load(weights_only=True)``. Tensors come back as numpy, bit for bit.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from conformance import flatten, torch_to_numpy

import xckpt

#: (output format, destination name) for ``xckpt.convert``: every output format.
OUTPUTS = [
    ("xckpt", "out"),
    ("torch-dcp", "out"),
    ("orbax", "out"),
    ("safetensors", "out.safetensors"),
    ("torch", "out.pt"),
]


def read_back(fmt: str, path: str) -> dict[str, np.ndarray]:
    """Every tensor of ``path``, read by its format's own library (numpy, bit for bit)."""
    if fmt == "xckpt":
        with xckpt.open(path) as src:
            return src.read_all(show_progress=False)
    if fmt == "torch-dcp":
        import torch
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(path, path + ".pt")
        sd = torch.load(path + ".pt", weights_only=False)
        return {k: torch_to_numpy(v) for k, v in _flat(sd).items() if isinstance(v, torch.Tensor)}
    if fmt == "orbax":
        import jax
        import orbax.checkpoint as ocp

        with jax.enable_x64(True), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ocp.PyTreeCheckpointer().restore(path)
        return {k: np.asarray(v) for k, v in flatten(tree).items() if isinstance(v, (np.ndarray, jax.Array))}
    if fmt == "safetensors":
        from safetensors.numpy import load_file

        return dict(load_file(path))
    import torch

    return {
        k: torch_to_numpy(v)
        for k, v in torch.load(path, weights_only=True).items()
        if isinstance(v, torch.Tensor)
    }


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
