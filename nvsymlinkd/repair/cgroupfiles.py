"""The cgroup v1 files a repair reads and writes: a container's devices and freezer directories placed
on the host's hierarchy, devices.list read, devices.allow written (one rule per write), and the wait for
systemd's asynchronous re-apply to show in devices.list.

Every path is resolved under --root and opened without following a last symlink.
"""

from __future__ import annotations

import errno
import os
import time

from nvsymlinkd.access.cgroup import Mount, cgroup_dir_on, find_cgroup_mounts
from nvsymlinkd.access.rules import decide, parse_devices_list
from nvsymlinkd.containers.model import Grant
from nvsymlinkd.errors import CgroupPathError, RepairError
from nvsymlinkd.host.root import HostRoot

FREEZER_FALLBACK = "/sys/fs/cgroup/freezer"
DEVICES_FALLBACK = "/sys/fs/cgroup/devices"
SETTLE_TIMEOUT = 5.0  # seconds to wait for FROZEN, and for systemd's re-apply to show in devices.list
POLL = 0.002


def cgroup_dir(root: HostRoot, controller: str, cgroup: str | None, fallback: str) -> str:
    """Inside path of a v1 cgroup directory on the host's hierarchy; RepairError when it cannot be placed.

    `cgroup` is as /proc/<pid>/cgroup printed it for this process (relative to its cgroup
    namespace); nvsymlinkd.access.cgroup maps it onto the host's mount of the hierarchy.
    """
    if cgroup is None:  # the planner picks a mechanism only with the paths it needs: never met
        raise RepairError(f"no {controller} cgroup path known for this container")
    mounts = find_cgroup_mounts(root)
    mount = mounts.v1_devices if controller == "devices" else mounts.v1_freezer if controller == "freezer" else None
    mount = mount or Mount("/", fallback, "cgroup", (controller,))
    try:
        return cgroup_dir_on(mount, cgroup)
    except CgroupPathError as exc:
        raise RepairError(f"refusing the {controller} cgroup path {cgroup!r}: {exc}") from exc


def read_cgroup_file(root: HostRoot, inside: str) -> str:
    fd = os.open(root.path(inside), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.read(fd, 1 << 20).decode("ascii", "replace")
    finally:
        os.close(fd)


def write_cgroup_file(root: HostRoot, inside: str, text: str) -> None:
    # cgroup files take one rule per write(); O_TRUNC is ignored by cgroupfs and keeps fakes exact
    fd = os.open(root.path(inside), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_TRUNC)
    try:
        os.write(fd, text.encode("ascii"))
    finally:
        os.close(fd)


def read_rules(root: HostRoot, devices_dir: str) -> list:
    inside = f"{devices_dir}/devices.list"
    return parse_devices_list(read_cgroup_file(root, inside), inside)


def covered(rules, grant: Grant) -> bool:
    return decide(rules, grant.device, grant.access).allowed


def write_devices_allow(root: HostRoot, devices_dir: str, grants, steps: list) -> None:
    for g in grants:
        inside = f"{devices_dir}/devices.allow"
        try:
            write_cgroup_file(root, inside, str(g.rule))
        except OSError as exc:
            if exc.errno == errno.EPERM:
                raise RepairError(f"the kernel refused '{g.rule}' in {inside} (EPERM): the parent cgroup "
                                  "does not allow it")
            raise RepairError(f"cannot write '{g.rule}' to {inside}: {exc.strerror}")
        steps.append(f"devices.allow {g.rule}")


def wait_listed(root: HostRoot, devices_dir: str, grants, timeout: float):
    """Poll devices.list until every grant shows (systemd re-applies asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        rules = read_rules(root, devices_dir)
        if all(covered(rules, g) for g in grants):
            return rules
        if time.monotonic() > deadline:
            raise RepairError(f"{devices_dir}/devices.list does not show "
                              f"{', '.join(str(g.rule) for g in grants if not covered(rules, g))} "
                              f"{timeout:g} s after SetUnitProperties")
        time.sleep(POLL)


def restore_dropped(root: HostRoot, devices_dir: str, before, after, steps: list) -> None:
    """systemd's v1 apply starts from deny-all: put back anything it dropped that the container had.

    Only rules the cgroup listed a moment ago are written back, wildcards too (`c *:* m`, runc's `c 136:* rwm`:
    in allow-list mode each listed line is exactly an exception the cgroup had); they are not persistent,
    which the verifier reports as at-risk. Default-allow mode (`a *:* rwm`) cannot be put back exactly.
    """
    if any(r.is_allow_all for r in before):
        return
    _write_back(root, devices_dir, before, after, steps, "restored: systemd's re-apply dropped it")


def _write_back(root: HostRoot, devices_dir: str, before, after, steps: list, why: str) -> None:
    listed = {str(r) for r in after}
    for rule in before:
        if not rule.allow or rule.is_allow_all or str(rule) in listed:
            continue
        device = rule.device
        if device is not None and decide(after, device, rule.access).allowed:
            continue
        inside = f"{devices_dir}/devices.allow"
        try:
            write_cgroup_file(root, inside, str(rule))
        except OSError as exc:
            raise RepairError(f"cannot write '{rule}' back to {inside}: {exc.strerror}")
        steps.append(f"devices.allow {rule} ({why})")


def restore_rules(root: HostRoot, devices_dir: str, before, steps: list) -> None:
    """Write back every allow rule the cgroup listed before a repair and does not now (wildcards too: in
    allow-list mode each listed line is exactly an exception the cgroup had). `a *:* rwm` cannot be put back
    exactly: devices.list does not show that mode's deny exceptions (REFERENCE.md, cgroup v1)."""
    if any(r.is_allow_all for r in before):
        raise RepairError(f"{devices_dir} was in default-allow mode (`a *:* rwm`), whose deny exceptions "
                          "devices.list does not show: it cannot be put back exactly")
    _write_back(root, devices_dir, before, read_rules(root, devices_dir), steps, "put back")
