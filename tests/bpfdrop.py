"""Take devices away from a cgroup v2 directory the way a runtime's re-apply does: a new device program
(the cgroup's own programs' policy, less open() of the given devices) attached with BPF_F_ALLOW_MULTI, then the
old ones detached. For the tests and the GPU suite (a real host, cgroup v2, runc's cgroupfs driver):

    python3 tests/bpfdrop.py /sys/fs/cgroup/<container id> 'c 195:0' 'c 195:255'

then `nvsymlinkd repair <container id>` gives them back. Run from the repository (it imports nvsymlinkd).
"""

from __future__ import annotations

import os
import sys

from nvsymlinkd.access import bpfeval, bpfgen, bpfprog, bpfproof
from nvsymlinkd.host.devices import Device, Rule


def drop(cgroup_dir: str, devices: list) -> list:
    """Replace the cgroup's own programs by one that denies `devices` and is otherwise the same; returns
    the new program's rules."""
    fd = bpfprog.open_cgroup_dir(cgroup_dir)
    try:
        own, flags = bpfprog.query_device_programs(fd, effective=False)
        if not own:
            raise SystemExit(f"{cgroup_dir} has no device program of its own")
        programs = [bpfeval.decode(bpfprog.read_program(i).xlated) for i in own]
        rules = [Rule(False, d.type, d.major, d.minor, "rw") for d in devices] + bpfproof.policy_rules(programs)
        held = [bpfprog.program_fd(i) for i in own]
        new = bpfprog.load_device_program(bpfeval.encode(bpfgen.program(rules)), "bpfdrop")
        try:
            multi = bool(flags & bpfprog.BPF_F_ALLOW_MULTI)
            bpfprog.attach_device_program(fd, new, bpfprog.BPF_F_ALLOW_MULTI if multi else flags)
            for old in held if multi else ():
                bpfprog.detach_device_program(fd, old)
        finally:
            for f in held + [new]:
                os.close(f)
        return rules
    finally:
        os.close(fd)


def main(argv: list) -> int:
    if len(argv) < 2:
        sys.stderr.write("usage: bpfdrop.py CGROUP_DIR 'c MAJOR:MINOR' ...\n")
        return 2
    for rule in drop(argv[0], [Device.parse(a) for a in argv[1:]]):
        print(rule.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
