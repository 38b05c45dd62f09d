"""The checkpoint manager: a training run's checkpoints under one root (DESIGN.md section 8).

[`CheckpointManager`][xckpt.manager.CheckpointManager] saves steps as ordinary xckpt checkpoints at
`<root>/<step>/` (async staging into host buffers it reuses, one save in flight),
keeps them by policy, turns SIGTERM into a last save and exit 143, and restores at
any world size, mesh, placement or sharding. Reading a root without a manager
(`xckpt.open(root, step="latest")`, `xckpt ls ROOT`) lives in `xckpt.native.steps`.

The family: `_manager` (the class), `_policy` (retention and ranking, pure),
`_staging` (the host buffers), `_adapters` (which framework saves a state),
`_coord` (how ranks agree), `_preemption` (the SIGTERM handler); the local tier
(DESIGN.md section 11): `_tiers` (local steps, retention, the root's `tiers.json`),
`_replicate` (copies to other nodes), `_fetch` (restore from both tiers, verified).
"""

from __future__ import annotations

from xckpt.native.steps import StepInfo, manager_steps, resolve_step

from ._manager import CheckpointManager
from ._policy import Policy
from ._staging import HostBuffers

__all__ = ["CheckpointManager", "HostBuffers", "Policy", "StepInfo", "manager_steps", "resolve_step"]
