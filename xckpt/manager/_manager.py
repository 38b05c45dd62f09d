"""`xckpt.CheckpointManager`: the life of a training run's checkpoints (DESIGN.md section 8).

Call protocol. Every rank builds its manager at the same point and makes the same
calls in the same order: `should_save`, `save`, `restore` and (in coordinated
mode) the end of each save are collective. A step's save goes:

1. `should_save(step)` or `save` itself: the ranks agree whether any of them got
   SIGTERM (one all-reduce of a flag; none with `handle_preemption=False`);
2. `save`: the previous save (its write and its retention) finishes first, so one
   save is in flight; the ranks exchange its outcome and rank 0's plan for this step
   (one all-gather: the save id, the metadata, whether the step is new, replaces an
   incomplete one, or is refused), decided from rank 0's view of storage;
3. the adapter stages the state into the manager's host buffers (`async_save`) and
   returns; `save` returns `True`;
4. the manager's save thread finishes the adapter's write (data, then `ranks/<r>.json`,
   then `xckpt.json`), then rank 0 runs retention (complete steps by the policy,
   incomplete steps no save is writing) and, in coordinated mode, a last broadcast
   releases the other ranks, so `wait()` returns on every rank once all of it is done.
   With `rank_local`, no rank waits for another's write: rank 0 polls storage until
   every rank's manifest of the save is there, writes `xckpt.json` and runs
   retention; the others poll for that `xckpt.json`;
5. after a preemption save, `save` waits for step 4 and raises `SystemExit(143)`.

Errors of a background save are raised by the next `save` (on every rank), `wait`
or `close`, with a note naming the step. Retention that fails in storage is a
warning: the save stands, and the next save's retention retries.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import secrets
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from xckpt.convert_parallel import convert
from xckpt.errors import CheckpointNotFoundError, IncompleteCheckpointError, XckptError
from xckpt.manifest import MAX_OBJECT_DEPTH, Manifest
from xckpt.native._codecs import check_compression
from xckpt.native.commit import read_rank_manifests
from xckpt.native.steps import (
    MANAGER_KEY,
    StepInfo,
    check_step,
    decode_metrics,
    delete_step,
    encode_metrics,
    manager_steps,
    read_step,
    step_location,
)
from xckpt.native.writer import finalize
from xckpt.storage import Location, Storage, location_name, location_spec

from ._adapters import framework_of, restore_state, start_save
from ._coord import coordinator
from ._fetch import restore as restore_tiers
from ._incremental import ManifestCache, base_step, check_replace, dedup_for, retain_steps, rows_predicate
from ._policy import Policy, positive_count
from ._preemption import SigtermFlag
from ._staging import HostBuffers
from ._tiers import Tiers

__all__ = ["CheckpointManager"]

#: The exit status after a preemption save: 128 + SIGTERM, which schedulers and
#: elastic launchers read as "restart me" (0 reads as "training finished").
PREEMPTED_EXIT = 143


class CheckpointManager:
    """Saves, keeps and restores a training run's checkpoints under one root.

    Each step is an ordinary xckpt checkpoint at `<root>/<step>/`, saved from a
    torch state dict (tensors, DTensors, optimizer state), a JAX pytree or a mapping
    of numpy arrays (the adapter is chosen from the state), and restored at any world
    size, mesh, placement or sharding.

    Args:
        root: a directory, kvstore URL (`file://`, `memory://`, `gs://`, `s3://`)
            or kvstore spec dict (an S3-compatible endpoint).
        keep_last: keep the N highest steps.
        keep_every: keep every step divisible by K.
        keep_best: keep the N best steps by `metric` (steps without it: kept, unranked).
        metric, mode: the metric steps rank by, `"min"` (lower is better) or `"max"`.
        save_every: `save` saves steps divisible by it (None: every call saves).
        async_save: `save` returns once the state is copied into host buffers the
            manager owns and reuses; the write runs on the manager's save thread.
        rank_local: saves need no collective (each rank writes its part and its
            manifest; rank 0 merges them once all are there).
        process_group: the torch group whose ranks save together (default: world).
        handle_preemption: install a SIGTERM handler (chaining any earlier one) that
            makes the next `should_save` true on every rank.
        local: the local tier (DESIGN.md section 11): a node-local directory (`/dev/shm/<job>`,
            a local NVMe disk) the ranks of a node share, not the root. Every `local_every` steps
            `save` also saves each rank's part there (staged like a persistent save, written
            and replicated in the background) whatever `save_every` says.
        local_every: save a local step every N steps (None: every `save` call).
        local_keep: local steps kept (the newest complete ones). The tier also keeps the
            files of the step it dropped as spares that the next step writes over, so it
            holds `local_keep + 1` steps' bytes (the peak of a save either way).
        replicas: ranks on other nodes that keep a copy of each rank's local part.
        ranks_per_node: ranks per node (nodes are consecutive groups; default
            `LOCAL_WORLD_SIZE`, else all ranks on one node).
        compression: the codec of array chunks, None (raw), `"zstd"` or
            `"shuffle-zstd"` (format version 6; packed small tensors stay raw).
        references: array chunks equal to the same chunk of the previous complete step
            (same tensor, box and dtype; equal BLAKE2b-128 hashes of their bytes) are stored
            as references to it, not written again; retention keeps referenced data
            (DESIGN.md section 12; `export` makes a standalone copy of a step).
        row_deltas: `True` (every 2-D tensor), a list of tensor names, or `False`: a
            2-D box of which fewer than half the rows changed since the previous step
            (compared with its staged copy: async saves) stores only the changed rows
            over a base; needs `references`.
        full_every: a box is saved whole at least every this many saves, so a read
            applies at most `full_every - 1` row patches.

    Raises:
        XckptError: a bad rule (a count below 1, `keep_best` without `metric`, a
            `mode` other than min/max) or location.
    """

    #: Seconds a rank-local save waits for the other ranks' manifests before it fails.
    rank_local_timeout_s: float = 600.0

    def __init__(
        self,
        root: Location,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        metric: str | None = None,
        mode: str = "min",
        save_every: int | None = None,
        async_save: bool = True,
        rank_local: bool = False,
        process_group: Any = None,
        handle_preemption: bool = True,
        local: Location | None = None,
        local_every: int | None = None,
        local_keep: int = 2,
        replicas: int = 1,
        ranks_per_node: int | None = None,
        compression: str | None = None,
        references: bool = True,
        row_deltas: bool | list[str] = True,
        full_every: int = 8,
    ) -> None:
        self._policy = Policy(
            keep_last=keep_last, keep_every=keep_every, keep_best=keep_best, metric=metric, mode=mode
        )
        self._save_every = positive_count("save_every", save_every)
        location_spec(root)  # refuses what is not a location, before anything else
        #: The root as given (a path-like becomes its string).
        self.root: Location = root if isinstance(root, Mapping) else os.fspath(root)
        self._name = location_name(root)
        self._async, self._rank_local, self._pg = bool(async_save), bool(rank_local), process_group
        self._handle = bool(handle_preemption)
        # -- incremental (section 12) --
        self._compression = check_compression(compression)
        self._references = bool(references)
        self._manifests = ManifestCache(self.root)
        self._full_every = positive_count("full_every", full_every) or 8
        #: (step, staging generation) of the values the staging buffers hold (row deltas)
        self._staged: tuple[int, int] | None = None
        # -- end incremental --
        self._coord = coordinator(process_group)
        #: This run's token, in every save id (`<step>-<run>-<n>`): a save that replaces
        #: a step left by a killed run never reuses that run's id (the writer refuses that).
        self._run: str = self._coord.share(secrets.token_hex(4) if self._coord.rank == 0 else None)
        self._n = 0
        self._lock = threading.Lock()
        self._cache: dict[int, StepInfo] | None = None  # rank 0: every step, as last listed
        #: The host buffers async saves stage into (reused across saves of one structure).
        self.staging = HostBuffers()
        self.staging.rows_for = rows_predicate(row_deltas) if self._references else None
        self._executor: cf.ThreadPoolExecutor | None = None
        self._inflight: cf.Future[None] | None = None
        self._inflight_step: int | None = None
        self._decision: tuple[int, bool] | None = None
        self._preempted = False
        self._closed = False
        # -- local tier (DESIGN.md section 11; xckpt.manager._tiers) --
        self._tiers: Tiers | None = None
        if local is not None:
            if self._coord.kind == "jax":
                raise XckptError("the local tier replicates over torch.distributed; a multi-process JAX job "
                                 "cannot use local= (use the persistent root alone)")
            self._tiers = Tiers(
                self.root, local, local_every=local_every, local_keep=local_keep, replicas=replicas,
                ranks_per_node=ranks_per_node, coord=self._coord, run=self._run, process_group=process_group,
            )
        # -- end local tier --
        self._sigterm = SigtermFlag()
        if self._handle:
            self._sigterm.install()

    # -- reading what is stored ----------------------------------------------

    def _known(self) -> dict[int, StepInfo]:
        with self._lock:
            return {} if self._cache is None else {s: i for s, i in self._cache.items() if i.complete}

    def _infos(self) -> list[StepInfo]:
        return manager_steps(self.root, known=self._known())

    def steps(self) -> list[int]:
        """The complete steps in storage, ascending (a save in flight appears once complete)."""
        return [i.step for i in self._infos() if i.complete]

    def latest_step(self) -> int | None:
        """The highest complete step, or None."""
        done = self.steps()
        return done[-1] if done else None

    def best_step(self) -> int | None:
        """The best complete step by `metric` (ties: the later), or None when none is ranked.

        Raises:
            XckptError: the manager has no `metric`.
        """
        if self._policy.metric is None:
            raise XckptError(
                f"best_step() of {self._name!r} ranks steps by a metric: build the CheckpointManager with "
                "metric= (e.g. metric='loss', mode='min') and save with metrics={'loss': ...}"
            )
        return self._policy.best([(i.step, i.metrics) for i in self._infos() if i.complete])

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The metrics step `step` was saved with (None: saved without metrics).

        Raises:
            XckptError: `step` is not a complete step (the message lists them).
        """
        s = check_step(step)
        info = self._known().get(s) or read_step(self.root, s)
        if not info.complete:
            raise XckptError(
                f"step {s} of {self._name!r} is not a complete step (its complete steps are {self.steps()}); "
                "ask for one of them"
            )
        return None if info.metrics is None else dict(info.metrics)

    @property
    def preempted(self) -> bool:
        """Whether this rank got SIGTERM, or learned in `should_save`/`save` that a rank did."""
        return self._preempted or self._sigterm.received

    # -- saving ---------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` would save: `save_every` divides the step (or is
        None), or a rank got SIGTERM. Collective: every rank calls it at the same steps;
        a following `save` of the same step reuses the answer.
        """
        self._check_open()
        return self._decide(check_step(step))

    def _decide(self, step: int) -> bool:
        agreed = self._handle and self._coord.any(self.preempted)
        if agreed:
            self._preempted = True
        go = agreed or self._save_every is None or step % self._save_every == 0
        self._decision = (step, go)
        return go

    def save(
        self, step: int, state: Any, *, metrics: Mapping[str, Any] | None = None, force: bool = False
    ) -> bool:
        """Save `state` as step `step` when it is due; whether a save was started.

        A save starts when `save_every` divides the step, when `force`, or after a
        preemption signal. With `async_save` it returns once the state is copied into
        the manager's host buffers: the caller may change the state at once, and the
        write runs in the background (the next save waits for it). Collective.

        Args:
            step: a Python or numpy integer >= 0.
            state: a torch state dict, a JAX pytree, or a mapping of numpy arrays and values.
            metrics: JSON values stored in the step's metadata (rank 0's are stored);
                with a `metric`, it must hold that metric as a number.
            force: save even when the step is not due, save below the latest step, or
                replace a complete step.

        Returns:
            True when a save started; False when the step is not due, or is already
            saved complete (a warning says so; `force` replaces it).

        Raises:
            XckptError: a bad step, a step below the latest complete one without
                `force`, metrics without the metric; nothing is written then. An
                earlier background save's error (on every rank).
            SystemExit: 143, after a preemption save is durable on every rank.
        """
        self._check_open()
        step = check_step(step)
        decided, self._decision = self._decision, None
        go = decided[1] if decided is not None and decided[0] == step else self._decide(step)
        self._decision = None
        if self._tiers is not None and self._tiers.due(step):  # local tier: before the persistent save
            self._local_save(step, state)
        if not (go or force):
            return False
        kind = framework_of(state)
        prev_step, err = self._inflight_step, self._finish_previous()
        mine: tuple[dict[str, Any], BaseException | None] | None = None
        if self._coord.rank == 0:
            mine = self._plan(step, metrics, force)
        outcomes = self._coord.gather(
            (None if err is None else f"{type(err).__name__}: {err}", mine and mine[0])
        )
        if err is not None:
            raise err
        failed = {r: m for r, (m, _) in enumerate(outcomes) if m is not None}
        if failed:
            raise XckptError(
                f"the background save of step {prev_step} to {self._name!r} failed on ranks {sorted(failed)}: "
                + "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))
                + f". Step {step} was not saved; fix the cause and save again"
            )
        plan: dict[str, Any] = outcomes[0][1]
        if plan["action"] == "error":
            if mine is not None and mine[1] is not None:
                raise mine[1]
            raise XckptError(plan["message"])
        if plan["action"] == "exists":
            warnings.warn(plan["message"], stacklevel=2)
            if self._preempted:
                self._exit()
            return False
        if kind == "numpy" and self._coord.kind != "single":
            kind = self._coord.kind  # each array written once, by the job's framework
        if kind == "jax" and self._rank_local and self._coord.world > 1:
            raise XckptError("rank_local=True is for torch saves; a multi-process JAX save is coordinated")
        self._n += 1
        save_id = plan["save_id"]
        if self._tiers is not None:
            self._tiers.wait_written()  # the local write of this step still reads the staging buffers
        options = self._writer_options(step, plan.get("base"))
        self._staged = None  # the staging is refilled below: it holds this step's values once done
        finish = start_save(
            kind,
            state,
            step_location(self.root, step),
            save_id=save_id,
            overwrite=plan["action"] == "replace",
            metadata=plan["metadata"],
            staging=self.staging,
            async_save=self._async,
            process_group=self._pg,
            rank_local=self._rank_local,
            writer_options=options,
        )
        self._staged = (step, self.staging.generation) if self._async else None
        if self._async:
            self._inflight_step = step
            self._inflight = self._pool().submit(self._complete, step, save_id, finish, True)
        else:
            self._complete(step, save_id, finish, False)
        if self._preempted:
            self._exit()
        return True

    def _local_save(self, step: int, state: Any) -> None:
        """Stage `state` as local step `step` (see `xckpt.manager._tiers`)."""
        if self._tiers is None:
            return
        kind = framework_of(state)
        if kind == "numpy" and self._coord.kind != "single":
            kind = self._coord.kind
        self._tiers.save(step, state, kind, self.staging, self._inflight)

    def local_steps(self) -> list[int]:
        """The local steps the job holds, ascending (none without `local=`): complete across
        the local tiers when the manager was built, plus the local saves finished since
        (on every rank, replicas included), less those local retention deleted."""
        return [] if self._tiers is None else self._tiers.steps()

    def _plan(self, step: int, metrics: Any, force: bool) -> tuple[dict[str, Any], BaseException | None]:
        """Rank 0: what to do with step `step` (from storage as last listed)."""
        try:
            enc = encode_metrics(metrics)
            self._policy.check_metrics(step, decode_metrics(enc))
            with self._lock:
                cache = self._cache
            if cache is None:
                cache = {i.step: i for i in manager_steps(self.root)}
                with self._lock:
                    self._cache = cache
            done = sorted(s for s, i in cache.items() if i.complete)
            latest = done[-1] if done else None
            if latest is not None and step < latest and not force:
                raise XckptError(
                    f"step {step} is below step {latest}, the latest complete step of {self._name!r}: a manager "
                    f"saves steps in increasing order. Save a step after {latest}, or pass force=True to save "
                    f"step {step} beside the later ones (latest_step() stays {latest})"
                )
            if step in done and not force:
                return {
                    "action": "exists",
                    "message": f"step {step} of {self._name!r} is already saved (complete) and is not replaced; "
                    "pass force=True to replace it",
                }, None
            meta = {MANAGER_KEY: {"step": step, "metrics": enc, "saved_at": time.time()}}
            action = "replace" if step in cache else "new"
            if self._references:  # incremental: never over data a complete step references
                check_replace(self.root, self._manifests, done, step)
            base = base_step(cache, step) if self._references else None
            return {
                "action": action, "save_id": f"{step}-{self._run}-{self._n}", "metadata": meta, "base": base,
            }, None
        except XckptError as e:
            return {"action": "error", "message": str(e)}, e

    def _writer_options(self, step: int, base: int | None) -> dict[str, Any]:
        """Compression, the step to reference and row deltas (section 12) for this rank's writers."""
        out: dict[str, Any] = {"compression": self._compression}
        if self._references:
            held = (base, self.staging.generation)  # staged by the save of base, and nothing since
            changed = self.staging.changed if base is not None and held == self._staged else None
            out["dedup"] = dedup_for(self._manifests, base, step, changed, self._full_every)
        return out

    def _pool(self) -> cf.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="xckpt-manager")
        return self._executor

    def _complete(self, step: int, save_id: str, finish: Callable[[], Any], background: bool) -> None:
        """The end of a save: the write, every rank's part, retention (see the module)."""
        finish()
        world, rank = self._coord.world, self._coord.rank
        if self._rank_local and world > 1:
            self._await_ranks(step, save_id)
            if rank == 0:
                self._retain_or_warn(step)
            return
        bug: BaseException | None = None
        if rank == 0:
            try:
                self._retain_or_warn(step)
            except Exception as e:  # a bug, not storage: still release the other ranks below
                bug = e
        if world > 1:
            share = self._coord.bg_share if background else self._coord.share
            told = share(None if bug is None else f"{type(bug).__name__}: {bug}")
            if told is not None and bug is None:
                raise XckptError(f"retention after step {step} of {self._name!r} failed on rank 0: {told}")
        if bug is not None:
            raise bug

    def _await_ranks(self, step: int, save_id: str) -> None:
        """Rank-local: wait until every rank's manifest of `save_id` is stored (rank 0 then
        writes `xckpt.json`); the other ranks wait for that `xckpt.json`."""
        loc = step_location(self.root, step)
        storage = Storage(loc)
        world = self._coord.world
        deadline = time.monotonic() + self.rank_local_timeout_s
        delay = 0.01
        while True:
            if self._coord.rank == 0:
                try:
                    read_rank_manifests(storage, expect_world_size=world, expect_save_id=save_id)
                except (IncompleteCheckpointError, CheckpointNotFoundError) as e:
                    why = str(e)
                else:
                    finalize(loc, world, save_id)
                    return
            else:
                data = storage.read_key("xckpt.json")
                if data is not None and Manifest.loads(data, f"{storage.path}/xckpt.json").save_id == save_id:
                    return
                why = "rank 0 has not merged the rank manifests (xckpt.json) yet"
            if time.monotonic() > deadline:
                raise XckptError(
                    f"step {step} of {self._name!r}: not every rank wrote its part within "
                    f"{self.rank_local_timeout_s:.0f} s ({why}); the step stays incomplete and is removed by a "
                    "later save. Check that every rank calls save() for this step"
                )
            time.sleep(delay)
            delay = min(1.0, delay * 1.5)

    def _retain_or_warn(self, step: int) -> None:
        try:
            self._retain()
        except (XckptError, OSError) as e:
            with self._lock:
                self._cache = None  # listed afresh by the next save
            warnings.warn(
                f"retention after step {step} of {self._name!r} failed: {e}. The step is saved; steps it would "
                "have deleted are kept and the next save retries",
                RuntimeWarning,
                stacklevel=2,
            )

    def _retain(self) -> None:
        """Rank 0, once a save is complete on every rank: delete every incomplete step and the
        complete steps the policy does not keep (oldest first); remember what is left.

        No incomplete step can be one a rank is still writing: every rank has finished
        this save (coordinated: the adapter's last exchange; rank-local: its manifest is
        stored), a rank's earlier saves finished before it started this one, and no rank
        starts its next save before rank 0 joins that save's exchange, which rank 0 does
        only after this retention.
        """
        infos = manager_steps(self.root, known=self._known())
        complete = [i for i in infos if i.complete]
        _, delete = self._policy.retain([(i.step, i.metrics) for i in complete])
        stale = [i.step for i in infos if not i.complete]
        cache = {i.step: i for i in infos}
        with self._lock:
            self._cache = dict(cache)

        def handled(s: int) -> None:
            cache.pop(s, None)
            with self._lock:
                self._cache = dict(cache)

        if self._references:  # incremental: referenced data stays (see _incremental)
            kept = [i.step for i in complete if i.step not in set(delete)]
            retain_steps(self.root, self._manifests, kept, stale + delete, handled)
            return
        for s in stale + delete:
            delete_step(self.root, s)
            handled(s)

    def _finish_previous(self) -> BaseException | None:
        """Wait for the save in flight; its error (with a note naming the step), or None."""
        fut, step = self._inflight, self._inflight_step
        self._inflight = self._inflight_step = None
        if fut is None:
            return None
        try:
            fut.result()
        except Exception as e:
            with self._lock:
                self._cache = None  # the failed save may have left its step incomplete: list afresh
            e.add_note(f"(raised by the background save of step {step} to {self._name!r})")
            return e
        return None

    def _exit(self) -> None:
        """After a preemption save: wait until it is durable on every rank, then exit 143."""
        self.close()
        raise SystemExit(PREEMPTED_EXIT)

    # -- restoring --------------------------------------------------------------

    def restore(self, target: Any = None, *, step: int | None = None, **load_options: Any) -> Any:
        """Load the latest complete step (or `step`) into `target`. Collective.

        The save in flight finishes first. The step is chosen on rank 0 and shared,
        so every rank loads the same one. torch targets (tensors, DTensors, any world
        size, mesh or placement) are filled in place by `xckpt.torch.load` and its
        [`LoadResult`][xckpt.torch.LoadResult] returned; a JAX target (a pytree of
        `ShapeDtypeStruct`s with shardings, shardings, or arrays) gives the restored
        pytree (`xckpt.jax.load`); with no target, every tensor (numpy) and object by
        name; a mapping of numpy arrays is filled in place and returned. With `local=`,
        the newest complete step of either tier (`step`: looked for in both), read from
        the local copies the ranks hold where it is local (`xckpt.manager._fetch`).

        Args:
            target: what to restore into (see above).
            step: the step to restore (default: the latest complete one).
            load_options: passed to the adapter's load (`strict=`, `rules=`, ...).

        Raises:
            XckptError: no complete step (`steps()` is `[]`), or `step` is not a
                complete step; the message lists the complete steps.
        """
        if not self._closed:
            self.wait()
        kind = framework_of(target, "restore target")
        if kind == "numpy" and _fresh_torch_target(target):
            kind = "torch"
        if kind == "numpy" and target is not None and self._coord.kind != "single":
            kind = self._coord.kind
        if self._tiers is not None:
            return self._restore_tiers(kind, target, step, load_options)
        chosen = self._coord.share(self._choose(step) if self._coord.rank == 0 else None)
        if isinstance(chosen, str):
            raise XckptError(chosen)
        return restore_state(
            kind, step_location(self.root, chosen), target, process_group=self._pg, options=load_options
        )

    def _restore_tiers(self, kind: str, target: Any, step: int | None, options: dict[str, Any]) -> Any:
        """Restore the newest complete step of both tiers (see `xckpt.manager._fetch`)."""
        if self._tiers is None:
            raise XckptError("internal: no local tier")
        local_opts = {**options, "read_once": True} if kind == "torch" else options

        def load(where: Any, opts: dict[str, Any]) -> Any:
            return restore_state(kind, where, target, process_group=self._pg, options=opts)

        return restore_tiers(
            self._tiers, self.root, self._name, None if step is None else check_step(step),
            lambda: sorted(self._known()), lambda src: load(src, local_opts), lambda loc: load(loc, options),
        )

    def _choose(self, step: int | None) -> int | str:
        """Rank 0: the step to restore, or the error message."""
        try:
            done = self.steps()
            if step is None:
                if not done:
                    return (
                        f"no complete step under {self._name!r}: nothing to restore (steps() is []). Start from "
                        "scratch, or point the manager at the root that holds the run's checkpoints"
                    )
                return done[-1]
            s = check_step(step)
        except XckptError as e:
            return str(e)
        if s not in done:
            return f"step {s} is not a complete step of {self._name!r}; its complete steps are {done}"
        return s

    def export(self, step: int, dst: str | os.PathLike[str], *, compression: str | None = None) -> str:
        """Copy step `step` to `dst` as a standalone checkpoint (every referenced chunk's
        bytes copied in, so it reads without the root); the output path.

        Args:
            step: a complete step.
            dst: a local path that does not exist yet.
            compression: the codec of the copy's array chunks (default raw).

        Raises:
            XckptError: `step` is not a complete step; `dst` exists.
        """
        s = check_step(step)
        if s not in self.steps():
            raise XckptError(f"step {s} is not a complete step of {self._name!r}; its complete steps are {self.steps()}")
        return convert(step_location(self.root, s), dst, to_format="xckpt", compression=compression)

    # -- the end -----------------------------------------------------------------

    def wait(self) -> None:
        """Return once the save in flight and its retention are done (on every rank,
        coordinated; see the module for rank-local); raise its error."""
        err = self._finish_previous()
        if self._tiers is not None:
            try:
                self._tiers.finish()
            except Exception as e:
                if err is None:
                    raise
                err.add_note(f"(the local save also failed: {e})")
        if err is not None:
            raise err

    def close(self) -> None:
        """Finish the save in flight (raising its error), put the SIGTERM handler back,
        release the host buffers. Further saves are refused; reads still work."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._sigterm.uninstall()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._tiers is not None:
                self._tiers.close()
            self.staging.clear()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as e:  # the error already leaving the block is the one to see
            exc.add_note(f"(closing the CheckpointManager of {self._name!r} also failed: {e})")

    def _check_open(self) -> None:
        if self._closed:
            raise XckptError(f"this CheckpointManager of {self._name!r} is closed; build a new one to save")

    def __repr__(self) -> str:
        return f"CheckpointManager({self._name!r}, {self._policy})"


def _fresh_torch_target(target: Any) -> bool:
    """A torch state dict that holds no tensor yet: an empty mapping or list nested in a
    mapping (a fresh optimizer's `state: {}`), while torch is imported. The numpy path
    would report it missing; `xckpt.torch.load` fills it (DESIGN.md section 10)."""

    def empty_inside(v: Any, depth: int) -> bool:
        if not isinstance(v, (Mapping, list)) or depth > MAX_OBJECT_DEPTH:
            return False
        items = v.values() if isinstance(v, Mapping) else v
        return not v or any(empty_inside(x, depth + 1) for x in items)

    return (
        "torch" in sys.modules
        and isinstance(target, Mapping)
        and any(empty_inside(v, 0) for v in target.values())
    )
