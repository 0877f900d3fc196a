"""What a cgroup path that cannot be placed becomes at each boundary, byte for byte (issue 37 item 5).

access/cgroup raises CgroupPathError where it finds the path wrong (mount_relative, cgroup_dir_on,
v2_cgroup_dir); read_access turns it into the source's error (the access unknown), repair/cgroupfiles into a
RepairError, repair/bpfrepair into RepairRefused (own_ids: None). tests/fixtures/cgroup-path-errors.json was
dumped from the tree before the change, when each of them returned (None, why): the same words now.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from nvsymlinkd.access.cgroup import CgroupMounts, Mount, read_access
from nvsymlinkd.errors import NvsymlinkdError
from nvsymlinkd.host.devices import Device
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.repair import bpfrepair, cgroupfiles
from nvsymlinkd.repair.model import RepairRequest

GOLDEN = Path(__file__).parent / "fixtures" / "cgroup-path-errors.json"
# the rows of tests/test_cgroupns.py's table that are refused: (cgroup, mount root, namespace base)
ROWS = [("/../../..", "/../..", "/pod/me"), ("/../x", "/..", None), ("/../x", "/", None), ("kubepods/ctr", "/", None),
        ("/a/../b", "/", None), ("/a/./b", "/", None), ("/a//b", "/", None), ("/a/\0b", "/", None),
        ("/../a/../../b", "/../..", "/x/y"), ("/x", "/../a", "/q"), ("/other/ctr", "/kubepods/pod0/me", None)]

def dump(t: str) -> dict:
    """Each boundary's words for each path (t: an empty host root, so no bpf(2) is ever reached)."""
    out: dict = {}
    root = HostRoot(t)
    for cgroup, mroot, base in ROWS:
        v1 = CgroupMounts(Mount(mroot, "/sys/fs/cgroup/devices", "cgroup", ("devices",), base), None)
        v2 = CgroupMounts(None, Mount(mroot, "/sys/fs/cgroup/unified", "cgroup2", (), base))
        a = read_access(root, cgroup, None, v1)
        b = read_access(root, None, cgroup, v2)
        out[repr((cgroup, mroot, base))] = [a.describe(), a.check(Device("c", 195, 0), "rw").reason,
                                            b.describe(), b.check(Device("c", 195, 0), "rw").reason]
    # repair/: no mountinfo at all (the fallback mounts), v1 and v2
    for cgroup in ("kubepods/ctr", "/a/../b", "/../x"):
        try:
            cgroupfiles.cgroup_dir(root, "devices", cgroup, "/sys/fs/cgroup/devices")
        except NvsymlinkdError as e:
            out["cgroup_dir " + cgroup] = f"{type(e).__name__}: {e}"
        req = RepairRequest("x", "runc", None, None, cgroup, None, "cgroupfs")
        try:
            bpfrepair.prepare(root, req, ())
        except NvsymlinkdError as e:
            out["prepare " + cgroup] = f"{type(e).__name__}: {e}"
        try:
            bpfrepair.hold(root, cgroup)
        except NvsymlinkdError as e:
            out["hold " + cgroup] = f"{type(e).__name__}: {e}"
        out["own_ids " + cgroup] = bpfrepair.own_ids(root, cgroup)
    os.makedirs(t + "/sys/fs/cgroup/unified")  # a cgroup2 found by the probe: the path is what is refused
    Path(t + "/sys/fs/cgroup/unified/cgroup.controllers").touch()
    for cgroup in ("kubepods/ctr", "/../x"):
        try:
            bpfrepair.prepare(root, RepairRequest("x", "runc", None, None, cgroup, None, "cgroupfs"), ())
        except NvsymlinkdError as e:
            out["prepare probed " + cgroup] = f"{type(e).__name__}: {e}"
    return out


def test_cgroup_path_failures_say_what_they_said(tmp_path):
    (tmp_path / "root").mkdir()
    got = json.loads(json.dumps(dump(str(tmp_path / "root"))))
    assert got == json.loads(GOLDEN.read_text())


def test_a_container_with_no_cgroup_raises_for_the_verifiers_boundary(tmp_path):
    """verify/verifier.read_policy raises (it returned (None, why)); _verify_one turns the words into the
    finding's detail, as it turns any failure to read."""
    import pytest

    from nvsymlinkd.access.cgroup import CgroupMounts
    from nvsymlinkd.containers.discovery import Container
    from nvsymlinkd.errors import CgroupPathError
    from nvsymlinkd.verify.cache import NoCache
    from nvsymlinkd.verify.verifier import read_policy

    with pytest.raises(CgroupPathError, match=r"^no cgroup known for init pid 4242$"):
        read_policy(HostRoot(str(tmp_path)), Container("x", "runc", init_pid=4242), CgroupMounts(None, None), NoCache())
