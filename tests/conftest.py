"""Suite-wide setup: 8 simulated CPU devices for JAX, set before anything imports jax."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``gpu`` on a machine without CUDA."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run on the GPU machine")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(params=[False, True], ids=["preadv", "mapped"])
def reads(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[bool]:
    """Chunk files under `tmp_path` read by `preadv`, or copied out of mappings (how a
    manager's local tier is read: `xckpt.native._fileio.read_mapped_under`)."""
    from xckpt.native import _fileio

    _fileio.read_mapped_under(str(tmp_path), request.param)
    yield request.param
    _fileio.read_mapped_under(str(tmp_path), False)
