"""The shipped rule sets on real models: a torch CNN/MLP (Conv2d, Conv1d, BatchNorm, LayerNorm,
Embedding, Linear) loads into the same flax.linen model through torch_to_flax and computes the
same outputs, and back through flax_to_torch; a tiny Hugging Face Llama goes to the scanned
layout and back bit for bit, and the model built from the round trip gives identical logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch import nn

import xckpt
import xckpt.jax as xj
import xckpt.torch as xt

VOCAB, CLASSES = 11, 5


class TorchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.embed = nn.Embedding(VOCAB, 8)
        self.seq = nn.Conv1d(8, 8, 3, padding=1)
        self.ln = nn.LayerNorm(16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, img: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv1(img))).mean((2, 3))
        e = self.seq(self.embed(tok).transpose(1, 2)).mean(2)
        h = self.ln(torch.cat([x, e], -1))
        return self.fc2(torch.relu(self.fc1(h)))


class FlaxNet(fnn.Module):
    """TorchNet in flax.linen: NHWC images, submodules named as the torch modules."""

    @fnn.compact
    def __call__(self, img: jax.Array, tok: jax.Array) -> jax.Array:
        x = fnn.Conv(8, (3, 3), padding=((1, 1), (1, 1)), name="conv1")(img)
        x = fnn.BatchNorm(use_running_average=True, epsilon=1e-5, name="bn")(x)
        x = jax.nn.relu(x).mean((1, 2))
        e = fnn.Embed(VOCAB, 8, name="embed")(tok)
        e = fnn.Conv(8, (3,), padding=((1, 1),), name="seq")(e).mean(1)
        h = fnn.LayerNorm(epsilon=1e-5, name="ln")(jnp.concatenate([x, e], -1))
        return fnn.Dense(CLASSES, name="fc2")(jax.nn.relu(fnn.Dense(32, name="fc1")(h)))


def inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((4, 3, 6, 6)).astype(np.float32), rng.integers(0, VOCAB, (4, 7))


def torch_out(model: TorchNet) -> np.ndarray:
    img, tok = inputs()
    with torch.no_grad():
        return model.eval()(torch.from_numpy(img), torch.from_numpy(tok)).numpy()


_apply = jax.jit(FlaxNet().apply)


def flax_out(variables: Any) -> np.ndarray:
    img, tok = inputs()
    return np.asarray(_apply(variables, jnp.asarray(img.transpose(0, 2, 3, 1)), jnp.asarray(tok)))


def flax_shapes() -> Any:
    """The flax variables' shapes (no init run: op-by-op random init compiles for tens of seconds)."""
    img, tok = inputs()
    return jax.eval_shape(FlaxNet().init, jax.random.key(0), img.transpose(0, 2, 3, 1), tok)


def flat_names(tree: Any) -> set[str]:
    return {".".join(str(k.key) for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_torch_cnn_mlp_loads_into_flax_through_torch_to_flax(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TorchNet()
    with torch.no_grad():  # non-trivial norm parameters and batch statistics
        for p in (model.bn.weight, model.bn.bias, model.ln.weight, model.ln.bias, model.bn.running_mean):
            p.copy_(torch.randn_like(p))
        model.bn.running_var.copy_(torch.rand(8) + 0.5)
    xt.save(model.state_dict(), tmp_path / "torch")
    cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=cpu), flax_shapes())
    view = xckpt.open(tmp_path / "torch", rules="torch_to_flax")
    assert set(view.names()) == flat_names(target)  # num_batches_tracked dropped, nothing else left over
    assert view.info("params.conv1.kernel").shape == (3, 3, 3, 8)
    loaded = xj.load(tmp_path / "torch", target, rules="torch_to_flax")
    want = torch_out(model)
    assert all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(loaded))
    np.testing.assert_allclose(flax_out(loaded), want, atol=1e-5, rtol=0)


def test_flax_cnn_mlp_loads_into_torch_through_flax_to_torch(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    variables = jax.tree_util.tree_map(
        lambda s: jnp.asarray(rng.standard_normal(s.shape).astype(s.dtype)), flax_shapes()
    )
    variables["batch_stats"]["bn"]["var"] = jnp.abs(variables["batch_stats"]["bn"]["var"]) + 0.5
    xj.save(variables, tmp_path / "flax")
    model = TorchNet()
    sd = model.state_dict()
    res = xt.load(tmp_path / "flax", sd, rules="flax_to_torch", strict=False)
    assert res.missing == ["bn.num_batches_tracked"] and res.unexpected == []
    np.testing.assert_allclose(torch_out(model), flax_out(variables), atol=1e-5, rtol=0)
    full = xt.load_full(tmp_path / "flax", ["conv1.weight"], rules="flax_to_torch")
    np.testing.assert_array_equal(
        full["conv1.weight"].numpy(), np.asarray(variables["params"]["conv1"]["kernel"]).transpose(3, 2, 0, 1)
    )


# ---------------------------------------------------------------------------
# Hugging Face Llama <-> scanned layers


@pytest.fixture(scope="module")
def llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return cfg, LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def test_llama_to_scanned_and_back_bit_exact(llama: Any, tmp_path: Path) -> None:
    import shutil

    from transformers import LlamaForCausalLM

    cfg, model = llama
    sd = model.state_dict()
    model.save_pretrained(tmp_path / "hf")  # safetensors, as transformers writes it
    scanned = xckpt.open(tmp_path / "hf", rules="hf_llama_to_scanned")
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    assert scanned.info("layers.self_attn.q_proj.kernel").shape == (D, L, D)
    assert scanned.info("layers.self_attn.k_proj.kernel").shape == (D, L, D // 2)
    assert scanned.info("layers.mlp.down_proj.kernel").shape == (cfg.intermediate_size, L, D)
    assert scanned.info("layers.input_layernorm.scale").shape == (L, D)
    assert len(scanned.names()) == 3 + 9  # embedding, final norm, lm_head; 7 kernels and 2 norms per layer
    kernel = scanned.read("layers.self_attn.o_proj.kernel")
    for i in range(L):
        want = sd[f"model.layers.{i}.self_attn.o_proj.weight"].T.contiguous().view(torch.int16).numpy()
        np.testing.assert_array_equal(kernel[:, i, :].view(np.int16), want)

    # HF -> scanned xckpt -> HF directory, both through xckpt.convert with the shipped rules
    xckpt.convert(tmp_path / "hf", tmp_path / "scanned", rules="hf_llama_to_scanned")
    back = xckpt.open(tmp_path / "scanned", rules="scanned_to_hf_llama")
    assert sorted(back.names()) == sorted(sd)
    got = back.read_all()
    for name, t in sd.items():
        assert got[name].dtype.name == "bfloat16"
        np.testing.assert_array_equal(got[name].view(np.int16), t.view(torch.int16).numpy(), err_msg=name)
    xckpt.convert(tmp_path / "scanned", tmp_path / "back", to_format="safetensors", rules="scanned_to_hf_llama")
    shutil.copy(tmp_path / "hf" / "config.json", tmp_path / "back" / "config.json")

    fresh = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    res = xt.load(tmp_path / "scanned", fresh.state_dict(), rules="scanned_to_hf_llama")
    assert res.missing == [] and res.unexpected == []
    # from_pretrained keeps its rotary buffers in float32 (a model cast with .to() does not), so
    # the round-tripped directory is compared with the original directory, both from_pretrained.
    original, reloaded = (
        LlamaForCausalLM.from_pretrained(tmp_path / d, dtype=torch.bfloat16).eval() for d in ("hf", "back")
    )
    for name, t in reloaded.state_dict().items():
        torch.testing.assert_close(t, sd[name], rtol=0, atol=0, msg=name)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, model(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(reloaded(ids).logits, original(ids).logits, rtol=0, atol=0)


def test_scanned_kernel_loads_sharded_into_jax_from_the_hf_checkpoint(llama: Any, tmp_path: Path) -> None:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    cfg, model = llama
    sd = model.state_dict()
    xt.save(sd, tmp_path / "hf")
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    name = "layers.mlp.up_proj.kernel"  # (D, L, I): D over "a", layers unsharded, I over "b"
    got = xj.load(tmp_path / "hf", {name: NamedSharding(mesh, P("a", None, "b"))}, rules="hf_llama_to_scanned")
    arr = got[name]
    assert arr.shape == (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size)
    want = np.stack(
        [sd[f"model.layers.{i}.mlp.up_proj.weight"].float().numpy().T for i in range(cfg.num_hidden_layers)], axis=1
    )
    np.testing.assert_array_equal(np.asarray(arr.astype(jnp.float32)), want)
