"""One systemd `DeviceAllow=` entry: the only place that writes or parses its text, and turns it into the
project's `Rule` and back (runc's libcontainer/cgroups/systemd/common.go, generateDeviceProperties, has
the one conversion; this is ours). Pure and standard library only.

systemd holds an entry as a (path, access) pair: the bus's `DeviceAllow a(ss)` gives the pairs, a unit
file or drop-in gives the text "PATH [ACCESS]" (systemd v252 src/core/load-fragment.c,
config_parse_device_allow: the path runs to the first whitespace, the rest is the access, none means
"rwm"). The path is one of (v252 src/core/cgroup.c, cgroup_apply_devices -> bpf-devices.c):
  - `/dev/char/M:m`, `/dev/block/M:m`: parsed as numbers, no stat (bpf_devices_allow_list_device,
    since v240; REFERENCE.md);
  - `char-NAME`, `block-NAME`: every major /proc/devices names NAME (fnmatch: `char-nvidia*`), `char-M`
    a number, `char-*` every device of the type (bpf_devices_allow_list_major / _type);
  - any other `/dev/...` path: systemd stats it when it applies the list.
Entries are compared as entries (path and letters), never as text.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Iterable, NamedTuple, Optional

from nvsymlinkd.host.devices import LETTERS, RWM, Access, Device, Rule
from nvsymlinkd.host.procdevices import decimal

NUMBERED = re.compile(r"/dev/(char|block)/(\d+):(\d+)")
GROUP_PREFIXES = (("char-", "c"), ("block-", "b"))
_KIND = {"c": "char", "b": "block"}


class DeviceAllow(NamedTuple):
    """One entry, as systemd holds it: `path` (/dev/char/195:0, char-nvidia, char-*, a /dev path) and
    `access` (the letters as given; ones beyond rwm grant nothing). A tuple: the bus's (ss) pair."""

    path: str
    access: str

    def __str__(self) -> str:
        """The unit-file value `DeviceAllow=` takes: "/dev/char/195:0 rw"."""
        return f"{self.path} {self.access}"

    @classmethod
    def parse(cls, value: str) -> Optional[DeviceAllow]:
        """One `DeviceAllow=` value from a unit file; None for the empty value (it resets the list)."""
        fields = value.split(None, 1)  # load-fragment.c: strcspn(rvalue, WHITESPACE)
        if not fields:
            return None
        return cls(fields[0], fields[1].strip() if len(fields) > 1 and fields[1].strip() else RWM)

    @classmethod
    def of_pair(cls, pair: Iterable[object]) -> DeviceAllow:
        """One (ss) element of the bus's DeviceAllow property."""
        path, access = pair
        return cls(str(path), str(access))

    @classmethod
    def of_device(cls, device: Device, access: str) -> DeviceAllow:
        """The entry that grants one device: its /dev/char/M:m path (no stat in systemd >= 240)."""
        return cls(device.dev_path, str(Access(access)))

    @classmethod
    def of_rule(cls, rule: Rule) -> Optional[DeviceAllow]:
        """An allow rule as runc's systemd driver writes it (runc v1.1.5 libcontainer/cgroups/systemd/
        common.go:180-315, generateDeviceProperties; newer runc names the major, REFERENCE.md): M:m ->
        /dev/char/M:m, M:* -> char-M, *:* -> char-*, block likewise. None for what has no entry: type `a`
        and `*:m` (runc skips it too)."""
        if not rule.allow or rule.type not in _KIND:
            return None
        kind = _KIND[rule.type]
        if rule.major is None:
            return None if rule.minor is not None else cls(f"{kind}-*", str(rule.access))
        if rule.minor is None:
            return cls(f"{kind}-{rule.major}", str(rule.access))
        return cls(f"/dev/{kind}/{rule.major}:{rule.minor}", str(rule.access))

    @property
    def letters(self) -> Access:
        """The access systemd grants: its letters within rwm (bpf-devices.c reads only r, w and m)."""
        return Access("".join(c for c in self.access if c in LETTERS))

    def holds(self, device: Device, access: str) -> bool:
        """This one entry grants every letter asked for on the device, by numbers (`char-195` holds 195:0;
        a `char-NAME` or a plain /dev path, which need the host, holds nothing here)."""
        return any(rule.covers(device, Access(access)) for rule in self.rules() or ())

    @property
    def by_number(self) -> bool:
        """Mapped to rules without looking at the host's /dev (a number path, or a /proc/devices group)."""
        return bool(NUMBERED.fullmatch(self.path)) or self.path.startswith(("char-", "block-"))

    def rules(self, majors: Iterable[tuple[str, int]] = ()) -> Optional[list[Rule]]:
        """The allow rules this entry means, by numbers alone; `majors`: /proc/devices' (name, major) pairs
        for `char-NAME`. None when that cannot say: a plain /dev path (systemd stats it: the caller
        does, under its root) or a number beyond the kernel's dev_t."""
        access = self.letters
        m = NUMBERED.fullmatch(self.path)
        if m:
            # the kernel's ranges (12-bit major, 20-bit minor); beyond them no device, and no int() of 5,000 digits
            major, minor = decimal(m.group(2), (1 << 12) - 1), decimal(m.group(3), (1 << 20) - 1)
            if major is None or minor is None:
                return None
            return [Rule(True, "c" if m.group(1) == "char" else "b", major, minor, access)]
        for prefix, dev_type in GROUP_PREFIXES:
            if self.path.startswith(prefix):
                name = self.path[len(prefix):]
                if name == "*":
                    return [Rule(True, dev_type, None, None, access)]
                if name.isdigit():
                    number = decimal(name, (1 << 12) - 1)
                    return None if number is None else [Rule(True, dev_type, number, None, access)]
                if dev_type == "b":
                    return []  # not an NVIDIA device either way
                hits = sorted({major for group, major in majors if fnmatch.fnmatchcase(group, name)})
                return [Rule(True, "c", major, None, access) for major in hits]
        return None
