"""Every Sink runs :class:`conformance.SinkTests`: ``xckpt.convert`` of one xckpt source to its
format, read back by the format's own library (``torch.distributed.checkpoint.load``, orbax's
``PyTreeCheckpointer().restore``, ``safetensors.torch.load_file``, ``torch.load(weights_only=True)``,
``xckpt.open``) and compared bit for bit; plus its call protocol driven directly."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import numpy as np
from conformance import OBJECTS, TRUTH, SinkTests, flatten, json_objects, nest, numpy_to_torch, torch_to_numpy

import xckpt


class TestXckptSink(SinkTests):
    format = "xckpt"
    dst = "out"
    keeps_layout = True

    def read_back(self, path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        with xckpt.open(path) as src:
            return src.read_all(show_progress=False), src.objects()


class TestDcpSink(SinkTests):
    format = "torch-dcp"
    dst = "out"
    keeps_layout = True

    def read_back(self, path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        import torch
        import torch.distributed.checkpoint as dcp

        state: dict[str, Any] = {n: torch.zeros_like(numpy_to_torch(a)) for n, a in TRUTH.items()}
        state.update({"step": 0, "cfg": {"lr": 0.0, "name": ""}})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
            dcp.load(state, checkpoint_id=path, no_dist=True)
        return {n: torch_to_numpy(state[n]) for n in TRUTH}, {k: state[k] for k in OBJECTS}


class TestOrbaxSink(SinkTests):
    format = "orbax"
    dst = "out"

    def read_back(self, path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        import jax
        import orbax.checkpoint as ocp

        with jax.enable_x64(True), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Populating sharding info from sharding file"
            tree = ocp.PyTreeCheckpointer().restore(path)
        flat = flatten(tree)
        arrays = {n: np.asarray(flat.pop(n)) for n in TRUTH}
        objects = nest({k: v.item() if isinstance(v, (np.generic, np.ndarray)) else v for k, v in flat.items()})
        return arrays, objects


class TestSafetensorsSink(SinkTests):
    format = "safetensors"
    dst = "out.safetensors"
    xckpt_objects: dict[str, Any] = {}  # objects travel in __metadata__, as JSON text

    def read_back(self, path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(path, "pt") as f:
            metadata = f.metadata()
        assert metadata["format"] == "pt"
        return {n: torch_to_numpy(t) for n, t in load_file(path).items()}, json_objects(metadata)


class TestHfDirectorySink(SinkTests):
    """safetensors as a Hugging Face directory: shards of at most 200 bytes and an index."""

    format = "safetensors"
    dst = "hf"
    options = {"max_shard_size": 200}
    xckpt_objects: dict[str, Any] = {}

    def read_back(self, path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            index = json.load(f)
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and sorted(index["weight_map"]) == sorted(TRUTH)
        arrays: dict[str, np.ndarray] = {}
        for shard in shards:
            arrays.update({n: torch_to_numpy(t) for n, t in load_file(os.path.join(path, shard)).items()})
        with safe_open(os.path.join(path, shards[0]), "pt") as f:
            objects = json_objects(f.metadata())
        return arrays, objects


class TestTorchSaveSink(SinkTests):
    format = "torch"
    dst = "out.pt"

    def read_back(self, path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        import torch

        sd = torch.load(path, weights_only=True)
        return {n: torch_to_numpy(sd[n]) for n in TRUTH}, {k: sd[k] for k in OBJECTS}
