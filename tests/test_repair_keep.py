"""repair/keep.py (pure): what narrowed between two readings of a container's effective access (issue 39)."""

from __future__ import annotations

from nvsymlinkd.access import bpfgen
from nvsymlinkd.access.cgroup import policy_of
from nvsymlinkd.host.devices import Device, Rule
from nvsymlinkd.repair import keep
from tests import bpfasm

LISTED = "c 1:3 rwm\nc *:* m\nc 136:* rwm\nc 195:255 rw\n"


def test_nothing_narrowed_when_the_grant_is_all_that_changed():
    before = policy_of(LISTED)
    after = policy_of(LISTED + "c 195:0 rw\n")
    assert keep.narrowed(before, after, [Device("c", 195, 0)]) == []


def test_a_dropped_wildcard_is_found_by_its_class():
    lost = keep.narrowed(policy_of(LISTED), policy_of("c 1:3 rwm\nc 195:255 rw\nc 195:0 rw\n"))
    # exact devices first (each lost its mknod), then the ranges; nothing the list still has
    assert [str(n) for n in lost][:2] == ["c 195:0 m", "c 195:255 m"]
    assert {str(n) for n in lost[2:]} == {"c *:* m", "c 1:* m", "c 136:* rwm", "c 195:* m"}
    assert all(n.state == "deny" for n in lost)


def test_a_scope_allow_list_of_the_grant_alone_narrows_everything_else():
    """The VM's case in numbers: the runtime's program had c 195:0, c 195:255; systemd's allow-list of uvm alone
    (plus the pseudo devices) is ANDed with it."""
    uvm = Device("c", 238, 0)
    runtime = bpfasm.runc_program([Rule(True, "c", 195, 0, "rw"), Rule(True, "c", 195, 255, "rw"),
                                   Rule(True, "c", 1, 3, "rwm")], False)
    scope = bpfasm.systemd_program([Rule(True, "c", 238, 0, "rw")], "closed")
    lost = keep.narrowed(policy_of(programs=[runtime]), policy_of(programs=[runtime, scope]), [uvm])
    assert [str(n) for n in lost] == ["c 195:0 rw", "c 195:255 rw"]
    assert "denies" in lost[0].reason


def test_no_restriction_before_counts_every_class():
    lost = keep.narrowed(policy_of(), policy_of(programs=[bpfgen.program([Rule(True, "c", 1, 3, "rwm")])]))
    assert {str(n) for n in lost} >= {"c *:* rwm", "b *:* rwm"}
    assert "c 1:3" not in {n.label for n in lost}
    assert keep.describe(lost, limit=1).endswith(f"(and {len(lost) - 1} more)")
