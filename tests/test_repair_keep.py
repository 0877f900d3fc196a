"""repair/keep.py (pure): what narrowed between two readings of a container's effective access (issue 39)."""

from __future__ import annotations

import random

from nvsymlinkd.access import bpfgen
from nvsymlinkd.access.cgroup import policy_of
from nvsymlinkd.host.devices import Access, Device, Rule
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


def _narrowed_check_by_check(before, after, extra):
    """keep.narrowed as it was before issue 38: check() for every class's device and request."""
    out = {}
    for device, label in keep.devices_to_compare(before, after, extra).items():
        for access in ("r", "w", "rw", "m"):
            if before.check(device, access).state != "allow":
                continue
            now = after.check(device, access)
            if now.state == "allow":
                continue
            prev = out.get(device)
            letters = Access("".join(c for c in "rwm" if c in access or (prev is not None and c in prev.access)))
            first = now if prev is None else prev
            out[device] = keep.Narrowed(device, letters, first.state, first.reason, label,
                                        (prev.requests if prev is not None else ()) + (Access(access),))
    return sorted(out.values(), key=lambda n: ("*" in n.label, n.device))


def test_narrowed_is_what_checking_every_class_says():
    """Drawn runtime programs and lists, before and after a drawn change (a scope's allow-list ANDed, a rule lost,
    the grant): keep.narrowed reads states in one pass per program and answers as check() per class did."""
    rng = random.Random(2026_11_28)
    pool = [Rule(True, rng.choice("cb"), rng.choice([None, 1, 195, 509]), rng.choice([None, 0, 1, 3, 255]),
                 rng.choice(["r", "w", "m", "rw", "rwm"])) for _ in range(40)]
    found = 0
    for n in range(60):
        rules = rng.sample(pool, rng.randint(1, 12))
        fewer = [r for r in rules if rng.random() < 0.8]
        grant = Device("c", 195, rng.choice([0, 1]))
        plus = fewer + [Rule(True, "c", grant.major, grant.minor, "rw")]
        if n % 2:
            text = "".join(f"{r}\n" for r in rules)
            before, after = policy_of(text), policy_of("".join(f"{r}\n" for r in plus))
        else:
            runtime = bpfasm.runc_program(rules, False)
            before = policy_of(programs=[runtime])
            after = policy_of(programs=[runtime, bpfasm.systemd_program(plus, rng.choice(["strict", "closed"]))])
        got = keep.narrowed(before, after, [grant])
        assert got == _narrowed_check_by_check(before, after, [grant]), n
        found += bool(got)
    assert found > 10   # not vacuous: many draws narrow
