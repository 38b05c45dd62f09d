"""xckpt.CheckpointManager against torch DCP's ``async_save`` and orbax's ``CheckpointManager``.

A training loop of ``--steps`` steps (15), each about 0.1 s of matmuls (calibrated in
each process), saves its state every ``--every`` steps (3: five saves) with the save
in flight overlapping the next steps. The state is W1 (``bench/_common.py``: a small
LLM's matrices, float32 and bfloat16, seeded), about ``--size-gib`` GiB (0.5: 512 MiB).
Systems, each run in a fresh process, ``--repeats`` times (medians):

- ``xckpt-torch``  ``CheckpointManager(root, keep_last=2)``, a torch state dict; the step
  also changes a slice of every tensor in place right after ``save`` returns;
- ``dcp``          ``torch.distributed.checkpoint.async_save`` of the same state dict, one
  save in flight as its docs recommend (the previous future's ``result()`` before the next
  save), single process (``no_dist=True``); its defaults (FileSystemWriter, a fresh host
  copy per save); no retention (DCP has no manager);
- ``xckpt-jax``    ``CheckpointManager(root, keep_last=2)``, the same tensors as a JAX pytree;
- ``orbax``        ``orbax.checkpoint.CheckpointManager`` (``max_to_keep=2``, async saves,
  ``StandardSave``) of that pytree.

Measured: **stall**, the time the loop is blocked in the save call per save (for DCP
the wait for the previous save plus ``async_save``; for the managers their ``save``,
which waits for the previous save itself); **total**, the loop's wall time including the
final wait for the last save; **RSS growth**, the peak resident set during the loop
(``/proc/self/clear_refs`` reset at its start) minus the resident set at its start (the
state is resident already), as a multiple of the state's bytes. After the timed loop,
the xckpt systems restore the last step and compare it bit for bit.

Targets (issue 23), each xckpt system against its anchor (torch: DCP, JAX: orbax):
stall at most 0.5x the anchor's; total wall time at most the anchor's; RSS growth at
most 1.3x the state over the five saves (host buffers reused, not reallocated).

``--device cuda`` puts the torch state and matmuls on the GPU (the JAX systems run only
where jax has a GPU); the staging then copies into pinned buffers on a side stream.

Usage, from the repository root::

    .venv/bin/python bench/manager.py                 # 0.5 GiB, 3 repeats, every system
    .venv/bin/python bench/manager.py --quick         # a small state, 1 repeat (< 1 min)
    .venv/bin/python bench/manager.py --systems xckpt-torch,dcp --device cuda

Prints a markdown table (medians) and verdict lines; results go to ``bench/out/manager.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    current_rss_mib,
    emit,
    load_average,
    make_array,
    markdown_table,
    median,
    out_dir,
    peak_rss_mib,
    reset_peak_rss,
    run_child,
    spec_bytes,
    workload_spec,
)

SYSTEMS = ("xckpt-torch", "dcp", "xckpt-jax", "orbax")
ANCHOR = {"xckpt-torch": "dcp", "xckpt-jax": "orbax"}
#: W1's matrix sizes for --quick (hidden, MLP width, vocabulary): a state of tens of MiB.
QUICK_DIMS = (256, 704, 8000)


def _spec(size_gib: float, quick: bool) -> list[tuple[str, tuple[int, ...], str]]:
    return workload_spec("W1", size_gib, QUICK_DIMS) if quick else workload_spec("W1", size_gib)


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``a.b.c`` names as nested dicts (a JAX pytree as a flax model would hold it)."""
    out: dict[str, Any] = {}
    for name, v in flat.items():
        *parents, leaf = name.split(".")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = v
    return out


# ---------------------------------------------------------------------------
# One system in one process


def _torch_setup(spec: Any, device: str) -> tuple[dict[str, Any], Any]:
    import torch
    from _common import to_torch

    torch.manual_seed(0)
    state = {name: to_torch(make_array(i, shape, dt)).to(device) for i, (name, shape, dt) in enumerate(spec)}
    a = torch.randn(1024, 1024, device=device)

    def matmuls(n: int) -> None:
        x = a
        for _ in range(n):
            x = torch.tanh(x @ a)
        if device == "cuda":
            torch.cuda.synchronize()

    def step(n: int, k: int) -> None:
        matmuls(n)
        with torch.no_grad():
            for t in state.values():  # an optimizer-like change: a slice of every tensor, in place
                t.view(-1)[:256].add_(1)

    return state, (matmuls, step)


def _jax_setup(spec: Any) -> tuple[dict[str, Any], Any]:
    import jax
    import jax.numpy as jnp

    flat = {name: jax.device_put(make_array(i, shape, dt)) for i, (name, shape, dt) in enumerate(spec)}
    state = _nest(flat)
    a = jax.random.normal(jax.random.PRNGKey(0), (1024, 1024))

    @jax.jit
    def body(x: Any, n: Any) -> Any:
        return jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y @ a), x)

    def matmuls(n: int) -> None:
        body(a, n).block_until_ready()

    def step(n: int, k: int) -> None:
        matmuls(n)

    return state, (matmuls, step)


def _calibrate(matmuls: Any, target_s: float = 0.1) -> int:
    matmuls(2)  # compile / warm up
    t = time.perf_counter()
    matmuls(8)
    per = (time.perf_counter() - t) / 8
    return max(1, round(target_s / per))


def child(system: str, size_gib: float, quick: bool, steps: int, every: int, device: str, root: str) -> None:
    spec = _spec(size_gib, quick)
    nbytes = spec_bytes(spec)
    if system in ("xckpt-torch", "dcp"):
        state, (matmuls, step_fn) = _torch_setup(spec, device)
    else:
        state, (matmuls, step_fn) = _jax_setup(spec)
    n = _calibrate(matmuls)
    t = time.perf_counter()
    step_fn(n, 0)
    step_s = time.perf_counter() - t

    save, finish = _system(system, root)
    stalls: list[float] = []
    rss0 = current_rss_mib()
    reset_peak_rss()
    t_loop = time.perf_counter()
    for k in range(1, steps + 1):
        step_fn(n, k)
        if k % every == 0:
            t0 = time.perf_counter()
            save(k, state)
            stalls.append(time.perf_counter() - t0)
    finish()
    total = time.perf_counter() - t_loop
    peak = peak_rss_mib()
    checked = _check(system, root, state, steps - steps % every)
    emit({
        "system": system, "state_bytes": nbytes, "steps": steps, "saves": len(stalls), "step_s": step_s,
        "stall_s": sum(stalls) / len(stalls), "stalls": stalls, "total_s": total,
        "rss_growth_mib": peak - rss0, "rss_growth_x": (peak - rss0) * (1 << 20) / nbytes, "checked": checked,
    })


def _system(system: str, root: str) -> tuple[Any, Any]:
    """(save(step, state), finish()) for one system."""
    if system in ("xckpt-torch", "xckpt-jax"):
        from xckpt.manager import CheckpointManager

        m = CheckpointManager(root, keep_last=2)

        def finish() -> None:
            m.close()

        return (lambda k, st: m.save(k, st)), finish
    if system == "dcp":
        import torch.distributed.checkpoint as dcp

        pending: list[Any] = []

        def save(k: int, st: Any) -> None:
            if pending:
                pending.pop().result()
            pending.append(dcp.async_save(st, checkpoint_id=os.path.join(root, str(k)), no_dist=True))

        def finish_dcp() -> None:
            if pending:
                pending.pop().result()

        return save, finish_dcp
    if system == "orbax":
        import orbax.checkpoint as ocp

        mgr = ocp.CheckpointManager(root, options=ocp.CheckpointManagerOptions(max_to_keep=2))

        def save_orbax(k: int, st: Any) -> None:
            mgr.save(k, args=ocp.args.StandardSave(st))

        def finish_orbax() -> None:
            mgr.wait_until_finished()
            mgr.close()

        return save_orbax, finish_orbax
    raise SystemExit(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")


def _check(system: str, root: str, state: Any, last: int) -> bool | None:
    """The xckpt systems: restore the last step and compare it bit for bit (outside the timing)."""
    if not system.startswith("xckpt"):
        return None
    import numpy as np

    import xckpt

    got = xckpt.load(os.path.join(root, str(last)))
    if system == "xckpt-torch":
        from _common import from_torch

        want = {k: from_torch(v.cpu()) for k, v in state.items()}
    else:
        import jax

        want = {".".join(str(getattr(p, "key", p)) for p in path): np.asarray(v)
                for path, v in jax.tree_util.tree_flatten_with_path(state)[0]}
    return set(got) == set(want) and all(got[k].tobytes() == want[k].tobytes() for k in want)


# ---------------------------------------------------------------------------
# The driver


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gib", type=float, default=0.5, help="state size (default 0.5 GiB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--quick", action="store_true", help="a small state (tens of MiB), 1 repeat")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--child", nargs=3, metavar=("SYSTEM", "ROOT", "QUICK"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        system, root, quick = args.child
        child(system, args.size_gib, quick == "1", args.steps, args.every, args.device, root)
        return
    if args.quick:
        args.size_gib, args.repeats = 0.03, 1
    systems = [s for s in args.systems.split(",") if s]
    if args.device == "cuda":
        systems = [s for s in systems if s in ("xckpt-torch", "dcp") or _jax_has_gpu()]
    base = Path(args.dir or tempfile.mkdtemp(prefix="xckpt-bench-manager-"))
    env = {"OMP_NUM_THREADS": str(os.cpu_count() or 2)}
    if args.device == "cpu":
        env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for r in range(args.repeats):
        for s in systems:  # interleaved, so drift in the machine's load hits every system alike
            root = base / f"{s}-{r}"
            shutil.rmtree(root, ignore_errors=True)
            argv = ["--child", s, str(root), "1" if args.quick else "0", "--size-gib", str(args.size_gib),
                    "--steps", str(args.steps), "--every", str(args.every), "--device", args.device]
            res = run_child(__file__, argv, env=env, timeout=1800)
            shutil.rmtree(root, ignore_errors=True)
            runs[s].append(res)
            print(f"  {s} run {r + 1}: stall {res['stall_s']:.3f} s/save, total {res['total_s']:.2f} s, "
                  f"RSS +{res['rss_growth_x']:.2f}x state", file=sys.stderr, flush=True)
    shutil.rmtree(base, ignore_errors=True)
    report(args, systems, runs)


def _jax_has_gpu() -> bool:
    try:
        import jax

        return any(d.platform == "gpu" for d in jax.devices())
    except Exception:  # no jax, or no GPU backend: the JAX systems are left out
        return False


def report(args: argparse.Namespace, systems: list[str], runs: dict[str, list[dict[str, Any]]]) -> None:
    med = {s: {k: median([r[k] for r in runs[s]]) for k in ("stall_s", "total_s", "rss_growth_x", "step_s")}
           for s in systems}
    state_mib = runs[systems[0]][0]["state_bytes"] / (1 << 20)
    rows = []
    for s in systems:
        m = med[s]
        anchor = ANCHOR.get(s)
        ratio = (m["stall_s"] / med[anchor]["stall_s"]) if anchor in med else float("nan")
        tratio = (m["total_s"] / med[anchor]["total_s"]) if anchor in med else float("nan")
        checked = all(r["checked"] is not False for r in runs[s])
        rows.append([s, m["stall_s"], ratio, m["total_s"], tratio, m["rss_growth_x"], "yes" if checked else "NO"])
    machine = f"{os.cpu_count()} cores, device {args.device}, load average {load_average()}"
    print(f"\nCheckpoint manager: {args.steps} steps of ~0.1 s matmuls, a save every {args.every} "
          f"({args.steps // args.every} saves) of a {state_mib:.0f} MiB state; medians of {args.repeats} "
          f"(fresh process each); {machine}\n")
    print(markdown_table(
        ["system", "stall s/save", "stall / anchor", "total s", "total / anchor", "RSS growth x state", "restored"],
        rows))
    verdicts = []
    for s, anchor in ANCHOR.items():
        if s not in med:
            continue
        m = med[s]
        parts = [f"RSS growth {m['rss_growth_x']:.2f}x <= 1.3x: {'met' if m['rss_growth_x'] <= 1.3 else 'NOT met'}"]
        if anchor in med:
            a = med[anchor]
            parts.insert(0, f"stall {m['stall_s']:.3f} s vs {anchor} {a['stall_s']:.3f} s = "
                            f"{m['stall_s'] / a['stall_s']:.2f}x <= 0.5x: "
                            f"{'met' if m['stall_s'] <= 0.5 * a['stall_s'] else 'NOT met'}")
            parts.insert(1, f"total {m['total_s']:.2f} s vs {a['total_s']:.2f} s: "
                            f"{'met' if m['total_s'] <= a['total_s'] else 'NOT met'}")
        verdicts.append(f"{s}: " + "; ".join(parts))
    if args.quick:
        verdicts.append("(--quick: a state of tens of MiB, where fixed costs dominate; the targets are for the "
                        "full run, 0.5 GiB)")
    print("\n" + "\n".join(verdicts))
    out = out_dir() / "manager.json"
    out.write_text(json.dumps({
        "when": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine,
        "args": {k: v for k, v in vars(args).items() if k != "child"}, "medians": med, "runs": runs,
        "verdicts": verdicts,
    }, indent=1))
    print(f"\nresults: {out}")


if __name__ == "__main__":
    main()
