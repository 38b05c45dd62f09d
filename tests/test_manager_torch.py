"""xckpt.CheckpointManager with torch: DTensors and Adam state on real gloo ranks, resumed at
another world size and placement; SIGTERM agreed across ranks; rank-local retention; the
staging path (reused host buffers, the device-copy hook, the event the writer waits on),
checked on CPU through the hook, and on CUDA when a GPU is there (``@pytest.mark.gpu``).

The ranks run twice (spawning is the expensive part): 2 ranks save (three roots), then 3
ranks restore; each check is its own test, from what the ranks report.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch
from dist_utils import run_ranks

import xckpt
import xckpt.torch as xt
from xckpt.manager import CheckpointManager, HostBuffers


def _model(world: int, seed: int, placement: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Two Linear layers whose parameters are DTensors (weights Shard(0) or Shard(1),
    biases Shard(0) or Replicate) and an Adam with state (one step taken)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 10))
    for mod in model:
        for n, p in list(mod.named_parameters()):
            if placement == "rows":
                pl = [Shard(0)]
            else:
                pl = [Shard(1)] if p.ndim == 2 else [Replicate()]
            setattr(mod, n, torch.nn.Parameter(distribute_tensor(p.data, mesh, pl)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt, 0)
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, float(step + i + 1) / 7.0)
    opt.step()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step, "rng": xt.PerRank({"r": int(os.environ["RANK"])})}


def _full(sd: dict) -> dict:
    """Every tensor of a (nested) state dict as whole numpy arrays (collective for DTensors)."""
    from torch.distributed.tensor import DTensor

    out = {}

    def walk(prefix: str, v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, torch.Tensor):
            t = v.full_tensor() if isinstance(v, DTensor) else v
            out[prefix] = t.detach().clone().numpy()

    walk("", sd)
    return out


def _save_ranks(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    import xckpt.native.writer

    out: dict = {}
    # 1. A training loop saving every 2nd step; the state changes in place right after save returns.
    model, opt = _model(world, 0, "rows")
    expected = {}
    with CheckpointManager(os.path.join(root, "main"), keep_last=2, save_every=2, metric="loss") as m:
        for step in range(1, 7):
            st = _state(model, opt, step)
            full = _full(st) if m.should_save(step) else None
            saved = m.save(step, st, metrics={"loss": 1.0 / step})
            if saved:
                expected[step] = full
                if step == 2:
                    out["alloc_first"] = m.staging.allocations
            _train(model, opt, step)  # in place, while the write runs
        out["alloc_last"] = m.staging.allocations
        out["staged_bytes"] = m.staging.nbytes
        m.wait()
        out["steps"] = m.steps()
        out["best"] = m.best_step()
        out["metrics6"] = m.metrics(6)
    out["expected"] = expected if rank == 0 else None

    # 2. SIGTERM on rank 1 only: should_save is true on both ranks at the same step, both save it and
    #    exit 143 once it is durable everywhere; the handler installed before the manager is chained.
    chained = []
    signal.signal(signal.SIGTERM, lambda s, f: chained.append(s))
    m = CheckpointManager(os.path.join(root, "pre"), save_every=1000)
    st = _state(model, opt, 0)
    try:
        for step in range(1, 20):
            if step == 3 and rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            if m.should_save(step):
                m.save(step, st)
            time.sleep(0.01)
        out["pre"] = ("no exit", step)
    except SystemExit as e:
        out["pre"] = (e.code, step, m.preempted, os.path.exists(os.path.join(root, "pre", str(step), "xckpt.json")))
    out["chained"] = chained
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    dist.barrier()

    # 3. Rank-local saves, rank 1 slow to commit: retention (rank 0) waits for both manifests.
    if rank == 1:
        real = xckpt.native.writer.Writer.commit

        def slow(self):
            time.sleep(0.4)
            return real(self)

        xckpt.native.writer.Writer.commit = slow
    rl = os.path.join(root, "rl")
    seen = []
    with CheckpointManager(rl, keep_last=1, rank_local=True, handle_preemption=False) as m:
        for step in (1, 2, 3):
            m.save(step, _state(model, opt, step))
            m.wait()
            seen.append((sorted(os.listdir(rl)), os.path.exists(os.path.join(rl, str(step), "xckpt.json"))))
    out["rank_local"] = seen
    return out


def _restore_ranks(rank: int, world: int, root: str) -> dict:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    out: dict = {}
    model, opt = _model(world, 123, "cols")  # another world size and placement, other values
    m = CheckpointManager(os.path.join(root, "main"), handle_preemption=False)
    out["steps"] = m.steps()
    for step in (None, 4):
        target = _state(model, opt, -1)
        target["rng"] = xt.PerRank(all_ranks=True)  # saved by 2 ranks: every rank's value
        res = m.restore(target, step=step)
        set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        out[step] = {"full": _full({"model": msd, "optim": osd}), "step": target["step"],
                     "missing": res.missing, "lr": opt.param_groups[0]["lr"],
                     "rng": target["rng"].value}
    m.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("manager_torch"))
    saved = run_ranks(_save_ranks, 2, root, timeout=180)
    restored = run_ranks(_restore_ranks, 3, root, timeout=180)
    return root, saved, restored


def test_steps_retention_and_metrics(runs):
    _, saved, _ = runs
    for r in saved:
        assert r["steps"] == [4, 6] and r["best"] == 6 and r["metrics6"] == {"loss": 1 / 6}


def test_host_buffers_are_reused_across_saves(runs):
    _, saved, _ = runs
    for r in saved:
        assert r["alloc_first"] > 0 and r["alloc_last"] == r["alloc_first"]
        assert r["staged_bytes"] > 0


@pytest.mark.parametrize("step", [None, 4])
def test_resume_at_three_ranks_in_another_placement(runs, step):
    _, saved, restored = runs
    want = saved[0]["expected"][6 if step is None else step]
    for r in restored:
        got = r[step]
        assert got["step"] == (6 if step is None else step) and got["missing"] == []
        assert got["lr"] == 0.01
        assert set(got["full"]) == set(want)
        for name, arr in want.items():
            np.testing.assert_array_equal(got["full"][name], arr, err_msg=name)
    # a per-rank object saved by 2 ranks, restored at 3: every rank's value
    assert restored[0][step]["rng"] == [{"r": 0}, {"r": 1}]


def test_restore_into_plain_tensors_in_one_process(runs):
    root, saved, _ = runs
    want = saved[0]["expected"][6]
    m = CheckpointManager(os.path.join(root, "main"), handle_preemption=False)
    target = {"model": {k[len("model."):]: torch.zeros(v.shape, dtype=torch.float32) for k, v in want.items()
                        if k.startswith("model.")}}
    res = m.restore(target, strict=True)
    for k, t in target["model"].items():
        np.testing.assert_array_equal(t.numpy(), want[f"model.{k}"])
    assert "step" in res.unexpected
    m.close()


def test_sigterm_on_one_rank_saves_on_every_rank_and_exits_143(runs):
    root, saved, _ = runs
    assert [r["pre"] for r in saved] == [(143, 3, True, True)] * 2
    assert saved[1]["chained"] == [signal.SIGTERM] and saved[0]["chained"] == []
    assert sorted(os.listdir(os.path.join(root, "pre"))) == ["3"]
    assert xckpt.load(os.path.join(root, "pre", "3"), per_rank="list")["step"] == 0


def test_rank_local_retention_waits_for_every_rank(runs):
    _, saved, _ = runs
    # after each wait() the step is complete (xckpt.json merged) and only keep_last=1 step is left
    assert saved[0]["rank_local"] == [(["1"], True), (["2"], True), (["3"], True)]
    assert [s[1] for s in saved[1]["rank_local"]] == [True, True, True]


# -- staging, single process ------------------------------------------------------------------


class _Deferred:
    """A fake device copy: the bytes land only when the writer synchronizes (as a CUDA copy
    on a side stream lands only when its event completes)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, tuple]] = []
        self.synced_on: list[str] = []

    def __call__(self, host: torch.Tensor, src: torch.Tensor):
        snapshot = src.detach().clone()  # what the GPU would copy: the state as save saw it
        self.calls.append((id(host), tuple(src.shape)))
        hook = self

        class Event:
            def synchronize(self) -> None:
                host.copy_(snapshot)
                hook.synced_on.append(threading.current_thread().name)

        return Event()


def test_device_copy_hook_and_the_event_the_writer_waits_on(tmp_path):
    hook = _Deferred()
    buffers = HostBuffers(device_copy=hook)
    sd = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16), "n": 3}
    fut = xt.save(sd, str(tmp_path / "a"), async_save=True, staging=buffers)
    sd["w"].add_(100)  # the caller goes on at once
    fut.result()
    got = xckpt.load(str(tmp_path / "a"))
    np.testing.assert_array_equal(got["w"], np.arange(12.0, dtype=np.float32).reshape(3, 4))
    assert got["n"] == 3 and len(hook.synced_on) == 2  # waited for, on the write thread
    assert all(name.startswith("xckpt-async-save") for name in hook.synced_on)
    first = [c[0] for c in hook.calls]
    xt.save(sd, str(tmp_path / "b"), async_save=True, staging=buffers).result()
    assert [c[0] for c in hook.calls[2:]] == first and buffers.allocations == 2  # the same host buffers
    np.testing.assert_array_equal(xckpt.load(str(tmp_path / "b"))["w"], sd["w"].numpy())


def test_manager_stages_through_the_hook(tmp_path):
    hook = _Deferred()
    with CheckpointManager(str(tmp_path), handle_preemption=False, keep_last=1) as m:
        m.staging.device_copy = hook
        sd = {"w": torch.zeros(4, 4)}
        for s in range(3):
            sd["w"].fill_(s)
            m.save(s, sd)
        m.wait()
        assert m.steps() == [2] and m.staging.allocations == 1
        target = {"w": torch.empty(4, 4)}
        m.restore(target)
    assert float(target["w"][0, 0]) == 2.0 and len(hook.synced_on) == 3


def test_staged_saves_match_unstaged_ones(tmp_path):
    """The staging path writes exactly what a plain save writes (objects, bf16, numpy, empty)."""
    sd = {"a": torch.randn(33, 7), "h": torch.randn(9).to(torch.bfloat16), "np": np.arange(6.0),
          "e": torch.zeros(0, 3), "cfg": {"k": [1, 2]}, "i": torch.tensor(5)}
    xt.save(sd, str(tmp_path / "plain"))
    xt.save(sd, str(tmp_path / "staged"), async_save=True, staging=HostBuffers()).result()
    a, b = xckpt.load(str(tmp_path / "plain")), xckpt.load(str(tmp_path / "staged"))
    assert set(a) == set(b)
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
        else:
            assert a[k] == b[k], k


# -- CUDA (runs where a GPU is) ----------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_staging_pinned_side_stream(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    sd = {"w": torch.randn(1024, 1024, device=dev), "b": torch.randn(77, device=dev).to(torch.bfloat16)}
    want = {k: v.cpu().clone() for k, v in sd.items()}
    with CheckpointManager(str(tmp_path), handle_preemption=False) as m:
        for s in range(3):
            m.save(s, sd)
            # queued on the current stream right after save returns: runs after the staging copy
            sd["w"].mul_(2)
            if s == 0:
                first = m.staging.allocations
                want0 = want
            want = {"w": (want["w"] * 2), "b": want["b"]}
        m.wait()
        assert m.staging.allocations == first
        assert all(b.is_pinned() for _, _, b in m.staging._slots.values())
        target = {"w": torch.empty(1024, 1024, device=dev), "b": torch.empty(77, device=dev, dtype=torch.bfloat16)}
        m.restore(target, step=0)
    torch.testing.assert_close(target["w"].cpu(), want0["w"], rtol=0, atol=0)
    torch.testing.assert_close(target["b"].cpu(), want0["b"], rtol=0, atol=0)


def test_a_fresh_torch_target_is_found_to_the_one_depth_limit() -> None:
    """An empty container nested in a torch target (a fresh optimizer's `state: {}`) is found
    as deep as objects may nest (`MAX_OBJECT_DEPTH`, the one depth limit), no deeper."""
    from xckpt.manager._manager import _fresh_torch_target
    from xckpt.manifest import MAX_OBJECT_DEPTH

    def nested(depth: int) -> dict[str, object]:
        v: dict[str, object] = {}
        for _ in range(depth):
            v = {"x": v}
        return v

    assert _fresh_torch_target({"optim": nested(MAX_OBJECT_DEPTH)})
    assert not _fresh_torch_target({"optim": nested(MAX_OBJECT_DEPTH + 1)})
    assert not _fresh_torch_target({"w": torch.zeros(2), "optim": {"state": {"0": torch.zeros(1)}}})
