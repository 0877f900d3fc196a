"""A createRuntime hook that grants devices the way the legacy NVIDIA hook (libnvidia-container)
does on cgroup v2: allow blocks prepended to the device program runc attached to the
container's cgroup, the new program attached, the old one detached. The devices are in neither
the spec's rules nor the scope's DeviceAllow, so a systemd reload takes them (failure 2).

    python3 nvidia_hook.py c:195:0:rw [...]     (runc passes the container state on stdin)
"""
import json
import os
import sys

sys.path[:0] = ["/mnt/src/tests", "/mnt/src"]

from bpfasm import nvidia_prepend  # noqa: E402  (tests/bpfasm.py: libnvidia-container's shape)

from nvsymlinkd.access import bpfeval, bpfprog  # noqa: E402
from nvsymlinkd.access.rules import DeviceRule  # noqa: E402


def container_cgroup(pid: int) -> str:
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return "/sys/fs/cgroup" + line.strip()[3:]
    raise RuntimeError(f"no cgroup v2 entry in /proc/{pid}/cgroup")


def main() -> None:
    state = json.load(sys.stdin)
    rules = []
    for arg in sys.argv[1:]:
        dev_type, major, minor, access = arg.split(":")
        rules.append((DeviceRule(dev_type, int(major), int(minor), access), True))
    fd = bpfprog.open_cgroup_dir(container_cgroup(state["pid"]))
    try:
        for prog_id in bpfprog.query_device_program_ids(fd, effective=False):
            old = bpfprog.read_program(prog_id)
            new = nvidia_prepend(rules, bpfeval.decode(old.xlated))
            new_fd = bpfprog.load_device_program(bpfeval.encode(new), name="nvidia_hook")
            bpfprog.attach_device_program(fd, new_fd)
            old_fd = bpfprog._bpf(bpfprog.BPF_PROG_GET_FD_BY_ID, bpfprog._attr((0, "=I", prog_id)), 12)
            bpfprog.detach_device_program(fd, old_fd)
            os.close(old_fd)
            os.close(new_fd)
    finally:
        os.close(fd)


if __name__ == "__main__":
    main()
