"""Retention and ranking of a manager's steps: pure functions of step numbers and metrics.

Nothing here reads storage or talks to ranks; `Policy` is checked once, at
construction, and every answer is a function of `(step, metrics)` pairs, so the
rules are tested exhaustively against a simple model (tests/test_manager_policy.py).

The rules (DESIGN.md section 8), decided where the design is silent:

* "last" is by step number: `keep_last=N` keeps the N highest steps (a step saved
  with `force=True` below the latest is not "last");
* `keep_every=K` keeps every step divisible by K (step 0 included);
* `keep_best=N` keeps the N best steps by `metric` (`mode="min"`: lowest first).
  Steps whose metrics lack the metric, or hold a value that is not a number, are
  unranked and always kept (orbax's `CheckpointManager` does the same); NaN ranks
  below every number (a diverged run's steps go first); ties go to the later step;
* the latest (highest) complete step is always kept;
* a step is kept when any rule keeps it; no rule given: everything is kept.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from xckpt.errors import XckptError

__all__ = ["Policy", "StepMetrics", "positive_count"]

#: `(step, metrics or None)`: what retention and ranking need of a complete step.
StepMetrics = tuple[int, "Mapping[str, Any] | None"]


def positive_count(name: str, v: Any) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise XckptError(f"{name}={v!r}: give a whole number >= 1, or None for no such rule")
    return int(v)


@dataclass(frozen=True)
class Policy:
    """Which complete steps retention keeps, and how steps rank by a metric.

    Raises (at construction):
        XckptError: a count is not a whole number >= 1, `keep_best` has no
            `metric`, or `mode` is neither "min" nor "max".
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: str = "min"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            positive_count(name, getattr(self, name))
        if self.mode not in ("min", "max"):
            raise XckptError(f"mode={self.mode!r}: use 'min' (lower is better, e.g. a loss) or 'max'")
        if self.metric is not None and not (isinstance(self.metric, str) and self.metric):
            raise XckptError(f"metric={self.metric!r}: give the name of a metric, e.g. metric='loss'")
        if self.keep_best is not None and self.metric is None:
            raise XckptError(
                f"keep_best={self.keep_best} ranks steps by a metric: pass metric= (e.g. metric='loss', "
                "mode='min') and save with metrics={'loss': ...}"
            )

    @property
    def keeps_all(self) -> bool:
        """No rule given: retention deletes nothing."""
        return self.keep_last is None and self.keep_every is None and self.keep_best is None

    def check_metrics(self, step: int, metrics: Mapping[str, Any] | None) -> None:
        """Refuse metrics that a step could not be ranked by (before anything is written).

        `None` is accepted (the step is kept, unranked). With a `metric`, a
        mapping must hold it as a real number (NaN and infinities included).

        Raises:
            XckptError: naming the step, the metric and the fix.
        """
        if metrics is None or self.metric is None:
            return
        if self.metric not in metrics:
            raise XckptError(
                f"step {step}: metrics {sorted(metrics)} lack {self.metric!r}, the metric this manager "
                f"ranks steps by (metric={self.metric!r}, mode={self.mode!r}); pass metrics="
                f"{{{self.metric!r}: value, ...}}, or metrics=None to keep the step unranked. Nothing "
                "was saved or deleted"
            )
        if _number(metrics[self.metric]) is None:
            raise XckptError(
                f"step {step}: metric {self.metric!r} is {metrics[self.metric]!r}, not a number; pass a "
                "number (e.g. float(loss)). Nothing was saved or deleted"
            )

    def value(self, metrics: Mapping[str, Any] | None) -> float | None:
        """The step's metric as a float, or None when it is unranked."""
        if metrics is None or self.metric is None:
            return None
        return _number(metrics.get(self.metric))

    def ranked(self, steps: Sequence[StepMetrics]) -> list[int]:
        """The ranked steps, best first (NaN last, ties: later step first)."""
        sign = 1.0 if self.mode == "min" else -1.0
        scored = [(s, v) for s, m in steps if (v := self.value(m)) is not None]
        scored.sort(
            key=lambda sv: (math.isnan(sv[1]), sign * sv[1] if not math.isnan(sv[1]) else 0.0, -sv[0])
        )
        return [s for s, _ in scored]

    def best(self, steps: Sequence[StepMetrics]) -> int | None:
        """The best ranked step, or None when no step is ranked."""
        ranked = self.ranked(steps)
        return ranked[0] if ranked else None

    def retain(self, steps: Sequence[StepMetrics]) -> tuple[list[int], list[int]]:
        """`(keep, delete)`: the complete steps to keep and to delete, each ascending."""
        all_steps = sorted({s for s, _ in steps})
        if self.keeps_all or not all_steps:
            return all_steps, []
        keep = {all_steps[-1]}  # the latest complete step, always
        if self.keep_last is not None:
            keep.update(all_steps[-self.keep_last :])
        if self.keep_every is not None:
            keep.update(s for s in all_steps if s % self.keep_every == 0)
        if self.keep_best is not None:
            keep.update(self.ranked(steps)[: self.keep_best])
            keep.update(s for s, m in steps if self.value(m) is None)  # unranked: kept
        return sorted(keep), [s for s in all_steps if s not in keep]


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)
