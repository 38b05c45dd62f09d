"""xckpt.rules: every rule kind on real xckpt checkpoints, every error path (type and
message, nothing read), rules files, the loaders' rules=, the bytes a sharded load of a
transposed kernel reads, and hypothesis checks of the box arithmetic against numpy."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import xckpt
from xckpt.errors import MissingEntryError, XckptError
from xckpt.layout import Box, check_coverage, plan_reads
from xckpt.manifest import Chunk, TensorEntry, ValueRange, dtype_name
from xckpt.rules import RULESETS_DIR, RuledSource, RuleError, apply_rules, load_rules, shipped_rule_sets
from xckpt.source import ChunkRead, Source

RNG = np.random.default_rng(0)
A = RNG.standard_normal((6, 8)).astype(np.float32)  # saved as two row blocks
B = RNG.standard_normal((4, 3, 5)).astype(np.float32)
LAYERS = [RNG.standard_normal((6, 4)).astype(np.float32) for _ in range(3)]


def save(path: Path, tensors: dict[str, Any], objects: dict[str, Any] | None = None) -> str:
    """A real xckpt checkpoint; a value given as a list of (offset, array) is saved as those boxes
    (the global shape is the union), anything else as one box."""
    w = xckpt.Writer(str(path))
    for name, v in tensors.items():
        if isinstance(v, list):
            shape = tuple(max(o[d] + a.shape[d] for o, a in v) for d in range(v[0][1].ndim))
            for off, arr in v:
                w.write(name, arr, global_shape=shape, offset=off)
        else:
            w.write(name, v)
    for name, v in (objects or {}).items():
        w.write_object(name, v)
    w.commit()
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    tensors: dict[str, Any] = {
        "enc.fc.weight": [((0, 0), A[:3]), ((3, 0), A[3:])],
        "enc.norm.weight": np.arange(8, dtype=np.float32),
        "conv.weight": B,
        "emb": np.arange(12, dtype=np.int32).reshape(3, 4),
    }
    for i, x in enumerate(LAYERS):  # layer 1 in two column blocks
        tensors[f"model.layers.{i}.w"] = [((0, 0), x[:, :2]), ((0, 2), x[:, 2:])] if i == 1 else x
    return save(tmp_path_factory.mktemp("rules") / "ck", tensors, {"step": 7, "cfg.lr": 0.5})


class Counting(Source):
    """Passes reads to an inner source and records every chunk box read of it."""

    def __init__(self, inner: Source) -> None:
        self.inner, self.format, self.path = inner, inner.format, inner.path
        self.reads: list[tuple[str, Box]] = []

    def names(self) -> list[str]:
        return self.inner.names()

    def info(self, name: str) -> TensorEntry:
        return self.inner.info(name)

    def object_names(self) -> list[str]:
        return self.inner.object_names()

    def objects(self, names: Sequence[str] | None = None, **kw: Any) -> dict[str, Any]:
        return self.inner.objects(names, **kw)

    def _read_chunks(self, jobs: Sequence[ChunkRead], bar: Any) -> None:
        self.reads.extend((j.name, j.chunk.box if j.req is None else j.req.box) for j in jobs)
        self.inner._read_chunks(jobs, bar)

    @property
    def nbytes(self) -> int:
        return sum(b.volume * self.inner.info(n).np_dtype.itemsize for n, b in self.reads)


class ArraySource(Source):
    """numpy arrays cut into given boxes: a fast source for the property tests."""

    format = "numpy"
    path = "<arrays>"

    def __init__(self, arrays: dict[str, tuple[np.ndarray, list[Box]]]) -> None:
        self.arrays = arrays

    def names(self) -> list[str]:
        return list(self.arrays)

    def info(self, name: str) -> TensorEntry:
        a, boxes = self.arrays[name]
        chunks = tuple(
            Chunk(offset=b.offset, shape=b.shape, key=f"{name}/{i}", rank=0, nbytes=b.volume * a.itemsize)
            for i, b in enumerate(boxes)
        )
        return TensorEntry(name=name, dtype=dtype_name(a.dtype), shape=a.shape, chunks=chunks)

    def _read_chunks(self, jobs: Sequence[ChunkRead], bar: Any) -> None:
        for name, chunk, req, out in jobs:
            src = self.arrays[name][0][chunk.box.slices()]
            if req is None:
                out[...] = src
            else:
                out[req.target_slices] = src[req.chunk_slices]


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.itemsize}") if a.dtype.kind not in "iub" else a


def equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(bits(a), bits(b))


def check_view(src: Source, expected: dict[str, np.ndarray]) -> None:
    """Shapes, dtypes, tiling boxes, whole reads and a slice of each expected tensor, element for element."""
    for name, want in expected.items():
        t = src.info(name)
        assert (t.shape, t.np_dtype) == (want.shape, want.dtype)
        check_coverage(t.shape, t.boxes, name)
        equal(src.read(name), want)
        if want.ndim:
            idx = tuple(slice(s // 3, max(s // 3 + 1, s - 1)) for s in want.shape)
            equal(src.read(name, idx), want[idx])


# ---------------------------------------------------------------------------
# Rule kinds


def test_rename_groups_first_match_and_unmatched(ckpt: str) -> None:
    src = xckpt.open(
        ckpt,
        rules=[
            {"match": r"enc\.(?P<mod>\w+)\.weight", "rename": r"encoder.\g<mod>.w"},
            {"match": r"enc\.fc\.weight", "rename": "never"},  # shadowed by the first rule
            {"match": "emb"},  # match alone: passes unchanged, shields from later rules
            {"match": "e.*", "drop": True},
        ],
    )
    assert isinstance(src, RuledSource)
    assert src.names()[:3] == ["encoder.fc.w", "encoder.norm.w", "conv.weight"]
    equal(src.read("encoder.fc.w"), A)
    equal(src.read("emb"), np.arange(12, dtype=np.int32).reshape(3, 4))
    assert src.info("encoder.fc.w").boxes == (Box((0, 0), (3, 8)), Box((3, 0), (3, 8)))
    equal(src.read("model.layers.1.w"), LAYERS[1])  # unmatched: unchanged
    with pytest.raises(MissingEntryError, match="has no tensor 'enc.fc.weight'"):
        src.info("enc.fc.weight")


def test_transpose_boxes_and_slices(ckpt: str) -> None:
    src = xckpt.open(
        ckpt, rules=[{"match": r"(.*)\.weight", "ndim": 2, "rename": r"\1.kernel", "transpose": [1, 0]}]
    )
    t = src.info("enc.fc.kernel")
    assert t.boxes == (Box((0, 0), (8, 3)), Box((0, 3), (8, 3)))  # the row blocks become column blocks
    assert t.placement is None
    assert src.names() == ["enc.fc.kernel", "enc.norm.weight", "conv.weight", "emb"] + [f"model.layers.{i}.w" for i in range(3)]
    check_view(src, {"enc.fc.kernel": A.T} | {f"model.layers.{i}.w": x for i, x in enumerate(LAYERS)})


def test_transpose_3d_and_cast(ckpt: str) -> None:
    src = xckpt.open(ckpt, rules=[{"match": "conv.weight", "transpose": [2, 0, 1], "dtype": "bfloat16"}])
    import ml_dtypes

    want = B.transpose(2, 0, 1).astype(ml_dtypes.bfloat16)
    assert src.info("conv.weight").chunks[0].nbytes == want.nbytes
    check_view(src, {"conv.weight": want, "enc.fc.weight": A})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn", "int8", "float64"])
def test_cast_rounds_as_astype(ckpt: str, dtype: str) -> None:
    src = xckpt.open(ckpt, rules=[{"match": r"enc\.fc\.weight", "dtype": dtype}])
    want = A.astype(xckpt.manifest.numpy_dtype(dtype))
    equal(src.read("enc.fc.weight"), want)
    equal(src.read("enc.fc.weight", (slice(2, 5), slice(1, 4))), want[2:5, 1:4])


def test_drop_tensor_and_object(ckpt: str) -> None:
    src = xckpt.open(ckpt, rules=[{"match": r"model\..*", "drop": True}, {"match": "step", "drop": True}])
    assert src.names() == ["enc.fc.weight", "enc.norm.weight", "conv.weight", "emb"]
    assert src.object_names() == ["cfg.lr"]
    assert src.objects() == {"cfg.lr": 0.5}


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_stack(ckpt: str, axis: int) -> None:
    rule = {"match": r"model\.layers\.(\d+)\.w", "rename": "layers.w", "stack": {"axis": axis, "index": r"\1"}}
    src = xckpt.open(ckpt, rules=[rule])
    want = np.stack(LAYERS, axis=axis)
    t = src.info("layers.w")
    assert len(t.chunks) == 4  # layer 1 keeps its two column blocks
    a = axis % 3
    assert sorted(b.offset[a] for b in t.boxes) == [0, 1, 1, 2] and all(b.shape[a] == 1 for b in t.boxes)
    check_view(src, {"layers.w": want, "enc.fc.weight": A})
    assert src.names() == ["enc.fc.weight", "enc.norm.weight", "conv.weight", "emb", "layers.w"]


def test_stack_orders_by_integer_position(tmp_path: Path) -> None:
    xs = {f"h.{i}.b": np.full((2,), i, np.int16) for i in (10, 2, 0, 1, 3, 4, 5, 6, 7, 8, 9)}
    path = save(tmp_path / "ck", xs)
    src = xckpt.open(path, rules=[{"match": r"h\.(\d+)\.b", "rename": "h.b", "stack": {"axis": 0, "index": r"\1"}}])
    equal(src.read("h.b"), np.repeat(np.arange(11, dtype=np.int16)[:, None], 2, axis=1))


def test_stack_with_transpose_is_the_maxtext_layout(ckpt: str) -> None:
    rule = {"match": r"model\.layers\.(\d+)\.w", "rename": "layers.kernel", "transpose": [1, 0], "stack": {"axis": 1, "index": r"\1"}}
    src = xckpt.open(ckpt, rules=[rule])
    want = np.stack([x.T for x in LAYERS], axis=1)
    assert want.shape == (4, 3, 6)
    equal(src.read("layers.kernel"), want)
    equal(src.read("layers.kernel", (slice(1, 3), slice(1, 2), slice(0, 6))), want[1:3, 1:2])


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_unstack(ckpt: str, axis: int) -> None:
    src = xckpt.open(ckpt, rules=[{"match": r"enc\.fc\.weight", "rename": "fc.{i}.w", "unstack": {"axis": axis}}])
    n = A.shape[axis]
    parts = {f"fc.{i}.w": np.take(A, i, axis=axis) for i in range(n)}
    check_view(src, parts | {"conv.weight": B})
    if axis == 1:  # every column crosses both row blocks
        assert src.info("fc.5.w").boxes == (Box((0,), (3,)), Box((3,), (3,)))
    assert src.names()[:n] == [f"fc.{i}.w" for i in range(n)]


def test_unstack_then_transpose_inverts_stack(ckpt: str, tmp_path: Path) -> None:
    fwd = {"match": r"model\.layers\.(\d+)\.w", "rename": "layers.k", "transpose": [1, 0], "stack": {"axis": 1, "index": r"\1"}}
    stacked = xckpt.open(ckpt, rules=[fwd]).read("layers.k")
    path = save(tmp_path / "s", {"layers.k": stacked})
    back = {"match": r"layers\.k", "rename": "model.layers.{i}.w", "unstack": {"axis": 1}, "transpose": [1, 0]}
    check_view(xckpt.open(path, rules=[back]), {f"model.layers.{i}.w": x for i, x in enumerate(LAYERS)})


def test_objects_renamed_by_the_same_rules(ckpt: str) -> None:
    src = xckpt.open(ckpt, rules=[{"match": r"cfg\.(.*)", "rename": r"config.\1"}, {"match": "(.*)", "ndim": 2, "drop": True}])
    assert src.object_names() == ["step", "config.lr"]  # ndim rules never match objects
    assert src.objects() == {"step": 7, "config.lr": 0.5}
    assert src.objects(["config.lr"]) == {"config.lr": 0.5}
    assert "enc.fc.weight" not in src.names()
    with pytest.raises(MissingEntryError, match="has no object 'cfg.lr'"):
        src.objects(["cfg.lr"])


def test_view_forwards_metadata_and_verify(ckpt: str) -> None:
    inner = xckpt.open(ckpt)
    src = apply_rules(inner, [{"match": "emb", "rename": "e"}])
    assert (src.format, src.path, src.world_size, src.save_id) == ("xckpt", inner.path, 1, inner.save_id)
    assert src.verify() == []
    assert "e" in src and "emb" not in src
    assert apply_rules(inner, []) is inner


# ---------------------------------------------------------------------------
# Rules files and shipped rule sets


def test_rules_files_json_toml_mapping_and_shipped(ckpt: str, tmp_path: Path) -> None:
    (tmp_path / "r.json").write_text('{"rules": [{"match": "emb", "rename": "x.\\\\g<0>"}]}')
    (tmp_path / "r.toml").write_text("[[rules]]\nmatch = 'emb'\nrename = 'x.\\g<0>'\n")
    for spec in (tmp_path / "r.json", str(tmp_path / "r.toml"), {"rules": [{"match": "emb", "rename": r"x.\g<0>"}]}):
        assert "x.emb" in xckpt.open(ckpt, rules=spec).names()
    assert shipped_rule_sets() == [
        "flax_to_torch",
        "fp8_block_dequant",
        "fp8_block_dequant_fp32",
        "hf_llama_to_megatron_gpt",
        "hf_llama_to_scanned",
        "megatron_gpt_to_hf_llama",
        "mxfp4_dequant",
        "mxfp4_dequant_fp32",
        "scanned_to_hf_llama",
        "torch_to_flax",
    ]
    assert load_rules("torch_to_flax") == load_rules(RULESETS_DIR / "torch_to_flax.json")
    src = xckpt.open(ckpt, rules="torch_to_flax")
    assert "params.enc.fc.kernel" in src.names() and "params.enc.norm.scale" in src.names()
    equal(src.read("params.enc.fc.kernel"), A.T)


# ---------------------------------------------------------------------------
# Errors: typed, naming the rule and the tensors, before anything is read


BAD_RULES = {
    "two onto one": (
        [{"match": r"enc\.(\w+)\.weight", "rename": "w"}],
        r"2 names map to one name 'w': tensor 'enc.fc.weight' \(rule 0 \(match '.*'\)\); tensor 'enc.norm.weight'.*use stack",
    ),
    "onto an unchanged name": (
        [{"match": "emb", "rename": "conv.weight"}],
        r"map to one name 'conv.weight': tensor 'conv.weight' \(no rule matches it: unchanged\); tensor 'emb' \(rule 0",
    ),
    "tensor onto an object": (
        [{"match": "emb", "rename": "step"}],
        r"tensor 'emb' \(rule 0 \(match 'emb'\)\); object 'step' \(no rule",
    ),
    "permutation too short": (
        [{"match": "conv.weight", "transpose": [1, 0]}],
        r"rule 0 \(match 'conv.weight'\): transpose \[1, 0\] has 2 axes but 'conv.weight' has 3; give one entry per axis",
    ),
    "not a permutation": (
        [{"match": "x", "transpose": [0, 0, 1]}],
        r"rule 0 \(match 'x'\): transpose \[0, 0, 1\] is not a permutation of 0..2",
    ),
    "stack position twice": (
        [{"match": r"enc\.(fc|norm)\.weight", "rename": "s", "stack": {"axis": 0, "index": "0"}}],
        r"rule 0 \(match '.*'\): stacking 2 tensors into 's' \(\['enc.fc.weight', 'enc.norm.weight'\]\) finds "
        r"position 0 twice",
    ),
    "stacked pieces disagree": (
        [
            {"match": r"enc\.fc\.weight", "rename": "s", "stack": {"axis": 0, "index": "0"}},
            {"match": r"enc\.norm\.weight", "rename": "s", "stack": {"axis": 0, "index": "1"}},
        ],
        r"rule 1 \(match 'enc\\\\.norm\\\\.weight'\): stacked pieces of 's' disagree: 'enc.fc.weight' is \(6, 8\) float32 "
        r"and 'enc.norm.weight' is \(8,\) float32",
    ),
    "stacked dtypes disagree": (
        [
            {"match": r"model\.layers\.2\.w", "rename": "s", "dtype": "float16", "stack": {"axis": 0, "index": "2"}},
            {"match": r"model\.layers\.(\d+)\.w", "rename": "s", "stack": {"axis": 0, "index": r"\1"}},
        ],
        r"stacked pieces of 's' disagree: 'model.layers.0.w' is \(6, 4\) float32 and 'model.layers.2.w' is \(6, 4\) float16",
    ),
    "stack positions with a gap": (
        [{"match": r"model\.layers\.([02])\.w", "rename": "s", "stack": {"axis": 0, "index": r"\1"}}],
        r"stacking 2 tensors into 's' \(\['model.layers.0.w', 'model.layers.2.w'\]\) finds no piece at positions \[1\]; "
        r"positions must be exactly 0..1",
    ),
    "non-integer index": (
        [{"match": r"model\.layers\.(\d+)\.(w)", "rename": "s", "stack": {"axis": 0, "index": r"\2"}}],
        r"stack index '\\\\2' expands to 'w' for 'model.layers.0.w', not a non-negative integer",
    ),
    "stack axis out of range": (
        [{"match": r"model\.layers\.(\d+)\.w", "rename": "s", "stack": {"axis": 3, "index": r"\1"}}],
        r"stack axis 3 is out of range for 'model.layers.0.w' of shape \(6, 4\) \(valid: -3..2\)",
    ),
    "bad regex": ([{"match": "enc.(fc"}], r"rule 0 \(match 'enc.\(fc'\): bad regular expression: missing \)"),
    "unknown key": (
        [{"match": "x", "rename": "y"}, {"match": "x", "reshape": [2]}],
        r"rules: rule 1 \(match 'x'\): unknown key\(s\) \['reshape'\]",
    ),
    "unknown dtype": ([{"match": "x", "dtype": "f32"}], r"rule 0 \(match 'x'\): unknown dtype 'f32'"),
    "bad group reference": (
        [{"match": "emb", "rename": r"\1.w"}],
        r"rule 0 \(match 'emb'\): template '\\\\1.w' does not expand for 'emb'",
    ),
    "stack without rename": ([{"match": "x", "stack": {"axis": 0, "index": "0"}}], r"'stack' needs a 'rename'"),
    "stack keys": ([{"match": "x", "rename": "y", "stack": {"axis": 0}}], r"'stack' must be \{\"axis\": k, \"index\""),
    "drop and rename": ([{"match": "x", "drop": True, "rename": "y"}], r"a rule that drops cannot also rename"),
    "unstack without {i}": ([{"match": "emb", "rename": "e", "unstack": {"axis": 0}}], r"'unstack' needs a 'rename' containing \{i\}"),
    "unstack collisions": (
        [{"match": "emb|conv.weight", "rename": "x.{i}", "unstack": {"axis": 0}}],
        r"2 names map to one name 'x.0': tensor 'conv.weight' \(rule 0 \(match 'emb\|conv.weight'\)\); tensor 'emb'",
    ),
    "unstack collides with a tensor": (
        [{"match": "emb", "rename": "model.layers.{i}.w", "unstack": {"axis": 0}}],
        r"2 names map to one name 'model.layers.0.w': tensor 'emb' \(rule 0 \(match 'emb'\)\); tensor 'model.layers.0.w' "
        r"\(no rule matches it: unchanged\)",
    ),
    "unstack permutation": (
        [{"match": "emb", "rename": "e{i}", "unstack": {"axis": 0}, "transpose": [1, 0]}],
        r"transpose \[1, 0\] has 2 axes but 'emb' has 1 after unstacking",
    ),
    "object transposed": (
        [{"match": "step|emb", "transpose": [1, 0]}],
        r"rule 0 \(match 'step\|emb'\) matches 'step', an object \(a non-tensor value\), but transpose need a tensor",
    ),
    "not a list": ({"rules": {"match": "x"}}, r"rules: 'rules' must be a list of rules, got dict"),
    "rule not a dict": (["x"], r"rules: rule 0 must be a table/object with a 'match' key, got 'x'"),
}


@pytest.mark.parametrize("case", list(BAD_RULES))
def test_bad_rules_fail_before_any_read(ckpt: str, case: str) -> None:
    rules, msg = BAD_RULES[case]
    inner = Counting(xckpt.open(ckpt))
    with pytest.raises(RuleError, match=msg):
        apply_rules(inner, rules)
    assert inner.reads == []
    assert issubclass(RuleError, XckptError) and issubclass(RuleError, ValueError)


def test_value_group_tensors_only_pass_or_drop(tmp_path: Path) -> None:
    w = xckpt.Writer(str(tmp_path / "vg"))
    w.write("mc.keys", np.arange(4, dtype=np.int64), value_range=ValueRange(group="mc", role="key", domain=(0, 10)))
    w.commit()
    src = xckpt.open(str(tmp_path / "vg"), rules=[{"match": "other", "drop": True}])
    assert src.info("mc.keys").value_range is not None
    with pytest.raises(RuleError, match=r"rule 0 \(match 'mc.keys'\) renames or reshapes 'mc.keys', a tensor of value group 'mc'"):
        xckpt.open(str(tmp_path / "vg"), rules=[{"match": "mc.keys", "rename": "k"}])


@pytest.mark.parametrize(
    ("name", "text", "msg"),
    [
        ("r.yaml", "rules: []", r"rules file '.*r.yaml': unknown suffix '.yaml'; a rules file is .json or .toml"),
        ("r.json", '{"rules": [', r"rules file '.*r.json' is not valid JSON: Expecting value: line 1 column 12"),
        ("r.toml", "[[rules]\nmatch=", r"rules file '.*r.toml' is not valid TOML"),
        ("r.json", '[{"match": "x"}]', r"rules file '.*r.json': expected \{\"rules\": \[...\]\}, got a list"),
        ("r.json", '{"rules": [{"match": "x", "transpose": "10"}]}', r"rules file '.*r.json': rule 0 \(match 'x'\): 'transpose' must be a list"),
    ],
)
def test_bad_rules_files(ckpt: str, tmp_path: Path, name: str, text: str, msg: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(RuleError, match=msg):
        xckpt.open(ckpt, rules=tmp_path / name)


def test_missing_rules_file_and_unknown_shipped_name(ckpt: str, tmp_path: Path) -> None:
    with pytest.raises(RuleError, match=r"rules file '.*nope.json' does not exist"):
        xckpt.open(ckpt, rules=str(tmp_path / "nope.json"))
    with pytest.raises(RuleError, match=r"rules 'torch2flax': no such file and no shipped rule set of that name; shipped rule sets: flax_to_torch"):
        xckpt.open(ckpt, rules="torch2flax")


# ---------------------------------------------------------------------------
# Loaders: the same rules= in xckpt.load, xckpt.torch.load / load_full, xckpt.jax.load


RENAME_T = [{"match": r"enc\.fc\.weight", "rename": "fc.kernel", "transpose": [1, 0]}]


def test_xckpt_load_with_rules(ckpt: str) -> None:
    got = xckpt.load(ckpt, rules=RENAME_T + [{"match": "step", "rename": "it"}])
    equal(got["fc.kernel"], A.T)
    assert got["it"] == 7 and "step" not in got


def test_torch_load_and_load_full_with_rules(ckpt: str) -> None:
    import torch

    import xckpt.torch as xt

    sd = {"fc.kernel": torch.zeros(8, 6), "layers.w": torch.zeros(3, 6, 4, dtype=torch.bfloat16), "step": None}
    rules = RENAME_T + [{"match": r"model\.layers\.(\d+)\.w", "rename": "layers.w", "dtype": "bfloat16", "stack": {"axis": 0, "index": r"\1"}}]
    res = xt.load(ckpt, sd, rules=rules, strict=True)
    assert "enc.norm.weight" in res.unexpected and res.missing == []
    equal(sd["fc.kernel"].numpy(), A.T)
    import ml_dtypes

    equal(sd["layers.w"].view(torch.int16).numpy().view(ml_dtypes.bfloat16), np.stack(LAYERS).astype(ml_dtypes.bfloat16))
    assert sd["step"] == 7
    full = xt.load_full(ckpt, ["fc.kernel", "step"], rules=rules)
    equal(full["fc.kernel"].numpy(), A.T)
    assert full["step"] == 7


def test_jax_load_sharded_transposed_kernel_reads_only_its_share(tmp_path: Path) -> None:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax as xj

    w = RNG.standard_normal((64, 48)).astype(np.float32)  # torch Linear (out, in)
    path = save(tmp_path / "k", {"fc.weight": w, "fc.bias": np.ones(64, np.float32)})
    rules = [{"match": r"(.*)\.weight", "rename": r"\1.kernel", "transpose": [1, 0]}]
    got = xj.load(path, {"fc.kernel": NamedSharding(jax.make_mesh((8,), ("x",)), P(None, "x"))}, rules=rules)
    np.testing.assert_array_equal(np.asarray(got["fc.kernel"]), w.T)
    # The same load through a byte counter: each device's (48, 8) block is 8 rows of the saved (64, 48).
    for mesh, spec in (((8,), P(None, "x")), ((2, 4), P("y", "x")), ((4, 2), P(None, "x"))):
        m = jax.make_mesh(mesh, ("y", "x")[-len(mesh) :])
        inner = Counting(xckpt.open(path))
        view = apply_rules(inner, rules)
        arr = xj.load(view, {"fc.kernel": NamedSharding(m, spec)})["fc.kernel"]
        np.testing.assert_array_equal(np.asarray(arr), w.T)
        assert inner.nbytes == w.nbytes  # every element once: replicas share a read, nothing else is read
        assert len(inner.reads) == len({str(s.index) for s in arr.addressable_shards})
        for shard in arr.addressable_shards:
            rows, cols = shard.index
            want = Box((cols.start or 0, rows.start or 0), (shard.data.shape[1], shard.data.shape[0]))
            assert ("fc.weight", want) in inner.reads


# ---------------------------------------------------------------------------
# Property tests: the box arithmetic against numpy


def _splits(draw: Any, n: int) -> list[tuple[int, int]]:
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=2))) if n > 1 else []
    edges = [0, *cuts, n]
    return [(a, b - a) for a, b in zip(edges, edges[1:])]


@st.composite
def chunked(draw: Any, min_dims: int = 1, shape: tuple[int, ...] | None = None) -> tuple[np.ndarray, list[Box]]:
    if shape is None:
        shape = tuple(draw(st.lists(st.integers(1, 5), min_size=min_dims, max_size=4)))
    arr = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape) * 3 + draw(st.integers(0, 9))
    per_dim = [_splits(draw, n) for n in shape]
    boxes = [Box(tuple(o for o, _ in c), tuple(s for _, s in c)) for c in _product(per_dim)]
    return arr, boxes


def _product(per_dim: list[list[tuple[int, int]]]) -> list[tuple[tuple[int, int], ...]]:
    import itertools

    return list(itertools.product(*per_dim))


@st.composite
def sub_box(draw: Any, shape: tuple[int, ...]) -> Box:
    off, shp = [], []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        off.append(a)
        shp.append(draw(st.integers(1, n - a)))
    return Box(tuple(off), tuple(shp))


def _check_boxes(src: Source, name: str, want: np.ndarray, box: Box) -> None:
    t = src.info(name)
    assert t.shape == want.shape
    check_coverage(t.shape, t.boxes, name)
    for c in t.chunks:  # every view chunk holds what the numpy result holds there
        got = np.empty(c.shape, want.dtype)
        src.read_into([(name, c.box, got)])
        equal(got, want[c.box.slices()])
    got = np.empty(box.shape, want.dtype)
    src.read_into([(name, box, got)])
    equal(got, want[box.slices()])
    assert len(plan_reads(t.boxes, box)) >= 1


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_transpose_property(data: Any) -> None:
    arr, boxes = data.draw(chunked())
    perm = data.draw(st.permutations(range(arr.ndim)))
    src = apply_rules(ArraySource({"t": (arr, boxes)}), [{"match": "t", "transpose": list(perm)}])
    want = arr.transpose(perm)
    _check_boxes(src, "t", want, data.draw(sub_box(want.shape)))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_stack_property(data: Any) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=0, max_size=3)))
    n = data.draw(st.integers(1, 4))
    pieces = [data.draw(chunked(shape=shape)) for _ in range(n)]
    axis = data.draw(st.integers(-len(shape) - 1, len(shape)))
    perm = data.draw(st.permutations(range(len(shape))))
    order = data.draw(st.permutations(range(n)))  # source order differs from positions
    src = ArraySource({f"p.{i}": pieces[i] for i in order})
    rule = {"match": r"p\.(\d+)", "rename": "s", "transpose": list(perm), "stack": {"axis": axis, "index": r"\1"}}
    view = apply_rules(src, [rule])
    want = np.stack([p[0].transpose(perm) for p in pieces], axis=axis)
    _check_boxes(view, "s", want, data.draw(sub_box(want.shape)))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_unstack_property(data: Any) -> None:
    arr, boxes = data.draw(chunked())
    axis = data.draw(st.integers(-arr.ndim, arr.ndim - 1))
    perm = data.draw(st.permutations(range(arr.ndim - 1)))
    rule = {"match": "t", "rename": "u.{i}", "unstack": {"axis": axis}, "transpose": list(perm)}
    view = apply_rules(ArraySource({"t": (arr, boxes)}), [rule])
    assert view.names() == [f"u.{i}" for i in range(arr.shape[axis])]
    for i in range(arr.shape[axis]):
        want = np.take(arr, i, axis=axis).transpose(perm)
        _check_boxes(view, f"u.{i}", want, data.draw(sub_box(want.shape)))


def test_no_torch_or_jax_on_import() -> None:
    import subprocess
    import sys

    code = "import sys, xckpt, xckpt.rules; assert 'torch' not in sys.modules and 'jax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plan_load_through_rules_counts_the_source_reads(tmp_path: Path) -> None:
    """A plan of a transposed view costs exactly what the equivalent plan of the stored tensor does
    (the same inner zarr chunks: the saved box is over 8 MiB, so it is split into inner chunks)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    w = np.zeros((1024, 2304), np.float32)  # 9 MiB
    path = save(tmp_path / "big", {"fc.weight": w})
    assert xckpt.open(path).info("fc.weight").chunks[0].grid != w.shape
    rules = [{"match": r"(.*)\.weight", "rename": r"\1.kernel", "transpose": [1, 0]}]
    m = jax.make_mesh((8,), ("x",))
    for kernel_spec, weight_spec in ((P(None, "x"), P("x", None)), (P("x", None), P(None, "x"))):
        via_rules = xckpt.plan_load(path, {"fc.kernel": NamedSharding(m, kernel_spec)}, rules=rules)
        direct = xckpt.plan_load(path, {"fc.weight": NamedSharding(m, weight_spec)})
        assert via_rules.ranks == direct.ranks
        assert via_rules.total_bytes_to_read >= w.nbytes
    torch_plan = xckpt.plan_load(path, {"fc.kernel": ((4,), "Shard(1)")}, rules=rules)
    assert torch_plan.ranks == xckpt.plan_load(path, {"fc.weight": ((4,), "Shard(0)")}).ranks


def test_convert_with_bad_rules_writes_nothing(ckpt: str, tmp_path: Path) -> None:
    with pytest.raises(RuleError, match=r"2 names map to one name 'w'"):
        xckpt.convert(ckpt, tmp_path / "out", rules=BAD_RULES["two onto one"][0])
    assert not (tmp_path / "out").exists()
    xckpt.convert(ckpt, tmp_path / "ok", rules=RENAME_T)
    equal(xckpt.open(tmp_path / "ok").read("fc.kernel"), A.T)


def test_each_view_chunk_is_one_source_read() -> None:
    """A whole read of a 512-chunk tensor through a transposed view makes 512 source chunk reads,
    each of one whole stored chunk (no re-planning against the source: that is quadratic)."""
    a = np.arange(512 * 4 * 3, dtype=np.float32).reshape(512 * 4, 3)
    boxes = [Box((4 * i, 0), (4, 3)) for i in range(512)]
    inner = Counting(ArraySource({"w": (a, boxes)}))
    view = apply_rules(inner, [{"match": "w", "transpose": [1, 0], "dtype": "float16"}])
    equal(view.read("w"), a.T.astype(np.float16))
    assert sorted(b.offset for _, b in inner.reads) == [b.offset for b in boxes]
    assert {b for _, b in inner.reads} == set(boxes)
