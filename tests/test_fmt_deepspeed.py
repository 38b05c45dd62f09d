"""DeepSpeed ZeRO (stages 1, 2, 3; fp32 and bf16) and universal checkpoints as an xckpt source.

The fixtures (``tests/fixtures_foreign/deepspeed``) were written by real DeepSpeed 0.19.8; their
truth is DeepSpeed's own recovery (``zero_to_fp32`` for the weights, ``ds_to_universal`` for the
moments). Read bit-exact into numpy, into DTensors on 2 gloo ranks and into JAX on 8 simulated
devices; converted to every output format and read back by each format's own library; read with
no torch at all; DeepSpeed's pickled helper classes never run. The conformance suite runs on a
ZeRO-2 checkpoint written with torch.save in DeepSpeed's layout (``tests/ds_synth.py``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conformance import OBJECTS, TRUTH, SourceTests, Written, same
from dist_utils import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from readback import OUTPUTS, read_back

import xckpt
from xckpt.converters import deepspeed
from xckpt.converters._deepspeed_layout import range_box, zero3_pieces, zero12_pieces
from xckpt.errors import IncompleteCheckpointError, ObjectError, XckptError

FIX = Path(__file__).parent / "fixtures_foreign" / "deepspeed"
#: ``z1_bf16_tied*``: ZeRO 1, bf16, 3 ranks, a tied head, two parameter groups (DeepSpeed's ZeRO
#: optimizer; ``_fp32acc``: its ``BF16_Optimizer``).
ZERO = ["z1_fp32", "z2_bf16", "z3_fp32", "z1_bf16_tied", "z1_bf16_tied_fp32acc"]
CKPTS = [*ZERO, "universal_z2_bf16"]


def truth(ck: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with np.load(FIX / f"{ck}.truth.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, json.loads((FIX / f"{ck}.truth.json").read_text())


# -- the real fixtures ---------------------------------------------------------------------


@pytest.mark.parametrize("ck", CKPTS)
def test_reads_bit_exact(ck: str) -> None:
    want, meta = truth(ck)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # everything is read: nothing to warn about
        src = xckpt.open(str(FIX / ck))
    with src:
        assert src.format == "deepspeed" and xckpt.formats.detect(str(FIX / ck)) == "deepspeed"
        assert sorted(src.names()) == sorted(want) and src.metadata["notes"] == []
        got = src.read_all(show_progress=False)
        assert [n for n, a in want.items() if not same(got[n], a)] == []
        assert src.verify(show_progress=False) == []


@pytest.mark.parametrize("ck", ZERO)
def test_names_as_zero_to_fp32_and_ds_to_universal(ck: str) -> None:
    _, meta = truth(ck)
    with xckpt.open(str(FIX / ck)) as src:
        names = src.names()
        weights = [n for n in names if not n.startswith("optimizer.")]
        assert weights == meta["zero_to_fp32_keys"]  # buffers first, then parameters in order
        assert sorted(n for n in names if n.startswith("optimizer.")) == sorted(meta["moments"])
        assert src.world_size == meta["world_size"] and src.metadata["zero_stage"] == meta["stage"]


@pytest.mark.parametrize("ck", CKPTS)
def test_tag_directory_opens_alone(ck: str) -> None:
    want, _ = truth(ck)
    with xckpt.open(str(FIX / ck / "global_step3")) as src:
        assert src.format == "deepspeed" and sorted(src.names()) == sorted(want)
        assert same(src.read("l1.weight"), want["l1.weight"])


@pytest.mark.parametrize("ck", CKPTS)
def test_opens_from_a_kvstore_location(ck: str) -> None:
    """Any location a checkpoint can live in: here tensorstore's file kvstore (listed, byte ranges)."""
    want, _ = truth(ck)
    with xckpt.open({"driver": "file", "path": str(FIX / ck) + "/"}) as src:
        assert src.format == "deepspeed"
        got = src.read_all(show_progress=False)
        assert sorted(got) == sorted(want) and [n for n, a in want.items() if not same(got[n], a)] == []
        assert src.objects(["global_steps"]) == {"global_steps": 3}


@pytest.mark.parametrize("ck", CKPTS)
def test_objects(ck: str) -> None:
    _, meta = truth(ck)
    with xckpt.open(str(FIX / ck)) as src:
        objs = src.objects()
        assert src.pickled_objects() == set()
        for p in meta["params"]:
            assert objs[f"optimizer.state.{p}.step"] == meta["optimizer_step"]
        assert objs["global_steps"] == meta["global_steps"] and objs["my_epoch"] == 1
        assert objs["ds_version"] == meta["versions"]["deepspeed"]
        groups = objs["optimizer.param_groups"]
        assert [n for g in groups for n in g["params"]] == meta["params"]
        assert len(groups) == meta.get("groups", 1) and all(g["lr"] == 0.01 for g in groups)
        assert not any(k in objs for k in ("module", "param_shapes", "buffer_names", "optimizer"))


def test_pieces_are_chunks_by_rank() -> None:
    with xckpt.open(str(FIX / "z2_bf16")) as src:  # l1.weight: 4 rows on rank 0, 8 on rank 1
        chunks = src.info("l1.weight").chunks
        assert [(c.offset, c.shape, c.rank) for c in chunks] == [((0, 0), (4, 8), 0), ((4, 0), (8, 8), 1)]
        assert [(c.rank, c.shape) for c in src.info("optimizer.state.l1.weight.exp_avg").chunks] == [
            (0, (4, 8)),
            (1, (8, 8)),
        ]
        assert src.info("counter").dtype == "float32"  # a buffer, as zero_to_fp32 returns it
    with xckpt.open(str(FIX / "z3_fp32")) as src:  # stage 3: every parameter split in two
        assert [(c.offset, c.shape, c.rank) for c in src.info("emb.weight").chunks] == [
            ((0, 0), (8, 8), 0),
            ((8, 0), (8, 8), 1),
        ]
        # (5, 12) split at element 30 (half a row): one chunk assembled from both ranks' pieces
        (c,) = src.info("l2.weight").chunks
        assert c.shape == (5, 12) and "2 pieces" in c.key


@pytest.mark.parametrize("ck", ["z1_bf16_tied", "z1_bf16_tied_fp32acc"])
def test_zero1_bf16_three_ranks_tied_head_two_groups(ck: str) -> None:
    """ZeRO 1 with bf16 on 3 ranks: DeepSpeed's ZeRO optimizer saves rank 2's fp32 partition of group 0
    without its 4 padding elements (104) and its Adam state with them (108); BF16_Optimizer keeps both
    padded. Either way every moment is read as ds_to_universal writes it."""
    want, meta = truth(ck)
    assert meta["ds_optimizer"] == ("BF16_Optimizer" if ck.endswith("fp32acc") else "DeepSpeedZeroOptimizer")
    with xckpt.open(str(FIX / ck)) as src:
        assert src.world_size == 3 and src.metadata["notes"] == []
        moments = sorted(n for n in src.names() if n.startswith("optimizer."))
        assert moments == sorted(meta["moments"]) and len(moments) == 2 * len(meta["params"])
        # rows 0-10 of l1.weight in rank 1's partition, row 11 in rank 2's; l2.weight all in rank 2's,
        # up to element 104 (byte 416), just before the padding; keys give byte ranges, as every format's do
        for name in ("l2.weight", "optimizer.state.l2.weight.exp_avg"):
            (c,) = src.info(name).chunks
            assert (c.rank, c.shape) == (2, (8, 12)) and c.key.endswith(
                "rank_2_mp_rank_00_optim_states.pt[32:416]"
            )
        assert [(c.rank, c.shape) for c in src.info("optimizer.state.l1.weight.exp_avg_sq").chunks] == [
            (1, (11, 8)),
            (2, (1, 8)),
        ]
        # the tied head: zero_to_fp32's alias of emb.weight (its fp32 master), no moments of its own
        assert meta["shared_params"] == [["head.weight", "emb.weight"]]
        assert same(src.read("head.weight"), want["emb.weight"]) and "head.weight" in want
        assert not any(n.startswith("optimizer.state.head.") for n in src.names() + src.object_names())
        groups = src.objects(["optimizer.param_groups"])["optimizer.param_groups"]
        assert [(g["params"], g["weight_decay"]) for g in groups] == [
            (["emb.weight", "l1.weight", "l2.weight"], 0.1),
            (["l1.bias", "ln.weight", "ln.bias"], 0.0),
        ]


def test_zero1_bf16_loads_into_plain_tensors() -> None:
    """xckpt.torch.load into plain (unsharded) tensors: fp32 weights and moments bit-exact, the step
    an object."""
    torch = pytest.importorskip("torch")
    import xckpt.torch as xt

    for ck in ("z1_bf16_tied", "z1_bf16_tied_fp32acc"):
        want, _ = truth(ck)
        sd: dict[str, Any] = {n: torch.zeros(a.shape) for n, a in want.items()}
        sd["optimizer.state.ln.bias.step"] = None
        res = xt.load(str(FIX / ck), sd)
        assert list(res.missing) == [] and sd["optimizer.state.ln.bias.step"] == 3.0
        assert [n for n, a in want.items() if not same(sd[n].numpy(), a)] == []


def test_assembled_parameter_reads_only_what_a_box_needs() -> None:
    want, _ = truth("z3_fp32")
    with xckpt.open(str(FIX / "z3_fp32")) as src:
        t = src.info("l2.weight")
        for index in [(slice(1, 2), slice(0, 12)), (slice(2, 3), slice(3, 9)), (slice(0, 5), slice(4, 5)), 4]:
            box = xckpt.layout.box_from_index(t.shape, index)
            assert same(src.read("l2.weight", index), np.array(want["l2.weight"][box.slices()], order="C"))
        # row 2 = elements 24..35: 6 from rank 0's piece, 6 from rank 1's
        units = src.read_units("l2.weight", t.chunks[0], xckpt.layout.Box((2, 0), (1, 12)), 4)
        assert sorted(units.values()) == [24, 24]


def test_reads_only_the_bytes_a_box_needs(tmp_path: Path) -> None:
    """Files too big to be read whole: a box costs its own bytes of the rank files (byte ranges)."""
    pytest.importorskip("torch")
    from ds_synth import write_zero

    rng = np.random.default_rng(1)
    a = rng.standard_normal(7).astype(np.float32)
    big = rng.standard_normal((300, 100)).astype(np.float32)  # starts at element 7: split mid-row
    rows = rng.standard_normal((400, 64)).astype(np.float32)  # alone in its group: split at row 200
    write_zero(str(tmp_path / "ck"), [{"a": a, "big": big}, {"rows": rows}])
    with xckpt.open(str(tmp_path / "ck")) as src:
        assert len(src.info("big").chunks) == 1 and len(src.info("rows").chunks) == 2
        before = src.bytes_read
        assert same(src.read("big", (slice(149, 150),)), big[149:150])  # 97 elements on rank 0, 3 on rank 1
        assert src.bytes_read - before == 400
        units = src.read_units("big", src.info("big").chunks[0], xckpt.layout.Box((149, 0), (1, 100)), 4)
        assert sorted(units.values()) == [12, 388]
        before = src.bytes_read
        assert same(src.read("rows", (slice(190, 210), slice(0, 64))), rows[190:210])
        assert src.bytes_read - before == 20 * 64 * 4
        before = src.bytes_read
        assert same(src.read("big"), big) and same(
            src.read("optimizer.state.big.exp_avg"), np.zeros_like(big)
        )
        assert src.bytes_read - before == 2 * big.nbytes


_NO_TORCH = r"""
import json, sys
sys.modules["torch"] = None
sys.modules["deepspeed"] = None
import numpy as np
import xckpt
out = {}
for ck in sys.argv[2:]:
    with np.load(f"{sys.argv[1]}/{ck}.truth.npz") as z, xckpt.open(f"{sys.argv[1]}/{ck}") as src:
        got = src.read_all(show_progress=False)
        out[ck] = [k for k in z.files if got[k].tobytes() != z[k].tobytes()]
        out[ck + ".step"] = src.objects(["optimizer.state.emb.weight.step"])["optimizer.state.emb.weight.step"]
print(json.dumps(out))
"""


def test_reads_without_torch_or_deepspeed() -> None:
    r = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, str(FIX), *CKPTS],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for ck in CKPTS:
        assert got[ck] == [] and got[ck + ".step"] == 3.0


# -- the layout arithmetic -------------------------------------------------------------------


def _boxes(shape: tuple[int, ...]) -> list[xckpt.layout.Box]:
    ranges = [[(a, b) for a in range(n) for b in range(a + 1, n + 1)] for n in shape]
    return [
        xckpt.layout.Box(tuple(r[0] for r in rs), tuple(r[1] - r[0] for r in rs))
        for rs in itertools.product(*ranges)
    ]


@settings(max_examples=150, deadline=None)
@given(shape=st.lists(st.integers(1, 4), max_size=3).map(tuple), data=st.data())
def test_range_box_is_the_box_of_exactly_that_range(shape: tuple[int, ...], data: st.DataObject) -> None:
    n = math.prod(shape)
    a = data.draw(st.integers(0, n - 1))
    b = data.draw(st.integers(a + 1, n))
    idx = np.arange(n).reshape(shape)
    box = range_box(shape, a, b)
    if box is not None:
        assert np.array_equal(np.ravel(idx[box.slices()]), np.arange(a, b))
    else:  # no box of the shape holds exactly these elements
        assert not any(sorted(np.ravel(idx[bx.slices()])) == list(range(a, b)) for bx in _boxes(shape))


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=2).map(tuple), min_size=1, max_size=5),
    world=st.integers(1, 4),
    groups=st.lists(st.integers(1, 30), min_size=1, max_size=3),
)
def test_zero_pieces_tile_every_parameter(
    shapes: list[tuple[int, ...]], world: int, groups: list[int]
) -> None:
    params = {f"p{i}": s for i, s in enumerate(shapes)}
    # stage 3: each parameter ceil(numel / world) per rank, the ranks' flat groups of equal sizes
    total = sum(math.ceil(math.prod(s) / world) for s in shapes)
    split = (
        [total]
        if total == 0
        else [len(c) for c in np.array_split(np.arange(total), len(groups)) if len(c)] or [0]
    )
    # stages 1/2 as DeepSpeed saves them: the group aligned to 2 * world elements, each rank an equal
    # part; its ZeRO optimizer saves the last rank's part without the padding
    numel = sum(math.prod(s) for s in shapes)
    per = 2 * math.ceil(numel / (2 * world))
    stripped = [[per]] * (world - 1) + [[max(0, numel - per * (world - 1))]]
    for pieces in (
        zero3_pieces(params, [split] * world, "ck"),
        zero12_pieces([params], [[math.ceil(numel / world)]] * world, None, "ck"),
        zero12_pieces([params], [[per]] * world, None, "ck"),
        zero12_pieces([params], stripped, None, "ck"),
    ):
        for name, shape in params.items():
            covered = sorted((p.at, p.at + p.length) for p in pieces[name])
            assert sum(b - a for a, b in covered) == math.prod(shape)
            assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))


# -- safety --------------------------------------------------------------------------------


class _Run:
    """Pickles as ``os.system("touch <marker>")``: run, it leaves the marker."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_foreign_globals_never_run(tmp_path: Path) -> None:
    """``os.system`` pickled in the model states and inside the optimizer state: opening, listing
    and reading everything else calls nothing (inert placeholders)."""
    torch = pytest.importorskip("torch")
    from ds_synth import deepspeed_classes, write_zero

    marker = tmp_path / "ran"
    path = tmp_path / "ck"
    w = np.arange(8, dtype=np.float32).reshape(2, 4)
    d = Path(write_zero(str(path), [{"w": w}], client_state={"evil": _Run(str(marker))}))
    opt = d / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with deepspeed_classes():
        sd = torch.load(opt, weights_only=False)
        sd["optimizer_state_dict"]["evil"] = _Run(str(marker))
        torch.save(sd, opt)
    assert not marker.exists()
    with xckpt.open(str(path)) as src:
        assert src.pickled_objects() == {"evil"}
        assert same(src.read("w"), w)
        with pytest.raises(ObjectError, match=r"'evil'.*allow_pickle=True"):
            src.objects(["evil"])
        src.objects([n for n in src.object_names() if n != "evil"])
        assert src.verify(show_progress=False) == []
    assert not marker.exists()


def test_errors_name_the_checkpoint_and_the_fix(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(FIX / "z3_fp32", ck)
    (ck / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(
        IncompleteCheckpointError, match=r"partitioned over 2 ranks but 1 \*_optim_states\.pt"
    ):
        deepspeed.open(str(ck))
    (ck / "latest").write_text("global_step9")
    with pytest.raises(IncompleteCheckpointError, match=r"'latest' names 'global_step9', which is missing"):
        deepspeed.open(str(ck))
    ck2 = tmp_path / "ck2"
    shutil.copytree(FIX / "z1_fp32", ck2)
    shutil.copy(
        ck2 / "global_step3" / "mp_rank_00_model_states.pt",
        ck2 / "global_step3" / "mp_rank_01_model_states.pt",
    )
    with pytest.raises(XckptError, match=r"model-parallel ranks other than 0.*ds_to_universal"):
        deepspeed.open(str(ck2))
    ck3 = tmp_path / "ck3"
    shutil.copytree(FIX / "z1_fp32", ck3)
    f = ck3 / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(XckptError, match=r"zero_pp_rank_0_mp_rank_00_optim_states\.pt"):
        deepspeed.open(str(ck3))
    with pytest.raises(XckptError, match=r"does not write them.*torch-dcp"):
        xckpt.convert(str(FIX / "z1_fp32"), str(tmp_path / "out"), to_format="deepspeed", show_progress=False)
    assert not (tmp_path / "out").exists()


def _edit_optim(tag_dir: str, edit: Any) -> None:
    """``edit(rank, optimizer_state_dict)`` on every rank's optimizer file (DeepSpeed's classes as stand-ins)."""
    import torch
    from ds_synth import deepspeed_classes

    files = sorted(Path(tag_dir).glob("*optim_states.pt"))
    with deepspeed_classes():
        for r, f in enumerate(files):
            sd = torch.load(f, weights_only=False)
            edit(r, sd["optimizer_state_dict"])
            torch.save(sd, f)


def _open_noting(path: str, count: int) -> Any:
    """Open ``path``, which must warn ``count`` times (from the caller's line): the notes."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        src = xckpt.open(path)
    assert [w.filename for w in rec] == [__file__] * count, [str(w.message) for w in rec]
    assert [str(w.message) for w in rec] == [
        f"DeepSpeed checkpoint {path!r}: {n}" for n in src.metadata["notes"]
    ]
    return src


def test_optimizer_state_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    """State xckpt cannot present per parameter is never silently absent: a warning at open and
    ``metadata["notes"]`` name it; everything else is read."""
    torch = pytest.importorskip("torch")
    from ds_synth import write_zero

    rng = np.random.default_rng(4)
    a, b, c = (rng.standard_normal(s).astype(np.float32) for s in ((3, 4), (5,), (2, 3)))
    path = str(tmp_path / "ck")
    tag = write_zero(path, [{"a": a, "b": b}, {"c": c}])

    def edit(r: int, osd: dict[str, Any]) -> None:
        state = osd["base_optimizer_state"]["state"]
        state[0]["odd"] = torch.zeros(7)  # not laid out like the partitions (9 elements per rank)
        if r == 0:
            state[1]["max_exp_avg_sq"] = torch.zeros(3)  # flat on rank 0, nothing on rank 1
        state[5] = {"exp_avg": torch.zeros(2)}  # no such group

    _edit_optim(tag, edit)
    src = _open_noting(path, 3)
    with src:
        extra, odd, amax = src.metadata["notes"]
        assert (
            "optimizer state entries [5] (zero_pp_rank_0_mp_rank_00_optim_states.pt and 1 more) belong"
            in extra
        )
        assert odd.startswith(
            "optimizer state 'odd' of 2 parameters (a, b) is not read: group 0: rank 0 holds a tensor of "
            "shape [7] where the rank's flat partition holds 9 elements"
        )
        assert amax.startswith(
            "optimizer state 'max_exp_avg_sq' of 1 parameter (c) is not read: group 1: rank 1 holds nothing"
        )
        assert sorted(n for n in src.names() if n.startswith("optimizer.")) == [
            f"optimizer.state.{p}.{k}" for p in "abc" for k in ("exp_avg", "exp_avg_sq")
        ]
        assert same(src.read("a"), a) and same(src.read("c"), c)
        assert src.objects(["optimizer.state.c.step"]) == {"optimizer.state.c.step": 3.0}

    def elastic(r: int, osd: dict[str, Any]) -> None:  # the per-group state as a list
        osd["base_optimizer_state"] = list(osd["base_optimizer_state"]["state"].values())

    _edit_optim(tag, elastic)
    with _open_noting(path, 1) as src:
        assert src.metadata["notes"][0].startswith(
            "no optimizer state is read: base_optimizer_state of zero_pp_rank_0_mp_rank_00_optim_states.pt "
            "holds no per-group 'state' dict (list;"
        )
        assert not any(n.startswith("optimizer.state.") for n in src.names() + src.object_names())
        assert same(src.read("b"), b)


def test_universal_files_that_are_not_read_are_named(tmp_path: Path) -> None:
    ck = tmp_path / "u"
    shutil.copytree(FIX / "universal_z2_bf16", ck)
    zero = ck / "global_step3" / "zero"
    (zero / "l1.weight" / "exp_avg_max.pt").write_bytes(b"not read")
    (zero / "ln.bias" / "fp32.pt").unlink()
    with _open_noting(str(ck), 2) as src:
        assert src.metadata["notes"] == [
            "zero/l1.weight: ['exp_avg_max.pt'] are not read (xckpt reads fp32.pt, exp_avg.pt, exp_avg_sq.pt, "
            "step.pt, the files ds_to_universal writes)",
            "zero/ln.bias holds no fp32.pt; its files ['exp_avg.pt', 'exp_avg_sq.pt', 'step.pt'] are not read",
        ]
        assert "ln.bias" not in src and same(
            src.read("l1.weight"), truth("universal_z2_bf16")[0]["l1.weight"]
        )


def test_not_a_deepspeed_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("global_step1")
    assert not deepspeed.detect(str(tmp_path))
    with pytest.raises(XckptError, match=r"no \*_model_states\.pt|names 'global_step1', which is missing"):
        deepspeed.open(str(tmp_path))


# -- torch, JAX and conversions -------------------------------------------------------------


def _torch_body(rank: int, world: int, root: str) -> dict[str, list[str]]:
    """Load each fixture into DTensors sharded on their last dim over ``world`` ranks."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import xckpt.torch as xt

    mesh = DeviceMesh("cpu", list(range(world)))
    out: dict[str, list[str]] = {}
    for ck in CKPTS:
        with np.load(f"{root}/{ck}.truth.npz") as z:
            want = {k: z[k] for k in z.files}
        sd = {
            n: distribute_tensor(torch.zeros(a.shape), mesh, [Shard(a.ndim - 1)], src_data_rank=None)
            for n, a in want.items()
        }
        sd["optimizer.state.l1.weight.step"] = None
        res = xt.load(f"{root}/{ck}", sd)
        bad = [n for n, a in want.items() if not np.array_equal(sd[n].full_tensor().numpy(), a)]
        bad += [] if sd["optimizer.state.l1.weight.step"] == 3.0 else ["step"]
        out[ck] = bad + list(res.missing)
    return out


@pytest.mark.slow
def test_torch_load_into_dtensors_at_another_world_size() -> None:
    # Saved by 2 ranks; loaded by 3 (uneven shards: 8 columns as 3+3+2, 5 as 2+2+1).
    for rank_result in run_ranks(_torch_body, 3, str(FIX), timeout=300):
        assert rank_result == {ck: [] for ck in CKPTS}


@pytest.mark.parametrize("ck", ["z2_bf16", "z3_fp32"])
def test_jax_load_on_eight_devices(ck: str) -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import xckpt.jax as xj

    want, _ = truth(ck)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("x", "y"))
    target = {}
    for n, a in want.items():
        spec = [
            ax if i < a.ndim and a.shape[i] % mesh.shape[ax] == 0 else None for i, ax in enumerate(("x", "y"))
        ]
        target[n] = NamedSharding(mesh, P(*spec[: a.ndim]))
    got = xj.load(str(FIX / ck), target)
    for n, arr in got.items():
        assert arr.sharding == target[n]
        for shard in arr.addressable_shards:
            assert same(np.asarray(shard.data), np.array(want[n][shard.index], order="C")), (n, shard.index)


@pytest.mark.parametrize("fmt,dst", OUTPUTS)
def test_convert_to_every_output(fmt: str, dst: str, tmp_path: Path) -> None:
    want, _ = truth("z2_bf16")
    out = str(tmp_path / dst)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # objects an output cannot hold are dropped with a warning
        xckpt.convert(str(FIX / "z2_bf16"), out, to_format=fmt, show_progress=False)
    got = read_back(fmt, out)
    assert sorted(got) == sorted(want)
    assert [n for n, a in want.items() if not same(got[n], a)] == []


# -- conformance: a ZeRO-2 checkpoint in DeepSpeed's layout, written with torch.save -----------

#: zero_to_fp32 casts floating buffers to float32: those of TRUTH cannot come back as saved.
_CAST = {
    n
    for n, a in TRUTH.items()
    if a.dtype.kind == "f" and a.dtype != np.float32 or a.dtype.name.startswith(("bfloat", "float8"))
}
_PARAMS = ("model.w", "model.scalar", "model.empty")


class TestDeepSpeedSource(SourceTests):
    format = "deepspeed"
    not_held = {n: "zero_to_fp32 returns floating buffers as float32" for n in _CAST}

    @pytest.fixture(scope="class")
    @classmethod
    def written(cls, tmp_path_factory: pytest.TempPathFactory) -> Written:
        pytest.importorskip("torch")
        from ds_synth import write_zero

        path = str(tmp_path_factory.mktemp("deepspeed") / "ckpt")
        rng = np.random.default_rng(5)
        # model.multi alone in group 0: 64 elements per rank, a row boundary (two chunks);
        # group 1's 49 elements split 25 / 24: model.w is assembled from both ranks' pieces.
        groups = [{"model.multi": TRUTH["model.multi"]}, {n: TRUTH[n] for n in _PARAMS}]
        buffers = {
            n: a for n, a in TRUTH.items() if n not in _CAST and n not in _PARAMS and n != "model.multi"
        }
        moments = {
            n: {k: rng.standard_normal(a.shape).astype(np.float32) for k in ("exp_avg", "exp_avg_sq")}
            for g in groups
            for n, a in g.items()
        }
        write_zero(path, groups, buffers=buffers, moments=moments, client_state=dict(OBJECTS))
        arrays = {n: a for n, a in TRUTH.items() if n not in _CAST}
        arrays.update({f"optimizer.state.{n}.{k}": v for n, m in moments.items() for k, v in m.items()})
        objects: dict[str, Any] = dict(OBJECTS, ds_version="0.19.8")
        objects.update({f"optimizer.state.{n}.step": 3.0 for g in groups for n in g})
        objects["optimizer.param_groups"] = [
            {"lr": 0.01, "betas": (0.9, 0.999), "params": list(g)} for g in groups
        ]
        return Written(path, arrays, objects)

    def test_layout_as_deepspeed_partitions(self, src: Any) -> None:
        assert [(c.offset, c.shape, c.rank) for c in src.info("model.multi").chunks] == [
            ((0, 0), (8, 8), 0),
            ((8, 0), (8, 8), 1),
        ]
        assert len(src.info("model.w").chunks) == 1 and "2 pieces" in src.info("model.w").chunks[0].key


def test_pickled_client_state_needs_allow_pickle(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import argparse

    from ds_synth import write_zero

    path = str(tmp_path / "ck")
    write_zero(
        path,
        [{"w": np.ones((2, 2), np.float32)}],
        client_state={"args": argparse.Namespace(lr=0.5), "epoch": 2},
    )
    with xckpt.open(path) as src:
        assert src.pickled_objects() == {"args"}
        assert src.objects(["epoch"]) == {"epoch": 2}
        with pytest.raises(ObjectError, match=r"'args'.*allow_pickle=True"):
            src.objects(["args"])
    with xckpt.open(path, allow_pickle=True) as src:
        assert src.objects(["args"])["args"] == argparse.Namespace(lr=0.5)


def test_frozen_parameters_and_tied_aliases_as_zero_to_fp32_lists_them(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from ds_synth import write_zero

    rng = np.random.default_rng(3)
    emb = rng.standard_normal((6, 4)).astype(np.float32)
    w = rng.standard_normal((4, 4)).astype(np.float32)
    frozen = rng.standard_normal(5).astype(np.float32)
    path = str(tmp_path / "ck")
    write_zero(
        path,
        [{"emb.weight": emb, "w": w}],
        buffers={"pos": np.arange(3, dtype=np.int64)},
        frozen={"scale": frozen},
        shared={"head.weight": "emb.weight", "gone.weight": "not.a.parameter"},
    )
    with xckpt.open(path) as src:
        # zero_to_fp32's order: buffers, frozen, trainable, then aliases of present parameters
        assert [n for n in src.names() if not n.startswith("optimizer.")] == [
            "pos",
            "scale",
            "emb.weight",
            "w",
            "head.weight",
        ]
        assert same(src.read("head.weight"), emb) and same(src.read("scale"), frozen)
        assert src.info("head.weight").chunks == src.info("emb.weight").chunks
        assert "optimizer.state.scale.exp_avg" not in src and "optimizer.state.head.weight.exp_avg" not in src


def test_synthetic_bf16_file_names(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from ds_synth import write_zero

    path = str(tmp_path / "ck")
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_zero(path, [{"w": w}], bf16=True, world=3)
    assert sorted(os.listdir(os.path.join(path, "global_step3")))[0].startswith("bf16_zero_pp_rank_0")
    with xckpt.open(path) as src:
        assert src.world_size == 3 and same(src.read("w"), w)
        assert [c.rank for c in src.info("w").chunks] == [0, 1, 2]
