"""What a replan does to the tasks that already exist. Pure: the handler applies the result.

A task id is per goal, across plan versions (one record per id). When version N+1 replaces N:

* kept: the id is in both plans with the same spec, it is `done` (or still `pending`), and so is
  every dependency it has: its accepted result still answers the same question on the same
  inputs, so it is not run again. (A done task whose dependency is re-run is not kept: its result
  was built from inputs that are being replaced.)
* superseded: every other task of the old plan that has not already ended that way;
* restored: every id of the new plan that is not kept and already has a record goes (after being
  superseded if needed) `superseded -> pending` with the new plan version.

Ids new in N+1 were created `pending` by `save_plan` and need nothing. The computation is
idempotent: re-running it after a crash half-way finds the moves already made and skips them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from bus.schemas import Plan, TaskRecord, TaskSpec, TaskState

_KEEPABLE = frozenset({TaskState.DONE, TaskState.PENDING})
# States a supersede leaves alone: already dropped, or ended by a cancellation (nothing leaves it).
_SETTLED = frozenset({TaskState.SUPERSEDED, TaskState.CANCELLED})


@dataclass(frozen=True)
class Reconciliation:
    keep: list[str] = field(default_factory=list)
    supersede: list[str] = field(default_factory=list)
    restore: list[str] = field(default_factory=list)


def _kept(old: Mapping[str, TaskSpec], new: Plan, records: Mapping[str, TaskRecord]) -> set[str]:
    new_specs = {t.id: t for t in new.tasks}
    candidates = {
        tid
        for tid, spec in new_specs.items()
        if old.get(tid) == spec and tid in records and records[tid].state in _KEEPABLE
    }
    # Drop candidates with a non-kept dependency until nothing changes (a fixpoint over the DAG).
    changed = True
    while changed:
        changed = False
        for tid in sorted(candidates):
            spec = new_specs[tid]
            if records[tid].state is TaskState.DONE and any(d not in candidates for d in spec.depends_on):
                candidates.discard(tid)
                changed = True
    return candidates


def reconcile(old: Plan, new: Plan, records: Mapping[str, TaskRecord], new_version: int) -> Reconciliation:
    """The moves that turn the task records of plan `old` into those of plan `new` (version `new_version`)."""
    old_specs = {t.id: t for t in old.tasks}
    new_ids = [t.id for t in new.tasks]
    keep = _kept(old_specs, new, records)
    out = Reconciliation(keep=[t for t in new_ids if t in keep])
    for tid in sorted(records):
        if tid in keep:
            continue
        rec = records[tid]
        if tid in new_ids:
            if rec.state is TaskState.PENDING and rec.plan_version == new_version:
                continue  # created by save_plan, or already restored by an earlier run
            if rec.state is TaskState.CANCELLED:
                continue
            if rec.state is not TaskState.SUPERSEDED:
                out.supersede.append(tid)
            out.restore.append(tid)
        elif rec.state not in _SETTLED:
            out.supersede.append(tid)
    return out
