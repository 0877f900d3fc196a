"""systemd.deviceallow: one DeviceAllow= entry, parsed, written and turned into Rules and back (tables, no root)."""

from __future__ import annotations

import pytest

from nvsymlinkd.host.devices import Access, Device, Rule
from nvsymlinkd.systemd.deviceallow import DeviceAllow

MAJORS = (("nvidia-frontend", 195), ("nvidia-uvm", 510), ("nvidia-caps", 234), ("mem", 1))


@pytest.mark.parametrize("value, want", [
    ("/dev/char/195:0 rw", ("/dev/char/195:0", "rw")),
    ("char-nvidia-frontend rwm", ("char-nvidia-frontend", "rwm")),
    ("char-* m", ("char-*", "m")),
    ("/dev/nvidiactl", ("/dev/nvidiactl", "rwm")),           # no access: systemd means rwm
    ("/dev/char/195:0\trw", ("/dev/char/195:0", "rw")),      # any whitespace ends the path (strcspn WHITESPACE)
    ("  /dev/char/1:3   r w ", ("/dev/char/1:3", "r w")),     # the rest is the access, as written
    ("/dev/char/195:0 ", ("/dev/char/195:0", "rwm")),
    ("", None),                                               # the empty value resets the list
    ("   ", None),
])
def test_parse(value, want):
    assert DeviceAllow.parse(value) == want


@pytest.mark.parametrize("entry", [
    DeviceAllow("/dev/char/195:0", "rw"), DeviceAllow("char-nvidia*", "rwm"), DeviceAllow("/dev/nvidia-uvm", "r"),
])
def test_written_text_parses_back(entry):
    assert DeviceAllow.parse(str(entry)) == entry


def test_a_bus_pair_is_an_entry():
    entry = DeviceAllow.of_pair(["/dev/char/195:255", "rw"])
    assert entry == ("/dev/char/195:255", "rw") and entry.path == "/dev/char/195:255"
    assert str(DeviceAllow.of_device(Device.char(195, 255), Access("wr"))) == "/dev/char/195:255 rw"


@pytest.mark.parametrize("rule, want", [
    (Rule(True, "c", 195, 0, Access("rw")), ("/dev/char/195:0", "rw")),
    (Rule(True, "b", 8, 1, Access("r")), ("/dev/block/8:1", "r")),
    (Rule(True, "c", 195, None, Access("rwm")), ("char-195", "rwm")),
    (Rule(True, "c", None, None, Access("m")), ("char-*", "m")),
    (Rule(True, "b", None, None, Access("m")), ("block-*", "m")),
    (Rule(True, "c", None, 5, Access("rw")), None),    # `*:5`: systemd has no such entry (runc skips it too)
    (Rule(True, "a", None, None, Access("rwm")), None),
    (Rule(False, "c", 195, 0, Access("rw")), None),    # DeviceAllow allows; a deny rule has no entry
])
def test_of_rule(rule, want):
    assert DeviceAllow.of_rule(rule) == want


@pytest.mark.parametrize("entry, want", [
    (("/dev/char/195:0", "rw"), [Rule(True, "c", 195, 0, Access("rw"))]),
    (("/dev/block/8:0", "rwm"), [Rule(True, "b", 8, 0, Access("rwm"))]),
    (("/dev/char/195:0", "rwx"), [Rule(True, "c", 195, 0, Access("rw"))]),   # letters beyond rwm grant nothing
    (("char-195", "rw"), [Rule(True, "c", 195, None, Access("rw"))]),
    (("char-*", "m"), [Rule(True, "c", None, None, Access("m"))]),
    (("block-*", "m"), [Rule(True, "b", None, None, Access("m"))]),
    (("char-nvidia-frontend", "rw"), [Rule(True, "c", 195, None, Access("rw"))]),
    (("char-nvidia*", "rw"), [Rule(True, "c", major, None, Access("rw")) for major in (195, 234, 510)]),
    (("char-nvidia-modeset", "rw"), []),               # a name /proc/devices lacks: nothing
    (("block-loop", "rw"), []),
    (("/dev/char/4096:0", "rw"), None),                 # beyond the 12-bit major: no device
    (("/dev/char/1:1048576", "rw"), None),
    (("/dev/char/" + "9" * 5000 + ":0", "rw"), None),
    (("char-" + "9" * 5000, "rw"), None),
    (("/dev/nvidiactl", "rw"), None),                   # systemd stats it: the caller does, under its root
    (("nvidia0", "rw"), None),
])
def test_rules(entry, want):
    assert DeviceAllow(*entry).rules(MAJORS) == want


def test_rule_round_trip():
    for rule in (Rule(True, "c", 195, 0, Access("rw")), Rule(True, "c", 195, None, Access("rwm")),
                 Rule(True, "c", None, None, Access("m"))):
        entry = DeviceAllow.of_rule(rule)
        assert entry is not None and entry.rules() == [rule]


@pytest.mark.parametrize("entry, by_number", [
    (("/dev/char/195:0", "rw"), True), (("char-nvidia", "rw"), True), (("block-*", "m"), True),
    (("/dev/nvidiactl", "rw"), False), (("/dev/char/195:x", "rw"), False),
])
def test_by_number(entry, by_number):
    assert DeviceAllow(*entry).by_number is by_number


def test_holds_compares_entries_not_text():
    gpu = Device.char(195, 0)
    assert DeviceAllow("/dev/char/195:0", "mwr").holds(gpu, Access("rw"))     # any order of letters
    assert not DeviceAllow("/dev/char/195:0", "r").holds(gpu, Access("rw"))   # one entry must hold every letter
    assert DeviceAllow("/dev/char/195:00", "rw").holds(gpu, Access("rw"))    # the same numbers
    assert DeviceAllow("char-195", "rw").holds(gpu, Access("rw"))
    assert not DeviceAllow("/dev/char/195:1", "rw").holds(gpu, Access("rw"))
