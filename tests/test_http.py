"""safetensors files and Hugging Face directories over ``http(s)://`` (issue 24, DESIGN section 6).

A threaded ``http.server`` on 127.0.0.1 (tests/range_server.py) serves files with ``Range``
requests and counts the body bytes it sends. An http location cannot be listed: a directory is
found by probing ``model.safetensors.index.json``, then ``model.safetensors``. Reads are byte
ranges only (one eighth of a tensor costs about one eighth of its bytes); redirects are followed
(the Hugging Face hub sends files to a CDN) with the location's headers kept to its own host;
a server that ignores ``Range`` is refused for large files; proxies come from the environment.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import numpy as np
import pytest
from range_server import RangeServer
from safetensors.numpy import load_file, save_file

import xckpt
from xckpt.cli import main
from xckpt.errors import CheckpointNotFoundError, XckptError
from xckpt.storage import HttpPlace, as_place

ROWS, COLS = 1024, 256  # 1 MiB of float32


def _arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "big": rng.standard_normal((ROWS, COLS)).astype(np.float32),
        "small": rng.integers(-5, 5, (7, 3)).astype(np.int32),
    }


def _bits(a: Any) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = str(tmp_path_factory.mktemp("www"))
    save_file(_arrays(1), os.path.join(d, "model.safetensors"))
    hf = os.path.join(d, "hf")
    os.makedirs(hf)
    weight_map = {}
    for i, (name, _a) in enumerate(sorted({**{f"layers.{k}": v for k, v in _arrays(2).items()}, "embed": _arrays(3)["big"]}.items())):
        shard = f"model-0000{i % 2 + 1}-of-00002.safetensors"
        weight_map[name] = shard
    for shard in sorted(set(weight_map.values())):
        tensors = {n: _hf_truth()[n] for n, s in weight_map.items() if s == shard}
        save_file(tensors, os.path.join(hf, shard))
    with open(os.path.join(hf, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 1}, "weight_map": weight_map}, f)
    os.makedirs(os.path.join(d, "single"))
    save_file(_arrays(4), os.path.join(d, "single", "model.safetensors"))
    os.makedirs(os.path.join(d, "empty"))
    with open(os.path.join(d, "empty", "README.md"), "w") as f:
        f.write("no weights here")
    shutil.copy(os.path.join(os.path.dirname(__file__), "fixtures_foreign", "lightning", "tiny_ns.ckpt"), d)
    return d


def _hf_truth() -> dict[str, np.ndarray]:
    return {**{f"layers.{k}": v for k, v in _arrays(2).items()}, "embed": _arrays(3)["big"]}


@pytest.fixture(scope="module")
def server(root: str) -> Any:
    with RangeServer(root) as srv:
        yield srv


def test_file_reads_byte_ranges_only(server: RangeServer) -> None:
    url = server.url("model.safetensors")
    want = _arrays(1)
    assert xckpt.formats.detect(url) == "safetensors"
    server.reset()
    with xckpt.open(url) as src:
        opened = server.sent
        assert opened <= 64 << 10  # one request: the first 64 KiB (the header is in it)
        assert sorted(src.names()) == ["big", "small"] and src.path == url
        server.reset()
        eighth = src.read("big", (slice(ROWS // 8, ROWS // 4), slice(None)))
        sent = server.sent
        assert _bits(eighth) == _bits(want["big"][ROWS // 8 : ROWS // 4])
        assert sent == want["big"].nbytes // 8  # exactly the rows' bytes: one Range request
        cols = src.read("big", (slice(None), slice(0, COLS // 8)))  # short runs: the span, in windows
        assert _bits(cols) == _bits(want["big"][:, : COLS // 8])
        assert _bits(src.read("small")) == _bits(want["small"])


@pytest.mark.parametrize("path", ["hf", "hf/", "hf/model.safetensors.index.json"])
def test_hugging_face_directory_is_probed(server: RangeServer, path: str) -> None:
    url = server.url(path)
    assert xckpt.formats.detect(url) == "safetensors"
    want = _hf_truth()
    with xckpt.open(url) as src:
        assert sorted(src.names()) == sorted(want) and src.world_size == 2
        got = src.read_all(show_progress=False)
        assert [n for n in want if _bits(got[n]) != _bits(want[n])] == []
        server.reset()
        src.read("embed", (slice(0, ROWS // 8), slice(None)))
        assert server.sent == want["embed"].nbytes // 8
    # Nothing was listed: only names were asked for.
    assert all(" /hf/ " not in line for line, _ in server.requests)


def test_directory_with_only_model_safetensors(server: RangeServer) -> None:
    with xckpt.open(server.url("single")) as src:
        assert _bits(src.read("big")) == _bits(_arrays(4)["big"])


def test_directory_without_either_name(server: RangeServer) -> None:
    url = server.url("empty/")
    with pytest.raises(CheckpointNotFoundError, match=r"model\.safetensors\.index\.json \(absent\), model\.safetensors \(absent\)"):
        xckpt.open(url)
    with pytest.raises(CheckpointNotFoundError, match=r"an http\(s\) location cannot be listed, and neither"):
        xckpt.open(url, format="safetensors")
    with pytest.raises(CheckpointNotFoundError, match=r"nothing \(the server has no file there"):
        xckpt.open(server.url("missing.safetensors"))


def test_torch_save_files_over_http(server: RangeServer) -> None:
    url = server.url("tiny_ns.ckpt")
    assert xckpt.formats.detect(url) == "torch"
    with xckpt.open(url) as src:
        assert src.pickled_objects() == {"hyper_parameters", "best_metric"}
        assert src.read("state_dict.bn.num_batches_tracked").item() == 2


def test_redirects_keep_headers_on_their_host(root: str) -> None:
    with RangeServer(root) as cdn, RangeServer(root, redirect_to=cdn.base) as hub:
        spec = {"driver": "http", "base_url": hub.url("redirect/hf/"), "headers": ["Authorization: Bearer sekrit"]}
        assert isinstance(as_place(spec), HttpPlace)
        with xckpt.open(spec) as src:
            got = src.read_all(show_progress=False)
        want = _hf_truth()
        assert [n for n in want if _bits(got[n]) != _bits(want[n])] == []
        assert hub.requests and all(h.get("Authorization") == "Bearer sekrit" for _, h in hub.requests)
        assert cdn.requests and all("Authorization" not in h for _, h in cdn.requests)
        # Each file is redirected once (other formats' probes aside); its later reads go to the CDN.
        files = [line for line, _ in hub.requests if ".safetensors" in line]
        assert len(files) == 3 and hub.sent == 0


def test_a_server_ignoring_range_is_refused(root: str) -> None:
    with RangeServer(root, ranges=False) as srv:
        with pytest.raises(XckptError, match=r"ignores Range requests .*Download the file and open it locally"):
            xckpt.open(srv.url("model.safetensors"), format="safetensors")


def test_proxy_from_the_environment(root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with RangeServer(root) as origin, RangeServer(root) as proxy:
        monkeypatch.setenv("http_proxy", proxy.base)
        for k in ("no_proxy", "NO_PROXY", "HTTP_PROXY"):
            monkeypatch.delenv(k, raising=False)
        with xckpt.open(origin.url("model.safetensors")) as src:
            assert _bits(src.read("small")) == _bits(_arrays(1)["small"])
        assert origin.requests == []
        assert proxy.requests and all(line.split()[1].startswith(origin.base) for line, _ in proxy.requests)


def test_convert_from_http(server: RangeServer, tmp_path: Any) -> None:
    out = str(tmp_path / "model.safetensors")
    assert xckpt.convert(server.url("hf"), out, show_progress=False) == out
    got, want = load_file(out), _hf_truth()
    assert sorted(got) == sorted(want) and all(_bits(got[n]) == _bits(want[n]) for n in want)
    out2 = str(tmp_path / "again")
    assert main(["--no-progress", "convert", server.url("model.safetensors"), out2]) == 0
    with xckpt.open(out2) as back:
        assert _bits(back.read("big")) == _bits(_arrays(1)["big"])


#: A bytes object stored under a key of its own (over 4 KiB), read as a file like the manifests.
BLOB = bytes(range(256)) * 40


@pytest.fixture(scope="module")
def xckpt_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """An xckpt checkpoint (`ck`) and the same save without its merged manifest (`ranks_only`)."""
    d = str(tmp_path_factory.mktemp("xckpt-www"))
    xckpt.save({**_arrays(5), "cfg": {"lr": 0.5}, "blob": BLOB}, os.path.join(d, "ck"))
    shutil.copytree(os.path.join(d, "ck"), os.path.join(d, "ranks_only"))
    os.remove(os.path.join(d, "ranks_only", "xckpt.json"))
    with RangeServer(d) as srv:
        yield srv, d


def test_an_http_location_reads_the_same_way_wherever_it_is_given(xckpt_server: Any) -> None:
    """`Storage` (the xckpt format's and the manager's keys) and `as_place` (every other
    format's files) read an http(s) location through one `HttpPlace`: the same requests (a
    first Range of 64 KiB), the same headers, the same answers for a missing file."""
    from xckpt.storage import Storage

    srv, d = xckpt_server
    spec = {"driver": "http", "base_url": srv.base, "path": "/ck/", "headers": ["Authorization: Bearer sekrit"]}
    with open(os.path.join(d, "ck", "xckpt.json"), "rb") as f:
        manifest = f.read()
    for loc in (srv.url("ck"), spec):
        srv.reset()
        storage, place = Storage(loc), as_place(loc)
        assert storage.read_key("xckpt.json") == place.read("xckpt.json") == manifest
        assert storage.read_keys(["ranks/0.json", "nope.json"])[1] is None and place.read("nope.json") is None
        assert storage.isfile("xckpt.json") and not storage.listable
        lines = [line for line, _ in srv.requests]
        assert lines and all(line.startswith("GET /ck/") for line in lines)
        assert all(h.get("Range") == "bytes=0-65535" for _, h in srv.requests)
        if isinstance(loc, dict):
            assert all(h.get("Authorization") == "Bearer sekrit" for _, h in srv.requests)
        with pytest.raises(XckptError, match=r"cannot be listed \(http\(s\)\), and reading it lists ranks/; copy"):
            storage.list_prefix("ranks/")


def test_an_xckpt_checkpoint_over_http_is_detected_and_read(xckpt_server: Any) -> None:
    srv, _ = xckpt_server
    want = _arrays(5)
    spec = {"driver": "http", "base_url": srv.base, "path": "/ck", "headers": ["Authorization: Bearer sekrit"]}
    for loc in (srv.url("ck"), srv.url("ck/"), spec):
        assert xckpt.formats.detect(loc) == "xckpt"
        srv.reset()
        with xckpt.open(loc) as src:
            assert src.format == "xckpt" and src.objects() == {"cfg": {"lr": 0.5}, "blob": BLOB}
            assert [n for n in want if _bits(src.read(n)) != _bits(want[n])] == []
        # Files (the manifest, the blob's key) by xckpt's http client; zarr arrays by tensorstore.
        ours = {line.split()[1] for line, h in srv.requests if h.get("User-Agent") == "xckpt"}
        theirs = {line.split()[1] for line, h in srv.requests if h.get("User-Agent") != "xckpt"}
        assert "/ck/xckpt.json" in ours and any("/o/" in p for p in ours) and len(ours) == 2
        assert theirs and all(p.endswith("/zarr.json") or "/c." in p for p in theirs)
        if isinstance(loc, dict):  # the headers reach the native reader (tensorstore's chunk reads included)
            auth = [{k.lower(): v for k, v in h.items()}.get("authorization") for _, h in srv.requests]
            assert auth and set(auth) == {"Bearer sekrit"}
    # The token in a spec's headers never shows in a name or a message.
    with xckpt.open(spec) as src:
        assert "sekrit" not in src.path + repr(src) and '"headers": "***"' in src.path
    with pytest.raises(CheckpointNotFoundError) as missing:
        xckpt.open({**spec, "path": "/nothing/"})
    assert "sekrit" not in str(missing.value) and '"headers": "***"' in str(missing.value)
    # Without xckpt.json its rank manifests would have to be listed.
    with pytest.raises(CheckpointNotFoundError, match=r"xckpt: no xckpt\.json, ranks/ or data/ \(an http\(s\) location"):
        xckpt.open(srv.url("ranks_only"))
    with pytest.raises(XckptError, match=r"cannot be listed \(http\(s\)\), and reading it lists ranks/"):
        xckpt.open(srv.url("ranks_only"), format="xckpt")
