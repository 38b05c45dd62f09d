"""xckpt.lightning.XckptCheckpointIO with a real Lightning Trainer: ModelCheckpoint writes xckpt
checkpoints (directories where Lightning names files), save_top_k prunes them, and
trainer.fit(ckpt_path=...) resumes to the weights an uninterrupted run reaches, with and
without AsyncCheckpointIO; a removal of a path whose write is queued or running drops it."""

from __future__ import annotations

import os
import threading

import pytest
import torch

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

import xckpt  # noqa: E402
from xckpt.errors import CheckpointNotFoundError, ObjectError  # noqa: E402
from xckpt.lightning import XckptCheckpointIO  # noqa: E402


class _Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, on_epoch=True, on_step=False)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 8, generator=g)
        ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
        return torch.utils.data.DataLoader(ds, batch_size=16)


def _fit(root, epochs: int, plugin=None, ckpt_path=None, top_k: int = 2) -> tuple[_Regression, ModelCheckpoint]:
    model = _Regression()
    cb = ModelCheckpoint(dirpath=root, monitor="train_loss", mode="max", save_top_k=top_k, save_last=True)
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        callbacks=[cb],
        plugins=[plugin] if plugin is not None else None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return model, cb


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> _Regression:
    """Four epochs without a break (torch.save checkpoints, Lightning's default)."""
    return _fit(tmp_path_factory.mktemp("straight"), 4)[0]


@pytest.mark.parametrize("wrap", ["sync", "async"])
def test_trainer_saves_prunes_and_resumes(tmp_path, straight, wrap):
    io = XckptCheckpointIO()
    plugin = AsyncCheckpointIO(io) if wrap == "async" else io
    # mode="max": the loss falls, so every epoch's checkpoint is among the worst and
    # ModelCheckpoint removes the previous one each epoch: pruning is exercised.
    _, cb = _fit(tmp_path, 3, plugin)
    kept = sorted(os.listdir(tmp_path))
    assert kept == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    for name in kept:
        assert os.path.isdir(tmp_path / name)  # a directory where Lightning names a file
        with xckpt.open(tmp_path / name) as ck:
            assert "state_dict.layer.0.weight" in ck.names()
            assert "optimizer_states.0.state.0.exp_avg" in ck.names()
    assert sorted(cb.best_k_models) == [str(tmp_path / "epoch=0-step=4.ckpt"), str(tmp_path / "epoch=1-step=8.ckpt")]

    io2 = XckptCheckpointIO()
    resumed, _ = _fit(tmp_path / "more", 4, AsyncCheckpointIO(io2) if wrap == "async" else io2, cb.last_model_path)
    for (n, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), n


def test_load_returns_the_dict_lightning_saved(tmp_path):
    _fit(tmp_path, 1, XckptCheckpointIO(), top_k=1)
    ours = XckptCheckpointIO().load_checkpoint(tmp_path / "last.ckpt")
    assert ours["epoch"] == 0 and ours["global_step"] == 4
    assert list(ours["state_dict"]) == ["layer.0.weight", "layer.0.bias", "layer.2.weight", "layer.2.bias"]
    assert list(ours["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
    assert ours["lr_schedulers"][0]["last_epoch"] == 1
    cb_state = next(v for k, v in ours["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert list(cb_state["best_k_models"]) == [str(tmp_path / "epoch=0-step=4.ckpt")]


def _blocked(async_io: AsyncCheckpointIO) -> threading.Event:
    """Occupy the AsyncCheckpointIO's one worker thread until the event is set."""
    go = threading.Event()
    async_io._ensure_setup()
    async_io._executor.submit(go.wait, 60)
    return go


def test_removing_a_queued_write_drops_it(tmp_path):
    io = XckptCheckpointIO()
    aio = AsyncCheckpointIO(io)
    go = _blocked(aio)
    aio.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "epoch": 0}, tmp_path / "a.ckpt")
    aio.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "epoch": 1}, tmp_path / "b.ckpt")
    aio.remove_checkpoint(tmp_path / "a.ckpt")  # still queued behind the blocked worker
    go.set()
    aio.teardown()
    assert sorted(os.listdir(tmp_path)) == ["b.ckpt"]
    io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "a.ckpt")  # the drop was used up
    assert os.path.isdir(tmp_path / "a.ckpt")


class _SlowIO(XckptCheckpointIO):
    def __init__(self) -> None:
        super().__init__()
        self.started, self.go = threading.Event(), threading.Event()

    def _write(self, checkpoint, path):
        self.started.set()
        self.go.wait(60)
        super()._write(checkpoint, path)


def test_removing_a_running_write_deletes_it_when_done(tmp_path):
    io = _SlowIO()
    aio = AsyncCheckpointIO(io)
    aio.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, tmp_path / "a.ckpt")
    assert io.started.wait(60)
    aio.remove_checkpoint(tmp_path / "a.ckpt")
    io.go.set()
    aio.teardown()
    assert os.listdir(tmp_path) == []


def test_errors(tmp_path):
    io = XckptCheckpointIO()
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "x.ckpt", storage_options={"a": 1})
    with pytest.raises(ObjectError, match="object"):
        io.save_checkpoint({"w": torch.ones(1), "hp": object()}, tmp_path / "y.ckpt")
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found") as e:
        io.load_checkpoint(tmp_path / "missing.ckpt")
    assert isinstance(e.value, CheckpointNotFoundError)
    io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "z.ckpt")
    io.save_checkpoint({"w": torch.zeros(1)}, tmp_path / "z.ckpt")  # replaced, as torch.save's file is
    assert torch.equal(io.load_checkpoint(tmp_path / "z.ckpt")["w"], torch.zeros(1))
    torch.save({"w": 1}, tmp_path / "old.ckpt")
    io.remove_checkpoint(tmp_path / "old.ckpt")  # a torch.save file from before the switch
    io.remove_checkpoint(tmp_path / "z.ckpt")
    assert sorted(os.listdir(tmp_path)) == []
