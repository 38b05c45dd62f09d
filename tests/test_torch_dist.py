"""xckpt.torch across world sizes: save at 1, 2 and 4 gloo ranks, load at each of the others.

The ranks run once per world size (spawning is the expensive part); each
(case, saved world, loading world) is its own test id, checked from the
results the ranks report. Every element of every local shard is compared
bit-exactly with the expected data.
"""

from __future__ import annotations

import os

import pytest
from dist_utils import run_ranks
from torch_cases import CASES, compare, state_dict

WORLDS = (1, 2, 4)
PAIRS = [(s, d) for s in WORLDS for d in WORLDS]


def _flat_model(sd: dict) -> dict:
    out = {f"model.{k}": v for k, v in sd["model"].items()}
    out["optim.state.0.m"] = sd["optim"]["state"][0]["m"]
    return out


def _check_load(path: str, src: int, world: int, rank: int) -> dict:
    """Load the checkpoint saved at ``src`` ranks into this world's layouts; per-case outcome."""
    import xckpt.torch as xt

    target = state_dict(world, rank, fill=-1.0)
    want = state_dict(world, rank)
    out: dict = {}
    try:
        res = xt.load(path, target)
    except Exception as e:  # reported per case to the parent test
        msg = f"load raised {type(e).__name__}: {e}"
        return {(c, src, world): msg for c in [*CASES, "objects", "nested_optim"]}
    got_t, want_t = _flat_model(target), _flat_model(want)
    for c in CASES:
        out[(c, src, world)] = compare(got_t[f"model.{c}"], want_t[f"model.{c}"])
    out[("nested_optim", src, world)] = compare(got_t["optim.state.0.m"], want_t["optim.state.0.m"]) or (
        None if target["optim"]["state"][0]["step"] == 3 else f"step {target['optim']['state'][0]['step']!r}"
    )
    problems = []
    if res.missing or res.unexpected:
        problems.append(f"missing {res.missing} unexpected {res.unexpected}")
    if target["step"] != 7 or target["blob"] != bytes(range(256)) * 20:
        problems.append(f"step/blob {target['step']!r}")
    if target["cfg"] != {"lr": 0.1, "names": ["a", "b"], 3: (1, 2)}:
        problems.append(f"cfg {target['cfg']!r}")
    if not (target["loader"].all_ranks and target["loader"].value == [{"rank": r} for r in range(src)]):
        problems.append(f"loader {target['loader']!r}")
    out[("objects", src, world)] = "; ".join(problems) or None
    return out


def _matrix_rank(rank: int, world: int, root: str, save: bool, load_from: tuple[int, ...]) -> dict:
    import xckpt.torch as xt

    if save:
        xt.save(state_dict(world, rank), os.path.join(root, f"w{world}"))
    out: dict = {}
    for src in load_from:
        out.update(_check_load(os.path.join(root, f"w{src}"), src, world, rank))
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("torch_matrix"))
    results: dict = {}

    def run(world: int, save: bool, load_from: tuple[int, ...]) -> None:
        for per_rank in run_ranks(_matrix_rank, world, root, save, load_from, timeout=180):
            for key, err in per_rank.items():
                if err is not None or key not in results:
                    results[key] = err if results.get(key) is None else results[key]

    # Each spawn saves at its world size and loads what exists by then.
    run(1, True, (1,))
    run(2, True, (1, 2))
    run(4, True, (1, 2, 4))
    run(1, False, (2, 4))
    run(2, False, (4,))
    return results


@pytest.mark.parametrize("src,dst", PAIRS, ids=[f"{s}to{d}" for s, d in PAIRS])
@pytest.mark.parametrize("case", [*CASES, "objects", "nested_optim"])
def test_reshard_round_trip(matrix, case, src, dst):
    key = (case, src, dst)
    assert key in matrix, f"no result for {key}"
    assert matrix[key] is None, matrix[key]
