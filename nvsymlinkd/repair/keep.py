"""What a repair keeps: every device the container could open before the repair it can still open after
(issue 39: a DeviceAllow= on a DevicePolicy=auto scope made it an allow-list of the grant alone). Pure: it
compares two readings of the container's effective access (access.cgroup.AccessPolicy, read by
repair.apply before the mechanism acts and after it), not what the mechanism meant to do.

Which devices: one of every class of devices that the sources before and after tell apart (the devices
their v1 rules and v2 programs name, and one device of each "every other" range: access.bpfproof.classes),
plus the grants, for every request the kernel makes (r, w, rw, m). A device the container could open
before (`allow`) and cannot now (`deny`, or `unknown`: unknown never counts as allow) has narrowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from nvsymlinkd.access import bpfproof
from nvsymlinkd.errors import CannotEvaluate
from nvsymlinkd.host.devices import Access, Device

if TYPE_CHECKING:
    from nvsymlinkd.access.cgroup import AccessPolicy


@dataclass(frozen=True)
class Narrowed:
    """A request the container's cgroup allowed before the repair and does not after."""

    device: Device  # the device judged: one member of its class
    access: Access
    state: str  # after: "deny" or "unknown"
    reason: str  # after, in the reader's words
    label: str = ""  # its class: `c 195:0`, `c 136:*`, `c *:*` (every char device no source names)
    requests: tuple[Access, ...] = ()  # each request the kernel makes that narrowed (r, w, rw, m): `access` joins them

    def __str__(self) -> str:
        return f"{self.label or self.device} {self.access}"


def devices_to_compare(before: AccessPolicy, after: AccessPolicy,
                       extra: Iterable[Device] = ()) -> dict[Device, str]:
    """One device of every class the two readings tell apart, and the extra ones: {device: its class's name};
    classes fall back to the extra devices alone where a program cannot be decoded (its verdicts are
    `unknown` then anyway)."""
    extra = list(extra)
    out = {d: str(d) for d in extra}
    try:
        for c in bpfproof.classes(before.programs() + after.programs(), extra):
            out.setdefault(c.sample, str(c))
    except CannotEvaluate:
        pass
    return out


def narrowed(before: AccessPolicy, after: AccessPolicy, extra: Iterable[Device] = ()) -> list[Narrowed]:
    """Every (device, access) allowed before and not after, one per device (the letters of every such access)."""
    out: dict[Device, Narrowed] = {}
    was, is_now = before.states(), after.states()   # check()'s states, without running every program per class
    for device, label in devices_to_compare(before, after, extra).items():
        for access in bpfproof.ACCESSES:
            if was(device, access) != "allow" or is_now(device, access) == "allow":
                continue
            now = after.check(device, access)   # the reader's words, for what narrowed
            prev = out.get(device)
            letters = Access("".join(c for c in "rwm" if c in access or (prev is not None and c in prev.access)))
            first = now if prev is None else prev
            out[device] = Narrowed(device, letters, first.state, first.reason, label,
                                   (prev.requests if prev is not None else ()) + (access,))
    return sorted(out.values(), key=lambda n: ("*" in n.label, n.device))  # exact devices first


def judged(policy: AccessPolicy, n: Narrowed) -> tuple[str, str]:
    """(state, reason) of a narrowed device's requests in another reading: allow only when each is allowed."""
    for access in n.requests or (n.access,):
        v = policy.check(n.device, access)
        if v.state != "allow":
            return v.state, v.reason
    return "allow", f"{policy.check(n.device, (n.requests or (n.access,))[0]).reason}"


def describe(lost: list[Narrowed], limit: int = 8) -> str:
    """`c 195:0 rw, c 195:255 rw (and 2 more)`: what narrowed, for the one-line error."""
    shown = ", ".join(str(n) for n in lost[:limit])
    return shown + (f" (and {len(lost) - limit} more)" if len(lost) > limit else "")
