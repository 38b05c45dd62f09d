"""The rules' ``split`` and ``join`` operations and the ``megatron_gpt_to_hf_llama`` rule sets.

``split`` cuts one tensor into named parts along an axis of an optional reshape; ``join`` is its
inverse. Both are lazy views: a part's box is read from the source's chunks box by box (one
piece per block of the whole), never the whole tensor. Checked against numpy on hand-made
layouts and random ones (hypothesis), and on the real Megatron fixture: converted to a Hugging
Face Llama directory, ``transformers.LlamaForCausalLM.from_pretrained`` reproduces Megatron's own
logits; and back, bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from array_source import ArraySource
from conformance import same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xckpt
from xckpt.layout import Box, box_from_index, check_coverage
from xckpt.rules import RuleError, apply_rules, load_rule_set
from xckpt.source import Source

FIX = Path(__file__).parent / "fixtures_foreign" / "megatron"
GPT = str(FIX / "gpt_tp2dp2")
#: The fixture model's head counts (as its args hold them).
PARAMS = {
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "kv_channels": 8,
    "hidden_size": 32,
    "ffn_hidden_size": 64,
}


def _rows(shape: tuple[int, ...], cuts: Sequence[int], axis: int = 0) -> list[Box]:
    """Boxes of ``shape`` cut along ``axis`` at ``cuts``."""
    edges = [0, *cuts, shape[axis]]
    return [
        Box(
            tuple(a if d == axis else 0 for d in range(len(shape))),
            tuple(b - a if d == axis else n for d, n in enumerate(shape)),
        )
        for a, b in zip(edges, edges[1:])
        if b > a
    ]


QKV_RULE = {
    "match": r"qkv",
    "rename": "layers.{i}.{part}",
    "unstack": {"axis": 0},
    "split": {
        "axis": 1,
        "reshape": ["groups", -1, 6],
        "names": ["q", "k", "v"],
        "sizes": ["q_rows", "d", "d"],
    },
}
QKV_PARAMS = {"groups": 3, "q_rows": "heads // groups * d", "d": 2, "heads": 6}


def _qkv() -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(2 layers, 3 groups * (2 q heads + k + v) * head dim 2, hidden 6) and its parts per layer."""
    a = np.arange(2 * 24 * 6, dtype=np.float32).reshape(2, 24, 6)
    g = a.reshape(2, 3, 8, 6)
    parts = {}
    for i in range(2):
        parts[f"layers.{i}.q"] = g[i, :, :4].reshape(12, 6)
        parts[f"layers.{i}.k"] = g[i, :, 4:6].reshape(6, 6)
        parts[f"layers.{i}.v"] = g[i, :, 6:].reshape(6, 6)
    return a, parts


def _view(rules: Any, src: Source) -> Any:
    return apply_rules(src, {"rules": rules, "parameters": QKV_PARAMS})


def test_split_per_group_reads_each_part() -> None:
    a, parts = _qkv()
    src = ArraySource({"qkv": a}, {"qkv": _rows(a.shape, [10], axis=1)})
    v = _view([QKV_RULE], src)
    assert sorted(v.names()) == sorted(parts)
    for n, want in parts.items():
        t = v.info(n)
        assert t.shape == want.shape and t.dtype == "float32"
        check_coverage(t.shape, [c.box for c in t.chunks])
        assert same(v.read(n), want), n
    # q rows 0..3 of group 0 are source rows 0..3 (chunk 0), group 1's 4..7 are rows 8..11: the
    # stored chunk [0, 10) holds q rows [0, 6), chunk [10, 24) the rest
    assert [(c.offset, c.shape) for c in v.info("layers.0.q").chunks] == [((0, 0), (6, 6)), ((6, 0), (6, 6))]


def test_a_part_box_reads_only_its_elements() -> None:
    a, parts = _qkv()
    src = ArraySource({"qkv": a}, {"qkv": _rows(a.shape, [10], axis=1)})
    v = _view([QKV_RULE], src)
    for n in ("layers.1.q", "layers.0.k", "layers.1.v"):
        for index in [(slice(1, 5), slice(2, 5)), (slice(3, 4),), 2, (slice(0, 6), slice(5, 6))]:
            box = box_from_index(v.info(n).shape, index)
            before = src.read_elements
            assert same(v.read(n, index), np.array(parts[n][box.slices()], order="C")), (n, index)
            assert src.read_elements - before == box.volume  # no other rows of the fused tensor
            units = sum(
                sum(v.read_units(n, c, common, 4).values())
                for c in v.info(n).chunks
                if (common := c.box.intersect(box)) is not None
            )
            assert units == box.volume * 4


def test_split_without_reshape_and_a_remainder_size() -> None:
    a = np.random.default_rng(0).standard_normal((2, 10, 3)).astype(np.float32)
    rule = {
        "match": "fc1",
        "rename": "l{i}.{part}",
        "unstack": {"axis": 0},
        "split": {"axis": 0, "names": ["gate", "up"], "sizes": [4, -1]},
    }
    v = apply_rules(ArraySource({"fc1": a}, {"fc1": _rows(a.shape, [1], axis=0)}), [rule])
    assert same(v.read("l1.gate"), a[1, :4]) and same(v.read("l0.up"), a[0, 4:])
    assert v.info("l0.up").shape == (6, 3)


def test_join_is_the_inverse_of_split() -> None:
    a, parts = _qkv()
    src = ArraySource(parts, {n: _rows(p.shape, [p.shape[0] // 3]) for n, p in parts.items()})
    join = {
        "match": r"layers\.(\d+)\.(q|k|v)",
        "rename": "qkv",
        "stack": {"axis": 0, "index": r"\1"},
        "join": {
            "axis": 1,
            "reshape": ["groups", -1, 6],
            "names": ["q", "k", "v"],
            "sizes": ["q_rows", "d", "d"],
            "part": r"\2",
        },
    }
    v = _view([join], src)
    assert v.names() == ["qkv"] and v.info("qkv").shape == a.shape
    check_coverage(a.shape, [c.box for c in v.info("qkv").chunks])
    assert same(v.read("qkv"), a)
    for index in [(1, slice(3, 20), slice(1, 4)), (slice(0, 2), slice(7, 9)), (0, 23, 5)]:
        box = box_from_index(a.shape, index)
        assert same(v.read("qkv", index), np.array(a[box.slices()], order="C"))
    # split of the join: the parts again, through two views
    back = _view([QKV_RULE], v)
    assert all(same(back.read(n), p) for n, p in parts.items())


def test_parameters_from_a_checkpoint_object() -> None:
    a, parts = _qkv()
    args = {"num_heads": 6, "groups": 3, "hidden": 6}
    rules = {
        "rules": [QKV_RULE],
        "parameters": {
            "groups": "args.groups",
            "heads": "args.num_heads",
            "d": "args.hidden // args.num_heads * 2",
            "q_rows": "heads // groups * d",
        },
    }
    v = apply_rules(ArraySource({"qkv": a}, {}, {"args": args}), rules)
    assert same(v.read("layers.1.k"), parts["layers.1.k"])
    assert v.parameters.value("q_rows") == 4


@pytest.mark.parametrize(
    "rules,msg",
    [
        (
            {"rules": [QKV_RULE], "parameters": {**QKV_PARAMS, "heads": "args.num_heads"}},
            r"size 'q_rows' cannot be resolved: 'args' is neither a parameter of the rule set .* nor an object",
        ),
        (
            {"rules": [QKV_RULE], "parameters": {**QKV_PARAMS, "d": None}},
            r"parameter 'd' has no value in the rule set; give it",
        ),
        (
            {"rules": [QKV_RULE], "parameters": {**QKV_PARAMS, "d": "q_rows", "q_rows": "d"}},
            r"circle: q_rows -> d -> q_rows",
        ),
        (
            {"rules": [QKV_RULE], "parameters": {**QKV_PARAMS, "d": "__import__('os')"}},
            r"Call is not allowed",
        ),
        (
            {"rules": [QKV_RULE], "parameters": {**QKV_PARAMS, "d": 3}},
            r"sizes \[6, 3, 3\] add up to 12, not the axis's extent 8",
        ),
        (
            {"rules": [QKV_RULE], "parameters": {**QKV_PARAMS, "groups": 5}},
            r"reshape \[5, -1, 6\] does not fit shape \(24, 6\)",
        ),
        (
            {
                "rules": [
                    {
                        **QKV_RULE,
                        "split": {**QKV_RULE["split"], "reshape": [3, 48], "axis": 1, "sizes": [16, 16, 16]},
                    }
                ],
                "parameters": QKV_PARAMS,
            },
            r"merges axes",
        ),
        (
            [{"match": "qkv", "rename": "x", "split": {"axis": 0, "names": ["a"], "sizes": [2]}}],
            r"'split' needs a 'rename' containing \{part\}",
        ),
        (
            [{"match": "qkv", "rename": "{part}", "split": {"axis": 0, "names": ["a", "b"], "sizes": [2]}}],
            r"one size per name",
        ),
        (
            [
                {
                    "match": "qkv",
                    "rename": "j",
                    "join": {"axis": 0, "names": ["a", "b"], "sizes": [2, 2], "part": "c"},
                }
            ],
            r"join part 'c' expands to 'c' for 'qkv', which is not one of the parts \['a', 'b'\]",
        ),
    ],
)
def test_bad_split_rules_fail_before_any_read(rules: Any, msg: str) -> None:
    a, _ = _qkv()
    src = ArraySource({"qkv": a}, {})
    with pytest.raises(RuleError, match=msg):
        apply_rules(src, rules)
    assert src.read_elements == 0


def test_join_with_a_missing_part_names_it() -> None:
    _, parts = _qkv()
    parts.pop("layers.1.k")
    join = {
        "match": r"layers\.(\d+)\.(q|k|v)",
        "rename": "qkv",
        "stack": {"axis": 0, "index": r"\1"},
        "join": {
            "axis": 1,
            "reshape": ["groups", -1, 6],
            "names": ["q", "k", "v"],
            "sizes": ["q_rows", "d", "d"],
            "part": r"\2",
        },
    }
    with pytest.raises(RuleError, match=r"joining 5 tensors into 'qkv' .* finds no part 'k' at position 1"):
        _view([join], ArraySource(parts, {}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_split_and_join_match_numpy_on_random_layouts(data: st.DataObject) -> None:
    groups = data.draw(st.integers(1, 3))
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    inner = data.draw(st.integers(1, 3))
    rows = groups * sum(sizes) * inner
    a = np.arange(rows * 2, dtype=np.int32).reshape(rows, 2)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, rows - 1), max_size=4)))) if rows > 1 else []
    names = [f"p{i}" for i in range(len(sizes))]
    spec = {"axis": 1, "reshape": [groups, sum(sizes), inner, 2], "names": names, "sizes": sizes}
    v = apply_rules(
        ArraySource({"t": a}, {"t": _rows(a.shape, cuts)}),
        [{"match": "t", "rename": "{part}", "split": spec}],
    )
    g = a.reshape(groups, sum(sizes), inner, 2)
    starts = np.cumsum([0, *sizes])
    for i, n in enumerate(names):
        want = g[:, starts[i] : starts[i + 1]].reshape(-1, 2)
        assert same(v.read(n), want)
        lo = data.draw(st.integers(0, want.shape[0] - 1))
        hi = data.draw(st.integers(lo + 1, want.shape[0]))
        assert same(v.read(n, (slice(lo, hi),)), np.array(want[lo:hi], order="C"))
    joined = apply_rules(
        v,
        [
            {
                "match": "(p.*)",
                "rename": "t",
                "join": {**spec, "reshape": [groups, -1, inner, 2], "part": r"\1"},
            }
        ],
    )
    assert same(joined.read("t"), a)
    lo = data.draw(st.integers(0, rows - 1))
    assert same(joined.read("t", (slice(lo, rows), slice(1, 2))), np.array(a[lo:, 1:], order="C"))


# -- the shipped Megatron <-> Hugging Face Llama rule sets --------------------------------------


def _hf_config() -> dict[str, Any]:
    cfg = json.loads((FIX / "gpt_tp2dp2.truth.json").read_text())["config"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["ffn_hidden_size"],
        "num_hidden_layers": cfg["num_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_query_groups"],
        "head_dim": cfg["head_dim"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": cfg["rope_theta"],
        "tie_word_embeddings": cfg["tie_word_embeddings"],
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The Megatron fixture converted to a Hugging Face Llama directory (head counts from its args)."""
    out = str(tmp_path_factory.mktemp("hf") / "llama")
    xckpt.convert(
        GPT,
        out,
        to_format="safetensors",
        rules="megatron_gpt_to_hf_llama",
        allow_pickle=True,
        show_progress=False,
    )
    Path(out, "config.json").write_text(json.dumps(_hf_config()))
    return out


def _logits(model_dir: str) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    ids = torch.from_numpy(np.load(FIX / "gpt_tp2dp2.input_ids.npy"))
    with torch.no_grad():
        return model(ids).logits.numpy()


def test_names_are_exactly_hugging_face_llamas(hf_dir: str) -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_hf_config()))
    index = json.loads(Path(hf_dir, "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(model.state_dict())


def test_logits_match_megatrons(hf_dir: str) -> None:
    """Megatron's own logits (fp32, TP 2) against transformers' on the converted weights.

    Tolerance 1e-5 absolute on logits of magnitude ~1: both compute the same fp32 graph (RMSNorm,
    rotate-half RoPE, GQA, SwiGLU) with different reduction orders and TP-split matmuls, which
    differ in the last bits (measured: 2e-7). A wrong split is off by ~1e-1 (below).
    """
    ref = np.load(FIX / "gpt_tp2dp2.logits.npy")
    got = _logits(hf_dir)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)


def test_a_wrong_qkv_split_is_caught(tmp_path: Path) -> None:
    """Splitting the fused QKV contiguously (not per query group) gives other logits: the check
    above can tell."""
    _, params = load_rule_set("megatron_gpt_to_hf_llama")
    raw = json.loads(Path(xckpt.rules.RULESETS_DIR, "megatron_gpt_to_hf_llama.json").read_text())["rules"]
    for r in raw:
        if "split" in r and "reshape" in r["split"]:
            r["split"] = {"axis": 0, "names": ["q_proj", "k_proj", "v_proj"], "sizes": [32, 16, 16]}
    out = str(tmp_path / "wrong")
    xckpt.convert(
        GPT,
        out,
        to_format="safetensors",
        rules={"rules": raw, "parameters": params},
        allow_pickle=True,
        show_progress=False,
    )
    Path(out, "config.json").write_text(json.dumps(_hf_config()))
    assert np.abs(_logits(out) - np.load(FIX / "gpt_tp2dp2.logits.npy")).max() > 1e-2


def test_load_hugging_face_names_straight_from_megatron() -> None:
    """No conversion step: torch loads the Llama state dict from the Megatron checkpoint through the rules."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import xckpt.torch as xt

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_hf_config()))
    sd = model.state_dict()
    res = xt.load(GPT, sd, rules={"rules": "megatron_gpt_to_hf_llama", "parameters": PARAMS})
    assert res.missing == []
    model.load_state_dict(sd)
    model.eval()
    with torch.no_grad():
        got = model(torch.from_numpy(np.load(FIX / "gpt_tp2dp2.input_ids.npy"))).logits.numpy()
    np.testing.assert_allclose(got, np.load(FIX / "gpt_tp2dp2.logits.npy"), rtol=0, atol=1e-5)


def test_head_counts_need_allow_pickle_or_parameters() -> None:
    with pytest.raises(
        RuleError, match=r"'args' is a pickle .*allow_pickle=True.*Give the parameters with the rule set"
    ):
        xckpt.open(GPT, rules="megatron_gpt_to_hf_llama")
    with xckpt.open(GPT, rules={"rules": "megatron_gpt_to_hf_llama", "parameters": PARAMS}) as v:
        assert "model.layers.1.self_attn.k_proj.weight" in v and v.object_names() == []


def test_a_part_reads_only_its_rows_of_the_fused_tensor() -> None:
    with xckpt.open(GPT, rules={"rules": "megatron_gpt_to_hf_llama", "parameters": PARAMS}) as v:
        k = v.info("model.layers.1.self_attn.k_proj.weight")  # (2 groups * 8, 32): one TP chunk per group
        assert [(c.offset, c.shape) for c in k.chunks] == [((0, 0), (8, 32)), ((8, 0), (8, 32))]
        assert sum(sum(v.read_units(k.name, c, c.box, 4).values()) for c in k.chunks) == 16 * 32 * 4
        plan = xckpt.plan_load(v, {"model.layers.1.self_attn.q_proj.weight": ((2,), "Shard(0)")})
        assert plan.total_bytes_to_read == 32 * 32 * 4


def test_back_to_megatron_bit_exact(hf_dir: str, tmp_path: Path) -> None:
    with np.load(FIX / "gpt_tp2dp2.truth.npz") as z:
        want = {k: z[k] for k in z.files if not k.startswith("optimizer.")}
    out = str(tmp_path / "mcore")
    rules = {"rules": "hf_llama_to_megatron_gpt", "parameters": PARAMS}
    xckpt.convert(hf_dir, out, to_format="torch-dcp", rules=rules, show_progress=False)
    with xckpt.open(out) as src:
        got = src.read_all(show_progress=False)
    assert sorted(got) == sorted(want)
    assert [n for n, a in want.items() if not same(got[n], a)] == []
    with pytest.raises(
        RuleError, match=r"parameter '\w+' has no value in the rule set; give it"
    ):
        xckpt.open(hf_dir, rules="hf_llama_to_megatron_gpt")


def test_shipped_rule_sets_parse() -> None:
    for name in ("megatron_gpt_to_hf_llama", "hf_llama_to_megatron_gpt"):
        rules, params = load_rule_set(name)
        assert rules and set(params) == set(PARAMS)
