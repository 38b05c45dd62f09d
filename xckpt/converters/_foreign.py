"""Inert placeholders for pickled classes outside the allow-list, and their opt-in rebuild.

A torch.save file's `data.pkl` may hold values of classes that are not on xckpt's
allow-list: an `argparse.Namespace` of training arguments, numpy scalars and RNG
states, `torch.device`, a user's own class (Lightning `.ckpt` files hold several).
Refusing the file would hide its tensors; running those classes' code would run
whatever the file names. So the restricted unpickler, asked with `foreign=True`,
answers every global outside the allow-list with a *placeholder class*
(`placeholder`): a class of this module, named after the global, that
records what the pickle does with it and calls nothing:

* calling it (`REDUCE`: a constructor, a function such as
  `numpy._core.multiarray.scalar`), creating an instance of it (`NEWOBJ`), or
  calling such a result, makes a `Foreign` instance holding the arguments;
* `BUILD` (`__setstate__`), `SETITEM(S)`, `APPEND(S)` and `ADDITEMS` on an
  instance are recorded in order.

Nothing of the foreign class runs: its module is not imported, no `__reduce__`
callable, constructor or `__setstate__` of it is called. The records are plain
data, bounded by the pickle's size.

`holds_foreign` says whether a value holds a placeholder (the source lists
such objects as pickled). `rebuild` turns a value holding placeholders into
the real objects by replaying the records with the real classes, exactly as
`pickle` would have (`find_class` with protocol 2's name fixes, the callable
with its arguments, `cls.__new__`, `__setstate__` or the instance dict,
items and appends): **this runs the code the file names**, and is called only for
the objects a caller asked for on a source opened with `allow_pickle=True`.
"""

from __future__ import annotations

import _compat_pickle
import importlib
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from xckpt.errors import XckptError
from xckpt.manifest import MAX_OBJECT_DEPTH

__all__ = ["Foreign", "placeholder", "holds_foreign", "find_foreign", "rebuild", "describe"]



class Foreign:
    """An instance the pickle made from a placeholder: how it was made, and what was done to it.

    `_how` is `("new", cls, args, kwargs)` (`NEWOBJ`), `("call", cls, args, kwargs)`
    (`REDUCE` of a placeholder class) or `("call", obj, args, kwargs)` (a call of another
    instance); `_ops` lists `("build", state)`, `("setitem", key, value)`,
    `("append", x)`, `("extend", items)` and `("add", x)` in the order the pickle did them.
    """

    #: The global a placeholder class stands for (set on each placeholder class).
    _global: tuple[str, str] = ("", "")

    def __new__(cls, *args: Any, **kwargs: Any) -> Foreign:
        obj = object.__new__(cls)
        object.__setattr__(obj, "_how", ("new", cls, args, kwargs))
        object.__setattr__(obj, "_ops", [])
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Only a call of the class (REDUCE) runs __init__; NEWOBJ stops at __new__.
        object.__setattr__(self, "_how", ("call", type(self), args, kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> Foreign:
        obj = object.__new__(Foreign)
        object.__setattr__(obj, "_how", ("call", self, args, kwargs))
        object.__setattr__(obj, "_ops", [])
        return obj

    def __setstate__(self, state: Any) -> None:
        self._ops.append(("build", state))

    def __setitem__(self, key: Any, value: Any) -> None:
        self._ops.append(("setitem", key, value))

    def append(self, x: Any) -> None:
        self._ops.append(("append", x))

    def extend(self, items: Any) -> None:
        self._ops.append(("extend", list(items)))

    def add(self, x: Any) -> None:
        self._ops.append(("add", x))

    def __repr__(self) -> str:
        return f"<placeholder of {describe(self)}>"

    _how: tuple[Any, ...]
    _ops: list[tuple[Any, ...]]


def placeholder(module: str, name: str) -> type[Foreign]:
    """A fresh placeholder class for the global `module.name` (what `find_class` returns)."""
    safe = "".join(c if c.isalnum() or c == "_" else "_" for c in name) or "foreign"
    return type(safe, (Foreign,), {"_global": (module, name), "__module__": __name__, "__slots__": ()})


def _is_placeholder_class(v: Any) -> bool:
    return isinstance(v, type) and issubclass(v, Foreign) and v is not Foreign


def describe(v: Any) -> str:
    """The foreign class a placeholder stands for, as `module.name` (for messages)."""
    if _is_placeholder_class(v):
        return ".".join(v._global)
    if isinstance(v, Foreign):
        kind, made_by = v._how[0], v._how[1]
        if isinstance(made_by, Foreign):
            return f"a call of {describe(made_by)}"
        return describe(made_by) if kind == "new" else f"{describe(made_by)}(...)"
    return type(v).__name__


def holds_foreign(value: Any) -> bool:
    """Whether `value` holds a placeholder anywhere (containers walked, keys included)."""
    return find_foreign(value) is not None


def find_foreign(value: Any) -> Any:
    """The first placeholder found in `value` (containers walked, keys included), or None."""
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, Foreign) or _is_placeholder_class(v):
            return v
        if depth > MAX_OBJECT_DEPTH:
            return v  # deeper than any reader walks: never returned bare
        if isinstance(v, (dict, list, tuple, set, frozenset)):
            if id(v) in seen:
                continue
            seen.add(id(v))
            items = [x for kv in v.items() for x in kv] if isinstance(v, dict) else list(v)
            stack.extend((x, depth + 1) for x in items)
            extra = getattr(v, "__dict__", None)  # attributes a pickle set on an OrderedDict
            if extra:
                stack.append((dict(extra), depth + 1))
    return None


def _find_class(module: str, name: str, where: str) -> Any:
    """The real global, as `pickle.Unpickler.find_class` finds it (protocol 2 names
    fixed, dotted names followed). Imports `module`: this runs its code."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise XckptError(
            f"{where}: the pickled object needs {module}.{name}, which cannot be imported here "
            f"({type(e).__name__}: {e}); install what defines it to read this object"
        ) from None
    return obj


def _build(inst: Any, state: Any) -> None:
    """`BUILD`, as pickle does it: `__setstate__`, else the instance dict and slots."""
    setstate = getattr(inst, "__setstate__", None)
    if setstate is not None:
        setstate(state)
        return
    slotstate = None
    if isinstance(state, tuple) and len(state) == 2:
        state, slotstate = state
    if state:
        d = inst.__dict__
        for k, v in state.items():
            d[sys.intern(k) if type(k) is str else k] = v
    if slotstate:
        for k, v in slotstate.items():
            setattr(inst, k, v)


def rebuild(value: Any, where: str, leaf: Callable[[Any], Any] = lambda v: v) -> Any:
    """`value` with every placeholder replaced by the real object, made as pickle would
    make it; `leaf` maps other leaves (tensor references to arrays). Shared and
    self-referencing objects stay shared.

    THIS RUNS CODE: it imports the foreign classes' modules and calls their constructors,
    reduce callables and `__setstate__`. Call it only for a caller who opened the
    checkpoint with `allow_pickle=True`.

    Raises:
        XckptError: a class cannot be imported, or rebuilding an object fails (the
            error names it and keeps the original as its cause).
    """
    memo: dict[int, Any] = {}

    def go(v: Any, depth: int) -> Any:
        if depth > MAX_OBJECT_DEPTH:
            raise XckptError(f"{where}: the pickled object is nested deeper than {MAX_OBJECT_DEPTH} levels")
        key = id(v)
        if key in memo:
            return memo[key]
        if _is_placeholder_class(v):
            module, name = v._global
            out = memo[key] = _find_class(module, name, where)
            return out
        if isinstance(v, Foreign):
            return made(v, depth)
        if isinstance(v, (dict, OrderedDict)):
            d = memo[key] = type(v)() if type(v) in (dict, OrderedDict) else {}
            for k, x in v.items():
                d[go(k, depth + 1)] = go(x, depth + 1)
            extra = getattr(v, "__dict__", None)
            if extra:
                d.__dict__.update(go(dict(extra), depth + 1))
            return d
        if isinstance(v, list):
            lst = memo[key] = []
            lst.extend(go(x, depth + 1) for x in v)
            return lst
        if isinstance(v, tuple):
            out = memo[key] = tuple(go(x, depth + 1) for x in v)
            return out
        if isinstance(v, (set, frozenset)):
            out = memo[key] = type(v)(go(x, depth + 1) for x in v)
            return out
        return leaf(v)

    def made(f: Foreign, depth: int) -> Any:
        kind, made_by, args, kwargs = f._how
        what = describe(f)
        try:
            fn = go(made_by, depth + 1)
            a = go(args, depth + 1)
            kw = go(kwargs, depth + 1)
            inst = fn.__new__(fn, *a, **kw) if kind == "new" else fn(*a, **kw)
            memo[id(f)] = inst
            for op in f._ops:
                if op[0] == "build":
                    _build(inst, go(op[1], depth + 1))
                elif op[0] == "setitem":
                    inst[go(op[1], depth + 1)] = go(op[2], depth + 1)
                elif op[0] == "append":
                    inst.append(go(op[1], depth + 1))
                elif op[0] == "extend":
                    items = go(op[1], depth + 1)
                    if hasattr(inst, "extend"):
                        inst.extend(items)
                    else:
                        for x in items:
                            inst.append(x)
                else:
                    inst.add(go(op[1], depth + 1))
        except XckptError:
            raise
        except Exception as e:  # noqa: BLE001 - the object's own code failed: say which object
            raise XckptError(f"{where}: rebuilding the pickled {what} failed ({type(e).__name__}: {e})") from e
        return inst

    return go(value, 0)
