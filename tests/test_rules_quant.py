"""Dequantizing rule sets (issue 32): block-scaled fp8 (DeepSeek-V3) and MXFP4 (gpt-oss) read as
bf16 or fp32, bit-exact against the references computed here (DeepSeek's `weight_dequant` math in
torch; transformers' own `convert_moe_packed_tensors` called directly), through `xckpt.open`,
`xckpt.torch.load`, `xckpt.convert` (read back by safetensors) and the CLI; box reads that touch only
the blocks and scales they need; the block and box arithmetic under hypothesis; the errors.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from array_source import ArraySource
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import xckpt
import xckpt.torch as xt
from xckpt import _dequant
from xckpt._dequant import dequant_fp8_block, dequant_mxfp4, mxfp4_boxes, scale_box
from xckpt.cli import main
from xckpt.errors import XckptError
from xckpt.layout import Box
from xckpt.rules import RuleError, apply_rules
from xckpt.source import ChunkRead, Source

TORCH = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
NUMPY = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32), "float16": np.dtype(np.float16)}
FP8_SETS = {"bfloat16": "fp8_block_dequant", "float32": "fp8_block_dequant_fp32"}
MXFP4_SETS = {"bfloat16": "mxfp4_dequant", "float32": "mxfp4_dequant_fp32"}


# ---------------------------------------------------------------------------
# References and data


def deepseek_dequant(w: torch.Tensor, s: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek-V3's `weight_dequant` (inference/kernel.py) in torch: every element of a block x block
    tile is `float32(w) * s[tile]`, stored to `dtype` (round to nearest even); partial edge tiles."""
    m, n = w.shape
    full = s.repeat_interleave(block, 0)[:m].repeat_interleave(block, 1)[:, :n]
    return (w.to(torch.float32) * full).to(dtype)


def bits(x: Any) -> np.ndarray:
    """The bit patterns of a torch tensor or numpy array (compares bf16, inf and -0.0 exactly)."""
    a = x.contiguous().view({2: torch.int16, 4: torch.int32}[x.element_size()]).numpy() if isinstance(x, torch.Tensor) else x
    return np.ascontiguousarray(a).view({2: np.uint16, 4: np.uint32}[a.itemsize])


def fp8(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random float8_e4m3fn bit patterns, NaN (0x7f, 0xff) left out."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    raw[(raw & 0x7F) == 0x7F] = 0x7E
    return raw.view(torch.float8_e4m3fn)


def scales(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """float32 scales over the whole range: products that are subnormal, normal and overflow to inf."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.rand(shape, generator=g) * 260 - 140) * (torch.rand(shape, generator=g) + 0.5)


# name -> shape: edges not multiples of 128, exact multiples, a one-column edge
FP8 = {
    "model.layers.0.mlp.down_proj.weight": (300, 520),
    "model.layers.0.self_attn.q_a_proj.weight": (256, 384),
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (129, 7),
}
PLAIN = {"model.embed_tokens.weight": (10, 520), "model.layers.0.input_layernorm.weight": (520,)}


@pytest.fixture(scope="module")
def fp8_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A DeepSeek-V3 style safetensors file written by safetensors.torch.save_file."""
    tensors: dict[str, torch.Tensor] = {}
    for i, (name, shape) in enumerate(FP8.items()):
        tensors[name] = fp8(shape, i)
        tensors[f"{name}_scale_inv"] = scales(tuple(-(-n // 128) for n in shape), 100 + i)
    for name, shape in PLAIN.items():
        tensors[name] = torch.randn(shape).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("fp8") / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


GPT_OSS = "model.layers.0.mlp.experts."


@pytest.fixture(scope="module")
def mxfp4_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """gpt-oss style experts: `*_blocks` (E, R, G, 16) uint8 and `*_scales` (E, R, G) over every e8m0 value."""
    g = torch.Generator().manual_seed(7)
    tensors = {
        f"{GPT_OSS}gate_up_proj_blocks": torch.randint(0, 256, (2, 70, 3, 16), dtype=torch.uint8, generator=g),
        f"{GPT_OSS}gate_up_proj_scales": torch.randint(0, 256, (2, 70, 3), dtype=torch.uint8, generator=g),
        f"{GPT_OSS}down_proj_blocks": torch.randint(0, 256, (2, 96, 2, 16), dtype=torch.uint8, generator=g),
        f"{GPT_OSS}down_proj_scales": torch.randint(110, 140, (2, 96, 2), dtype=torch.uint8, generator=g),
        f"{GPT_OSS}gate_up_proj_bias": torch.randn(2, 70).to(torch.bfloat16),
        "model.layers.0.mlp.router.weight": torch.randn(2, 96).to(torch.bfloat16),
    }
    path = tmp_path_factory.mktemp("mxfp4") / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def fp8_expected(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    out = {n: deepseek_dequant(tensors[n], tensors[f"{n}_scale_inv"], 128, TORCH[dtype]) for n in FP8}
    return {**out, **{n: tensors[n] for n in PLAIN}}


def mxfp4_expected(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    out = {}
    for p in ("gate_up_proj", "down_proj"):
        b, s = tensors[f"{GPT_OSS}{p}_blocks"], tensors[f"{GPT_OSS}{p}_scales"]
        out[f"{GPT_OSS}{p}"] = convert_moe_packed_tensors(b, s, dtype=TORCH[dtype])
    plain = (f"{GPT_OSS}gate_up_proj_bias", "model.layers.0.mlp.router.weight")
    return {**out, **{n: tensors[n] for n in plain}}


# ---------------------------------------------------------------------------
# The arithmetic against the references, every value


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_mxfp4_every_scale_and_byte_matches_transformers(dtype: str) -> None:
    blocks = torch.arange(256, dtype=torch.uint8).repeat(256).reshape(1, 256, 16, 16)  # row = scale, all bytes
    scl = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1).expand(1, 256, 16).contiguous()
    want = convert_moe_packed_tensors(blocks, scl, dtype=TORCH[dtype]).transpose(1, 2)
    got = np.empty((1, 256, 512), NUMPY[dtype])
    dequant_mxfp4(blocks.numpy(), scl.numpy(), got)
    assert np.array_equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_fp8_every_value_and_scale_range_matches_deepseek(dtype: str) -> None:
    w = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).repeat(300, 2)  # (300, 512)
    s = scales((3, 4), 1)
    got = np.empty((300, 512), NUMPY[dtype])
    dequant_fp8_block(w.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn), s.numpy(), (0, 0), (128, 128), got)
    want = deepseek_dequant(w, s, 128, TORCH[dtype])
    nan = np.isnan(got.astype(np.float32))
    assert np.array_equal(nan, torch.isnan(want.float()).numpy())  # 0x7f / 0xff: NaN stays NaN
    assert np.array_equal(bits(got)[~nan], bits(want)[~nan])


# ---------------------------------------------------------------------------
# Through xckpt.open, xckpt.torch.load, convert and the CLI


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_open_reads_deepseek_dequant(fp8_file: Any, dtype: str) -> None:
    path, tensors = fp8_file
    want = fp8_expected(tensors, dtype)
    with xckpt.open(path, rules=FP8_SETS[dtype]) as src:
        assert sorted(src.names()) == sorted(want)  # the scales are gone
        for name, t in want.items():
            info = src.info(name)
            assert info.shape == tuple(t.shape) and info.dtype == (dtype if name in FP8 else "bfloat16")
            assert np.array_equal(bits(src.read(name)), bits(t)), name
        w = want["model.layers.0.mlp.down_proj.weight"]
        for rows, cols in [(slice(100, 290), slice(3, 517)), (slice(127, 129), slice(255, 257)), (slice(256, 300), slice(512, 520))]:
            got = src.read("model.layers.0.mlp.down_proj.weight", (rows, cols))
            assert np.array_equal(bits(got), bits(w[rows, cols]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mxfp4_open_reads_transformers_layout(mxfp4_file: Any, dtype: str) -> None:
    path, tensors = mxfp4_file
    want = mxfp4_expected(tensors, dtype)
    with xckpt.open(path, rules=MXFP4_SETS[dtype]) as src:
        assert sorted(src.names()) == sorted(want)
        for name, t in want.items():
            assert src.info(name).shape == tuple(t.shape)
            assert np.array_equal(bits(src.read(name)), bits(t)), name
        up = want[f"{GPT_OSS}gate_up_proj"]  # (2, 96, 70): groups of 32 along axis 1
        for box in [(slice(1, 2), slice(33, 90), slice(7, 60)), (slice(0, 2), slice(31, 33), slice(69, 70))]:
            assert np.array_equal(bits(src.read(f"{GPT_OSS}gate_up_proj", box)), bits(up[box]))


def test_torch_load_dequantizes_into_the_state_dict(fp8_file: Any, mxfp4_file: Any) -> None:
    path, tensors = fp8_file
    name = "model.layers.0.mlp.down_proj.weight"
    sd = {name: torch.empty(300, 520, dtype=torch.bfloat16)}
    xt.load(path, sd, rules="fp8_block_dequant")
    assert torch.equal(sd[name].view(torch.int16), fp8_expected(tensors, "bfloat16")[name].view(torch.int16))
    path, tensors = mxfp4_file
    sd = {f"{GPT_OSS}down_proj": torch.empty(2, 64, 96, dtype=torch.float32)}
    xt.load(path, sd, rules="mxfp4_dequant_fp32")
    assert torch.equal(sd[f"{GPT_OSS}down_proj"], mxfp4_expected(tensors, "float32")[f"{GPT_OSS}down_proj"])


@pytest.mark.parametrize("band", [None, 3000])
@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_convert_to_safetensors_reads_back(
    fp8_file: Any, mxfp4_file: Any, tmp_path: Path, kind: str, band: int | None, monkeypatch: Any
) -> None:
    """Also with the large tensors written in bands of rows (`WriteJob.rows`; bands of a few
    rows here, which cross the 128-row scale blocks), verified (crc32c per source box)."""
    if band is not None:
        monkeypatch.setattr(xckpt.sink, "ROWS_BAND", band)
    path, tensors = fp8_file if kind == "fp8" else mxfp4_file
    want = fp8_expected(tensors, "bfloat16") if kind == "fp8" else mxfp4_expected(tensors, "bfloat16")
    out = xckpt.convert(path, tmp_path / "out.safetensors", rules={"fp8": "fp8_block_dequant", "mxfp4": "mxfp4_dequant"}[kind])
    got = load_file(str(out))
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and np.array_equal(bits(got[name]), bits(t)), name


def test_cli_convert_to_a_hugging_face_directory(fp8_file: Any, tmp_path: Path, capsys: Any) -> None:
    path, tensors = fp8_file
    dst = tmp_path / "bf16"
    assert main(["convert", str(path), str(dst), "--to", "safetensors", "--rules", "fp8_block_dequant"]) == 0
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert not any(n.endswith("_scale_inv") for n in index["weight_map"])
    got = {k: v for f in sorted(dst.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    want = fp8_expected(tensors, "bfloat16")
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(bits(got[n]), bits(t)) for n, t in want.items())
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    assert "fp8_block_dequant" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# Lazy: a box reads only the quantized bytes and scales it needs


class Recorded:
    """Records the boxes each read of a source asks for (the reads still run)."""

    def __init__(self, src: Source) -> None:
        self.boxes: list[tuple[str, Box]] = []
        inner = src._read_chunks

        def read(jobs: Sequence[ChunkRead], bar: Any) -> None:
            self.boxes += [(j.name, j.chunk.box if j.req is None else j.req.box) for j in jobs]
            inner(jobs, bar)

        src._read_chunks = read  # type: ignore[method-assign]


def test_a_box_reads_only_its_blocks(fp8_file: Any, mxfp4_file: Any) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    raw = xckpt.open(fp8_file[0])
    rec = Recorded(raw)
    view = apply_rules(raw, "fp8_block_dequant")
    view.read(name, (slice(130, 200), slice(260, 300)))
    assert rec.boxes == [(name, Box((130, 260), (70, 40))), (f"{name}_scale_inv", Box((1, 2), (1, 1)))]
    units = view.read_units(name, view.info(name).chunks[0], Box((130, 260), (70, 40)), 2)
    assert sum(units.values()) == 70 * 40 + 4  # the plan counts the same bytes
    raw = xckpt.open(mxfp4_file[0])
    rec = Recorded(raw)
    view = apply_rules(raw, "mxfp4_dequant")
    view.read(f"{GPT_OSS}gate_up_proj", (slice(1, 2), slice(33, 90), slice(7, 60)))  # (E, K, R)
    assert rec.boxes == [
        (f"{GPT_OSS}gate_up_proj_blocks", Box((1, 7, 1, 0), (1, 53, 2, 16))),  # values 33..89: groups 1, 2
        (f"{GPT_OSS}gate_up_proj_scales", Box((1, 7, 1), (1, 53, 2))),
    ]
    raw.close()


# ---------------------------------------------------------------------------
# Block and box arithmetic (hypothesis), over stored chunks of any layout


def _cuts(draw: Any, n: int) -> list[int]:
    return sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=3)))) if n > 1 else []


def _grid(shape: tuple[int, ...], cuts: list[list[int]]) -> list[Box]:
    edges = [[0, *c, n] for c, n in zip(cuts, shape)]
    spans = [list(zip(e, e[1:])) for e in edges]
    out = [Box((), ())]
    for axis in spans:
        out = [Box((*b.offset, lo), (*b.shape, hi - lo)) for b in out for lo, hi in axis]
    return out


@st.composite
def boxes_in(draw: Any, shape: tuple[int, ...]) -> Box:
    lo = [draw(st.integers(0, n - 1)) for n in shape]
    return Box(tuple(lo), tuple(draw(st.integers(1, n - a)) for a, n in zip(lo, shape)))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_scale_and_group_boxes_hold_exactly_the_blocks_touched(data: Any) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=3)))
    block = tuple(data.draw(st.integers(1, 9)) for _ in shape)
    box = data.draw(boxes_in(shape))
    touched = {tuple(i // b for i, b in zip(idx, block)) for idx in np.ndindex(*box.shape)
               for idx in [tuple(o + i for o, i in zip(box.offset, idx))]}
    sb = scale_box(box, block)
    assert touched == {tuple(o + i for o, i in zip(sb.offset, idx)) for idx in np.ndindex(*sb.shape)}
    group = data.draw(st.integers(1, 4))
    qb, gb = mxfp4_boxes(box, group)
    groups = {(*idx[:-1], idx[-1] // (2 * group)) for idx in (tuple(o + i for o, i in zip(box.offset, j)) for j in np.ndindex(*box.shape))}
    assert groups == {tuple(o + i for o, i in zip(gb.offset, j)) for j in np.ndindex(*gb.shape)}
    assert qb == Box((*gb.offset, 0), (*gb.shape, group))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_stored_layout_any_box_equals_the_reference(data: Any) -> None:
    # Pieces of 64 quantized bytes, batches of 300: a box is cut, read and dequantized in parts.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_dequant, "PIECE_BYTES", 64)
        mp.setattr(_dequant, "BATCH_BYTES", 300)
        _any_layout(data)


def _any_layout(data: Any) -> None:
    m, n, b = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 40)), data.draw(st.integers(1, 16))
    w = fp8((m, n), data.draw(st.integers(0, 99)))
    s = scales((-(-m // b), -(-n // b)), 5)
    e, r, g = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 9)), data.draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 99)))
    blk = torch.randint(0, 256, (e, r, g, 16), dtype=torch.uint8, generator=gen)
    scl = torch.randint(0, 256, (e, r, g), dtype=torch.uint8, generator=gen)
    arrays = {"w": w.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn), "w_scale_inv": s.numpy(),
              "x_blocks": blk.numpy(), "x_scales": scl.numpy()}
    layouts = {k: _grid(a.shape, [_cuts(data.draw, d) for d in a.shape]) for k, a in arrays.items()}
    rules = [{"match": "(.*)", "dequant": {"kind": "fp8_block", "scale": r"\1_scale_inv", "block": [b, b]}, "transpose": [1, 0]},
             {"match": "(.*)_blocks", "dequant": {"kind": "mxfp4", "scale": r"\1_scales"}, "rename": r"\1",
              "transpose": [0, 2, 1], "dtype": "float32"}]
    view = apply_rules(ArraySource(arrays, layouts, {"step": 3}), rules)
    assert view.names() == ["w", "x"] and view.object_names() == ["step"]  # the fp8 rule matches no object
    for name, want in (("w", deepseek_dequant(w, s, b, torch.bfloat16).T), ("x", convert_moe_packed_tensors(blk, scl, dtype=torch.float32))):
        box = data.draw(boxes_in(tuple(want.shape)))
        got = view.read(name, tuple(slice(o, o + k) for o, k in zip(box.offset, box.shape)))
        assert np.array_equal(bits(got), bits(want[box.slices()])), (name, box)


# ---------------------------------------------------------------------------
# Errors: typed, naming the rule, the tensors and the fix, before anything is read


def _src(**arrays: np.ndarray) -> Source:
    return ArraySource(arrays, {})


W8 = np.zeros((300, 200), ml_dtypes.float8_e4m3fn)


@pytest.mark.parametrize(
    "arrays, rules, message",
    [
        ({"a.weight": W8}, "fp8_block_dequant",
         "float8_e4m3fn tensor 'a.weight' (300, 200) needs its scale tensor 'a.weight_scale_inv', which checkpoint "
         "'arrays' does not hold; exclude 'a.weight'"),
        ({"a.weight": W8, "a.weight_scale_inv": np.ones((3, 2), np.float32)},
         {"rules": "fp8_block_dequant", "parameters": {"block_size": 64}},
         "in 64 x 64 blocks the scale must be float32 of shape (5, 4); check the rule's block size (the model "
         "config's weight_block_size)"),
        ({"a.weight": W8, "a.weight_scale_inv": np.ones((3, 2), np.int32)}, "fp8_block_dequant",
         "the scale must be float32 of shape (3, 2)"),
        ({"x_blocks": np.zeros((2, 4, 3, 16), np.uint8), "x_scales": np.zeros((2, 4, 2), np.uint8)}, "mxfp4_dequant",
         "MXFP4 blocks (..., G, B) need uint8 scales of shape (..., G) = (2, 4, 3)"),
        ({"a": W8, "b": W8, "s": np.ones((3, 2), np.float32)},
         [{"match": "[ab]", "dequant": {"kind": "fp8_block", "scale": "s"}}],
         "scale tensor 's' is claimed by both 'a' and 'b'; each quantized tensor needs its own scale"),
        ({"x_blocks": np.zeros((2, 4, 3, 16), np.uint8), "x_scales": np.zeros((2, 4, 3), np.uint8), "y": np.zeros((2, 4), np.uint8)},
         [{"match": "x_blocks", "dequant": {"kind": "mxfp4", "scale": "x_scales"}},
          {"match": "x_scales", "dequant": {"kind": "mxfp4", "scale": "y"}}],
         "tensor 'x_scales' is both dequantized and the scale of 'x_blocks'"),
        ({"a": W8, "a_s": np.zeros((3, 2), ml_dtypes.float8_e4m3fn)},
         [{"match": "a", "dequant": {"kind": "fp8_block", "scale": "a_s"}}],
         "the scale must be float32 of shape (3, 2)"),
        ({"a": W8, "a_s": np.ones((3, 2), np.float32)},
         [{"match": "(.*)", "dequant": {"kind": "fp8_block", "scale": r"\1_s", "block": [128]}}],
         "block [128] must give one positive size per axis (2)"),
        ({"a": W8, "a_s": np.ones((3, 2), np.float32)},
         [{"match": "(.*)", "dequant": {"kind": "fp8_block", "scale": r"\1_s"}, "dtype": "int8"}],
         "a dequant rule's dtype is one of ['bfloat16', 'float16', 'float32'], not 'int8'"),
        ({"a": W8}, [{"match": "a", "dequant": {"kind": "int4", "scale": "s"}}],
         "rule 0 (match 'a'): dequant kind 'int4' is not one of ['fp8_block', 'mxfp4']"),
        ({"a": W8}, [{"match": "a", "dequant": {"kind": "mxfp4", "scale": "s", "block": [32]}}],
         "an mxfp4 dequant takes no 'block'"),
        ({"a": W8}, [{"match": "a", "drop": True, "dequant": {"kind": "mxfp4", "scale": "s"}}],
         "a rule that drops cannot also rename, transpose, cast"),
        ({"a": W8}, [{"match": "a", "dequant": {"kind": "fp8_block"}}], "'dequant' must be {\"kind\""),
    ],
)
def test_errors(arrays: dict[str, np.ndarray], rules: Any, message: str) -> None:
    with pytest.raises(RuleError) as e:
        apply_rules(_src(**arrays), rules)
    assert message in str(e.value)
    assert isinstance(e.value, XckptError) and isinstance(e.value, ValueError)
