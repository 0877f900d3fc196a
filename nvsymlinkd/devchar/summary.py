"""Summary lines and counts: what a pass or a repair actually did, in words that match.

One place builds them, so `sync`, `repair`, `check` and the daemon count the
same way: an action that failed is counted as failed, never as done; a dry
run says what it *would* do.
"""

from __future__ import annotations

import os

from nvsymlinkd.devchar.plan import ACTIONS, CONFLICT, CREATE, CREATE_NODE, KEEP, REMOVE, REPLACE
from nvsymlinkd.host.procdevices import PROC_DEVICES
from nvsymlinkd.text import plural


def sync_counts(result) -> dict:
    """The JSON `summary` of a sync: per action, how many were done (dry run: would be done), plus `error`.

    An action whose apply failed counts under `error` only, so `create` never
    counts a link that is not there. Additive keys: `nodes` (NVIDIA nodes present
    after the pass) and `failed` (per action, the failures behind `error`).
    """
    planned = {name: 0 for name in ACTIONS}
    for a in result.plan.actions:
        planned[a.action] += 1
    failed = {name: 0 for name in ACTIONS}
    for o in result.outcomes:
        if o.error is not None:
            failed[o.action.action] += 1
    counts: dict = {name: planned[name] - failed[name] for name in ACTIONS}
    counts["error"] = sum(failed.values())
    nodes = len(result.snapshot.nodes)
    if not result.dry_run:
        nodes += counts[CREATE_NODE]  # made by this pass: they are there now
    counts["nodes"] = nodes
    counts["failed"] = {name: n for name, n in failed.items() if n}
    return counts


def sync_line(result) -> str:
    """`sync: 6 NVIDIA nodes (2 created); 4 links created, 2 kept, 1 conflict, 1 failed`."""
    c = sync_counts(result)
    head = "sync (dry run)" if result.dry_run else "sync"
    nodes = plural(c["nodes"], "NVIDIA node")
    if c[CREATE_NODE]:
        nodes += f" ({c[CREATE_NODE]} would be created)" if result.dry_run else f" ({c[CREATE_NODE]} created)"
    if result.dry_run:
        parts = [f"would create {plural(c[CREATE], 'link')}"]
        parts += [f"would {verb} {c[name]}" for name, verb in ((REPLACE, "replace"), (REMOVE, "remove")) if c[name]]
    else:
        parts = [f"{plural(c[CREATE], 'link')} created"]
        parts += [f"{c[name]} {past}" for name, past in ((REPLACE, "replaced"), (REMOVE, "removed")) if c[name]]
    parts.append(f"{c[KEEP]} kept")
    if c[CONFLICT]:
        parts.append(plural(c[CONFLICT], "conflict"))
    if c["error"]:
        failed = ", ".join(f"{n} {name}" for name, n in c["failed"].items())
        parts.append(f"{c['error']} failed ({failed})")
    return f"{head}: {nodes}; " + ", ".join(parts)


def sync_warnings(root, result) -> list:
    """What makes an empty pass suspicious: no driver, or a driver root that is not there."""
    out = []
    snap = result.snapshot
    if snap.driver_root != "/" and not os.path.isdir(root.path(snap.driver_root)):
        out.append(f"driver root {snap.driver_root} does not exist (check --driver-root / driver_root; "
                   "with the driver container it appears once the driver is installed)")
    for lineno, why in snap.majors.skipped:
        out.append(f"{PROC_DEVICES}:{lineno}: {why}: line skipped (not an NVIDIA driver's)")
    if not snap.majors.nvidia_majors:
        out.append("NVIDIA driver not loaded (no nvidia entry in /proc/devices): no nodes to link")
    return out


REPAIR_WORDS = {  # status -> how the summary says it
    "repaired": "repaired", "prevented": "prevented", "nothing-to-do": "nothing to do",
    "would-repair": "would repair", "cannot-repair": "cannot repair", "failed": "failed",
    "cannot-judge": "cannot judge", "not-repairable": "not repairable (recreate)",
    "denied": "denied, not repaired",
}


def repair_line(results, counts: dict, dry_run: bool) -> str:
    """`repair: 3 containers with findings: 1 repaired, 1 failed, 1 cannot judge`: every container
    `check` would count, the ones no repair can help (cannot-judge, not-repairable) included."""
    head = "repair (dry run)" if dry_run else "repair"
    parts = [f"{n} {REPAIR_WORDS.get(k, k)}" for k, n in counts.items() if n]
    total = len(results) + sum(counts.get(k, 0) for k in ("cannot-judge", "not-repairable", "denied"))
    return f"{head}: {plural(total, 'container')} with findings" + (": " + ", ".join(parts) if parts else "")
