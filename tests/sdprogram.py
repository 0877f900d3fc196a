"""systemd's device program for a scope's DevicePolicy and DeviceAllow, attached to its cgroup v2 directory the
way systemd 252 does it (src/core/bpf-devices.c, bpf_devices_apply_policy: the new program attached with
BPF_F_ALLOW_MULTI, then the one it installed before detached; DevicePolicy=auto with no entries attaches
none, src/core/cgroup.c cgroup_context_has_device_policy). The dbusmock systemd of tests/test_repair_narrow.py
runs it on every SetUnitProperties, so the kernel judges what systemd would have done:

    python3 -m tests.sdprogram CGROUP_DIR POLICY '[["/dev/char/195:0", "rw"], ["char-*", "m"]]'

`auto` and `closed` with entries are an allow-list of them plus systemd's pseudo devices; `strict` of them
alone. Run from the repository (it imports nvsymlinkd and tests.bpfasm).
"""

from __future__ import annotations

import json
import os
import stat
import sys

from nvsymlinkd.access import bpfeval, bpfprog
from nvsymlinkd.host.devices import Rule
from tests import bpfasm

NAME = "sd_devices"  # systemd's program name (bpf-devices.c, bpf_program_new)


def rule(path: str, access: str) -> Rule | None:
    """A DeviceAllow entry as the rule systemd's program checks; None for what it would skip."""
    for prefix, dev_type in (("/dev/char/", "c"), ("/dev/block/", "b")):
        if path.startswith(prefix):
            major, minor = path[len(prefix):].split(":")
            return Rule(True, dev_type, int(major), int(minor), access)
    for prefix, dev_type in (("char-", "c"), ("block-", "b")):
        if path.startswith(prefix):
            name = path[len(prefix):]
            return Rule(True, dev_type, None if name == "*" else int(name), None, access)
    try:
        st = os.stat(path)
    except OSError:
        return None  # systemd: "Couldn't stat device", skipped
    dev_type = "c" if stat.S_ISCHR(st.st_mode) else "b" if stat.S_ISBLK(st.st_mode) else None
    if dev_type is None:
        return None
    return Rule(True, dev_type, os.major(st.st_rdev), os.minor(st.st_rdev), access)


def apply(cgroup_dir: str, policy: str, entries: list) -> None:
    rules = [r for r in (rule(p, a) for p, a in entries) if r is not None]
    fd = bpfprog.open_cgroup_dir(cgroup_dir)
    try:
        own, _ = bpfprog.query_device_programs(fd, effective=False)
        installed = [i for i in own if bpfprog.read_program(i).name == NAME]
        if policy != "auto" or entries:
            prog = bpfasm.systemd_program(rules, "strict" if policy == "strict" else "closed")
            new = bpfprog.load_device_program(bpfeval.encode(prog), NAME)
            try:
                bpfprog.attach_device_program(fd, new, bpfprog.BPF_F_ALLOW_MULTI)
            finally:
                os.close(new)
        for prog_id in installed:
            old = bpfprog.program_fd(prog_id)
            try:
                bpfprog.detach_device_program(fd, old)
            finally:
                os.close(old)
    finally:
        os.close(fd)


if __name__ == "__main__":
    apply(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
