"""nvsymlinkd/repair/freeze.py on a fake tree: a freeze's record (where it is written, what it says) and
the thaw of what an interrupted repair left frozen (thaw_orphans), one case per state the record's cgroup
can be in. The freezer is a plain file here, as cgroupfs shows it (freezer.state takes one word per
write); the kernel's freezer is tests/test_repair_dbus.py's and tests/test_repair_crash.py's."""

from __future__ import annotations

import json
import os
import stat

import pytest

from nvsymlinkd.config import Config
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.repair.freeze import FROZEN_DIR, FreezeRecord, thaw_orphans, thawed_line
from nvsymlinkd.repair.model import RepairRequest

FREEZER = "/sys/fs/cgroup/freezer"  # the hierarchy where no mount table says otherwise


def request(freezer: str | None = "/docker/c1", cid: str = "c1") -> RepairRequest:
    return RepairRequest(cid, "runc", f"docker-{cid}.scope", freezer, None, freezer, "systemd")


class Journal:
    def __init__(self):
        self.said: list = []

    def event(self, kind, priority, message, **fields):
        self.said.append((kind, message, fields))

    def warning(self, message, **fields):
        self.said.append(("warning", message, fields))

    error = warning


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    return root


def frozen_cgroup(root, path: str, state: str) -> str:
    d = root / f"{FREEZER}{path}".lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    (d / "freezer.state").write_text(state + "\n")
    return str(d / "freezer.state")


def test_the_record_is_written_under_the_state_dir_for_its_owner_alone(tree):
    record = FreezeRecord(HostRoot(str(tree)), Config(), request())
    record.write()
    (name,) = os.listdir(tree / "run/nvsymlinkd" / FROZEN_DIR)
    path = tree / "run/nvsymlinkd" / FROZEN_DIR / name
    assert name.endswith(".json") and len(name) == 32 + 5
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tree / "run/nvsymlinkd" / FROZEN_DIR).stat().st_mode) == 0o700
    doc = json.loads(path.read_text())
    assert (doc["freezer"], doc["container_id"], doc["unit"], doc["pid"]) == ("/docker/c1", "c1", "docker-c1.scope",
                                                                             os.getpid())
    # one record per freezer cgroup: the same cgroup is the same name, another one another
    assert FreezeRecord(HostRoot(str(tree)), Config(), request()).inside == record.inside
    assert FreezeRecord(HostRoot(str(tree)), Config(), request("/docker/c2", "c2")).inside != record.inside
    record.drop()
    assert os.listdir(tree / "run/nvsymlinkd" / FROZEN_DIR) == []


def test_a_request_without_a_freezer_path_has_no_record(tree):
    from nvsymlinkd.errors import RepairError

    with pytest.raises(RepairError, match="freezer cgroup path"):
        FreezeRecord(HostRoot(str(tree)), Config(), request(None))


# the cgroup's freezer.state (None: no cgroup) -> (state read, action, freezer.state after, record kept)
ORPHANS = [
    ("FROZEN", "FROZEN", "thawed", "THAWED", False),
    ("FREEZING", "FREEZING", "thawed", "THAWED", False),
    ("THAWED", "THAWED", "none", "THAWED", False),  # nothing of ours to undo
    (None, "gone", "none", None, False),  # the container went away meanwhile
]


@pytest.mark.parametrize(("state", "read", "action", "after", "kept"), ORPHANS)
def test_thaw_orphans(tree, state, read, action, after, kept):
    root = HostRoot(str(tree))
    FreezeRecord(root, Config(), request()).write()
    state_file = frozen_cgroup(tree, "/docker/c1", state) if state else None
    journal = Journal()
    (entry,) = thaw_orphans(root, Config(), journal)
    assert (entry["state"], entry["action"]) == (read, action)
    assert (entry["container"], entry["unit"], entry["freezer"], entry["pid"]) == ("c1", "docker-c1.scope",
                                                                                   "/docker/c1", os.getpid())
    if state_file:
        assert open(state_file).read().strip() == after
        assert entry["freezer_dir"] == f"{FREEZER}/docker/c1"
    assert bool(os.listdir(tree / "run/nvsymlinkd" / FROZEN_DIR)) is kept
    assert [k for k, _, _ in journal.said] == (["repair-thawed"] if action == "thawed" else [])


def test_a_dry_run_thaws_nothing_and_keeps_the_record(tree):
    root = HostRoot(str(tree))
    FreezeRecord(root, Config(), request()).write()
    state_file = frozen_cgroup(tree, "/docker/c1", "FROZEN")
    (entry,) = thaw_orphans(root, Config(), dry_run=True)
    assert entry["action"] == "would-thaw" and open(state_file).read().strip() == "FROZEN"
    assert len(os.listdir(tree / "run/nvsymlinkd" / FROZEN_DIR)) == 1


@pytest.mark.parametrize(("text", "why"), [
    ("{not json", "Expecting"),
    (json.dumps({"container_id": "c1"}), "no freezer cgroup path in it"),
    (json.dumps({"freezer": "/../../etc"}), "refusing the freezer cgroup path"),
])
def test_an_invalid_record_is_dropped_and_thaws_nothing(tree, text, why):
    directory = tree / "run/nvsymlinkd" / FROZEN_DIR
    directory.mkdir(parents=True)
    (directory / ("0" * 32 + ".json")).write_text(text)
    frozen_cgroup(tree, "/etc", "FROZEN")
    journal = Journal()
    (entry,) = thaw_orphans(HostRoot(str(tree)), Config(), journal)
    assert entry["action"] == "none" and entry["freezer_dir"] is None
    assert os.listdir(directory) == []
    ((kind, message, _),) = journal.said
    assert kind == "warning" and "dropping the invalid freeze record" in message and why in message


def test_a_half_written_record_goes_and_no_records_is_no_work(tree):
    root = HostRoot(str(tree))
    assert thaw_orphans(root, Config()) == []  # no directory
    directory = tree / "run/nvsymlinkd" / FROZEN_DIR
    directory.mkdir(parents=True)
    (directory / "x.json.tmp").write_text("{")  # its writer died before the rename: it froze nothing
    assert thaw_orphans(root, Config(), dry_run=True) == [] and os.listdir(directory) == ["x.json.tmp"]
    assert thaw_orphans(root, Config()) == [] and os.listdir(directory) == []


@pytest.mark.parametrize(("entry", "line"), [
    ({"freezer_dir": f"{FREEZER}/docker/c1", "freezer": "/docker/c1", "container": "c1", "unit": "docker-c1.scope",
      "pid": 42, "action": "thawed"},
     f"thawed {FREEZER}/docker/c1 (container c1, docker-c1.scope): a repair (pid 42) froze it and did not finish"),
    ({"freezer_dir": None, "freezer": "/docker/c1", "container": None, "unit": None, "pid": 7,
      "action": "would-thaw"},
     "would thaw /docker/c1: a repair (pid 7) froze it and did not finish"),
    ({"freezer_dir": "/f/x", "freezer": "/x", "container": None, "unit": "x.scope", "pid": 1, "action": "thawed"},
     "thawed /f/x (x.scope): a repair (pid 1) froze it and did not finish"),
])
def test_thawed_line(entry, line):
    assert thawed_line(entry) == line
