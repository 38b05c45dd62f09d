"""The torch adapter's distributed helpers: who this rank is, and one outcome exchange.

`share_outcome` is the one place ranks tell each other whether their
part worked. `xckpt.torch.save` (after writing), the value-group load (before
filling any target) and [`xckpt.torch.redistribute_by_value`][xckpt.torch.redistribute_by_value] (before
moving rows) call it on every rank of the group, in the same order as their
other collectives; every rank returns, or every rank raises (the failing rank
its own error, the others one naming the failing ranks), so no rank is left
waiting in a later collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from xckpt.errors import XckptError

__all__ = ["distributed", "rank_world", "share_outcome", "raise_for_ranks"]


def distributed() -> Any:
    """`torch.distributed` when a process group is initialised, else None."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_world(process_group: Any) -> tuple[int, int, Callable[[int], int]]:
    """(rank, world size, global->group rank function) without any collective.

    Raises:
        XckptError: a group is given but torch.distributed is not initialised,
            or this rank is not in the group.
    """
    dist = distributed()
    if dist is None:
        if process_group is not None:
            raise XckptError("a process_group was given but torch.distributed is not initialised")
        return 0, 1, lambda g: 0 if g == 0 else -1
    rank = dist.get_rank(process_group)
    world = dist.get_world_size(process_group)
    if rank < 0:
        raise XckptError("this rank is not a member of the process_group passed to xckpt.torch")
    if process_group is None:
        return rank, world, lambda g: g if 0 <= g < world else -1

    def group_rank(g: int) -> int:
        try:
            return dist.get_group_rank(process_group, g)
        except (ValueError, RuntimeError):
            return -1

    return rank, world, group_rank


def raise_for_ranks(msgs: Sequence[str | None], error: type[Exception], what: str, fix: str) -> None:
    """Raise `error` naming every rank whose exchanged outcome `msgs[r]` is a failure."""
    bad = {r: m for r, m in enumerate(msgs) if m is not None}
    if bad:
        raise error(
            f"{what} failed on ranks {sorted(bad)}: "
            + "; ".join(f"rank {r}: {m}" for r, m in sorted(bad.items()))
            + f". {fix}"
        )


def share_outcome(
    err: BaseException | None,
    *,
    group: Any,
    world: int,
    error: type[Exception],
    what: str,
    fix: str,
) -> None:
    """Exchange this rank's outcome with every rank of `group`; raise on all if any failed.

    One `all_gather_object` of `None` or `"<Type>: <message>"`. With
    `world <= 1` or no initialised process group nothing is sent.

    Args:
        err: this rank's failure, or None.
        group: the process group (None: world).
        world: its size; pass 1 for a save that must not talk (rank-local).
        error: raised on the ranks that succeeded when another failed.
        what, fix: the message: "<what> failed on ranks [...]: rank r: ... . <fix>".

    Raises:
        BaseException: `err` itself on the rank that failed.
        error: on the others, naming every failing rank and its message.
    """
    dist = distributed() if world > 1 else None
    if dist is None:
        if err is not None:
            raise err
        return
    msgs: list[Any] = [None] * world
    dist.all_gather_object(msgs, None if err is None else f"{type(err).__name__}: {err}", group=group)
    if err is not None:
        raise err
    raise_for_ranks(msgs, error, what, fix)
