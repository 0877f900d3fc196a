"""cgroup v1 device rules: parse `devices.list` and decide one access request.

The kernel prints a v1 devices cgroup in one of two ways:
  - `a *:* rwm`: the cgroup is in default-allow mode. Deny exceptions of that
    mode are NOT printed, so the file cannot show them (runc's emulator has the
    same limit and treats the line as allow-all; so do we, and say so).
  - otherwise: default-deny, and each line is an allowed exception
    `TYPE MAJOR:MINOR ACCESS` (`c 195:* rw`, `c *:* m`, `b 8:0 rwm`).

A request is allowed when ONE exception matches its type, major and minor and
covers every requested access letter (the kernel's match_exception; two rules
`c 1:3 r` and `c 1:* w` do not add up to `rw` on 1:3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from nvsymlinkd.errors import HostFileError
from nvsymlinkd.host.devices import LETTERS, Access, Device, Rule
from nvsymlinkd.host.procdevices import decimal

ACCESS_LETTERS = LETTERS
MAX_U32 = 0xFFFFFFFF


def _number(field: str, what: str, path: str, lineno: int) -> Optional[int]:
    if field == "*":
        return None
    if not field.isascii() or not field.isdigit():
        raise HostFileError(path, f"{what} {field[:20]!r} is neither a number nor '*'", lineno)
    value = decimal(field, MAX_U32)
    if value is None:
        shown = field if len(field) <= 20 else f"{field[:12]}... ({len(field)} digits)"
        raise HostFileError(path, f"{what} {shown} does not fit in 32 bits", lineno)
    return value


def parse_devices_list(text: str, path: str) -> list[Rule]:
    """Parse a cgroup v1 devices.list; `path` (inside view) names the file in errors.

    Raises HostFileError (and nothing else) naming the line for malformed input.
    Blank lines are skipped.
    """
    rules = []
    for lineno, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line:
            continue
        # runc's parser: fields separated by spaces and ':' -> type, major, minor, access
        fields = line.replace(":", " ").split()
        if len(fields) != 4 or line.count(":") != 1:
            raise HostFileError(path, f"expected 'TYPE MAJOR:MINOR ACCESS', got {line[:60]!r}", lineno)
        dev_type, major, minor, access = fields
        if dev_type not in ("a", "b", "c"):
            raise HostFileError(path, f"device type {dev_type!r} is not a, b or c", lineno)
        if not access or any(letter not in ACCESS_LETTERS for letter in access):
            raise HostFileError(path, f"access {access!r} is not a non-empty subset of rwm", lineno)
        rules.append(Rule(True, dev_type, _number(major, "major", path, lineno),
                          _number(minor, "minor", path, lineno), Access(access)))
    return rules


ALLOW, DENY, UNKNOWN = "allow", "deny", "unknown"


@dataclass(frozen=True)
class AccessDecision:
    """What a cgroup's device access answers for one device and access (access.cgroup's AccessPolicy.check;
    verify.kinds.Verdict is a container's verdict, made from many of these; a repair's verification holds
    one per device). Here, beside RuleDecision, so that the pure modules can say one."""

    state: str        # "allow" | "deny" | "unknown"
    reason: str       # one line


@dataclass(frozen=True)
class RuleDecision:
    allowed: bool
    rule: Optional[Rule]   # the rule that allowed it, or None
    reason: str


def decide(rules: Sequence[Rule], device: Device, access: Access,
           source: str = "devices.list") -> RuleDecision:
    """Decide one request against parsed devices.list rules (kernel semantics)."""
    access = Access(access)
    for rule in rules:
        if rule.is_allow_all:
            return RuleDecision(True, rule, f"{source} has {rule} (allow-all mode; the kernel "
                                             "does not list deny exceptions of that mode)")
    for rule in rules:
        if rule.covers(device, access):
            return RuleDecision(True, rule, f"{source} has {rule}")
    request = f"{device} {access}"
    partial = [str(r) for r in rules if r.matches(device)]
    if partial:
        return RuleDecision(False, None, f"{source} has no rule covering {request} "
                                         f"(only {', '.join(partial)})")
    return RuleDecision(False, None, f"{source} has no rule for {request}")
