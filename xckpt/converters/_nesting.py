"""Objects of foreign formats keep the shape their users see (DESIGN.md section 6).

A format that flattens a state dict into leaves (DCP's `optim.param_groups.0.lr`,
orbax's `cfg.lr`) presents every tensor-free subtree as one object under its
parent's name, as `dcp_to_torch_save` rebuilds it: `group_by_prefix` groups
object leaves by the shortest key path that holds no tensor, and `nest` builds
the subtree back from its leaves (integer keys `0..n-1` become a list, as
`torch.distributed.checkpoint`'s `set_element` makes them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from xckpt.errors import XckptError

__all__ = ["KeyPath", "group_by_prefix", "nest", "nest_paths"]

#: A key path in a nested state dict: dict keys (str) and list positions (int).
KeyPath = tuple[Any, ...]


def group_by_prefix(
    leaves: Mapping[str, KeyPath], tensors: Iterable[KeyPath], where: str
) -> dict[str, list[tuple[KeyPath, str]]]:
    """Object leaves grouped by object: `{object name: [(path below the object, leaf), ...]}`
    (`where` names the checkpoint in messages).

    An object is named by the shortest prefix of a leaf's key path that is no prefix of a
    tensor's path (joined with "."), so a subtree holding no tensor is one object.

    Raises:
        XckptError: an object's name is also a tensor's.
    """
    prefixes: set[KeyPath] = set()
    names: set[str] = set()
    for p in tensors:
        prefixes.update(p[:i] for i in range(1, len(p) + 1))
        names.add(".".join(map(str, p)))
    groups: dict[str, list[tuple[KeyPath, str]]] = {}
    for leaf, p in leaves.items():
        i = next((i for i in range(1, len(p) + 1) if p[:i] not in prefixes), len(p))
        name = leaf if i == len(p) else ".".join(map(str, p[:i]))
        if name in names:
            raise XckptError(f"{where}: {name!r} is both a tensor and an object")
        groups.setdefault(name, []).append((p[i:], leaf))
    return groups


def nest(values: list[tuple[KeyPath, Any]], name: str, where: str) -> Any:
    """One object from its leaves' `(path below it, value)`: a bare leaf, or nested
    dicts and lists (integer keys `0..n-1` make a list)."""
    if len(values) == 1 and values[0][0] == ():
        return values[0][1]
    if any(sub == () for sub, _ in values):
        raise XckptError(f"{where}: object {name!r} is both a leaf and a container")
    children: dict[Any, list[tuple[KeyPath, Any]]] = {}
    for sub, v in values:
        children.setdefault(sub[0], []).append((sub[1:], v))
    keys = list(children)
    if all(type(k) is int for k in keys) and sorted(keys) == list(range(len(keys))):
        return [nest(children[k], name, where) for k in range(len(keys))]
    return {k: nest(c, name, where) for k, c in children.items()}


def nest_paths(items: Iterable[tuple[KeyPath, Any]], where: str) -> dict[Any, Any]:
    """A nested state dict with each value at its key path, as torch's `set_element` builds
    it (a str key makes a dict, an int key a list padded with None).

    Raises:
        XckptError: a path runs through a value, or two paths name one place.
    """
    root: dict[Any, Any] = {}
    for path, value in items:
        if not path:
            raise XckptError(f"{where}: an empty key path")
        cur: Any = root
        for i in range(1, len(path)):
            key, nxt = path[i - 1], path[i]
            fresh: Any = [] if type(nxt) is int else {}
            if isinstance(cur, dict):
                cur = cur.setdefault(key, fresh)
            else:
                cur.extend([None] * (key + 1 - len(cur)))
                if cur[key] is None:
                    cur[key] = fresh
                cur = cur[key]
            if not isinstance(cur, (dict, list)) or isinstance(cur, list) != (type(nxt) is int):
                raise XckptError(f"{where}: {'.'.join(map(str, path))!r} runs through another value")
        key = path[-1]
        if isinstance(cur, list):
            if type(key) is not int:
                raise XckptError(f"{where}: {'.'.join(map(str, path))!r} runs through another value")
            cur.extend([None] * (key + 1 - len(cur)))
            if cur[key] is not None:
                raise XckptError(f"{where}: two values at {'.'.join(map(str, path))!r}")
        elif key in cur:
            raise XckptError(f"{where}: two values at {'.'.join(map(str, path))!r}")
        cur[key] = value
    return root
