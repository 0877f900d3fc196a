"""The device vocabulary: one `Device`, one `Access`, one `Rule` (after runc's libcontainer/devices).

Every layer speaks these: the cgroup v1 reader and the BPF interpreter (access/), the OCI spec and
systemd's DeviceAllow (containers/), the verifier's expected and granted maps (verify/), the repair
planner's grants (repair/). Text appears only where a file format, the JSON or the journal needs it:
`str(Device)` is "c 195:0", `str(Rule)` is a devices.list line "c 195:* rw", `Device.parse()` and
`Access()` read them back.

It lives in host/ because host/ is the bottom of the tree (every other package already imports it,
it imports none of them) and because a device is the host's fact: a node's type and rdev numbers.
Pure and standard library only.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Optional

from nvsymlinkd.record import dataclass

LETTERS = "rwm"  # the cgroup's access letters, in the kernel's (and runc's) canonical order
TYPES = ("c", "b")  # a device's type; a rule may also say "a" (all)
MAX_MAJOR = (1 << 12) - 1  # the kernel's dev_t: 12-bit major, 20-bit minor
MAX_MINOR = (1 << 20) - 1


_ACCESS: dict[str, Access] = {}  # canonical letters -> the one Access of them (Access.__new__)


class Access(str):
    """A set of access letters (r read, w write, m mknod), always in the order r, w, m.

    A `str`, so it is its own text in JSON, rules and messages; built from any order ("wr" -> "rw").
    Like runc's devices.Permissions: union, difference, covers.
    """

    __slots__ = ()

    def __new__(cls, letters: str = "") -> Access:
        if type(letters) is cls:
            return letters
        if not isinstance(letters, str):
            raise TypeError(f"access must be a string of r, w, m, not {type(letters).__name__}")
        if cls is Access:
            # one object per set of letters (at most 8): every parsed rule of every container's spec and
            # state held its own, ~2.5 KB of the ~15.7 KB the daemon keeps per container (issue 38).
            # Keyed by the canonical text only, so what a container writes cannot grow the table.
            one = _ACCESS.get(letters)
            if one is not None:
                return one
        bad = set(letters) - set(LETTERS)
        if bad:
            raise ValueError(f"access letters must be r, w, m (got {''.join(sorted(bad))!r})")
        canonical = "".join(letter for letter in LETTERS if letter in letters)
        if cls is not Access:
            return super().__new__(cls, canonical)
        return _ACCESS.setdefault(canonical, super().__new__(cls, canonical))

    @classmethod
    def valid(cls, letters: object) -> bool:
        return isinstance(letters, str) and not set(letters) - set(LETTERS)

    def union(self, other: str) -> Access:
        return Access(self + Access(other))

    def difference(self, other: str) -> Access:
        other = Access(other)
        return Access("".join(letter for letter in self if letter not in other))

    def intersection(self, other: str) -> Access:
        other = Access(other)
        return Access("".join(letter for letter in self if letter in other))

    def covers(self, other: str) -> bool:
        """Every letter of `other` is in this set."""
        return all(letter in self for letter in Access(other))

    @property
    def usable(self) -> Access:
        """The letters an open() is checked for (mknod is not use)."""
        return self.intersection("rw")

    def __repr__(self) -> str:
        return f"Access({str(self)!r})"


RW = Access("rw")
RWM = Access("rwm")


class Device(NamedTuple):
    """One device: type "c" or "b", major, minor. str() is "c 195:0"; a tuple, so it sorts and keys."""

    type: str
    major: int
    minor: int

    def __str__(self) -> str:
        return f"{self.type} {self.major}:{self.minor}"

    @classmethod
    def char(cls, major: int, minor: int) -> Device:
        return cls("c", major, minor)

    @classmethod
    def parse(cls, text: str) -> Device:
        """"c 195:0" -> Device("c", 195, 0); ValueError for anything else."""
        if not isinstance(text, str):
            raise ValueError(f"not a device: {text!r}")
        fields = text.split()
        if len(fields) != 2 or fields[0] not in TYPES:
            raise ValueError(f"not a device 'c|b MAJOR:MINOR': {text[:40]!r}")
        major, sep, minor = fields[1].partition(":")
        if not sep or not (major.isascii() and major.isdigit() and minor.isascii() and minor.isdigit()):
            raise ValueError(f"not a device 'c|b MAJOR:MINOR': {text[:40]!r}")
        if len(major) > 7 or len(minor) > 7:  # never int() of a huge string
            raise ValueError(f"device numbers out of range: {text[:40]!r}")
        return cls(fields[0], int(major), int(minor))

    @classmethod
    def try_parse(cls, text: object) -> Optional[Device]:
        if not isinstance(text, str):
            return None
        try:
            return cls.parse(text)
        except ValueError:
            return None

    @property
    def in_range(self) -> bool:
        """Within the kernel's dev_t (12-bit major, 20-bit minor)."""
        return 0 <= self.major <= MAX_MAJOR and 0 <= self.minor <= MAX_MINOR

    @property
    def dev_path(self) -> str:
        """systemd's DeviceAllow path and the link nvsymlinkd keeps: /dev/char/195:0 (/dev/block/ for b)."""
        return f"/dev/{'char' if self.type == 'c' else 'block'}/{self.major}:{self.minor}"


def _num(n: Optional[int]) -> str:
    return "*" if n is None else str(n)


@dataclass(frozen=True)
class Rule:
    """One device cgroup rule: allow or deny `access` to a device or a wildcard.

    type "a" (all), "c" or "b"; major/minor None is the wildcard `*`. The v1 devices.list lines
    (all allow rules), the OCI spec's linux.resources.devices, runc's recorded rules and systemd's
    DeviceAllow entries are all Rules. str() is the devices.list / devices.allow line.
    """

    allow: bool
    type: str
    major: Optional[int]
    minor: Optional[int]
    access: Access

    def __post_init__(self) -> None:
        if self.type not in ("a", *TYPES):
            raise ValueError(f"device type must be a, c or b, not {self.type!r}")
        object.__setattr__(self, "access", Access(self.access))

    @classmethod
    def exact(cls, device: Device, access: str, allow: bool = True) -> Rule:
        return cls(allow, device.type, device.major, device.minor, Access(access))

    @property
    def device(self) -> Optional[Device]:
        """The one device this rule names, or None for a wildcard."""
        if self.type == "a" or self.major is None or self.minor is None:
            return None
        return Device(self.type, self.major, self.minor)

    @property
    def dev_type(self) -> str:  # the v1 reader's name for `type`
        return self.type

    @property
    def is_allow_all(self) -> bool:
        """`a *:* rwm` in devices.list: the cgroup is in default-allow mode."""
        return self.allow and self.type == "a"

    def matches(self, device: Device) -> bool:
        """This rule's type and numbers cover the device (whatever the access)."""
        if self.type != "a" and self.type != device.type:
            return False
        if self.major is not None and self.major != device.major:
            return False
        return self.minor is None or self.minor == device.minor

    def covers(self, device: Device, access: Access) -> bool:
        """This one rule matches the device and holds every letter asked for."""
        return self.matches(device) and self.access.covers(access)

    def __str__(self) -> str:
        return f"{self.type} {_num(self.major)}:{_num(self.minor)} {self.access}"

    def describe(self) -> str:
        """"allow c 195:* rwm": the rule with its verb, for messages."""
        return f"{'allow' if self.allow else 'deny'} {self}"


def named_minors(rules: Iterable[Rule]) -> frozenset[int]:
    """The minors some Rule names (None, the wildcard, names none)."""
    return frozenset(r.minor for r in rules if r.minor is not None)


def rule_class(device: Device, named: frozenset[int]) -> tuple[str, int, Optional[int]]:
    """A key two devices share only when they match the very same rules, for rules whose named minors
    are `named`: a rule matches a device by its type (or all), its major (or *) and its minor (or *), so
    devices of one type and major whose minors no rule names cannot be told apart; a minor some rule
    names is its own class. A MIG host's ~2,000 capability nodes are then decided once per class."""
    return (device.type, device.major, device.minor if device.minor in named else None)
