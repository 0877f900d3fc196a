"""The device vocabulary (host/devices.py), as tables: Device, Access, Rule. Pure, no root."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from nvsymlinkd.host.devices import RW, RWM, Access, Device, Rule


@pytest.mark.parametrize("text, device", [
    ("c 195:0", Device("c", 195, 0)),
    ("c 195:255", Device("c", 195, 255)),
    ("b 8:16", Device("b", 8, 16)),
    ("  c   510:1 ", Device("c", 510, 1)),
])
def test_device_parse_and_str(text, device):
    assert Device.parse(text) == device
    assert str(device) == " ".join(text.split())
    assert Device.parse(str(device)) == device


@pytest.mark.parametrize("text", [
    "c 195:*", "a *:*", "c 195", "c195:0", "x 1:2", "c -1:0", "c 1:2:3", "c 1:2 rw", "", "c ١:٢",
    "c 12345678:0",
])
def test_device_parse_refuses(text):
    with pytest.raises(ValueError):
        Device.parse(text)
    assert Device.try_parse(text) is None


def test_device_is_a_tuple_key_and_has_its_paths():
    d = Device.char(195, 0)
    assert d == ("c", 195, 0) and {d: 1}[("c", 195, 0)] == 1
    assert sorted([Device.char(195, 255), Device.char(195, 0), Device.char(10, 200)])[0] == Device.char(10, 200)
    assert d.dev_path == "/dev/char/195:0" and Device("b", 8, 0).dev_path == "/dev/block/8:0"
    assert d.in_range and not Device.char(1 << 12, 0).in_range and not Device.char(0, 1 << 20).in_range


@pytest.mark.parametrize("given, canonical", [
    ("", ""), ("r", "r"), ("wr", "rw"), ("mwr", "rwm"), ("mr", "rm"), ("rr", "r"), ("wm", "wm"),
])
def test_access_canonical_order(given, canonical):
    a = Access(given)
    assert a == canonical and str(a) == canonical and json.dumps(a) == json.dumps(canonical)
    assert Access(a) is a


@pytest.mark.parametrize("given", ["x", "rwx", "R", "r w", "rw\n"])
def test_access_refuses_other_letters(given):
    with pytest.raises(ValueError):
        Access(given)
    assert not Access.valid(given)


@pytest.mark.parametrize("a, b, union, difference, intersection, covers", [
    ("rw", "m", "rwm", "rw", "", False),
    ("rwm", "wr", "rwm", "m", "rw", True),
    ("r", "w", "rw", "r", "", False),
    ("", "r", "r", "", "", False),
    ("rw", "", "rw", "rw", "", True),
    ("mw", "rm", "rwm", "w", "m", False),
])
def test_access_set_operations(a, b, union, difference, intersection, covers):
    a = Access(a)
    assert a.union(b) == union and a.difference(b) == difference and a.intersection(b) == intersection
    assert a.covers(b) is covers
    assert RWM.usable == RW and Access("m").usable == ""


@pytest.mark.parametrize("rule, device, access, matches, covers", [
    (Rule(True, "c", 195, None, "rw"), Device.char(195, 7), "rw", True, True),
    (Rule(True, "c", 195, None, "rw"), Device.char(195, 7), "rwm", True, False),
    (Rule(True, "c", 195, 0, "r"), Device.char(195, 1), "r", False, False),
    (Rule(True, "a", None, None, "rwm"), Device("b", 8, 0), "m", True, True),
    (Rule(True, "c", None, 0, "w"), Device.char(10, 0), "w", True, True),
    (Rule(True, "b", 195, 0, "rw"), Device.char(195, 0), "r", False, False),
])
def test_rule_matches_and_covers(rule, device, access, matches, covers):
    assert rule.matches(device) is matches
    assert rule.covers(device, access) is covers


@pytest.mark.parametrize("rule, line, described, device", [
    (Rule(True, "c", 195, 0, "wr"), "c 195:0 rw", "allow c 195:0 rw", Device.char(195, 0)),
    (Rule(False, "a", None, None, "rwm"), "a *:* rwm", "deny a *:* rwm", None),
    (Rule(True, "c", 195, None, "m"), "c 195:* m", "allow c 195:* m", None),
    (Rule.exact(Device("b", 8, 0), "r"), "b 8:0 r", "allow b 8:0 r", Device("b", 8, 0)),
])
def test_rule_text(rule, line, described, device):
    assert str(rule) == line and rule.describe() == described and rule.device == device


def test_rule_refuses_bad_type_and_access():
    with pytest.raises(ValueError):
        Rule(True, "x", 1, 2, "r")
    with pytest.raises(ValueError):
        Rule(True, "c", 1, 2, "rx")
    assert Rule(True, "a", None, None, "rwm").is_allow_all and not Rule(False, "a", None, None, "rwm").is_allow_all


# Where loose device numbers may still be parameters: the constructor of a char Device, and the
# /dev/char link name "M:m" (a file name, devchar's own text).
# Device.char builds one; incremental's _name writes the link name; bpfeval's _Table.find looks numbers up in
# one context's partition (its type and access are the table's own: bpfeval.decisions)
LOOSE_NUMBERS_ALLOWED = {("nvsymlinkd/host/devices.py", "char"), ("nvsymlinkd/devchar/incremental.py", "_name"),
                         ("nvsymlinkd/access/bpfeval.py", "find")}


def test_no_function_takes_a_device_as_loose_fields():
    """The vocabulary at every seam: a function that decides about a device takes a Device (and an
    Access), never (dev_type, major, minor[, access]) (issue 27: nine did)."""
    repo = Path(__file__).parent.parent
    loose = []
    for path in sorted((repo / "nvsymlinkd").rglob("*.py")):
        rel = str(path.relative_to(repo))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            names = {a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
            if ("dev_type" in names or {"major", "minor"} <= names) and (rel, node.name) not in LOOSE_NUMBERS_ALLOWED:
                loose.append(f"{rel}:{node.lineno} {node.name}({', '.join(sorted(names))})")
    assert not loose, "take a host.devices.Device instead:\n" + "\n".join(loose)


def test_device_text_is_read_back_only_from_a_file():
    """"c M:m" is text for the JSON, the journal and messages: only the files nvsymlinkd wrote and reads back
    (the baseline, the record of the hook's inputs) turn it back into a Device; nothing parses its own text
    to decide."""
    repo = Path(__file__).parent.parent
    parsing = []
    for path in sorted((repo / "nvsymlinkd").rglob("*.py")):
        rel = str(path.relative_to(repo))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            f = node.func if isinstance(node, ast.Call) else None
            if (isinstance(f, ast.Attribute) and f.attr in ("parse", "try_parse") and isinstance(f.value, ast.Name)
                    and f.value.id == "Device"):
                parsing.append(f"{rel}:{node.lineno}")
    assert [p.partition(":")[0] for p in parsing] == ["nvsymlinkd/containers/baseline.py",
                                                      "nvsymlinkd/containers/hookrecord.py"], parsing
