"""The verbs of xckpt, xckpt.torch and xckpt.jax: the same options, and each closes what it opened.

Every load verb takes a location of any format (or an open Source) and the same
read options; every save verb the same write options. A verb that opens a source
closes it before it returns, error or not; a Source the caller passes in is the
caller's and stays open.
"""

from __future__ import annotations

import inspect
import subprocess
import sys

import numpy as np
import pytest
import safetensors.numpy
import torch

import xckpt
import xckpt.jax as xj
import xckpt.torch as xt
from xckpt.converters.safetensors import SafetensorsSource
from xckpt.errors import MissingEntryError

LOADS = {
    "xckpt.load": xckpt.load,
    "xckpt.torch.load": xt.load,
    "xckpt.torch.load_full": xt.load_full,
    "xckpt.jax.load": xj.load,
}
SAVES = {"xckpt.save": xckpt.save, "xckpt.torch.save": xt.save, "xckpt.jax.save": xj.save}
READ_OPTIONS = {"format", "allow_pickle", "rules", "show_progress", "context"}
WRITE_OPTIONS = {"overwrite", "save_id", "async_save", "show_progress", "storage", "metadata"}


def _params(fn) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


@pytest.mark.parametrize("name", sorted(LOADS))
def test_every_load_takes_the_same_read_options(name) -> None:
    params = _params(LOADS[name])
    assert list(params)[0] == "path"
    assert READ_OPTIONS <= set(params), READ_OPTIONS - set(params)
    assert all(params[o].kind is inspect.Parameter.KEYWORD_ONLY for o in READ_OPTIONS)
    assert params["allow_pickle"].default is False and params["rules"].default is None


@pytest.mark.parametrize("name", sorted(SAVES))
def test_every_save_takes_the_same_write_options(name) -> None:
    params = _params(SAVES[name])
    assert list(params)[1] == "path"  # data first, location second
    have = set(params) | ({"storage", "metadata"} if "writer_options" in params else set())
    assert WRITE_OPTIONS <= have, WRITE_OPTIONS - have
    assert params["overwrite"].default is False and params["async_save"].default is False


@pytest.fixture()
def st_file(tmp_path):
    path = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(path))
    return str(path)


@pytest.fixture()
def closes(monkeypatch):
    """Paths of the safetensors sources closed while the test runs."""
    closed: list[str] = []
    real = SafetensorsSource.close

    def spy(self) -> None:
        closed.append(self.path)
        real(self)

    monkeypatch.setattr(SafetensorsSource, "close", spy)
    return closed


def _run_verbs(path) -> dict:
    import jax

    t = torch.empty(2, 3)
    out = {
        "xckpt.load": xckpt.load(path)["w"],
        "xckpt.torch.load": (xt.load(path, {"w": t}), t)[1].numpy(),
        "xckpt.torch.load_full": xt.load_full(path)["w"].numpy(),
        "xckpt.jax.load": np.asarray(xj.load(path, {"w": jax.ShapeDtypeStruct((2, 3), np.float32,
                                                                                  sharding=_sharding())})["w"]),
        "xckpt.plan_load": xckpt.plan_load(path, {"w": ((1,), "Shard(0)")}).total_bytes_to_read,
    }
    return out


def _sharding():
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)), PartitionSpec())


def test_each_verb_closes_the_source_it_opened(st_file, closes) -> None:
    out = _run_verbs(st_file)
    want = np.arange(6, dtype=np.float32).reshape(2, 3)
    for name in ("xckpt.load", "xckpt.torch.load", "xckpt.torch.load_full", "xckpt.jax.load"):
        assert np.array_equal(out[name], want), name
    assert out["xckpt.plan_load"] == want.nbytes
    assert closes == [st_file] * 5


def test_a_verb_closes_its_source_on_error_too(st_file, closes) -> None:
    with pytest.raises(MissingEntryError, match="'missing'"):
        xt.load(st_file, {"missing": torch.empty(1)})
    with pytest.raises(MissingEntryError, match="'missing'"):
        xt.load_full(st_file, ["missing"])
    assert closes == [st_file] * 2


def test_an_open_source_passed_in_stays_open(st_file, closes) -> None:
    with xckpt.open(st_file) as src:
        out = _run_verbs(src)
        assert closes == []
        assert np.array_equal(src.read("w"), out["xckpt.load"])  # still readable
    assert closes == [st_file]


@pytest.mark.parametrize("cmd", ["ls", "show", "verify"])
def test_cli_commands_close_their_source(st_file, cmd) -> None:
    # In a fresh interpreter, so the spy sees only the command's own source.
    code = (
        "import sys\n"
        "from xckpt.converters.safetensors import SafetensorsSource\n"
        "from xckpt import cli\n"
        "closed = []\n"
        "real = SafetensorsSource.close\n"
        "SafetensorsSource.close = lambda self: (closed.append(self.path), real(self))[1]\n"
        f"rc = cli.main([{cmd!r}, sys.argv[1]] + ([\"w\"] if {cmd!r} == 'show' else []))\n"
        "print('CLOSED', len(closed), rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, st_file], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "CLOSED 1 0"
