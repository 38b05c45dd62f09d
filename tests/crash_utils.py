"""Helpers (no tests) for tests/test_reliability.py: saves killed at chosen points, byte
flips, and the bookkeeping of outcomes (trials, refused, complete, silent-wrong).

A killed save runs in a process of its own, forked from a multiprocessing
*forkserver* that has imported numpy and xckpt but never touched tensorstore (a
process that has used tensorstore cannot fork). The worker first saves something
complete (an earlier checkpoint at another path, or the old save it overwrites),
measures how long that took, then arms a timer that SIGKILLs the process after a
chosen fraction of that time and starts the save under test. Fractions are spread
evenly over [0, 1.3) so the kills land before the claim, among the data writes,
between the data and the manifest, and after the commit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import xckpt
from xckpt.errors import XckptError

#: Trials per kind: a modest number in `make test`, many more with XCKPT_SOAK=1 (`make soak`).
SOAK = os.environ.get("XCKPT_SOAK", "") not in ("", "0")


def data(seed: int, small: int = 120) -> dict[str, Any]:
    """A state of about 2.5 MB: two array chunks, ``small`` packed tensors, objects."""
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {
        "big.0": rng.standard_normal((512, 512)).astype(np.float32),
        "big.1": rng.integers(-(2**40), 2**40, (300, 256), dtype=np.int64),
    }
    for i in range(small):
        out[f"small.{i}"] = rng.standard_normal(64).astype(np.float32)
    out["step"] = seed
    out["cfg"] = {"seed": seed, "shape": (3, 4), "name": f"run-{seed}"}
    out["blob"] = rng.bytes(6000)
    return out


def same(got: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    """Every tensor bit for bit and every object equal, and nothing more or less."""
    if set(got) != set(want):
        return False
    for k, v in want.items():
        g = got[k]
        if isinstance(v, np.ndarray):
            if not (isinstance(g, np.ndarray) and g.dtype == v.dtype and g.shape == v.shape):
                return False
            if g.tobytes() != v.tobytes():
                return False
        elif g != v:
            return False
    return True


def _arm(delay: float) -> None:
    threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def worker(kind: str, root: str, seed: int, frac: float) -> None:
    """One killed save (runs in a forked child; see the module docstring)."""
    target = os.path.join(root, "target")
    storage = ("ocdbt", "plain", "files")[seed % 3]
    # Warm up (tensorstore's drivers and thread pools start on first use), so the timed
    # save below takes as long as the save under test.
    xckpt.save(data(0, small=2), os.path.join(root, "warm"), storage=storage)
    if kind == "numpy":
        t = _timed(lambda: xckpt.save(data(seed + 1000), os.path.join(root, "earlier"), storage=storage))
        _arm(frac * t)
        xckpt.save(data(seed), target, storage=storage)
    elif kind == "overwrite":
        t = _timed(lambda: xckpt.save(data(seed + 1000), target, storage=storage))
        _arm(frac * t)
        xckpt.save(data(seed), target, overwrite=True, storage=storage)
    elif kind == "rank_local":
        # Three ranks save A (rank-local, all in this process), then two overwrite with B:
        # any prefix of that must open as all of A, all of B, or not at all.
        def save_ranks(world: int, sid: str, d: Mapping[str, Any], overwrite: bool) -> None:
            for r in range(world):
                w = xckpt.Writer(target, rank=r, world_size=world, save_id=sid, overwrite=overwrite, storage=storage)
                for name, v in d.items():
                    if isinstance(v, np.ndarray) and v.ndim and name.startswith("big"):
                        rows = np.array_split(np.arange(v.shape[0]), world)[r]
                        w.write(name, v[rows[0] : rows[-1] + 1], global_shape=v.shape, offset=(int(rows[0]),) + (0,) * (v.ndim - 1))
                    elif isinstance(v, np.ndarray):
                        w.declare(name, v.dtype, v.shape)
                        if int(name.split(".")[1]) % world == r:
                            w.write(name, v)
                    else:
                        w.write_object(name, v)
                w.commit()

        t = _timed(lambda: save_ranks(3, f"A{seed}", data(seed + 1000), False))
        _arm(frac * t * 2 / 3)
        save_ranks(2, f"B{seed}", data(seed), True)
    else:
        raise ValueError(kind)
    time.sleep(0.05)  # a kill due right after the commit still lands


_CTX: Any = None


def _ctx() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        mp.set_forkserver_preload(["numpy", "xckpt", "crash_utils"])
    return _CTX


@dataclass
class Tally:
    """Outcomes of killed saves: the figures the README quotes."""

    what: str
    trials: int = 0
    refused: int = 0
    complete: int = 0
    old: int = 0  # an overwrite killed early: the previous save still opens, whole
    silent_wrong: int = 0
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        old = f", {self.old} still the previous save" if self.old else ""
        return (
            f"{self.what}: {self.trials} trials, {self.refused} refused, {self.complete} complete{old}, "
            f"{self.silent_wrong} silent-wrong"
        )


def judge(tally: Tally, path: str, want: Mapping[str, Any], old: Mapping[str, Any] | None = None) -> None:
    """Open ``path`` as a user would and classify the outcome (raw errors propagate)."""
    tally.trials += 1
    try:
        got = xckpt.load(path, per_rank="list")
    except XckptError as e:
        tally.refused += 1
        tally.notes.append(type(e).__name__)
        return
    if same(got, want):
        tally.complete += 1
    elif old is not None and same(got, old):
        tally.old += 1
    else:
        tally.silent_wrong += 1
        tally.notes.append(f"silent wrong at {path}: {sorted(got)[:5]}")


def run_killed(kind: str, root: str, seed: int, frac: float, timeout: float = 60) -> int | None:
    """Run :func:`worker` in a forked child and wait for it; its exit code (-9: killed)."""
    p = _ctx().Process(target=worker, args=(kind, root, seed, frac), daemon=True)
    p.start()
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join()
    return p.exitcode


def fractions(n: int, seed: int = 0) -> list[float]:
    """``n`` kill points spread evenly over [0, 1.3), jittered (stratified sampling)."""
    rng = np.random.default_rng(seed)
    return [float((i + rng.random()) * 1.3 / n) for i in range(n)]
