"""One reconcile pass: observe, plan, apply. Shared by `sync` and the daemon."""

from __future__ import annotations

import time

from nvsymlinkd.devchar.apply import Outcome, apply_plan
from nvsymlinkd.devchar.model import HostSnapshot
from nvsymlinkd.devchar.plan import CONFLICT, Plan, plan_sync
from nvsymlinkd.devchar.quick import observe_and_plan
from nvsymlinkd.devchar.snapshot import observe
from nvsymlinkd.devchar.summary import sync_counts, sync_line
from nvsymlinkd.record import dataclass


@dataclass(frozen=True)
class SyncResult:
    snapshot: HostSnapshot
    plan: Plan
    outcomes: tuple  # Outcome, one per plan action (empty on dry-run)
    dry_run: bool
    seconds: float

    @property
    def errors(self) -> list:
        return [o for o in self.outcomes if o.error is not None]

    @property
    def as_desired(self) -> bool:
        if self.plan.conflicts or self.errors:
            return False
        return not (self.dry_run and self.plan.changes)

    def summary(self) -> dict:
        return sync_counts(self)

    def to_json(self) -> dict:
        items = self.outcomes if self.outcomes else [Outcome(a) for a in self.plan.actions]
        return {
            "dry_run": self.dry_run,
            "actions": [o.to_json() for o in items],
            "summary": self.summary(),
            "notes": list(self.plan.notes),
        }

    def human_lines(self) -> list:
        lines = []
        verb_prefix = "would " if self.dry_run else ""
        errors = {id(o.action): o.error for o in self.errors}
        for a in self.plan.actions:
            if not a.changes and a.action != CONFLICT:
                continue
            what = a.target if a.action == "create-node" else a.link
            arrow = f" -> {a.target}" if a.action in ("create", "replace") else ""
            err = errors.get(id(a))
            status = f"  FAILED: {err}" if err else ""
            verb = a.action if a.action == CONFLICT else verb_prefix + a.action
            lines.append(f"{verb} {what}{arrow} ({a.device}): {a.reason}{status}")
        for note in self.plan.notes:
            lines.append(f"note: {note}")
        lines.append(sync_line(self))
        return lines


def reconcile(root, config, dry_run: bool = False, listings=None) -> SyncResult:
    """`listings` (host/listings.Listings): the daemon's directories as its last full pass read them, read
    again only where changed; `sync` and the daemon's first pass read everything. Not used with
    create_nodes (its plan also reads the driver's /proc files and each node's mode and owner)."""
    start = time.perf_counter()
    if config.create_nodes:
        snap = observe(root, config.driver_root, config.dev_char_path, with_driver_info=True)
        plan = plan_sync(snap, create_nodes=True)
    else:  # the same snapshot and plan, exact links settled in the observing loop
        snap, plan = observe_and_plan(root, config.driver_root, config.dev_char_path, listings)
    outcomes = () if dry_run else tuple(apply_plan(root, plan))
    return SyncResult(snap, plan, outcomes, dry_run, time.perf_counter() - start)
