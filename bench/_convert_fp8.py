"""The fp8 source and the per-file torch dequantization of ``bench/convert_scale.py``.

- `make_fp8_source`: a DeepSeek-V3 style block-scaled fp8 Hugging Face directory, written by
  ``safetensors.torch.save_file``: per file (one "layer") float8_e4m3fn matrices with
  float32 ``*.weight_scale_inv`` per 128 x 128 block, some shapes not multiples of 128
  (8200 rows or columns; the 576-row ``kv_a_proj_with_mqa``), bfloat16 norms, and in the
  first file a bfloat16 embedding.
- `dequant`: what a user writes today in a per-file script, DeepSeek's ``weight_dequant``
  math (inference/kernel.py: ``float32(w) * s`` of the tile, stored to bfloat16) in torch on
  the CPU, in its fast broadcast form: the scales repeated along the columns (a 1/128-size
  tensor), multiplied over whole 128-row tiles, the last partial tile on its own. Scale
  tensors leave the state dict; everything else passes unchanged.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

BLOCK = 128
#: name in a layer -> (shape, fp8?); 8200 = 64 x 128 + 8 and 576 = 4.5 x 128 make partial tiles.
LAYER: list[tuple[str, tuple[int, ...], bool]] = [
    ("mlp.gate_proj.weight", (8200, 7168), True),
    ("mlp.up_proj.weight", (8200, 7168), True),
    ("mlp.down_proj.weight", (7168, 8200), True),
    ("self_attn.q_a_proj.weight", (1536, 7168), True),
    ("self_attn.kv_a_proj_with_mqa.weight", (576, 7168), True),
    ("input_layernorm.weight", (7168,), False),
    ("post_attention_layernorm.weight", (7168,), False),
    ("self_attn.kv_a_layernorm.weight", (512,), False),
]
EMBED = ("model.embed_tokens.weight", (8200, 7168))
#: The largest tensor of the bfloat16 output (an 8200 x 7168 matrix).
LARGEST_OUT = 8200 * 7168 * 2


def _layer_bytes() -> int:
    """fp8 bytes of one layer (the source's size is counted in these)."""
    return sum(math.prod(shape) for _, shape, fp8 in LAYER if fp8)


def make_fp8_source(path: str, size_gb: float) -> tuple[int, int]:
    """Write the directory; return (its tensor bytes, the bytes of its bfloat16 output)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    files = max(2, 2 * round(size_gb * 1e9 / _layer_bytes() / 2))  # even: 2 processes get equal shares
    os.makedirs(path)
    weight_map: dict[str, str] = {}
    total = out = 0
    for i in range(files):
        rng = np.random.default_rng(1000 + i)
        sd: dict[str, Any] = {}
        if i == 0:
            sd[EMBED[0]] = torch.from_numpy(rng.integers(0, 0x3F80, EMBED[1], dtype=np.uint16).view(np.int16)).view(
                torch.bfloat16)
        for name, shape, fp8 in LAYER:
            key = f"model.layers.{i}.{name}"
            if not fp8:
                sd[key] = torch.ones(shape, dtype=torch.bfloat16)
                continue
            raw = rng.integers(0, 256, shape, dtype=np.uint8)
            raw[(raw & 0x7F) == 0x7F] = 0x7E  # no NaN (its bits are not pinned)
            sd[key] = torch.from_numpy(raw).view(torch.float8_e4m3fn)
            sshape = tuple(-(-n // BLOCK) for n in shape)
            sd[key + "_scale_inv"] = torch.from_numpy((rng.random(sshape, dtype=np.float32) + 0.5) * 1e-3)
        fname = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        save_file(sd, os.path.join(path, fname), metadata={"format": "pt"})
        for k, t in sd.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
            if not k.endswith("_scale_inv"):
                out += t.numel() * 2
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total, out


def weight_dequant(w: Any, s: Any, block: int = BLOCK) -> Any:
    """DeepSeek's `weight_dequant` on the CPU: `float32(w) * s[tile]` stored to bfloat16."""
    import torch

    m, n = w.shape
    cols = s.repeat_interleave(block, dim=1)[:, :n]  # (ceil(m / block), n) float32
    y = torch.empty((m, n), dtype=torch.bfloat16)
    full = m // block * block
    if full:
        y[:full] = (w[:full].to(torch.float32).view(full // block, block, n) * cols[: full // block, None, :]).view(
            full, n).to(torch.bfloat16)
    if full < m:
        y[full:] = (w[full:].to(torch.float32) * cols[-1]).to(torch.bfloat16)
    return y


def dequant(sd: dict[str, Any]) -> dict[str, Any]:
    """A state dict with every float8 `W` (and its `W_scale_inv`) dequantized to bfloat16."""
    import torch

    out = {}
    for k, t in sd.items():
        if k.endswith("_scale_inv"):
            continue
        out[k] = weight_dequant(t, sd[k + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
    return out
