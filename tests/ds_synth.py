"""DeepSpeed-shaped ZeRO 1/2 checkpoints written with ``torch.save``, without DeepSpeed.

The files have the structure of the real ones (``tests/fixtures_foreign/deepspeed/README.md``):
``mp_rank_00_model_states.pt`` (module, buffer_names, param_shapes, ...), one
``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank holding its slice of every
group's flat fp32 buffer (``single_partition_of_fp32_groups``), the base optimizer's flat
``exp_avg`` / ``exp_avg_sq`` / ``step`` per group, ``param_slice_mappings`` of
``fragment_address`` records, a ``LossScaler`` and a ``ZeroStageEnum``; and ``latest``.
DeepSpeed's helper classes are pickled under their real names from stand-in modules that
exist only while :func:`write_zero` runs (DeepSpeed is never imported).

Used by ``tests/test_fmt_deepspeed.py`` (the conformance checkpoint) and
``bench/deepspeed_memory.py`` (a large one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import os
import sys
import types
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

_MODULES = {
    "deepspeed.runtime.fp16.loss_scaler": "LossScaler",
    "deepspeed.runtime.zero.config": "ZeroStageEnum",
    "deepspeed.utils.tensor_fragment": "fragment_address",
}


@contextlib.contextmanager
def deepspeed_classes() -> Iterator[dict[str, Any]]:
    """Stand-in modules named as DeepSpeed's, holding classes named as DeepSpeed's, while inside."""
    names = sorted({".".join(m.split(".")[: i + 1]) for m in _MODULES for i in range(m.count(".") + 1)})
    if any(n in sys.modules for n in names):
        raise RuntimeError("a deepspeed module is already imported; write synthetic checkpoints without it")

    class LossScaler:
        def __init__(self) -> None:
            self.cur_scale = 1.0
            self.dynamic = False

    class ZeroStageEnum(int, enum.Enum):
        disabled = 0
        optimizer_states = 1
        gradients = 2
        weights = 3

    @dataclasses.dataclass
    class fragment_address:  # noqa: N801 - DeepSpeed's name
        numel: int
        start: int

    classes = {"LossScaler": LossScaler, "ZeroStageEnum": ZeroStageEnum, "fragment_address": fragment_address}
    mods = {n: types.ModuleType(n) for n in names}
    for module, name in _MODULES.items():
        cls = classes[name]
        cls.__module__, cls.__qualname__ = module, name
        setattr(mods[module], name, cls)
    sys.modules.update(mods)
    try:
        yield classes
    finally:
        for n in names:
            sys.modules.pop(n, None)


def _torch(a: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.array(a, order="C", copy=True))


def write_zero(
    path: str,
    groups: Sequence[Mapping[str, np.ndarray]],
    *,
    world: int = 2,
    stage: int = 2,
    buffers: Mapping[str, np.ndarray] | None = None,
    moments: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    step: float = 3.0,
    client_state: Mapping[str, Any] | None = None,
    bf16: bool = False,
    tag: str = "global_step3",
    frozen: Mapping[str, np.ndarray] | None = None,
    shared: Mapping[str, str] | None = None,
) -> str:
    """Write a ZeRO ``stage`` (1 or 2) checkpoint at ``path`` (the directory holding ``latest``).

    Args:
        groups: per parameter group, parameter name -> fp32 master weight (in order).
        buffers: buffer name -> value (saved in ``module`` as given).
        moments: parameter name -> {"exp_avg": ..., "exp_avg_sq": ...} (default: zeros).
        client_state: extra top-level entries of the model states (``engine.save_checkpoint``'s
            ``client_state``).
        frozen: frozen parameters (``requires_grad=False``): whole in the model states
            (``frozen_param_shapes`` / ``frozen_param_fragments``), not in the optimizer.
        shared: tied aliases, alias -> the parameter it shares storage with (``shared_params``).

    Returns:
        The tag directory.
    """
    import torch

    buffers = dict(buffers or {})
    d = os.path.join(path, tag)
    os.makedirs(d, exist_ok=True)
    with deepspeed_classes() as ds:
        parts: list[list[dict[str, Any]]] = [[] for _ in range(world)]  # per rank, per group
        mappings: list[list[dict[str, Any]]] = [[] for _ in range(world)]
        for params in groups:
            numel = sum(int(np.prod(a.shape)) for a in params.values())
            per_rank = max(1, math.ceil(numel / world))
            flats: dict[str, np.ndarray] = {}
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                flat = np.zeros(per_rank * world, np.float32)
                off = 0
                for name, a in params.items():
                    n = int(np.prod(a.shape))
                    src = (
                        a
                        if key == "fp32"
                        else (moments or {}).get(name, {}).get(key, np.zeros(a.shape, np.float32))
                    )
                    flat[off : off + n] = np.asarray(src, np.float32).reshape(-1)
                    off += n
                flats[key] = flat
            for r in range(world):
                parts[r].append({k: _torch(v[r * per_rank : (r + 1) * per_rank]) for k, v in flats.items()})
                m, off = {}, 0
                for name, a in params.items():
                    n = int(np.prod(a.shape))
                    lo, hi = max(off, r * per_rank), min(off + n, (r + 1) * per_rank)
                    if lo < hi:
                        m[name] = ds["fragment_address"](numel=hi - lo, start=lo - r * per_rank)
                    off += n
                mappings[r].append(m)
        ngroups = len(groups)
        cfg = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}}
        if bf16:
            cfg["bf16"] = {"enabled": True}
        for r in range(world):
            osd = {
                "loss_scaler": ds["LossScaler"](),
                "dynamic_loss_scale": False,
                "overflow": False,
                "clip_grad": 1.0,
                "base_optimizer_state": {
                    "state": {
                        g: {
                            "step": torch.tensor(step),
                            "exp_avg": parts[r][g]["exp_avg"],
                            "exp_avg_sq": parts[r][g]["exp_avg_sq"],
                        }
                        for g in range(ngroups)
                    },
                    "param_groups": [
                        {"lr": 0.01, "betas": (0.9, 0.999), "params": [g]} for g in range(ngroups)
                    ],
                },
                "single_partition_of_fp32_groups": [parts[r][g]["fp32"] for g in range(ngroups)],
                "zero_stage": ds["ZeroStageEnum"](stage),
                "group_paddings": [0] * ngroups,
                "partition_count": [world] * ngroups,
                "ds_version": "0.19.8",
                "param_slice_mappings": mappings[r],
            }
            name = f"{'bf16_' if bf16 else ''}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
            torch.save(
                {"optimizer_state_dict": osd, "ds_config": cfg, "ds_version": "0.19.8"}, os.path.join(d, name)
            )
    module: dict[str, Any] = {}
    for params in groups:
        for name, a in params.items():
            t = _torch(a)
            module[name] = t.to(torch.bfloat16) if bf16 else t
    module.update({k: _torch(v) for k, v in buffers.items()})
    states = {
        "module": module,
        "buffer_names": list(buffers),
        "optimizer": None,
        "param_shapes": [
            OrderedDict((n, torch.Size(a.shape)) for n, a in params.items()) for params in groups
        ],
        "frozen_param_shapes": OrderedDict((n, torch.Size(a.shape)) for n, a in (frozen or {}).items()),
        "shared_params": dict(shared or {}),
        "frozen_param_fragments": {n: _torch(a) for n, a in (frozen or {}).items()},
        "ds_version": "0.19.8",
        **dict(client_state or {}),
    }
    torch.save(states, os.path.join(d, "mp_rank_00_model_states.pt"))
    with open(os.path.join(path, "latest"), "w") as f:
        f.write(tag)
    return d
