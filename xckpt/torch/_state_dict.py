"""State dicts as flat names: nested dicts, lists and tuples joined with ".".

The torch counterpart of `xckpt.jax._tree`: `flatten` names every leaf and
remembers where it sits (`Slot`) so a load can put objects back; `PerRank` marks
a value that differs between ranks. No collectives, no I/O.

Key types. A name loses its keys' types ("optim.state.0.exp_avg": was the 0 an
int?), so a save records, in the manifest metadata under `KEYS_META`, the
containers whose keys are not plain strings: `{"optim.state": "int"}` (all keys
ints, as an optimizer's parameter ids), `"list"` (a list or tuple), `"leaves"`
(string keys, some holding ".", every value a leaf: a module's state dict, whose
"0.weight" names one tensor), or the keys themselves (`[0, "a.b"]`) where they
are mixed, or hold a "." above nested containers. `expand` uses them to rebuild
a subtree that a fresh job's target holds as an empty mapping; where nothing is
recorded (other writers), a name is split at every ".", keys as strings.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from xckpt.errors import XckptError

__all__ = ["KEYS_META", "PerRank", "Slot", "expand", "flatten", "iter_tensor_names", "unflatten"]

#: The manifest metadata key under which a torch save records its containers' key types.
KEYS_META = "torch_keys"


@dataclass
class PerRank:
    """Wrap a non-tensor value that differs between ranks (e.g. a data-loader state).

    On save each rank's own `value` is stored. On load, a `PerRank` placeholder
    receives `PerRank(<this rank's saved value>)`; at another world size that is
    an error unless the placeholder is `PerRank(all_ranks=True)`, which receives
    `PerRank([value of rank 0, value of rank 1, ...], all_ranks=True)`.
    """

    value: Any = None
    all_ranks: bool = False


@dataclass
class Slot:
    """Where a flattened leaf lives in the caller's structure (to put objects back)."""

    container: Any
    key: Any


def _holds_tensor(v: Any) -> bool:
    if isinstance(v, (torch.Tensor, np.ndarray)):
        return True
    if isinstance(v, Mapping):
        return any(_holds_tensor(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_tensor(x) for x in v)
    return False


def _key_spec(v: Any) -> Any:
    """How a flattened container's keys are typed (None: plain strings without ".")."""
    if isinstance(v, (list, tuple)):
        return "list"
    keys = list(v.keys())
    if keys and all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
        return "int"
    if all(isinstance(k, str) for k in keys):
        if all("." not in k for k in keys):
            return None
        if not any(isinstance(x, (Mapping, list, tuple)) and _holds_tensor(x) for x in v.values()):
            return "leaves"  # a module's state dict: "0.weight" names one leaf
    return [k if isinstance(k, int) and not isinstance(k, bool) else str(k) for k in keys]


def flatten(
    state: Mapping[str, Any], keys: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Slot]]:
    """Flatten nested dicts to "."-joined names (keys via `str`).

    Dicts, lists and tuples are flattened (lists by index) only when they hold a
    tensor somewhere inside; otherwise they are one leaf (an object), like every
    other non-tensor value. The same rule applied to the caller's structure on
    load gives the same names.

    Args:
        state: the state dict.
        keys: when given, receives the key types of the flattened containers that
            are not plain strings (see the module), by container name.

    Returns:
        `(leaves by name, slot by name)`.

    Raises:
        XckptError: two paths flatten to the same name.
    """
    leaves: dict[str, Any] = {}
    slots: dict[str, Slot] = {}

    def walk(prefix: str, container: Any, key: Any, v: Any) -> None:
        if isinstance(v, Mapping) and _holds_tensor(v):
            if keys is not None and (spec := _key_spec(v)) is not None:
                keys[prefix] = spec
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v, k, x)
            return
        if isinstance(v, (list, tuple)) and _holds_tensor(v):
            if keys is not None:
                keys[prefix] = "list"
            for i, x in enumerate(v):
                walk(f"{prefix}.{i}" if prefix else str(i), v, i, x)
            return
        if prefix in leaves:
            raise XckptError(
                f"two entries of the state dict flatten to the name {prefix!r} (a key that "
                "contains '.' next to a nested dict); rename one of them"
            )
        leaves[prefix] = v
        slots[prefix] = Slot(container, key)

    if not isinstance(state, Mapping):
        raise XckptError(f"state_dict must be a dict, got {type(state).__name__}")
    if keys is not None and (top := _key_spec(state)) is not None:
        keys[""] = top
    for k, v in state.items():
        walk(str(k), state, k, v)
    return leaves, slots


def iter_tensor_names(leaves: Mapping[str, Any]) -> Iterator[str]:
    for n, v in leaves.items():
        if isinstance(v, (torch.Tensor, np.ndarray)):
            yield n


def _check_keys(keys: Any, where: str) -> Mapping[str, Any]:
    """The recorded key types (see the module), checked."""
    if keys is None:
        return {}
    ok = isinstance(keys, Mapping) and all(
        isinstance(k, str)
        and (v in ("int", "list", "leaves") or (isinstance(v, list) and all(isinstance(x, (int, str)) for x in v)))
        for k, v in keys.items()
    )
    if not ok:
        raise XckptError(
            f"checkpoint {where!r}: its metadata {KEYS_META!r} is not a map of container names to "
            '"int", "list", "leaves" or a list of keys; it was not written by xckpt.torch.save. Load into a '
            "target that holds every entry (not an empty mapping)"
        )
    return keys


def _split(prefix: str, name: str, spec: Any) -> tuple[Any, str]:
    """The key under `prefix` that stored `name` sits at, and that child's name."""
    rest = name[len(prefix) + 1 :] if prefix else name
    if spec == "leaves":
        return rest, name
    if isinstance(spec, list):
        by_str = {str(k): k for k in spec}
        parts = rest.split(".")
        for j in range(len(parts), 0, -1):  # the longest recorded key that matches
            head = ".".join(parts[:j])
            if head in by_str:
                return by_str[head], f"{prefix}.{head}" if prefix else head
    head = rest.split(".", 1)[0]
    child = f"{prefix}.{head}" if prefix else head
    if spec in ("int", "list") and head.lstrip("-").isdigit():
        return int(head), child
    return head, child


def _build(
    prefix: str,
    names: list[str],
    keys: Mapping[str, Any],
    leaf: Callable[[str], Any],
    into: Any,
    flat: dict[str, Any],
    slots: dict[str, Slot],
) -> None:
    """Put the stored entries `names` (all under `prefix`) into the empty `into`."""
    spec = keys.get(prefix)
    groups: dict[Any, tuple[str, list[str]]] = {}
    for n in names:
        k, child = _split(prefix, n, spec)
        groups.setdefault(k, (child, []))[1].append(n)
    if isinstance(into, list):
        ints = [k for k in groups if isinstance(k, int) and k >= 0]
        into.extend([None] * ((max(ints) + 1) if ints else 0))
    for k, (child, below) in groups.items():
        if below == [child]:
            value = leaf(child)
            flat[child], slots[child] = value, Slot(into, k)
        else:
            value = [] if keys.get(child) == "list" else {}
            _build(child, [n for n in below if n != child], keys, leaf, value, flat, slots)
        into[k] = value


def _device_near(flat: Mapping[str, Any], name: str) -> Any:
    """The device of the target tensors nearest `name` (same parent first); None: CPU."""
    tensors = [(n, v) for n, v in flat.items() if isinstance(v, torch.Tensor)]
    parts = name.split(".")
    for j in range(len(parts) - 1, -1, -1):
        p = ".".join(parts[:j])
        for n, v in tensors:
            if not p or n.startswith(p + "."):
                return v.device
    return None


def expand(
    flat: dict[str, Any],
    slots: dict[str, Slot],
    stored: list[str],
    keys: Any,
    leaf: Callable[[str, Any], Any],
    where: str,
) -> None:
    """Fill what a fresh job's target leaves out: mappings the checkpoint holds a subtree for.

    A target leaf that the checkpoint does not hold by name, is a mapping (or a
    list), and has stored entries under its name is replaced by its entries: an
    empty one receives every stored entry under it (keys typed as recorded at
    save, nested dicts and lists rebuilt); a non-empty one is opened and each of
    its entries treated the same way (so it is filled only where it has entries). Mutates
    `flat` and `slots` (new leaves and where they go) and the caller's mappings.

    Args:
        flat, slots: the target, flattened (`flatten`).
        stored: every tensor and object name of the checkpoint, in its order.
        keys: the checkpoint's recorded key types (metadata `KEYS_META`, or None).
        leaf: `leaf(name, device)` gives the placeholder of stored entry `name`:
            a tensor to read into (on `device`: that of the target's tensors
            nearest the mapping, None for CPU), or None for an object.
        where: the checkpoint, for messages.

    Raises:
        XckptError: a mapping to fill cannot be changed, or `keys` is malformed.
    """
    have = set(stored)
    order = {n: i for i, n in enumerate(stored)}
    ordered = sorted(stored)

    def under(prefix: str) -> list[str]:
        lo = bisect.bisect_left(ordered, prefix + ".")
        hi = bisect.bisect_left(ordered, prefix + "/")  # "/" sorts right after "."
        return sorted(ordered[lo:hi], key=order.__getitem__)  # in the checkpoint's order

    todo = [n for n, v in flat.items() if isinstance(v, (Mapping, list, tuple)) and n not in have and under(n)]
    if not todo:
        return
    checked = _check_keys(keys, where)
    for name in todo:
        device = _device_near(flat, name)
        slots.pop(name)
        _open(name, flat.pop(name), under, have, checked, functools.partial(_at, leaf, device), flat, slots)


def _at(leaf: Callable[[str, Any], Any], device: Any, name: str) -> Any:
    return leaf(name, device)


def _open(
    name: str,
    mapping: Any,
    under: Callable[[str], list[str]],
    have: set[str],
    keys: Mapping[str, Any],
    leaf: Callable[[str], Any],
    flat: dict[str, Any],
    slots: dict[str, Slot],
) -> None:
    if not hasattr(mapping, "__setitem__"):
        raise XckptError(
            f"target {name!r} is a read-only {type(mapping).__name__}; the checkpoint holds entries under "
            "it, which cannot be put there. Pass a dict"
        )
    if not mapping:
        _build(name, under(name), keys, leaf, mapping, flat, slots)
        return
    for k, x in list(mapping.items() if isinstance(mapping, Mapping) else enumerate(mapping)):
        child = f"{name}.{k}"
        if isinstance(x, (Mapping, list, tuple)) and child not in have and under(child):
            _open(child, x, under, have, keys, leaf, flat, slots)
        else:
            flat[child], slots[child] = x, Slot(mapping, k)


def unflatten(values: Mapping[str, Any], keys: Any, where: str) -> dict[str, Any]:
    """The nested state dict whose `flatten` gave `values` (by name, in saved order),
    its containers' keys typed as `keys` records (see the module)."""
    out: dict[str, Any] = {}
    flat: dict[str, Any] = {}
    slots: dict[str, Slot] = {}
    _build("", list(values), _check_keys(keys, where), values.__getitem__, out, flat, slots)
    return out
