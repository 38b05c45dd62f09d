"""The layout arithmetic against torch's own placement semantics, and torch adapter helpers.

No process group is needed: torch's ``Shard._split_tensor`` and
``_StridedShard._split_tensor`` are applied to ``torch.arange`` per mesh dim and
compared, as index sets, with :func:`xckpt.layout.dim_indices` on random
meshes, shapes and placements.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from xckpt import layout as L
from xckpt.errors import LayoutError, ObjectError, UnsupportedPlacementError, XckptError
from xckpt.layout import dim_runs
from xckpt.torch._dtypes import as_numpy, dtype_name, torch_dtype
from xckpt.torch._placement import pieces_from_indices, pieces_from_runs, torch_to_layout
from xckpt.torch._state_dict import PerRank, flatten

EXAMPLES = settings(max_examples=200, deadline=None)


def torch_indices(shape, mesh_shape, coord, placements):
    """Per-dim global indices a coordinate holds, by torch's own ``_split_tensor``."""
    idx = [torch.arange(n) for n in shape]
    for m, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        on0 = _StridedShard(0, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(0)
        pieces, _ = on0._split_tensor(idx[p.dim], mesh_shape[m], with_padding=False)
        idx[p.dim] = pieces[coord[m]]
    return [sorted(i.tolist()) for i in idx]


def fsdp_rows(length, dp, tp, d, t):
    """FSDP2 + TP storage: chunk(chunk(rows, tp)[t], dp)[d], empty chunks kept."""

    def chunk(x, n, i):
        parts = list(torch.chunk(x, n)) if len(x) else []
        parts += [x[:0]] * (n - len(parts))
        return parts[i]

    return chunk(chunk(torch.arange(length), tp, t), dp, d).tolist()


@st.composite
def torch_layouts(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 12), min_size=ndim, max_size=ndim)))
    mesh_ndim = draw(st.integers(1, 3))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=mesh_ndim, max_size=mesh_ndim)))
    placements = []
    for _ in mesh:
        kind = draw(st.sampled_from(["shard", "strided", "replicate"]))
        d = draw(st.integers(0, ndim - 1))
        if kind == "shard":
            placements.append(Shard(d))
        elif kind == "strided":
            placements.append(_StridedShard(d, split_factor=draw(st.integers(1, 4))))
        else:
            placements.append(Replicate())
    return shape, mesh, placements


@EXAMPLES
@given(torch_layouts())
def test_dim_indices_match_torch_split_tensor(case):
    shape, mesh, placements = case
    ours = torch_to_layout(placements, "t")
    for coord in itertools.product(*(range(n) for n in mesh)):
        assert L.dim_indices(shape, mesh, coord, ours) == torch_indices(shape, mesh, coord, placements)


@EXAMPLES
@given(torch_layouts())
def test_boxes_tile_the_tensor_once_per_replica(case):
    """Every element is held by exactly prod(replicated axes) coordinates."""
    shape, mesh, placements = case
    ours = torch_to_layout(placements, "t")
    count = np.zeros(shape, dtype=np.int64)
    for coord in itertools.product(*(range(n) for n in mesh)):
        for b in L.boxes_for_coordinate(shape, mesh, coord, ours):
            count[b.slices()] += 1
    reps = int(np.prod([n for n, p in zip(mesh, placements) if isinstance(p, Replicate)] or [1]))
    assert (count == reps).all()


@EXAMPLES
@given(
    st.integers(0, 30), st.integers(1, 4), st.integers(1, 4), st.integers(1, 5)
)
def test_fsdp_rule_matches_chunk_of_chunk(length, dp, tp, cols):
    placements = [L.StridedShard(0, tp), L.Shard(0)]
    for d, t in itertools.product(range(dp), range(tp)):
        boxes = L.fsdp_boxes_for_coordinate((length, cols), (dp, tp), (d, t), placements)
        rows = [r for b in boxes for r in range(b.offset[0], b.end[0])]
        assert rows == fsdp_rows(length, dp, tp, d, t)


@EXAMPLES
@given(torch_layouts())
def test_pieces_reassemble_the_local_tensor(case):
    """Pieces' local slices, filled from the global tensor, give torch's local shard."""
    shape, mesh, placements = case
    ours = torch_to_layout(placements, "t")
    full = torch.arange(int(np.prod(shape)), dtype=torch.int64).reshape(shape)
    for coord in itertools.product(*(range(n) for n in mesh)):
        idx = torch_indices(shape, mesh, coord, placements)
        expect = full[np.ix_(*idx)] if all(idx) else torch.empty([len(i) for i in idx])
        local = torch.full([len(i) for i in idx], -1, dtype=torch.int64)
        for p in pieces_from_indices(L.dim_indices(shape, mesh, coord, ours), local):
            local[p.slices] = full[p.box.slices()]
        if local.numel():
            assert torch.equal(local, expect)


@EXAMPLES
@given(torch_layouts(), st.booleans())
def test_dim_runs_are_dim_indices_as_runs(case, fsdp):
    """dim_runs (range arithmetic, what loads and saves use) gives exactly the runs of
    dim_indices (index lists), in mesh order and in FSDP2's order, and the same pieces."""
    shape, mesh, placements = case
    ours = torch_to_layout(placements, "t")
    order = L.fsdp_order(ours) if fsdp else None
    if order is not None:
        ours = [L.Shard(p.dim) if isinstance(p, L.StridedShard) else p for p in ours]
    for coord in itertools.product(*(range(n) for n in mesh)):
        idx = L.dim_indices(shape, mesh, coord, ours, order=order)
        runs = dim_runs(shape, mesh, coord, ours, order=order)
        assert runs == [L.indices_to_runs(i) for i in idx]
        local = torch.empty([len(i) for i in idx])
        assert pieces_from_runs(runs, local) == pieces_from_indices(idx, local)


def test_dim_runs_raise_as_dim_indices_do():
    with pytest.raises(UnsupportedPlacementError, match=r"tensor 'w': Shard\(2\) names dim 2 but the tensor has 2"):
        dim_runs((4, 4), (2,), (0,), [L.Shard(2)], name="w")
    with pytest.raises(UnsupportedPlacementError, match=r"tensor 'w': split factor 0 must be >= 1"):
        dim_runs((4, 4), (2,), (0,), [L.StridedShard(0, 0)], name="w")


def test_torch_to_layout_converts_each_kind():
    got = torch_to_layout([Shard(1), _StridedShard(0, split_factor=3), Replicate()], "w")
    assert got == [L.Shard(1), L.StridedShard(0, 3), L.Replicate()]


def test_partial_placement_is_refused_naming_the_tensor():
    with pytest.raises(UnsupportedPlacementError, match=r"tensor 'layers.0.w' has a Partial placement .*redistribute"):
        torch_to_layout([Shard(0), Partial()], "layers.0.w")


@pytest.mark.parametrize(
    "dtype",
    [
        torch.bool, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
        torch.uint32, torch.uint64, torch.float16, torch.float32, torch.float64, torch.complex64,
        torch.complex128, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
        torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    ],
    ids=str,
)
def test_numpy_view_shares_memory_and_bits(dtype):
    t = torch.randint(0, 100, (3, 4)).to(dtype)
    a = as_numpy(t)
    assert torch_dtype(dtype_name(dtype)) == dtype
    assert a.shape == (3, 4) and a.dtype.itemsize == t.element_size()
    assert a.ctypes.data == t.data_ptr()
    assert bytes(a.tobytes()) == bytes(t.contiguous().view(torch.uint8).numpy().tobytes())


def test_unsupported_dtype_names_the_tensor():
    with pytest.raises(ObjectError, match=r"tensor 'x' has dtype torch.float8_e8m0fnu.*Cast it"):
        dtype_name(torch.float8_e8m0fnu, "x")


def test_flatten_joins_nested_names_and_keeps_object_leaves():
    sd = {
        "model": {"w": torch.ones(1)},
        "optim": {"state": {0: {"exp_avg": torch.zeros(1), "step": 3}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
        "extra": PerRank({"a": 1}),
        "empty": {},
        "cfg": {"lr": 0.1, 3: [1]},
        "pairs": [torch.ones(1), "x"],
    }
    flat, slots = flatten(sd)
    assert list(flat) == [
        "model.w", "optim.state.0.exp_avg", "optim.state.0.step", "optim.param_groups", "extra",
        "empty", "cfg", "pairs.0", "pairs.1",
    ]
    assert slots["optim.state.0.step"].container is sd["optim"]["state"][0]
    assert slots["pairs.1"].key == 1


def test_flatten_refuses_colliding_names():
    with pytest.raises(XckptError, match=r"two entries of the state dict flatten to the name 'a.b'"):
        flatten({"a.b": 1, "a": {"b": torch.ones(1)}})


def test_layout_error_type_is_value_error():
    assert issubclass(LayoutError, ValueError)


def test_whole_tensors_save_and_load_in_order_bit_exact(tmp_path):
    """Plain tensors and parameters take the whole-tensor path on save and load: the
    manifest keeps the state dict's order, every element comes back bit for bit, and
    a target that does not fit still gets the precise error."""
    import xckpt
    import xckpt.torch as xt
    from xckpt.errors import DtypeMismatchError, ShapeMismatchError

    g = torch.Generator().manual_seed(0)
    sd = {
        "bf": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "param": torch.nn.Parameter(torch.randn(4, generator=g)),
        "empty": torch.empty(0, 3),
        "arr": np.arange(5.0),
        "scalar": torch.tensor(-3, dtype=torch.int64),
        "big": torch.randn(300_000, generator=g),
        "f8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
    }
    path = str(tmp_path / "c")
    xt.save(sd, path)
    assert xckpt.open(path).names() == list(sd)
    tgt = {k: np.zeros_like(v) if isinstance(v, np.ndarray) else torch.zeros_like(v.detach()) for k, v in sd.items()}
    tgt["param"] = torch.nn.Parameter(torch.zeros(4))
    xt.load(path, tgt)
    for k, v in sd.items():
        got = tgt[k]
        if isinstance(v, np.ndarray):
            assert got.tobytes() == v.tobytes(), k
        else:
            assert got.dtype == v.dtype and got.shape == v.shape, k
            assert as_numpy(got.detach()).tobytes() == as_numpy(v.detach()).tobytes(), k
    with pytest.raises(DtypeMismatchError, match=r"tensor 'bf': saved as bfloat16, the target is float32"):
        xt.load(path, {"bf": torch.zeros(2, 3)})
    with pytest.raises(ShapeMismatchError, match=r"tensor 'big': saved with global shape \(300000,\), the target"):
        xt.load(path, {"big": torch.zeros(3)})
