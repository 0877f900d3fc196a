"""nvsymlinkd/devchar/summary.py as tables: the summary lines and counts of a sync and a repair, in words that
match what happened (a failed action is counted as failed, never as done; a dry run says "would")."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from nvsymlinkd.devchar.summary import repair_line, sync_counts, sync_line, sync_warnings
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.text import plural


@pytest.mark.parametrize(("n", "noun", "many", "said"), [
    (0, "link", None, "0 links"), (1, "link", None, "1 link"), (2, "link", None, "2 links"),
    (1, "sync pass", "sync passes", "1 sync pass"), (3, "sync pass", "sync passes", "3 sync passes"),
])
def test_plural(n, noun, many, said):
    assert plural(n, noun, many) == said


def sync_result(planned: dict, failed: dict | None = None, nodes: int = 6, dry_run: bool = False):
    actions = [NS(action=name) for name, n in planned.items() for _ in range(n)]
    outcomes = []
    left = dict(failed or {})
    for a in actions:
        bad = left.get(a.action, 0) > 0
        left[a.action] = left.get(a.action, 0) - bad
        outcomes.append(NS(action=a, error="EACCES" if bad else None))
    return NS(plan=NS(actions=actions), outcomes=outcomes, snapshot=NS(nodes=[object()] * nodes), dry_run=dry_run)


# (planned actions, failed ones, dry run) -> (the counts that differ from 0, the line)
SYNCS = [
    ({"create": 4, "keep": 2}, {}, False,
     {"create": 4, "keep": 2, "nodes": 6}, "sync: 6 NVIDIA nodes; 4 links created, 2 kept"),
    ({"create": 4, "keep": 2, "conflict": 1}, {"create": 1}, False,
     {"create": 3, "keep": 2, "conflict": 1, "error": 1, "nodes": 6, "failed": {"create": 1}},
     "sync: 6 NVIDIA nodes; 3 links created, 2 kept, 1 conflict, 1 failed (1 create)"),
    ({"create-node": 2, "create": 1, "replace": 1, "remove": 2, "keep": 1}, {}, False,
     {"create-node": 2, "create": 1, "replace": 1, "remove": 2, "keep": 1, "nodes": 8},
     "sync: 8 NVIDIA nodes (2 created); 1 link created, 1 replaced, 2 removed, 1 kept"),
    ({"create-node": 2, "create": 1, "replace": 1, "remove": 2, "keep": 1, "conflict": 2}, {}, True,
     {"create-node": 2, "create": 1, "replace": 1, "remove": 2, "keep": 1, "conflict": 2, "nodes": 6},
     "sync (dry run): 6 NVIDIA nodes (2 would be created); would create 1 link, would replace 1, would remove 2, "
     "1 kept, 2 conflicts"),
    ({"create-node": 1, "replace": 2}, {"create-node": 1, "replace": 2}, False,
     {"error": 3, "nodes": 6, "failed": {"create-node": 1, "replace": 2}},
     "sync: 6 NVIDIA nodes; 0 links created, 0 kept, 3 failed (1 create-node, 2 replace)"),
]


@pytest.mark.parametrize(("planned", "failed", "dry_run", "counts", "line"), SYNCS)
def test_sync_counts_and_line(planned, failed, dry_run, counts, line):
    result = sync_result(planned, failed, dry_run=dry_run)
    got = sync_counts(result)
    assert {k: v for k, v in got.items() if v} == counts
    assert set(got) == {"create-node", "create", "replace", "remove", "keep", "conflict", "error", "nodes",
                        "failed"}
    assert sync_line(result) == line


# (results, counts, dry run) -> line
REPAIRS = [
    (2, {"repaired": 1, "failed": 1}, False, "repair: 2 containers with findings: 1 repaired, 1 failed"),
    (1, {"would-repair": 1}, True, "repair (dry run): 1 container with findings: 1 would repair"),
    (0, {}, False, "repair: 0 containers with findings"),
    (1, {"prevented": 1, "cannot-judge": 2, "not-repairable": 1, "denied": 1, "nothing-to-do": 0}, False,
     "repair: 5 containers with findings: 1 prevented, 2 cannot judge, 1 not repairable (recreate), "
     "1 denied, not repaired"),
    (1, {"some-new-status": 1}, False, "repair: 1 container with findings: 1 some-new-status"),
]


@pytest.mark.parametrize(("results", "counts", "dry_run", "line"), REPAIRS)
def test_repair_line(results, counts, dry_run, line):
    assert repair_line([object()] * results, counts, dry_run) == line


def majors(nvidia=(195,), skipped=()):
    return NS(nvidia_majors=set(nvidia), skipped=list(skipped))


@pytest.mark.parametrize(("driver_root", "present", "snap_majors", "warnings"), [
    ("/", True, majors(), []),
    ("/run/nvidia/driver", True, majors(), []),
    ("/run/nvidia/driver", False, majors(),
     ["driver root /run/nvidia/driver does not exist (check --driver-root / driver_root; with the driver "
      "container it appears once the driver is installed)"]),
    ("/", True, majors(nvidia=()), ["NVIDIA driver not loaded (no nvidia entry in /proc/devices): no nodes to link"]),
    ("/", True, majors(skipped=[(7, "a major of 4000 digits")]),
     ["/proc/devices:7: a major of 4000 digits: line skipped (not an NVIDIA driver's)"]),
])
def test_sync_warnings(tmp_path, driver_root, present, snap_majors, warnings):
    if present:
        (tmp_path / driver_root.lstrip("/")).mkdir(parents=True, exist_ok=True)
    result = NS(snapshot=NS(driver_root=driver_root, majors=snap_majors))
    assert sync_warnings(HostRoot(str(tmp_path)), result) == warnings
