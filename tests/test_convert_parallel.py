"""Parallel, deterministic, resumable conversion (DESIGN section 13).

The source is an xckpt checkpoint of two writers (row-sharded float32, bfloat16 and
int64 tensors, an empty tensor, replicated and per-rank objects), cut into parts of
64 KB, so every output format but the one-file ones has several parts. Each output is
converted with 1, 2 and 3 local worker processes and under ``torchrun`` (2 ranks, gloo
on 127.0.0.1): every file name and every byte must be the same, and each output is read
back by its own library (xckpt.open, safetensors, torch DCP's ``load``, ``torch.load``,
orbax's ``StandardCheckpointer``).
Kill-and-resume runs the CLI in a fresh process, SIGKILLs its process group once a
random number of parts is in the journal (and a random few milliseconds more), damages
one finished file, and resumes: the output is the clean run's, byte for byte, and the
finished files that were intact are not rewritten (same inode, same mtime).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest

import xckpt
from xckpt.convert import VerifyMismatchError
from xckpt.errors import CheckpointExistsError, XckptError
from xckpt.native.writer import Writer, finalize

PART = 20_000
ROWS = 96
TENSORS = {  # name -> (shape, dtype); rows split over the two writers
    "model.embed": ((ROWS, 64), np.float32),
    "model.w1": ((ROWS, 48), ml_dtypes.bfloat16),
    "model.w2": ((ROWS, 80), np.float32),
    "model.ids": ((ROWS, 4), np.int64),
    "model.norm": ((ROWS,), np.float32),
    "optim.m": ((ROWS, 64), np.float32),
}
OBJECTS = {"step": 12, "cfg": {"lr": 0.25, "name": "tiny"}}


def _value(name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little"))
    if np.dtype(dtype).kind == "i":
        return rng.integers(-(2**40), 2**40, shape, dtype=np.int64)
    return rng.standard_normal(shape).astype(dtype)


EXPECTED = {n: _value(n, s, d) for n, (s, d) in TENSORS.items()}
EXPECTED["model.empty"] = np.zeros((0, 8), np.float32)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("src") / "ckpt")
    half = ROWS // 2
    for r in range(2):
        w = Writer(path, rank=r, world_size=2, save_id="src")
        for name, arr in EXPECTED.items():
            if arr.size == 0:
                w.declare(name, arr.dtype, arr.shape)
                continue
            w.write(name, arr[r * half : (r + 1) * half], global_shape=arr.shape, offset=(r * half,) + (0,) * (arr.ndim - 1))
        for k, v in OBJECTS.items():
            w.write_object(k, v)
        w.write_object("rng", [r, r + 1], per_rank=True)
        w.commit()
    finalize(path, 2, "src")
    return path


def digest(path: str) -> dict[str, str]:
    """Every file under ``path`` (or the file itself): relative name -> sha256."""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return {"": hashlib.sha256(f.read()).hexdigest()}
    out = {}
    for f in sorted(glob.glob(os.path.join(path, "**"), recursive=True) + glob.glob(os.path.join(path, ".*"))):
        if os.path.isfile(f):
            with open(f, "rb") as fh:
                out[os.path.relpath(f, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def _torch_np(t) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.contiguous().numpy()


def _same(got: np.ndarray, name: str) -> None:
    want = EXPECTED[name]
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert got.tobytes() == want.tobytes(), name


def read_back(fmt: str, path: str) -> None:
    """``path`` read by its format's own library; every element compared bit for bit."""
    if fmt == "xckpt":
        with xckpt.open(path) as ck:
            for name in EXPECTED:
                _same(ck.read(name), name)
            assert ck.objects(["step", "cfg"]) == OBJECTS
    elif fmt in ("hf-dir", "safetensors"):
        from safetensors.torch import load_file

        files = [path] if fmt == "safetensors" else sorted(glob.glob(os.path.join(path, "*.safetensors")))
        got = {k: v for f in files for k, v in load_file(f).items()}
        assert set(got) == set(EXPECTED)
        for name, t in got.items():
            _same(_torch_np(t), name)
        if fmt == "hf-dir":
            with open(os.path.join(path, "model.safetensors.index.json")) as f:
                assert set(json.load(f)["weight_map"]) == set(EXPECTED)
    elif fmt == "torch-dcp":
        import torch
        import torch.distributed.checkpoint as dcp

        sd = {n: torch.empty(a.shape, dtype=torch.bfloat16 if a.dtype == ml_dtypes.bfloat16 else torch.from_numpy(a).dtype)
              for n, a in EXPECTED.items()}
        sd.update(step=0, cfg={"lr": 0.0, "name": ""})
        dcp.load(sd, checkpoint_id=path)
        for name in EXPECTED:
            _same(_torch_np(sd[name]), name)
        assert sd["step"] == 12 and sd["cfg"] == OBJECTS["cfg"]
    elif fmt == "orbax":
        import jax
        import orbax.checkpoint as ocp

        assert not os.path.exists(os.path.join(path, "manifest.ocdbt")), "reproducible: orbax's non-OCDBT layout"
        with jax.enable_x64(True):
            tree = ocp.StandardCheckpointer().restore(path)
        for name in EXPECTED:
            node = tree
            for k in name.split("."):
                node = node[k]
            _same(np.asarray(node), name)
        assert tree["step"] == 12 and tree["cfg"] == OBJECTS["cfg"]
    else:
        import torch

        sd = torch.load(path, weights_only=True)
        for name in EXPECTED:
            _same(_torch_np(sd[name]), name)
        assert sd["step"] == 12


_CLI = [sys.executable, "-m", "xckpt.cli", "--no-progress", "convert"]

# (test id, to_format, dst name, max_shard_size, worker counts besides 1)
TARGETS = [
    ("xckpt", "xckpt", "out", PART, (2, 3)),
    ("torch-dcp", "torch-dcp", "out", PART, (2,)),
    ("hf-dir", "safetensors", "out", PART, (3,)),
    ("safetensors", "safetensors", "out.safetensors", None, (2,)),
    ("torch", "torch", "out.pt", None, (2,)),
    ("orbax", "orbax", "out", None, (2, 3)),
]


@pytest.fixture(scope="module")
def clean(source: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """Each target converted with one worker: its digest, and the output read back."""
    root = tmp_path_factory.mktemp("clean")
    out = {}
    for tid, fmt, name, size, _ in TARGETS:
        dst = str(root / tid / name)
        xckpt.convert(source, dst, to_format=fmt, max_shard_size=size, workers=1)
        read_back(tid, dst)
        out[tid] = digest(dst)
    return out


@pytest.mark.parametrize("tid, fmt, name, size, counts", TARGETS, ids=[t[0] for t in TARGETS])
def test_same_bytes_for_any_number_of_workers(source, clean, tmp_path, tid, fmt, name, size, counts):
    assert len([f for f in clean[tid] if not f.startswith(".")]) >= (1 if name != "out" else 3)
    for n in counts:
        dst = str(tmp_path / f"w{n}" / name)
        xckpt.convert(source, dst, to_format=fmt, max_shard_size=size, workers=n)
        assert digest(dst) == clean[tid], f"{tid} with {n} workers"
    assert not glob.glob(str(tmp_path / "*" / ".*")), "the temporary output and journal are gone"


def test_twice_the_same_bytes_and_the_save_id_is_derived(source, clean, tmp_path):
    dst = str(tmp_path / "again")
    xckpt.convert(source, dst, max_shard_size=PART, workers=1)
    assert digest(dst) == clean["xckpt"]
    with xckpt.open(dst) as ck:
        assert ck.save_id.startswith("convert-") and ck.world_size >= 3
    # Other options, another id: the part size is part of the fingerprint.
    other = str(tmp_path / "other")
    xckpt.convert(source, other, max_shard_size=2 * PART, workers=1)
    with xckpt.open(other) as ck, xckpt.open(dst) as ck2:
        assert ck.save_id != ck2.save_id


_TORCHRUN = r"""
import sys
import torch.distributed as dist
from xckpt.cli import main
src, root = sys.argv[1:3]
dist.init_process_group("gloo")  # a group the caller started: the conversions use it
for tid, fmt in [("torch-dcp", "torch-dcp"), ("hf-dir", "safetensors"), ("orbax", "orbax")]:
    size = [] if fmt == "orbax" else ["--max-shard-size", "20000"]
    rc = main(["--no-progress", "convert", src, f"{root}/{tid}/out", "--to", fmt, *size])
    assert rc == 0, (tid, rc)
dist.destroy_process_group()
"""


def test_torchrun_two_ranks(source, clean, tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    # python -m xckpt.cli under torchrun: every rank a worker, the group started from the environment.
    dst = str(tmp_path / "xckpt" / "out")
    r = subprocess.run([*torchrun, "-m", "xckpt.cli", "--no-progress", "convert", source, dst, "--max-shard-size",
                        str(PART)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(f"-> {dst} (xckpt, verified)") == 1, "rank 0 alone reports"
    script = tmp_path / "run.py"
    script.write_text(_TORCHRUN)
    r = subprocess.run([*torchrun, str(script), source, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for tid in ("xckpt", "torch-dcp", "hf-dir", "orbax"):
        assert digest(str(tmp_path / tid / "out")) == clean[tid], tid
        read_back(tid, str(tmp_path / tid / "out"))


def test_workers_refused_under_torchrun(source, tmp_path):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    dst = str(tmp_path / "out")
    r = subprocess.run([*_CLI, source, dst, "--workers", "2"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "under torchrun every rank is a worker: drop --workers" in r.stderr
    assert not os.path.exists(dst)


# -- kill and resume ------------------------------------------------------------------------------

def _journal(dst: str) -> str:
    parent, base = os.path.split(dst)
    return os.path.join(parent, f".{base}.xckpt-journal")


def _tmp(dst: str) -> str:
    parent, base = os.path.split(dst)
    return os.path.join(parent, f".{base}.xckpt-convert")


def _kill_after(args: list[str], dst: str, parts: int, extra: float) -> bool:
    """Run the CLI; SIGKILL its process group once ``parts`` parts are journaled and
    ``extra`` seconds more have passed. True if it was killed before finishing."""
    p = subprocess.Popen(args, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while p.poll() is None and time.monotonic() < deadline:
        if len(glob.glob(os.path.join(_journal(dst), "part-*.json"))) >= parts:
            time.sleep(extra)
            break
        time.sleep(0.002)
    killed = p.poll() is None
    if killed:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    p.stderr.close()
    return killed


def _stamps(root: str) -> dict[str, tuple[int, int]]:
    return {rel: (os.stat(os.path.join(root, rel)).st_ino, os.stat(os.path.join(root, rel)).st_mtime_ns)
            for rel in digest(root)}


@pytest.mark.parametrize("tid, fmt, seed", [("xckpt", "xckpt", 1), ("hf-dir", "safetensors", 2)])
def test_killed_then_resumed(source, clean, tmp_path, tid, fmt, seed):
    rnd = random.Random(seed)
    dst = str(tmp_path / "out")
    args = [*_CLI, source, dst, "--to", fmt, "--max-shard-size", str(PART), "--workers", "2"]
    total = len([f for f in clean[tid] if f.startswith("ranks/") or f.endswith(".safetensors")])
    assert total >= 3
    # Killed once 2 .. total-1 parts are finished (and up to 20 ms more): one to damage, one to keep.
    killed = _kill_after(args, dst, rnd.randrange(2, total), rnd.uniform(0, 0.02))
    if not killed:
        pytest.skip("the conversion finished before the kill (machine too fast for this size)")
    assert not os.path.exists(dst), "a killed conversion leaves nothing at dst"
    entries = [json.loads(open(f).read()) for f in glob.glob(os.path.join(_journal(dst), "part-*.json"))]
    finished = [rel for e in entries for rel, _, _ in e["files"]]
    assert finished
    damaged = rnd.choice(finished)
    with open(os.path.join(_tmp(dst), damaged), "r+b") as f:  # one finished file, damaged
        f.seek(os.path.getsize(f.name) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    before = _stamps(_tmp(dst))
    r = subprocess.run([*args, "--resume"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert digest(dst) == clean[tid]
    after = _stamps(dst)
    # The damaged file's part is written again whole; every other finished part is kept.
    kept = [rel for e in entries if damaged not in [f[0] for f in e["files"]] for rel, _, _ in e["files"]]
    assert kept
    for rel in kept:
        assert after[rel] == before[rel], f"{rel} was rewritten"
    assert after[damaged] != before[damaged], "the damaged file was written again"
    assert not os.path.exists(_journal(dst)) and not os.path.exists(_tmp(dst))


def test_resume_of_another_plan_starts_afresh(source, clean, tmp_path):
    dst = str(tmp_path / "out")
    os.makedirs(_journal(dst))
    with open(os.path.join(_journal(dst), "plan.json"), "w") as f:
        json.dump({"plan_id": "another"}, f)
    os.makedirs(_tmp(dst))
    with open(os.path.join(_tmp(dst), "stray"), "w") as f:
        f.write("left by another plan")
    xckpt.convert(source, dst, max_shard_size=PART, workers=1, resume=True)
    assert digest(dst) == clean["xckpt"]


# -- errors ---------------------------------------------------------------------------------------


def test_errors(source, tmp_path):
    with pytest.raises(XckptError, match="workers must be a positive number of processes"):
        xckpt.convert(source, str(tmp_path / "a"), workers=0)
    with pytest.raises(XckptError, match="max_shard_size applies to Hugging Face directories .* and to the parts"):
        xckpt.convert(source, str(tmp_path / "b.pt"), max_shard_size=PART, workers=2)
    xckpt.convert(source, str(tmp_path / "d"), workers=1)
    with pytest.raises(CheckpointExistsError):
        xckpt.convert(source, str(tmp_path / "d"), workers=2)
    r = subprocess.run([*_CLI, source, str(tmp_path / "e"), "--workers", "0"], capture_output=True, text=True)
    assert r.returncode == 2 and "workers must be a positive number" in r.stderr


# -- object storage ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3():
    import s3_server

    yield from s3_server.serve()


def test_from_s3_each_worker_its_own_reads(source, clean, tmp_path, s3):
    spec = s3.fresh()
    with xckpt.open(source) as ck:
        for r in range(2):
            w = Writer(spec, rank=r, world_size=2, save_id="src")
            for name in EXPECTED:
                t = ck.info(name)
                w.declare(name, t.dtype, t.shape)
                for c in t.chunks:
                    if c.rank == r:
                        w.write(name, ck.read(name, c.box.slices()), global_shape=t.shape, offset=c.offset)
            for k, v in OBJECTS.items():
                w.write_object(k, v)
            w.write_object("rng", [r, r + 1], per_rank=True)
            w.commit()
        finalize(spec, 2, "src")
    dst = str(tmp_path / "out")
    xckpt.convert(spec, dst, max_shard_size=PART, workers=2)
    assert digest(dst) == clean["xckpt"]


def test_verify_mismatch_removes_the_output_and_journal(source, tmp_path, monkeypatch):
    import xckpt._parts as parts
    import xckpt.convert_parallel as cp

    real = parts.commit_files

    def commit_then_damage(job, plan, results):
        real(job, plan, results)
        path = os.path.join(job.dst, plan.shard_file(1))
        with open(path, "r+b") as f:  # a tensor byte of the second shard, after its journal entry
            f.seek(-3, 2)
            f.write(b"\xff\xfe\xfd")

    monkeypatch.setattr(cp, "commit_files", commit_then_damage)
    dst = str(tmp_path / "out")
    with pytest.raises(VerifyMismatchError, match=r"reads back with crc32c .* the source's is"):
        xckpt.convert(source, dst, to_format="safetensors", max_shard_size=PART, workers=1)
    assert not os.path.exists(dst) and not os.path.exists(_tmp(dst)) and not os.path.exists(_journal(dst))


def test_a_failed_rank_fails_every_rank_with_its_error():
    import xckpt.convert_parallel as cp

    def boom():
        raise XckptError("no such checkpoint")

    gathered = [cp._attempt(lambda: 1), cp._attempt(boom)]
    with pytest.raises(XckptError, match=r"writing the parts failed on rank 1: XckptError: no such checkpoint"):
        cp._raise_any(gathered, "writing the parts")
    cp._raise_any([1, [2]], "nothing")  # no error: nothing raised


def test_to_s3_in_place_each_worker_its_own_writer(source, s3):
    dst = s3.fresh("out")
    assert xckpt.convert(source, dst, max_shard_size=PART, workers=2) == dst
    with xckpt.open(dst) as ck:
        assert ck.world_size >= 3 and ck.save_id.startswith("convert-")
    read_back("xckpt", dst)
    with pytest.raises(CheckpointExistsError, match="already holds a checkpoint"):
        xckpt.convert(source, dst, workers=1)
    with pytest.raises(XckptError, match="written in place: overwrite and resume are for local outputs"):
        xckpt.convert(source, s3.fresh("out"), workers=1, resume=True)
    with pytest.raises(XckptError, match="convert writes safetensors to local paths"):
        xckpt.convert(source, s3.fresh("out"), to_format="safetensors", workers=1)
