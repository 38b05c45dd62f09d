"""`xckpt.torch.load(..., read_once=True)`: each stored range read by one rank, sent to the others.

When several ranks need the same stored bytes (replicated tensors, data-parallel
replicas of a sharded layout), reading them from storage once per rank multiplies
what storage serves by the replication factor. With `read_once` the ranks of the
process group agree on a plan in which every stored range is read by exactly one
of the ranks that need it, which sends it to the others over the process group;
storage serves about one copy of what the group needs.

The plan is `xckpt.sharing.make_plan` (pure arithmetic over boxes, no torch; see that
module for what it decides).

Call protocol (`load_once`, every rank of the group, same order):

1. one exchange of every rank's requests, or of its failure so far (a target that
   does not fit, a missing name, ...), with a `fingerprint` of the checkpoint
   it opened: all ranks raise if any rank failed or opened another checkpoint;
2. one broadcast of the plan: rank `PLANNER` of the group makes it and sends it (or its
   failure, which every rank raises); each other rank decodes only its part of it
   (`decode_plan`). One rank plans instead of every rank, the others' CPU is spared
   (ranks sharing a host's cores wait for each other's);
3. per round: the reader of each group reads it and copies its cells to its own
   targets and to one send buffer per destination; one batch of point-to-point sends
   and receives (`batch_isend_irecv`: measured faster than `all_to_all_single` and
   than one broadcast per reader on gloo, and a buffer every destination needs alike
   is sent from one copy); each rank copies what it received into its targets. A rank
   whose read failed (a corrupt chunk, ...) reads no more and sends zeros of the
   planned lengths, so no rank waits for a message that never comes; no round
   exchanges outcomes (each such exchange costs every rank a round trip);
4. each rank reads its solo parts while the first round's data travel (after every
   round when there is none): the others wait for what a rank reads for them, not for
   its own parts;
5. one exchange of outcomes: a failure on any rank (in any round, or a solo read)
   fails every rank, so what a failed rank sent is never kept as loaded.

Every collective is waited for with `TIMEOUT_S`: a rank that stops (killed, or
stuck outside `load`) makes the others raise an [`XckptError`][xckpt.errors.XckptError]
instead of hanging. The exchanges carry bytes and int64 arrays, never pickles. On
NCCL the buffers travel through the current CUDA device.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from xckpt import layout as L
from xckpt._progress import progress
from xckpt._wait import wait_works
from xckpt.errors import XckptError
from xckpt.sharing import Cell, Group, Need, Plan, decode_plan, encode_plan, make_plan, messages
from xckpt.source import Source
from xckpt.torch._dist import distributed, raise_for_ranks
from xckpt.torch._dtypes import torch_dtype
from xckpt.torch._pipeline import ALIGN, Copier, DeviceRing, wait_all

__all__ = ["load_once"]

#: Seconds any one collective of a read_once load may wait for the other ranks.
TIMEOUT_S = 600.0
#: Bytes of each rank's requests sent in the first exchange (a plan's requests of about
#: 1,300 tensors); longer requests take a second exchange for the rest.
GATHER_HEAD = 64 << 10
#: Bytes of the plan sent in its first broadcast (a plan of about 5,000 groups of one
#: cell); a longer plan takes a second broadcast for the rest.
PLAN_HEAD = 256 << 10
#: The rank of the group that plans the load and sends the plan to the others.
PLANNER = 0

#: A rank's target part: (tensor name, global box, numpy view or torch tensor of the box's shape).
Target = tuple[str, L.Box, Any]


def _framed(payload: bytes, head: int) -> np.ndarray:
    """A first message of `payload`: its length (8 bytes, little-endian) and its first
    `head` bytes, zero-padded to `8 + head` (every rank's is as long)."""
    out = np.zeros(8 + head, dtype=np.uint8)
    out[:8] = np.frombuffer(len(payload).to_bytes(8, "little"), dtype=np.uint8)
    first = payload[:head]
    out[8 : 8 + len(first)] = np.frombuffer(first, dtype=np.uint8)
    return out


def _size(framed: np.ndarray) -> int:
    """The payload length a `_framed` message carries."""
    return int.from_bytes(framed[:8].tobytes(), "little")


def _rest(payload: bytes, head: int, n: int) -> np.ndarray:
    """The second message of `payload`: its bytes after the first `head`, zero-padded to `n`."""
    out = np.zeros(n, dtype=np.uint8)
    more = payload[head:]
    out[: len(more)] = np.frombuffer(more, dtype=np.uint8)
    return out


def _layout(cells: Sequence[Cell]) -> tuple[list[int], int]:
    """Offsets of `cells` packed in one message (aligned), and its length."""
    offs, pos = [], 0
    for c in cells:
        pos = -(-pos // ALIGN) * ALIGN
        offs.append(pos)
        pos += c.nbytes
    return offs, pos


# -- encoding (int64 arrays, no pickle) --------------------------------------------------------


def fingerprint(ckpt: Source) -> int:
    """What every rank must agree on to read each other's requests: the checkpoint's
    tensor names (their order indexes the requests), dtypes, shapes and save id."""
    text = "\n".join(f"{n}\0{ckpt.info(n).dtype}\0{ckpt.info(n).shape}" for n in ckpt.names())
    return zlib.crc32(f"{ckpt.save_id}\n{text}".encode())


def _encode_needs(needs: Sequence[Need], index: Mapping[str, int], print_: int) -> bytes:
    out = [print_, len(needs)]
    for n in needs:
        out += [index[n.name], n.box.ndim, *n.box.offset, *n.box.shape]
    return b"N" + np.asarray(out, dtype="<i8").tobytes()


def _decode_needs(data: bytes, names: Sequence[str], rank: int, where: str) -> list[Need]:
    try:
        a = np.frombuffer(data[1:], dtype="<i8").tolist()
        count, pos, out = a[1], 2, []
        for _ in range(count):
            i, nd = a[pos], a[pos + 1]
            off, shape = a[pos + 2 : pos + 2 + nd], a[pos + 2 + nd : pos + 2 + 2 * nd]
            if len(shape) != nd:
                raise ValueError("truncated")
            out.append(Need(names[i], L.Box(tuple(off), tuple(shape))))
            pos += 2 + 2 * nd
        if pos != len(a):
            raise ValueError("trailing data")
    except (ValueError, IndexError) as e:
        raise XckptError(
            f"{where}: the requests rank {rank} sent cannot be decoded ({e}); every rank must load the "
            "same checkpoint with the same xckpt version"
        ) from None
    return out


# -- the group's collectives --------------------------------------------------------------------


class _Comm:
    """The collectives of one read_once load, each waited for with `TIMEOUT_S`."""

    def __init__(self, group: Any, rank: int, world: int, where: str) -> None:
        dist = distributed()
        if dist is None:
            raise XckptError("internal: read_once needs an initialised process group")
        self.dist, self.group, self.rank, self.world, self.where = dist, group, rank, world, where
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def _global(self, r: int) -> int:
        return r if self.group is None else int(self.dist.get_global_rank(self.group, r))

    def _wait(self, works: Sequence[Any], what: str) -> None:
        wait_works(
            works,
            TIMEOUT_S,
            lambda e: f"{self.where}: loading with read_once, rank {self.rank} got no {what} within "
            f"{TIMEOUT_S:g} s ({type(e).__name__}: {e}): another rank stopped (it failed outside "
            "xckpt.torch.load, was killed, or did not call load with read_once=True); see the other ranks' logs",
        )

    def gather_ints(self, value: int, what: str) -> list[int]:
        out = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.world)]
        mine = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._wait([self.dist.all_gather(out, mine, group=self.group, async_op=True)], what)
        return [int(t.item()) for t in out]

    def gather_bytes(self, payload: bytes, what: str) -> list[bytes]:
        """Every rank's `payload`: one exchange of `GATHER_HEAD` bytes each (its length and
        its first bytes), and a second of the rest only when some payload is longer (each
        collective costs a round trip of every rank: about 4 ms on 4 gloo ranks here)."""
        heads = self._all_gather(torch.from_numpy(_framed(payload, GATHER_HEAD)), what)
        sizes = [_size(h) for h in heads]
        out = [h[8 : 8 + min(n, GATHER_HEAD)].tobytes() for h, n in zip(heads, sizes)]
        rest = max(sizes) - GATHER_HEAD
        if rest > 0:
            tails = self._all_gather(torch.from_numpy(_rest(payload, GATHER_HEAD, rest)), what)
            out = [o + t[: max(0, n - GATHER_HEAD)].tobytes() for o, t, n in zip(out, tails, sizes)]
        return out

    def broadcast_bytes(self, payload: bytes | None, src: int, what: str) -> bytes:
        """Rank `src`'s `payload` on every rank: one broadcast of `PLAN_HEAD` bytes (its
        length and its first bytes), and a second of the rest only when it is longer."""
        data = (payload or b"") if self.rank == src else b""
        got = self._broadcast(torch.from_numpy(_framed(data, PLAN_HEAD)), src, what)
        size = _size(got)
        out = got[8 : 8 + min(size, PLAN_HEAD)].tobytes()
        if size > PLAN_HEAD:
            out += self._broadcast(torch.from_numpy(_rest(data, PLAN_HEAD, size - PLAN_HEAD)), src, what).tobytes()
        return out

    def _broadcast(self, buf: torch.Tensor, src: int, what: str) -> np.ndarray:
        on = buf.to(self.device)
        self._wait([self.dist.broadcast(on, self._global(src), group=self.group, async_op=True)], what)
        return on.cpu().numpy()

    def _all_gather(self, mine: torch.Tensor, what: str) -> list[np.ndarray]:
        """Every rank's `mine` (a CPU tensor of the same size on every rank), as numpy arrays."""
        out = [torch.empty_like(mine, device=self.device) for _ in range(self.world)]
        self._wait([self.dist.all_gather(out, mine.to(self.device), group=self.group, async_op=True)], what)
        return [t.cpu().numpy() for t in out]

    def share(self, err: BaseException | None, what: str) -> None:
        """Every rank returns, or every rank raises (this rank's own error where it failed)."""
        flags = self.gather_ints(0 if err is None else 1, f"the outcome of {what}")
        if not any(flags):
            return
        msg = b"" if err is None else f"{type(err).__name__}: {err}".encode()
        msgs = self.gather_bytes(msg, f"the errors of {what}")
        if err is not None:
            raise err
        raise_for_ranks(
            [m.decode(errors="replace") if f else None for f, m in zip(flags, msgs)],
            XckptError,
            f"{self.where}: loading with read_once ({what})",
            "Every rank stopped; fix the failing rank's problem and load again",
        )

    def post(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, int]],
        pin: bool,
    ) -> tuple[list[Any], dict[int, torch.Tensor]]:
        """Start sending each `(rank, buffer)` and receiving `(rank, nbytes)`: the works to
        wait for (`received`) and the buffers the data arrive in."""
        dist = self.dist
        ops, got = [], {}
        on_host = self.device.type == "cpu"
        for src, n in recvs:
            buf = got[src] = (
                _host(n, pin)[0] if on_host else torch.empty(n, dtype=torch.uint8, device=self.device)
            )
            ops.append(dist.P2POp(dist.irecv, buf, self._global(src), self.group))
        for dst, buf in sends:
            ops.append(dist.P2POp(dist.isend, buf.to(self.device), self._global(dst), self.group))
        return (dist.batch_isend_irecv(ops) if ops else []), got

    def received(self, works: Sequence[Any], got: dict[int, torch.Tensor], what: str) -> dict[int, torch.Tensor]:
        """Wait for `post`'s works; the received buffers (CPU, pinned when `post` pinned them)."""
        if works:
            self._wait(works, what)
        return got if self.device.type == "cpu" else {r: b.to("cpu") for r, b in got.items()}


# -- one rank's side ---------------------------------------------------------------------------


class _Targets:
    """This rank's target parts by tensor name, and the copies into them (numpy copies
    into CPU memory, the copier for torch tensors elsewhere)."""

    def __init__(self, targets: Sequence[Target], copier: Copier, dtypes: Mapping[str, torch.dtype]) -> None:
        self.by_name: dict[str, list[tuple[L.Box, Any]]] = {}
        self.exact: dict[tuple[str, L.Box], Any] = {}  # whole parts (many small tensors): no search
        for name, box, out in targets:
            self.by_name.setdefault(name, []).append((box, out))
            self.exact[(name, box)] = out
        self.copier = copier
        self.dtypes = dtypes

    def part(self, name: str, box: L.Box) -> Any:
        """The view of this rank's target where `box` of `name` goes."""
        out = self.exact.get((name, box))
        if out is not None:
            return out
        for tbox, whole in self.by_name.get(name, ()):
            if tbox.contains(box):
                return _at(whole, box.slices(tbox))
        raise XckptError(f"internal: read_once has no target for {name!r} {box}")

    def fill(self, name: str, box: L.Box, src: np.ndarray) -> None:
        """Copy `src` (a numpy array of host memory) where `box` of `name` goes."""
        dst = self.part(name, box)
        if isinstance(dst, np.ndarray):
            np.copyto(dst, src, casting="no")
        else:
            self.copier.copy(dst, _torch_view(src, self.dtypes[name]))


def _at(out: Any, slices: tuple[slice, ...]) -> Any:
    """`out[slices]` as a view, also for a 0-d numpy array (whose `a[()]` is a scalar)."""
    return out[slices] if slices else out[...]


def _view(buf: np.ndarray, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Bytes `offset:` of `buf` (uint8) as an array of `shape` and `dtype`."""
    return buf[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)


def _torch_view(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """`a` as a torch tensor of `dtype` sharing its memory (ml_dtypes types included)."""
    if a.dtype.type.__module__.startswith("ml_dtypes"):
        return torch.from_numpy(a.view(np.dtype(f"u{a.dtype.itemsize}"))).view(dtype)
    return torch.from_numpy(a)


def _host(nbytes: int, pin: bool) -> tuple[torch.Tensor, np.ndarray]:
    """A host buffer (pinned when `pin`) as a uint8 tensor and its numpy view. An unpinned one
    is numpy's: numpy asks for transparent huge pages for large allocations (torch does not),
    and a fresh 32 MiB buffer's pages fault in 4x faster (5.8 ms against 22 here); every
    read_once load allocates its send, receive and scratch buffers afresh."""
    if pin:
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return t, t.numpy()
    raw = np.empty(nbytes, np.uint8)
    return torch.from_numpy(raw), raw


def load_once(
    ckpt: Source,
    targets: Sequence[Target],
    err: BaseException | None,
    *,
    group: Any,
    rank: int,
    world: int,
    ring: DeviceRing,
    show_progress: bool | None = None,
) -> int:
    """This rank's side of a read_once load (see the module); the bytes it read from storage.

    Args:
        ckpt: the checkpoint (opened alike on every rank).
        targets: this rank's target parts; a numpy view is filled with numpy copies, a
            torch tensor through `ring` (its copy hook or the device's side stream).
        err: this rank's failure before loading, shared with the others first.
        group, rank, world: the process group, this rank in it, its size.
        ring: the device pipeline for this rank's own (solo) reads.
        show_progress: a progress bar of the bytes this rank's targets received.

    Raises:
        XckptError: on every rank when any rank failed (a failing rank raises its own).
    """
    where = f"checkpoint {str(ckpt.path)!r}"
    comm = _Comm(group, rank, world, where)
    names = ckpt.names()
    payload = b"E" + f"{type(err).__name__}: {err}".encode() if err is not None else b""
    mine_print = fingerprint(ckpt)
    if err is None:
        index = {n: i for i, n in enumerate(names)}
        payload = _encode_needs([Need(n, b) for n, b, _o in targets], index, mine_print)
    msgs = comm.gather_bytes(payload, "every rank's requests")
    failed = [m[1:].decode(errors="replace") if m[:1] == b"E" else None for m in msgs]
    if err is not None:
        raise err
    raise_for_ranks(
        failed, XckptError, f"{where}: loading with read_once", "Every rank stopped before reading"
    )
    prints = [int(np.frombuffer(m[1:9], dtype="<i8")[0]) if len(m) >= 9 else None for m in msgs]
    if len(set(prints)) > 1:
        by: dict[Any, list[int]] = {}
        for r, p in enumerate(prints):
            by.setdefault(p, []).append(r)
        raise XckptError(
            f"{where}: loading with read_once, the ranks opened different checkpoints (tensor names, "
            f"dtypes, shapes or save ids differ): ranks {sorted(by.values())} agree among themselves. "
            "Every rank of the group must load the same checkpoint"
        )
    plan = _plan(ckpt, msgs, names, comm)
    used = {n for n, _b, _o in targets} | {n for rnd in plan.rounds for g in rnd for n, _b, _i in g.reads}
    dtypes = {t: torch_dtype(ckpt.info(t).dtype) for t in used}
    np_dtypes = {t: ckpt.info(t).np_dtype for t in dtypes}
    pin = (
        torch.cuda.is_available()
        and ring.copy is None
        and any(isinstance(o, torch.Tensor) and o.device.type == "cuda" for _n, _b, o in targets)
    )
    copier = Copier(ring.copy)
    mine = _Targets(targets, copier, dtypes)
    fail: BaseException | None = None
    total = sum(b.volume * dtypes[n].itemsize for n, b, _o in targets)
    with progress(total, f"{ckpt.format or 'xckpt'} load (read once)", show_progress) as bar:
        fail = _rounds(ckpt, plan, rank, comm, mine, copier, ring, np_dtypes, pin, bar)
    comm.share(fail, "loading")
    return plan.group_read_bytes(rank) + sum(b.volume * dtypes[n].itemsize for n, b in plan.solo[rank])


def _plan(ckpt: Source, msgs: Sequence[bytes], names: Sequence[str], comm: _Comm) -> Plan:
    """The load's plan (collective): `PLANNER` makes it from every rank's requests and
    broadcasts it; the others keep their part of it (`decode_plan`). Planning once
    instead of on every rank spares the others its CPU (4 ranks sharing 2 cores spent
    40-60 ms each planning a restore of 408 tensors). A rank whose part does not decode
    (ranks running different xckpt versions) raises; the others then fail after
    `TIMEOUT_S`, waiting for its messages."""
    where, rank = comm.where, comm.rank
    plan: Plan | None = None
    blob = b""
    err: BaseException | None = None
    if rank == PLANNER:
        try:
            decoded: dict[bytes, list[Need]] = {}  # replicas send alike: decoded once
            needs = [
                decoded.get(m) or decoded.setdefault(m, _decode_needs(m, names, r, where)) for r, m in enumerate(msgs)
            ]
            plan = make_plan(ckpt.info, ckpt.read_units, needs, holders=getattr(ckpt, "holders", None))
            blob = b"P" + encode_plan(plan, {n: i for i, n in enumerate(names)})
        except Exception as e:  # sent to every rank, raised below
            err = e
            blob = b"E" + f"{type(e).__name__}: {e}".encode()
    blob = comm.broadcast_bytes(blob, PLANNER, "the plan")
    if err is not None:
        raise err
    if plan is not None:
        return plan
    if blob[:1] != b"P":
        raise XckptError(
            f"{where}: loading with read_once, rank {PLANNER} could not plan the load "
            f"({blob[1:].decode(errors='replace')[:2000]}); every rank stopped before reading"
        )
    try:
        return decode_plan(blob[1:], names, rank)
    except ValueError as e:
        raise XckptError(
            f"{where}: loading with read_once, the plan rank {PLANNER} sent cannot be decoded on rank {rank} "
            f"({e}); every rank must load with the same xckpt version"
        ) from None


def _rounds(
    ckpt: Source,
    plan: Plan,
    rank: int,
    comm: _Comm,
    mine: _Targets,
    copier: Copier,
    ring: DeviceRing,
    dtypes: Mapping[str, np.dtype],
    pin: bool,
    bar: Any,
) -> BaseException | None:
    """Every round, this rank's solo reads while the first round's data travel (the other
    ranks wait for what this one reads and sends, not for its own parts; see the module);
    its failure, if any."""
    fail: BaseException | None = None
    solo_done = False

    def solo() -> BaseException | None:
        try:
            direct: list[tuple[str, L.Box, np.ndarray]] = []
            staged: list[tuple[str, L.Box, torch.Tensor]] = []
            for name, box in plan.solo[rank]:
                part = mine.part(name, box)
                (direct if isinstance(part, np.ndarray) else staged).append((name, box, part))
            if direct:
                ckpt.read_into(direct, show_progress=False)
            if staged:
                ring.run(ckpt, staged, show_progress=False)
            bar.update(sum(b.volume * dtypes[n].itemsize for n, b in plan.solo[rank]))
        except Exception as e:  # shared with every rank at the last exchange
            return e
        return None

    try:
        for k, rnd in enumerate(plan.rounds):
            what = f"round {k + 1} of {len(plan.rounds)}"
            sends_by, recvs_by = messages(rnd, rank)
            out: list[tuple[int, torch.Tensor]] = []
            scratch = None  # kept until the round's device copies out of it completed
            if fail is None:
                try:
                    out, scratch = _read_round(ckpt, rnd, rank, sends_by, mine, dtypes, pin)
                except Exception as e:
                    fail = e
            if fail is not None:  # the others still get a message of each planned length: the last
                # exchange of outcomes fails every rank, whatever it received
                out = [(dst, torch.zeros(_layout(cells)[1], dtype=torch.uint8)) for dst, cells in sends_by.items()]
            recvs = [(src, _layout(cells)[1]) for src, cells in recvs_by.items()]
            works, got = comm.post(out, recvs, pin)
            if not solo_done:
                solo_done = True
                fail = fail or solo()
            got = comm.received(works, got, f"the data of {what}")
            if fail is not None:
                continue  # nothing more to fill: this rank fails at the last exchange
            try:
                for src, cells in recvs_by.items():
                    buf = got[src].numpy()
                    for c, off in zip(cells, _layout(cells)[0]):
                        mine.fill(c.name, c.box, _view(buf, off, c.box.shape, dtypes[c.name]))
                wait_all(copier.mark())
                bar.update(sum(c.nbytes for g in rnd for c in g.cells if rank in c.ranks))
            except Exception as e:
                fail = fail or e
                wait_all(copier.mark())
            del scratch
        if not solo_done:
            fail = fail or solo()
    finally:
        copier.finish()
        wait_all(copier.mark())
    return fail


def _read_round(
    ckpt: Source,
    rnd: Sequence[Group],
    me: int,
    sends_by: Mapping[int, list[Cell]],
    mine: _Targets,
    dtypes: Mapping[str, np.dtype],
    pin: bool,
) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor]:
    """Read this rank's groups of the round and fill its own targets: the buffers to send,
    and the scratch buffer the reads went to (device copies out of it may still run).

    A read that is one cell needed by one other rank alone (a whole chunk of a part this
    rank holds for a rank that holds none) goes straight into that rank's send buffer;
    the others go to the scratch buffer and are copied from it."""
    groups = [g for g in rnd if g.reader == me]
    out: list[tuple[int, torch.Tensor]] = []
    made: dict[tuple[int, ...], tuple[torch.Tensor, np.ndarray, dict[int, int]]] = {}
    for dst, cells in sends_by.items():
        key = tuple(id(c) for c in cells)
        if key not in made:
            layout, total = _layout(cells)
            buf, raw = _host(total, False)
            made[key] = (buf, raw, {id(c): off for c, off in zip(cells, layout)})
        out.append((dst, made[key][0]))
    # the send buffer of each cell one rank alone needs (one buffer holds it); each
    # destination's buffer is looked up once, not once per cell (that was quadratic)
    send_of: dict[int, tuple[torch.Tensor, np.ndarray, dict[int, int]]] = {}
    for cells in sends_by.values():
        buffer = made[tuple(id(x) for x in cells)]
        send_of.update((id(c), buffer) for c in cells if len(c.ranks) == 1)
    direct: dict[tuple[int, int], np.ndarray] = {}  # (group, read) -> its view in a send buffer
    for g in groups:
        per_read: dict[int, list[Cell]] = {}
        for c in g.cells:
            per_read.setdefault(c.read, []).append(c)
        for j, cs in per_read.items():
            c = cs[0]
            if len(cs) == 1 and c.box == g.reads[j][1] and me not in c.ranks and len(c.ranks) == 1:
                _buf, raw, where = send_of[id(c)]
                direct[(id(g), j)] = _view(raw, where[id(c)], c.box.shape, dtypes[c.name])
    reads = [(g, j, name, box) for g in groups for j, (name, box, _i) in enumerate(g.reads)]
    offs, pos = [], 0
    for g, j, name, box in reads:
        offs.append(pos)
        if (id(g), j) not in direct:
            pos = -(-pos // ALIGN) * ALIGN
            offs[-1] = pos
            pos += box.volume * dtypes[name].itemsize
    keep, scratch = _host(pos, pin)
    views: dict[tuple[int, int], tuple[L.Box, np.ndarray]] = {}
    for (g, j, name, box), off in zip(reads, offs):
        at = direct.get((id(g), j))
        views[(id(g), j)] = (box, at if at is not None else _view(scratch, off, box.shape, dtypes[name]))
    ckpt.read_into([(name, box, views[(id(g), j)][1]) for g, j, name, box in reads], show_progress=False)

    def cell_data(g: Group, c: Cell) -> np.ndarray:
        box, view = views[(id(g), c.read)]
        return view if c.box == box else _at(view, c.box.slices(box))

    owner = {id(c): g for g in groups for c in g.cells}
    for g in groups:
        for c in g.cells:
            if me in c.ranks:
                mine.fill(c.name, c.box, cell_data(g, c))
    for cells in {tuple(id(c) for c in cells): cells for cells in sends_by.values()}.values():
        _buf, raw, where = made[tuple(id(c) for c in cells)]  # (a cell several ranks need: in each buffer)
        for c in cells:
            g = owner[id(c)]
            if (id(g), c.read) in direct:
                continue  # read straight into its place
            np.copyto(_view(raw, where[id(c)], c.box.shape, dtypes[c.name]), cell_data(g, c), casting="no")
    return out, keep
