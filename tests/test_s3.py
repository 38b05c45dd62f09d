"""Object storage: xckpt on a real S3-compatible server (moto, see tests/s3_server.py).

The location is a tensorstore kvstore spec with an ``endpoint`` (how an S3-compatible
server or a private region is reached; URLs and AWS_ENDPOINT_URL go to AWS). Saves and
loads are compared bit for bit, with numpy, 2 gloo ranks saving and 3 loading, and
JAX on 8 devices; a killed save is refused; verify finds damage; racing saves have
one winner; the CLI takes the spec as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import ml_dtypes
import numpy as np
import pytest
import s3_server
from dist_utils import run_ranks

import xckpt
from xckpt.cli import main
from xckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptChunkError,
    StorageError,
    XckptError,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3():
    yield from s3_server.serve()


def _data(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((400, 300)).astype(np.float32),  # an array chunk
        "bf16": rng.standard_normal((64, 8)).astype(ml_dtypes.bfloat16),  # packed
        "i8": rng.integers(-128, 127, (33,), dtype=np.int8),
        "scalar": np.array(3.5, dtype=np.float64),
        "step": 11,
        "cfg": {"lr": 0.5, "shape": (2, 3)},
        "blob": rng.bytes(9000),
    }


def _same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        if isinstance(v, np.ndarray):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tobytes() == v.tobytes(), k
        else:
            assert got[k] == v, k


@pytest.mark.parametrize("storage", ["ocdbt", "plain", "files"])
def test_save_load_bit_exact(s3, storage):
    spec, d = s3.fresh(), _data(1)
    xckpt.save(d, spec, storage=storage)
    _same(xckpt.load(spec), d)
    ck = xckpt.open(spec)
    assert json.loads(ck.path)["endpoint"] == s3.endpoint  # named as the spec, secrets hidden
    assert ck.read("w", (slice(100, 250), slice(7, 9))).tobytes() == d["w"][100:250, 7:9].tobytes()
    assert ck.verify() == []
    assert any(k.endswith("xckpt.json") for k in s3.keys(spec))
    with pytest.raises(CheckpointExistsError, match="pass overwrite=True"):
        xckpt.save(d, spec)
    xckpt.save({"x": np.ones(3)}, spec, overwrite=True, storage=storage)
    _same(xckpt.load(spec), {"x": np.ones(3)})
    # The replaced save's data is deleted once the new manifest is in place.
    assert not [k for k in s3.keys(spec) if "/data/0/" in k]


def _dist_body(rank: int, world: int, spec: dict) -> str | None:
    """Ranks 0 and 1 save on a 2-rank mesh (their own process group); then all 3 load."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import xckpt.torch as xt

    full = torch.arange(13 * 6, dtype=torch.float32).reshape(13, 6) / 7
    full_bf = (torch.arange(10 * 4, dtype=torch.float32).reshape(10, 4) - 3).to(torch.bfloat16)
    pair = DeviceMesh("cpu", torch.tensor([0, 1]))  # every rank builds it; rank 2 is not in it
    if rank < 2:
        sd = {"w": distribute_tensor(full, pair, [Shard(0)]), "b": distribute_tensor(full_bf, pair, [Shard(1)]),
              "step": 5}
        xt.save(sd, spec, process_group=pair.get_group())
    dist.barrier()
    mesh = init_device_mesh("cpu", (world,))
    target = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)]),
              "b": distribute_tensor(torch.zeros_like(full_bf), mesh, [Shard(0)]), "step": 0}
    xt.load(spec, target)
    bad = []
    for name, want in (("w", full), ("b", full_bf)):
        as_int = torch.int16 if want.dtype == torch.bfloat16 else torch.int32
        if not torch.equal(target[name].full_tensor().view(as_int), want.view(as_int)):
            bad.append(name)
    if target["step"] != 5:
        bad.append("step")
    return ", ".join(bad) or None


def test_two_gloo_ranks_save_three_load_and_jax_on_eight_devices(s3):
    """One spawn of 3 gloo ranks: ranks 0-1 save (their own process group), all 3 load."""
    spec = s3.fresh()
    assert run_ranks(_dist_body, 3, spec, timeout=180) == [None, None, None]
    assert xckpt.open(spec).world_size == 2
    # JAX on the 8 simulated devices of this process, sharded over all of them.
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax as xj

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    out = xj.load(spec, {"w": NamedSharding(mesh, P(None, "b")), "b": NamedSharding(mesh, P("b", "a"))})
    full = (np.arange(13 * 6, dtype=np.float32).reshape(13, 6) / np.float32(7))
    assert len(out["w"].sharding.device_set) == 8
    assert np.asarray(out["w"]).tobytes() == xckpt.load(spec)["w"].tobytes()
    assert np.allclose(np.asarray(out["w"]), full)
    want_b = (np.arange(40, dtype=np.float32).reshape(10, 4) - 3).astype(ml_dtypes.bfloat16)
    assert np.asarray(out["b"]).tobytes() == want_b.tobytes()


def _killed_writer(spec: dict, env: dict) -> None:
    os.environ.update(env)  # a forkserver started before the fixture lacks the credentials
    w = xckpt.Writer(spec)
    w.write("w", np.ones((400, 300), np.float32))
    w._flush()  # the data is on the server, the manifest is not
    os.kill(os.getpid(), signal.SIGKILL)


def test_killed_save_is_refused(s3):
    from crash_utils import _ctx

    spec = s3.fresh()
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    p = _ctx().Process(target=_killed_writer, args=(spec, env))
    p.start()
    p.join(120)
    assert p.exitcode == -9
    assert any("/data/0/" in k for k in s3.keys(spec))
    with pytest.raises(CheckpointNotFoundError, match=r"a save has claimed it .* not committed"):
        xckpt.open(spec)
    with pytest.raises(CheckpointExistsError, match="has not committed.*overwrite=True"):
        xckpt.save({"x": np.zeros(2)}, spec)
    xckpt.save({"x": np.zeros(2)}, spec, overwrite=True)
    _same(xckpt.load(spec), {"x": np.zeros(2)})


def test_verify_and_damage(s3):
    import boto3

    spec, d = s3.fresh(), _data(2)
    xckpt.save(d, spec, storage="plain")
    assert xckpt.open(spec).verify() == []
    client = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1")
    key = next(k for k in s3.keys(spec) if "/data/0/t/" in k and "/c/" in k)
    raw = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
    raw[10] ^= 0xFF
    client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(raw))
    problems = xckpt.open(spec).verify()
    assert len(problems) == 1 and "tensor 'w'" in problems[0]
    with pytest.raises(CorruptChunkError, match="tensor 'w'"):
        xckpt.load(spec)


def test_racing_saves_one_winner(s3):
    for _ in range(3):
        spec = s3.fresh()
        res: list = [None, None]
        barrier = threading.Barrier(2)

        def run(j, spec=spec, res=res, barrier=barrier):
            barrier.wait()
            try:
                xckpt.save({"w": np.full(1000, j, np.int64)}, spec)
                res[j] = "ok"
            except XckptError as e:
                res[j] = e

        threads = [threading.Thread(target=run, args=(j,)) for j in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(map(str, (r if r == "ok" else type(r).__name__ for r in res))) == [
            "CheckpointExistsError", "ok"], res
        winner = res.index("ok")
        assert (xckpt.load(spec)["w"] == winner).all()


def test_cli_takes_a_json_spec(s3, capsys):
    spec = s3.fresh()
    xckpt.save({"w": np.arange(12, dtype=np.float32).reshape(3, 4)}, spec)
    assert main(["ls", json.dumps(spec)]) == 0
    assert "w     float32  [3, 4]  1       48 B" in capsys.readouterr().out
    assert main(["verify", json.dumps(spec)]) == 0
    assert main(["ls", "{not json"]) == 2
    assert "is not a JSON kvstore spec" in capsys.readouterr().err


def test_unreachable_endpoint_is_a_storage_error(s3):
    spec = {**s3.spec("x"), "endpoint": "http://127.0.0.1:9", "context": {"s3_request_retries": {"max_retries": 1}}}
    with pytest.raises(StorageError, match=r"checkpoint '\{.*storage failed while reading xckpt.json") as e:
        xckpt.open(spec)
    assert isinstance(e.value, OSError) and isinstance(e.value.__cause__, ValueError)
