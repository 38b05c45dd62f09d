"""Retention and ranking (xckpt.manager.Policy): pure functions, checked case by case and
against a simple model of the rules with hypothesis."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xckpt.errors import XckptError
from xckpt.manager import Policy


def _m(v):
    return None if v is None else {"loss": v}


CASES = [
    # (policy kwargs, [(step, loss or None)], kept)
    ({}, [(1, 3.0), (2, 1.0)], [1, 2]),
    ({"keep_last": 2}, [(s, None) for s in range(5)], [3, 4]),
    ({"keep_last": 10}, [(s, None) for s in range(3)], [0, 1, 2]),
    ({"keep_every": 3}, [(s, None) for s in range(8)], [0, 3, 6, 7]),
    ({"keep_every": 5, "keep_last": 1}, [(s, None) for s in range(1, 12)], [5, 10, 11]),
    ({"keep_best": 2, "metric": "loss"}, [(1, 5.0), (2, 1.0), (3, 3.0), (4, 9.0)], [2, 3, 4]),
    ({"keep_best": 1, "metric": "loss", "mode": "max"}, [(1, 5.0), (2, 1.0), (3, 9.0), (4, 2.0)], [3, 4]),
    # unranked steps (no metrics, or no such metric) are kept
    ({"keep_best": 1, "metric": "loss"}, [(1, None), (2, 1.0), (3, 3.0), (4, 2.0)], [1, 2, 4]),
    # NaN ranks below every number; ties go to the later step
    ({"keep_best": 1, "metric": "loss"}, [(1, math.nan), (2, 4.0), (3, 4.0), (4, math.nan)], [3, 4]),
    ({"keep_best": 2, "metric": "loss", "mode": "max"}, [(1, math.nan), (2, -math.inf), (3, 0.0), (4, 1.0)],
     [3, 4]),
    ({"keep_last": 1, "keep_best": 1, "metric": "loss"}, [(1, 0.5), (2, 2.0), (3, 1.0)], [1, 3]),
    ({"keep_last": 1}, [], []),
]


@pytest.mark.parametrize("kwargs,steps,kept", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_retain(kwargs, steps, kept):
    p = Policy(**kwargs)
    keep, delete = p.retain([(s, _m(v)) for s, v in steps])
    assert keep == kept
    assert delete == sorted({s for s, _ in steps} - set(kept))


def test_a_forced_step_below_the_latest_is_not_last():
    """keep_last is by step number: a step saved with force below the latest is older."""
    keep, delete = Policy(keep_last=2).retain([(10, None), (20, None), (5, None)])
    assert (keep, delete) == ([10, 20], [5])


def test_best_and_ranked():
    p = Policy(metric="loss")
    steps = [(1, _m(3.0)), (2, _m(math.nan)), (3, None), (4, _m(1.0)), (5, _m(1.0)), (6, {"acc": 1})]
    assert p.ranked(steps) == [5, 4, 1, 2]
    assert p.best(steps) == 5
    assert Policy(metric="loss", mode="max").best(steps) == 1
    assert p.best([(1, None)]) is None
    assert p.value({"loss": 2}) == 2.0 and p.value({"loss": "x"}) is None and p.value({"loss": True}) is None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"keep_last": 0}, "keep_last=0"),
        ({"keep_every": -2}, "keep_every=-2"),
        ({"keep_last": 1.5}, "whole number"),
        ({"keep_last": True}, "whole number"),
        ({"keep_best": 2}, "keep_best=2 ranks steps by a metric: pass metric="),
        ({"mode": "best"}, "mode='best'"),
        ({"metric": ""}, "metric=''"),
    ],
)
def test_bad_policies_are_refused(kwargs, match):
    with pytest.raises(XckptError, match=match):
        Policy(**kwargs)


def test_check_metrics():
    p = Policy(keep_best=1, metric="loss")
    p.check_metrics(3, None)  # saved without metrics: kept, unranked
    p.check_metrics(3, {"loss": math.nan, "acc": "x"})
    with pytest.raises(XckptError, match=r"step 3: metrics \['acc'\] lack 'loss'.*Nothing was saved or deleted"):
        p.check_metrics(3, {"acc": 1.0})
    with pytest.raises(XckptError, match="metric 'loss' is 'low', not a number"):
        p.check_metrics(3, {"loss": "low"})
    Policy().check_metrics(3, {"anything": "goes"})


def _model(kwargs, steps):
    """The rules, written as plainly as possible."""
    if not any(kwargs.get(k) for k in ("keep_last", "keep_every", "keep_best")):
        return sorted(s for s, _ in steps)
    allsteps = sorted(s for s, _ in steps)
    keep = set(allsteps[-1:])
    if kwargs.get("keep_last"):
        keep |= set(allsteps[-kwargs["keep_last"]:])
    if kwargs.get("keep_every"):
        keep |= {s for s in allsteps if s % kwargs["keep_every"] == 0}
    if kwargs.get("keep_best"):
        ranked = [(v, s) for s, v in steps if v is not None]
        sign = 1 if kwargs.get("mode", "min") == "min" else -1
        ranked.sort(key=lambda vs: (math.isnan(vs[0]), 0 if math.isnan(vs[0]) else sign * vs[0], -vs[1]))
        keep |= {s for _, s in ranked[: kwargs["keep_best"]]}
        keep |= {s for s, v in steps if v is None}
    return sorted(keep)


@settings(max_examples=300, deadline=None)
@given(
    steps=st.dictionaries(
        st.integers(0, 60),
        st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True, width=32)),
        max_size=15,
    ),
    keep_last=st.one_of(st.none(), st.integers(1, 5)),
    keep_every=st.one_of(st.none(), st.integers(1, 7)),
    keep_best=st.one_of(st.none(), st.integers(1, 4)),
    mode=st.sampled_from(["min", "max"]),
)
def test_retain_matches_the_model(steps, keep_last, keep_every, keep_best, mode):
    kwargs = {"keep_last": keep_last, "keep_every": keep_every, "keep_best": keep_best, "mode": mode,
              "metric": "loss" if keep_best else None}
    pairs = list(steps.items())
    keep, delete = Policy(**kwargs).retain([(s, _m(v)) for s, v in pairs])
    assert keep == _model(kwargs, pairs)
    assert sorted(keep + delete) == sorted(steps)
    if steps:
        assert max(steps) in keep  # the latest complete step, always
