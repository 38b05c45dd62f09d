"""The device-load pipeline (xckpt/torch/_pipeline.py): a bounded ring of host buffers,
storage reads overlapped with device copies.

On CPU its logic runs through the ring's copy hook: a fake "device" copy that runs
only when its event is synchronized (as a DMA engine would, later), recording order,
sizes and overlap. A buffer refilled before its copies completed would hand the fake
copies overwritten bytes, so every load is compared bit for bit; a watching source
also checks, before every read, that no pending copy still reads the memory being
filled. ``gpu`` tests load onto CUDA for real (skipped without CUDA).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import xckpt
import xckpt.torch as xt
from xckpt import layout as L
from xckpt.errors import CorruptChunkError, XckptError
from xckpt.torch._pipeline import ALIGN, DeviceRing, plan_batches, split_box
from xckpt.views import SourceView

# -- the arithmetic --------------------------------------------------------------------------

SPLITS = [
    ((10, 4), 4, 16),  # one row per piece
    ((10, 4), 4, 40),  # two rows
    ((10, 4), 4, 1000),  # whole
    ((3, 5, 7), 2, 20),  # a row of the last dims is 14 bytes: one row of dim 1 per piece
    ((3, 5, 7), 2, 6),  # the last dim itself is cut
    ((100,), 8, 64),
    ((), 4, 64),
    ((2, 0, 3), 4, 8),
]


@pytest.mark.parametrize("shape,itemsize,limit", SPLITS, ids=[f"{s}-{i}-{n}" for s, i, n in SPLITS])
def test_split_box_tiles_the_box_with_pieces_that_fit(shape, itemsize, limit):
    box = L.Box((1,) * len(shape), shape)
    pieces = split_box(box, itemsize, limit)
    seen = np.zeros(shape, dtype=int)
    for p in pieces:
        assert box.contains(p)
        assert p.volume * itemsize <= max(limit, itemsize)
        seen[p.slices(box)] += 1
    assert (seen == 1).all()


BATCHES = [
    ([((0, 0), (10, 4)), ((0,), (3,)), ((0, 0), (0, 5)), ((0, 0), (7, 7))], 4, 64),
    ([((0, 0), (64, 64))], 2, 1024),
    ([((0,), (1,))] * 50, 8, 256),
]


@pytest.mark.parametrize("boxes,itemsize,buffer", BATCHES, ids=["mixed", "split", "many_small"])
def test_plan_batches_fits_every_buffer_and_covers_every_item_once(boxes, itemsize, buffer):
    items = [(L.Box(o, s), itemsize) for o, s in boxes]
    batches = plan_batches(items, buffer)
    cover = [np.zeros(b.shape, dtype=int) for b, _ in items]
    for batch in batches:
        end = 0
        for p in batch:
            assert p.offset % ALIGN == 0 and p.offset >= end
            end = p.offset + p.nbytes
            assert end <= buffer
            cover[p.item][p.slices] += 1
    assert all((c == 1).all() for c in cover)
    assert all(batch for batch in batches)


def test_ring_arguments_are_checked():
    with pytest.raises(XckptError, match=r"DeviceRing\(buffers=0"):
        DeviceRing(0)
    with pytest.raises(XckptError, match="at least 64 bytes"):
        DeviceRing(2, 8)


# -- the logic, on CPU, through the copy hook ---------------------------------------------------


def _data(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1
    return torch.from_numpy(raw).view(dtype).reshape(shape).clone()


STATE = {
    "big": ((1200, 300), torch.float32),  # an array chunk with a zarr grid (not packed)
    "w": ((300, 70), torch.float32),
    "b16": ((123, 45), torch.bfloat16),
    "ids": ((77,), torch.int64),
    "flag": ((9, 2), torch.bool),
    "c": ((5, 3), torch.complex64),
    "scalar": ((), torch.float32),
    "empty": ((0, 4), torch.float32),
}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and bytes(a.reshape(-1).view(torch.uint8).numpy()) == bytes(b.reshape(-1).view(torch.uint8).numpy())
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pipe") / "ck")
    sd = {n: _data(s, d, i) for i, (n, (s, d)) in enumerate(STATE.items())}
    xt.save(sd, path)
    return path, sd


class FakeDevice:
    """A copy hook whose copies run when their event is synchronized (later, as DMA does)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []  # ("copy", nbytes) / ("sync", id) / ("read", nbytes)
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.ids = itertools.count()
        self.copied = 0
        self.reads_while_pending = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> _Event:
        i = next(self.ids)
        self.pending[i] = (dst, src)
        self.log.append(("copy", src.numel() * src.element_size()))
        return _Event(self, i)

    def run(self, i: int) -> None:
        dst, src = self.pending.pop(i)
        dst.copy_(src)
        self.copied += src.numel() * src.element_size()
        self.log.append(("sync", i))

    def busy(self, arr: np.ndarray) -> list[int]:
        """Pending copies whose source memory overlaps ``arr``'s."""
        lo = arr.__array_interface__["data"][0]
        hi = lo + arr.nbytes
        out = []
        for i, (_dst, src) in self.pending.items():
            s = src.data_ptr()
            if s < hi and lo < s + src.numel() * src.element_size():
                out.append(i)
        return out


class _Event:
    def __init__(self, dev: FakeDevice, i: int) -> None:
        self.dev, self.i = dev, i

    def synchronize(self) -> None:
        if self.i in self.dev.pending:
            self.dev.run(self.i)


class Watched(SourceView):
    """Fails a read into memory a pending copy still reads; counts reads made meanwhile."""

    def __init__(self, source, dev: FakeDevice) -> None:
        super().__init__(source)
        self.dev = dev

    def _read_chunks(self, jobs, bar) -> None:
        for job in jobs:
            busy = self.dev.busy(job.out)
            assert not busy, f"read into a buffer whose copies {busy} have not completed"
        if self.dev.pending:
            self.dev.reads_while_pending += 1
        self.dev.log.append(("read", sum(j.out.nbytes for j in jobs)))
        super()._read_chunks(jobs, bar)


@pytest.mark.parametrize("buffers,buffer_bytes", [(2, 4096), (3, 20000), (4, 1 << 20), (1, 4096)])
def test_hook_load_is_bit_exact_bounded_and_overlapped(saved, buffers, buffer_bytes):
    path, want = saved
    dev = FakeDevice()
    ring = DeviceRing(buffers, buffer_bytes, copy=dev.copy)
    target = {n: torch.zeros(s, dtype=d) for n, (s, d) in STATE.items()}
    with xckpt.open(path) as src:
        xt.load(Watched(src, dev), target, ring=ring)
    assert all(_same(target[n], want[n]) for n in STATE)
    assert not dev.pending  # every copy completed before load returned
    assert dev.copied == sum(v.numel() * v.element_size() for v in want.values())
    # bounded: never more buffers than the ring holds, none larger than asked
    assert ring.allocations <= buffers
    assert all(h is None or h.numel() <= buffer_bytes for h in ring._host)
    sizes = [n for kind, n in dev.log if kind == "copy"]
    assert max(sizes) <= buffer_bytes
    reads = sum(1 for kind, _ in dev.log if kind == "read")
    if buffers > 1 and reads > 1:
        # the next batch is read while the previous batch's copies are still running
        assert dev.reads_while_pending >= 1


def test_ring_is_reused_across_loads(saved):
    path, want = saved
    dev = FakeDevice()
    ring = DeviceRing(2, 8192, copy=dev.copy)
    for _ in range(3):
        target = {n: torch.zeros(s, dtype=d) for n, (s, d) in STATE.items()}
        xt.load(path, target, ring=ring)
        assert all(_same(target[n], want[n]) for n in STATE)
    assert ring.allocations == 2
    ring.release()
    assert ring._host == [None, None]


def test_strided_tensor_and_numpy_targets_through_the_ring(saved):
    path, want = saved
    dev = FakeDevice()
    ring = DeviceRing(2, 4096, copy=dev.copy)
    target = {"w": torch.zeros(300, 70)[:, :].t().contiguous().t(), "ids": np.zeros(77, np.int64)}
    xt.load(path, target, ring=ring, strict=False)
    assert _same(target["w"], want["w"])
    assert (target["ids"] == want["ids"].numpy()).all()
    # the numpy target is read directly; the tensor (column-major) through the ring
    assert dev.copied == want["w"].numel() * 4


def test_a_failed_read_leaves_no_copy_running(saved, tmp_path):
    path, _want = saved
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(path, bad)
    key = xckpt.open(bad).info("big").chunks[0].key
    import glob
    import os

    files = sorted(glob.glob(os.path.join(bad, key, "c.*")))
    with open(files[-1], "r+b") as f:
        f.seek(10)
        byte = f.read(1)
        f.seek(10)
        f.write(bytes([byte[0] ^ 0xFF]))
    dev = FakeDevice()
    ring = DeviceRing(2, 4096, copy=dev.copy)
    target = {n: torch.zeros(s, dtype=d) for n, (s, d) in STATE.items()}
    with pytest.raises(CorruptChunkError, match="'big'"):
        xt.load(bad, target, ring=ring)
    assert not dev.pending


def test_a_load_without_a_ring_sizes_its_buffers_to_the_load(saved):
    ring = DeviceRing.for_load()
    path, want = saved
    dev = FakeDevice()
    ring.copy = dev.copy
    target = {"ids": torch.zeros(77, dtype=torch.int64)}
    xt.load(path, target, ring=ring, strict=False)
    assert _same(target["ids"], want["ids"])
    assert ring._host[0] is not None and ring._host[0].numel() == 1 << 20


# -- CUDA ------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_load_is_bit_exact_and_reuses_pinned_buffers(saved):
    path, want = saved
    ring = DeviceRing(2, 4096)
    for _ in range(2):
        target = {n: torch.zeros(s, dtype=d, device="cuda") for n, (s, d) in STATE.items()}
        xt.load(path, target, ring=ring)
        assert all(_same(target[n].cpu(), want[n]) for n in STATE)
    assert ring.allocations == 2
    assert all(h is not None and h.is_pinned() for h in ring._host)


@pytest.mark.gpu
def test_cuda_load_full_and_a_default_ring(saved):
    path, want = saved
    got = xt.load_full(path, device="cuda")
    assert all(got[n].device.type == "cuda" and _same(got[n].cpu(), want[n]) for n in STATE)
    target = {n: torch.zeros(s, dtype=d, device="cuda") for n, (s, d) in STATE.items()}
    # work queued on the current stream before the load runs before the copies land
    target["w"].fill_(7.0)
    xt.load(path, target)
    assert all(_same(target[n].cpu(), want[n]) for n in STATE)


@pytest.mark.gpu
def test_cuda_large_load_through_a_small_ring(tmp_path):
    sd = {f"t{i}": _data((1024, 1024), torch.bfloat16, i) for i in range(6)}  # 12 MiB
    xt.save(sd, str(tmp_path / "big"))
    ring = DeviceRing(3, 1 << 20)
    target = {n: torch.empty(1024, 1024, dtype=torch.bfloat16, device="cuda") for n in sd}
    xt.load(str(tmp_path / "big"), target, ring=ring)
    assert all(_same(target[n].cpu(), sd[n]) for n in sd)
    assert ring.allocations == 3


# -- bench/gpu.py without a GPU ------------------------------------------------------------------

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(BENCH, "gpu.py"), *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_bench_says_it_needs_a_gpu():
    res = _bench("--repeats", "1")
    assert res.returncode == 2
    assert "has none" in res.stderr and "--plan" in res.stderr


def test_gpu_bench_arguments():
    sys.path.insert(0, BENCH)
    try:
        import gpu
    finally:
        sys.path.remove(BENCH)
    args = gpu.parse_args(["--size-gib", "0.5", "--methods", "pinned peak,xckpt", "--buffer-mib", "128"])
    assert args.methods == ["pinned peak", "xckpt"] and args.buffer_mib == 128
    assert "DeviceRing(3, 128 MiB)" in gpu.plan_text(args, gpu.spec_for(args.size_gib))
    with pytest.raises(SystemExit):
        gpu.parse_args(["--methods", "nope"])
    with pytest.raises(SystemExit):
        gpu.parse_args(["--repeats", "0"])
    res = _bench("--plan", "--size-gib", "0.01")
    assert res.returncode == 0 and "methods: pinned peak" in res.stdout


def test_gpu_bench_runs_its_steps_on_cpu(tmp_path):
    """``--device cpu`` runs every step (save three formats, load each, check bits)."""
    res = _bench("--device", "cpu", "--size-gib", "0.01", "--repeats", "1", "--dir", str(tmp_path / "g"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "| DCP |" in res.stdout and "NO" not in res.stdout
