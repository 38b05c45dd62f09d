"""Checkpoint tiers (DESIGN.md section 11): local saves, replication and restore after a lost node.

Four gloo ranks as two nodes (``ranks_per_node=2``: A = ranks 0-1, B = ranks 2-3), the
local tier on ``/dev/shm`` (a directory per node), the persistent root on a local S3
server (moto's, on 127.0.0.1) and on this disk. The state is W1 (``bench/_common.py``)
of about ``--size-mib`` MiB, every tensor a DTensor split by rows over the four ranks
(built from each rank's slice; the same bytes every run). Each repeat is a fresh set of
processes; the table shows medians over ``--repeats`` (3). Per repeat:

- **staging copy**: ``xckpt.torch``'s staging of the rank's shards into the manager's
  host buffers alone (the copy a save cannot avoid), barrier to barrier, before each local
  save below (the two alternate, so both see the machine alike), median of 8 (after one
  that allocates the buffers);
- **local save stall**: ``CheckpointManager(root, local=..., local_every=1)``'s ``save``
  of a local step (no persistent save due), with nothing in flight (each save's round
  is waited for before the next), median of 8 saves (after one that allocates the buffers);
- **persistent save stall**: the same manager without ``local=`` saving to the root
  (S3, disk): its ``save`` with ``async_save=True``;
- **dcp.async_save stall**: ``torch.distributed.checkpoint.async_save`` to this disk
  (its defaults), the call's time, then its future waited for;
- **replication**: each local save's replication (``Replicator.seconds``: making its
  head, then from the first exchange, once every rank's local write is done, to the last,
  every replica stored), on the slowest rank, median of saves 7-9 (``local_keep=2``: from
  save 4 on each rank writes over and receives into the files of the step retention
  dropped, `xckpt.manager._spares`, and from save 7 on their mappings are kept from
  before); rows also show saves 4-6 and save 2 (fresh files). Against a plain gloo
  ``batch_isend_irecv`` of the same bytes between the same ranks, barrier to barrier: the
  median of 5 sends into receive buffers already in memory (the anchor: the transport at
  its fastest), and the first send into them (a row of its own: its receive buffers'
  pages are faulted in and zeroed then, which doubles its time here);
- **restore after losing node B**: node B's directory is deleted and its ranks come
  back with an empty one (a replaced node); the manager with ``local=`` restores the
  newest local step (its ranks fetch what they need from node A over gloo), against a
  manager without ``local=`` restoring the same state from the persistent root (S3,
  disk). Each is timed ``--restores`` (3) times in a repeat, the median kept. Bytes read
  from the S3 root are tensorstore's ``bytes_read`` metrics during the restores; every
  restore is checked bit for bit. The restores are timed warm: one untimed restore from
  the tiers runs first (imports, the first use of the code paths), so the restore timed
  first does not pay alone what a process pays once.

Targets (issue 30): restore from tiers at most 0.5x the restore from S3, with 0 bytes read
from the root; local save stall at most 1.1x the staging copy alone; replication at least
0.7x the plain send.

Usage, from the repository root::

    .venv/bin/python bench/tiers.py                 # 128 MiB, 3 repeats
    .venv/bin/python bench/tiers.py --quick         # 16 MiB, 1 repeat
    .venv/bin/python bench/tiers.py --repeats 1 --restores 15   # many restores in one repeat

Results: a markdown table on stdout and ``bench/out/tiers.json`` (with every timed
restore's seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any

from _common import (
    load_average,
    make_array,
    markdown_table,
    median,
    out_dir,
    run_ranks,
    spec_bytes,
    to_torch,
    workload_spec,
)

#: Restores of each kind timed per repeat by default (their median is the repeat's figure).
RESTORES = 3
#: W1 dims giving about 2.7 MB a layer.
DIMS = (256, 704, 8000)
AWS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION")


def _s3_bytes() -> int:
    import tensorstore as ts

    return sum(
        int(v.get("value", 0))
        for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/s3")
        if m["name"].endswith("/bytes_read")
        for v in m.get("values", [])
    )


def _timed(dist: Any, fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _state(spec: list[Any], rank: int, world: int, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for i, (n, s, d) in enumerate(spec):
        full = to_torch(make_array(i, tuple(s), d))
        local = full.chunk(world, 0)[rank].clone()  # its own storage (DCP copies storages)
        out[n] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return all(
        torch.equal(a[n].to_local().reshape(-1).view(torch.uint8), b[n].to_local().reshape(-1).view(torch.uint8))
        for n in b
    )


def _saves(dist: Any, rank: int, cfg: dict[str, Any], sd: dict[str, Any], res: dict[str, Any]) -> None:
    """Staging alone, local save stall, persistent save stalls, dcp.async_save stall."""
    import torch.distributed.checkpoint as dcp

    from xckpt.manager import CheckpointManager, HostBuffers
    from xckpt.torch._staging import Stager

    buffers = HostBuffers()

    def stage() -> None:
        st = Stager(buffers)
        for n, t in sd.items():
            st.stage((n, (0, 0)), t.to_local())
        st.finish()

    stage()  # allocate once, as a manager's second save finds its buffers
    local = os.path.join(cfg["shm"], "A" if rank < 2 else "B")
    m = CheckpointManager(cfg["roots"]["disk"] + "-l", local=local, local_every=1, save_every=10**9, local_keep=2,
                          ranks_per_node=2, handle_preemption=False)
    stalls, staged, reps = [], [], []
    rep = m._tiers.rep  # type: ignore[union-attr]
    for step in range(1, 10):
        staged.append(_timed(dist, stage))  # the anchor, in alternation with the saves: both see the same machine
        dist.barrier()
        t0 = time.perf_counter()
        m.save(step, sd)
        stalls.append(time.perf_counter() - t0)
        m.wait()
        reps.append((rep.seconds, rep.reused_bytes))
    res["staging"] = median(staged[1:])
    res["local_stall"] = median(stalls[1:])  # the first allocates the buffers
    # each round's replication on its slowest rank. local_keep=2: from step 4 on, each receives
    # into the spares of the step retention dropped (step 1's after step 3), mapped anew in
    # steps 4-6, and from step 7 on into the same files again, their mappings kept
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, reps)
    took = [max(r[i][0] for r in every) for i in range(len(reps))]
    res["replicate_s"] = median(took[6:])
    res["replicate_first_spares_s"] = median(took[3:6])
    res["replicate_fresh_s"] = took[1]  # step 2: fresh files (step 1 also makes the receive buffers)
    res["reused_bytes"] = sum(r[-1][1] for r in every)
    res["replicated_bytes"] = rep.sent_bytes
    res["plain_send_cold_s"], res["plain_send_s"] = _plain_send(dist, rank, rep)
    m.close()
    for kind, root in cfg["roots"].items():
        p = CheckpointManager(root, save_every=1, keep_last=1, handle_preemption=False)
        stalls = []
        for step in range(1, 4):
            dist.barrier()
            t0 = time.perf_counter()
            p.save(step, sd)
            stalls.append(time.perf_counter() - t0)
            p.wait()
        p.close()
        res[f"persistent_stall_{kind}"] = median(stalls[1:])
    stalls = []
    for step in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=os.path.join(cfg["dcp"], str(step)))
        stalls.append(time.perf_counter() - t0)
        fut.result()
    res["dcp_stall"] = median(stalls[1:])


def _plain_send(dist: Any, rank: int, rep: Any) -> tuple[float, float]:
    """The same bytes each rank replicated, sent with one gloo batch_isend_irecv on the
    replication's group: the first send, into receive buffers no page of which is in memory
    yet, and the median of 5 more into the same buffers (the anchor: a plain send at its
    fastest)."""
    import torch

    def exchange(sends: list[Any], recvs: list[Any]) -> None:
        ops = [dist.P2POp(dist.irecv, buf, rep._ranks[s], rep.group) for s, buf in recvs]
        ops += [dist.P2POp(dist.isend, buf, rep._ranks[d], rep.group) for d, buf in sends]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    n = torch.tensor([rep.sent_bytes // max(1, len(rep.dsts))], dtype=torch.int64)
    sizes = {s: torch.zeros(1, dtype=torch.int64) for s in rep.srcs}
    exchange([(d, n) for d in rep.dsts], list(sizes.items()))
    payload = torch.ones(int(n.item()), dtype=torch.uint8)
    got = {s: torch.empty(int(t.item()), dtype=torch.uint8) for s, t in sizes.items()}
    times = [_timed(dist, lambda: exchange([(d, payload) for d in rep.dsts], list(got.items()))) for _ in range(6)]
    return times[0], median(times[1:])


def _restores(dist: Any, rank: int, cfg: dict[str, Any], sd: dict[str, Any], res: dict[str, Any]) -> None:
    """Node B lost: restore from the tiers, against restoring the same state from the roots."""
    import torch

    from xckpt.manager import CheckpointManager

    def blank() -> dict[str, Any]:
        return {n: t * 0 for n, t in sd.items()}

    if rank == 0:
        shutil.rmtree(os.path.join(cfg["shm"], "B"))
    dist.barrier()
    for replaced in ("B1", "B2"):  # the first, untimed: what a process pays once (imports, first uses)
        local = os.path.join(cfg["shm"], "A" if rank < 2 else replaced)
        m = CheckpointManager(cfg["roots"]["s3"], local=local, local_every=1, local_keep=2, ranks_per_node=2,
                              handle_preemption=False)
        if replaced == "B1":
            m.restore(blank())
            m.close()
    target = blank()
    before = _s3_bytes()
    prof = None
    if cfg.get("profile"):  # --profile: cProfile of each rank's timed restore from the tiers
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    times, exact = [], True
    for _ in range(cfg["restores"]):
        target = blank()
        times.append(_timed(dist, lambda target=target: m.restore(target)))
        exact = exact and _same(target, sd)
    res["restore_tiers_s"] = median(times)
    res["restore_tiers_each_s"] = times
    if prof is not None:
        prof.disable()
        prof.dump_stats(os.path.join(cfg["profile"], f"restore_tiers.rank{rank}.prof"))
    res["restore_tiers_root_bytes"] = _s3_bytes() - before
    res["restore_tiers_exact"] = exact
    m.close()
    for kind, root in cfg["roots"].items():
        p = CheckpointManager(root, handle_preemption=False)
        times, exact = [], True
        for _ in range(cfg["restores"]):
            target = blank()
            times.append(_timed(dist, lambda p=p, target=target: p.restore(target)))
            exact = exact and _same(target, sd)
        res[f"restore_{kind}_s"] = median(times)
        res[f"restore_{kind}_each_s"] = times
        res[f"restore_{kind}_exact"] = exact
        p.close()
    del torch


def _rank(rank: int, world: int, port: int, cfg: dict[str, Any], out: Any) -> None:
    os.environ.update(OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE="2", **cfg["env"])
    try:
        import datetime

        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        mesh = init_device_mesh("cpu", (world,))
        sd = _state([tuple(x) for x in cfg["spec"]], rank, world, mesh)
        res: dict[str, Any] = {}
        _saves(dist, rank, cfg, sd, res)
        _restores(dist, rank, cfg, sd, res)
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, True, res))
    except BaseException:  # noqa: B036 - reported to the parent
        import traceback

        out.put((rank, False, traceback.format_exc()))


def _one(spec: Any, s3: Any, profile: str | None = None, restores: int = RESTORES) -> dict[str, Any]:
    """One repeat in fresh processes; rank 0's figures (byte counts summed over ranks)."""
    shm = tempfile.mkdtemp(prefix="xckpt-bench-tiers-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    disk = tempfile.mkdtemp(prefix="tiers-", dir=out_dir())
    cfg = {
        "spec": spec,
        "shm": shm,
        "dcp": os.path.join(disk, "dcp"),
        "roots": {"s3": s3.fresh("tiers"), "disk": os.path.join(disk, "root")},
        "env": {k: os.environ[k] for k in AWS},
        "profile": profile,
        "restores": restores,
    }
    try:
        per = run_ranks(_rank, 4, cfg, timeout=3600)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    r0 = dict(per[0])
    r0["restore_tiers_root_bytes"] = sum(p["restore_tiers_root_bytes"] for p in per)
    r0["replicated_bytes"] = sum(p["replicated_bytes"] for p in per)
    r0["reused_bytes"] = per[0]["reused_bytes"]  # already summed over ranks
    r0["exact"] = all(p[k] for p in per for k in p if k.endswith("_exact"))
    return r0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=float, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="16 MiB, 1 repeat")
    ap.add_argument("--restores", type=int, default=RESTORES, help="restores of each kind timed per repeat (their "
                    "median is the repeat's figure)")
    ap.add_argument("--profile", metavar="DIR", help="write cProfile stats of each rank's timed restore from "
                    "the tiers to DIR/restore_tiers.rank<r>.prof (the last repeat's; it slows that restore)")
    args = ap.parse_args()
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        args.profile = os.path.abspath(args.profile)
    if args.quick:
        args.size_mib, args.repeats = 16, 1
    spec = workload_spec("W1", args.size_mib / 1024, DIMS)
    total = spec_bytes(spec)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import logging

    import s3_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    gen = s3_server.serve()
    s3 = next(gen)
    try:
        runs = [_one(spec, s3, args.profile, args.restores) for _ in range(args.repeats)]
    finally:
        gen.close()

    def med(k: str) -> float:
        return median([r[k] for r in runs])

    mib = total / (1 << 20)
    rep_gbps = med("replicated_bytes") / med("replicate_s") / 1e9
    plain_gbps = med("replicated_bytes") / med("plain_send_s") / 1e9
    checks = {
        "restore from tiers <= 0.5x restore from S3": med("restore_tiers_s") <= 0.5 * med("restore_s3_s"),
        "0 bytes read from the persistent root": max(r["restore_tiers_root_bytes"] for r in runs) == 0,
        "local save stall <= 1.1x the staging copy": med("local_stall") <= 1.1 * med("staging"),
        "replication >= 0.7x the plain send": rep_gbps >= 0.7 * plain_gbps,
        "every restore bit-exact": all(r["exact"] for r in runs),
    }
    rows = [
        ["staging copy alone (anchor)", med("staging"), 1.0],
        ["local save stall", med("local_stall"), med("local_stall") / med("staging")],
        ["persistent save stall, S3 root", med("persistent_stall_s3"), med("persistent_stall_s3") / med("staging")],
        ["persistent save stall, disk root", med("persistent_stall_disk"),
         med("persistent_stall_disk") / med("staging")],
        ["dcp.async_save stall, disk", med("dcp_stall"), med("dcp_stall") / med("staging")],
        ["restore from S3 root (anchor)", med("restore_s3_s"), 1.0],
        ["restore from disk root", med("restore_disk_s"), med("restore_disk_s") / med("restore_s3_s")],
        ["restore from tiers, node B lost", med("restore_tiers_s"), med("restore_tiers_s") / med("restore_s3_s")],
        ["plain gloo send (anchor)", med("plain_send_s"), 1.0],
        ["plain gloo send, receive buffers' first use", med("plain_send_cold_s"),
         med("plain_send_s") / med("plain_send_cold_s")],
        ["replication", med("replicate_s"), rep_gbps / plain_gbps],
        ["replication, spares mapped anew (rounds 4-6)", med("replicate_first_spares_s"),
         med("plain_send_s") / med("replicate_first_spares_s")],
        ["replication into fresh files (round 2, before any spares)", med("replicate_fresh_s"),
         med("plain_send_s") / med("replicate_fresh_s")],
    ]
    print(f"\nstate {mib:.0f} MiB (W1, rows split over 4 gloo ranks = 2 nodes), medians of {args.repeats}; "
          f"load {load_average()}\n")
    print(markdown_table(["what", "seconds", "ratio to its anchor"], rows))
    print(f"\nreplication {rep_gbps:.2f} GB/s, plain send {plain_gbps:.2f} GB/s; bytes read from the root during "
          f"the tier restore: {max(r['restore_tiers_root_bytes'] for r in runs)}; the last replication received "
          f"{med('reused_bytes') / max(1, med('replicated_bytes')):.0%} of its bytes into spares")
    for k, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {k}")
    path = out_dir() / "tiers.json"
    path.write_text(json.dumps({"size_mib": mib, "runs": runs, "checks": checks, "id": uuid.uuid4().hex}, indent=1))


if __name__ == "__main__":
    main()
