"""A managed-collision group loaded into JAX on W' devices: each device holds what
torch rank r' of W' loads (same five steps), not a positional slice."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_value_helpers import COUNTS, MOM, RAW, ROWS, WEIGHT, make_rank_state, named
from test_value_ranges import _decl, load_sim, save_sim

import xckpt
import xckpt.jax as xj
from xckpt.errors import DtypeMismatchError

N, INPUT = 48, 10_000
ROW_NAMES = [RAW, ROWS, COUNTS, WEIGHT, MOM]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("jaxvg") / "c")
    states = [make_rank_state(N, 3, r, INPUT, seed=5) for r in range(3)]
    save_sim(path, [named(s) for s in states], [_decl(INPUT, chunk_rows=5)])
    return path


@pytest.mark.parametrize("devices", [2, 4, 8], ids=lambda d: f"{d}dev")
def test_devices_hold_what_torch_ranks_load(saved: str, devices: int) -> None:
    mesh = jax.make_mesh((devices,), ("x",), devices=jax.devices()[:devices])
    target = {n: NamedSharding(mesh, P("x", None) if n in (WEIGHT, MOM) else P("x")) for n in ROW_NAMES}
    with jax.enable_x64(True):
        got = xj.load(saved, target)
    torch_ranks, _ = load_sim(saved, N, devices)
    rows = N // devices
    for r in range(devices):
        for n in ROW_NAMES:
            assert np.array_equal(np.asarray(got[n])[r * rows : (r + 1) * rows], torch_ranks[r][n]), (r, n)


def test_weight_sharded_on_both_dims(saved: str) -> None:
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    with jax.enable_x64(True):
        got = xj.load(saved, {WEIGHT: NamedSharding(mesh, P("x", "y")), RAW: NamedSharding(mesh, P("x"))})
    torch_ranks, _ = load_sim(saved, N, 4)
    assert np.array_equal(np.asarray(got[WEIGHT]), np.concatenate([t[WEIGHT] for t in torch_ranks]))


def test_columns_only_sharding_is_one_rank(saved: str) -> None:
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    with jax.enable_x64(True):
        got = xj.load(saved, {WEIGHT: NamedSharding(mesh, P(None, "x"))})
    one, _ = load_sim(saved, N, 1)
    assert np.array_equal(np.asarray(got[WEIGHT]), one[0][WEIGHT])


def test_int64_group_without_x64_is_refused(saved: str) -> None:
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    with pytest.raises(DtypeMismatchError, match=r"_mch_sorted_raw_ids': saved as int64.*jax_enable_x64"):
        xj.load(saved, {RAW: NamedSharding(mesh, P("x"))})


def test_replicated_target_loads_the_whole_table_by_value(saved: str) -> None:
    mesh = jax.make_mesh((8,), ("x",))
    with jax.enable_x64(True):
        got = xj.load(saved, {RAW: NamedSharding(mesh, P())})
    one, _ = load_sim(saved, N, 1)
    assert np.array_equal(np.asarray(got[RAW]), one[0][RAW])
    assert os.path.exists(saved) and xckpt.open(saved).info(RAW).value_range is not None
