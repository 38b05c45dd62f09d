"""torch dtypes <-> the manifest's dtype names, and zero-copy numpy views of CPU tensors.

One table: every name in `xckpt.manifest.DTYPES` is also the name of a
torch dtype (`torch.bfloat16`, `torch.float8_e4m3fn`, ...), so the mapping is
built from that tuple, and a dtype added to the manifest is added here too.
dtypes numpy lacks (bfloat16, the float8s) are viewed through a same-width
unsigned int, then as their ml_dtypes type (`xckpt.manifest.numpy_dtype`).
"""

from __future__ import annotations

import numpy as np
import torch

from xckpt.errors import ObjectError, XckptError
from xckpt.manifest import DTYPES, numpy_dtype

__all__ = ["dtype_name", "torch_dtype", "as_numpy"]

_DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in DTYPES}
_NAMES: dict[torch.dtype, str] = {t: n for n, t in _DTYPES.items()}
_UINT = {1: torch.uint8, 2: torch.uint16}
# Names whose numpy dtype is an ml_dtypes extension type: torch cannot hand those
# to numpy directly. (Their numpy kind varies: "V" for most, "f" for float8_e5m2.)
_BITS: dict[str, torch.dtype] = {
    n: _UINT[numpy_dtype(n).itemsize] for n in DTYPES if numpy_dtype(n).type.__module__.startswith("ml_dtypes")
}


def dtype_name(dtype: torch.dtype, name: str = "<tensor>") -> str:
    """The manifest dtype name of a torch dtype.

    Raises:
        ObjectError: xckpt cannot store the dtype, naming the tensor.
    """
    n = _NAMES.get(dtype)
    if n is None:
        raise ObjectError(
            f"tensor {name!r} has dtype {dtype}, which xckpt cannot store; supported: "
            f"{', '.join(DTYPES)}. Cast it before saving"
        )
    return n


def known_dtype_name(dtype: torch.dtype) -> str | None:
    """The manifest dtype name of a torch dtype, or None when xckpt cannot store it."""
    return _NAMES.get(dtype)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a manifest dtype name."""
    return _DTYPES[name]


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view (no copy) of a CPU tensor, bf16/float8 as ml_dtypes."""
    t = t.detach()
    if t.device.type != "cpu":
        raise XckptError(f"internal: as_numpy needs a CPU tensor, got one on {t.device}")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    n = _NAMES.get(t.dtype)
    bits = _BITS.get(n) if n is not None else None
    if n is None or bits is None:
        return t.numpy()
    return t.view(bits).numpy().view(numpy_dtype(n))
