"""What the repair mechanisms (repair/mechanisms.py, pure) do to the host through: one RepairHost per
repair, bound to --root, the config and the repair's timeouts. Every write of a repair goes through it:
the cgroup v1 files (repair/cgroupfiles.py), the lock and the freeze (repair/freeze.py), the
/dev/char links, the device programs (repair/bpfrepair.py), and systemd (systemd.units.SystemdUnits, the
one seam there).
"""

from __future__ import annotations

import os
import stat
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

from nvsymlinkd.containers.model import Grant
from nvsymlinkd.errors import NvsymlinkdError, RepairError
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.repair import cgroupfiles
from nvsymlinkd.repair.cgroupfiles import (
    DEVICES_FALLBACK,
    FREEZER_FALLBACK,
    SETTLE_TIMEOUT,
    cgroup_dir,
)
from nvsymlinkd.repair.freeze import LOCK_WAIT, RepairLock, freeze_unless_created, thawed_line
from nvsymlinkd.repair.model import RepairRequest

if TYPE_CHECKING:
    from nvsymlinkd.repair.bpfrepair import Prepared
    from nvsymlinkd.systemd.units import SystemdUnits


@dataclass
class Saved:
    """What a mechanism changes, read before it acts (Mechanism.saves): put back when the container can open
    less after the repair than before (RepairHost.put_back)."""

    properties: tuple | None = None  # (scope, DevicePolicy, ((path, access), ...))
    scope_cgroup: str | None = None  # the scope's cgroup v2 path, where systemd's re-apply attaches its program
    programs: list = field(default_factory=list)  # [bpfrepair.Held], one per cgroup v2 directory
    devices: tuple | None = None  # (v1 devices directory, [Rule] of its devices.list)


class RepairHost:
    def __init__(self, root: HostRoot, config, timeout: float = SETTLE_TIMEOUT, journal=None,
                 lock_wait: float = LOCK_WAIT, systemd: SystemdUnits | None = None):
        self.root = root
        self.config = config
        self.timeout = timeout
        self.journal = journal
        self.lock_wait = lock_wait
        if systemd is None:  # the systemd client's module only when a repair runs
            from nvsymlinkd.systemd.units import SystemdUnits

            systemd = SystemdUnits(timeout)
        self.systemd = systemd

    # -- cgroup v1 files

    def devices_dir(self, request: RepairRequest) -> str:
        return cgroup_dir(self.root, "devices", request.v1_devices, DEVICES_FALLBACK)

    def freezer_dir(self, request: RepairRequest) -> str:
        return cgroup_dir(self.root, "freezer", request.freezer, FREEZER_FALLBACK)

    def write_devices_allow(self, devices_dir: str, grants: Sequence[Grant], steps: list) -> None:
        cgroupfiles.write_devices_allow(self.root, devices_dir, grants, steps)

    def read_rules(self, devices_dir: str) -> list:
        return cgroupfiles.read_rules(self.root, devices_dir)

    def wait_listed(self, devices_dir: str, grants: Sequence[Grant]) -> list:
        return cgroupfiles.wait_listed(self.root, devices_dir, grants, self.timeout)

    def restore_dropped(self, devices_dir: str, before: list, after: list, steps: list) -> None:
        cgroupfiles.restore_dropped(self.root, devices_dir, before, after, steps)

    # -- the lock and the freeze

    @contextmanager
    def locked(self) -> Iterator[list]:
        """The host-wide repair lock; yields the lines of what an interrupted repair froze and taking the
        lock thawed (the caller adds them to its steps)."""
        with RepairLock(self.root, self.config, self.lock_wait, self.journal) as lock:
            yield [thawed_line(e) for e in lock.thawed if e["action"] == "thawed"]

    def frozen_unless_created(self, request: RepairRequest, freezer_dir: str, steps: list) -> AbstractContextManager:
        return freeze_unless_created(self.root, request, freezer_dir, steps, self.timeout, self.config)

    # -- /dev/char links

    def ensure_dev_char_links(self, grants: Sequence[Grant], steps: list) -> None:
        """Older systemd stats DeviceAllow paths: make sure /dev/char/M:m exists first."""
        config = self.config
        base = config.dev_char_path if config is not None else "/dev/char"

        def present(g: Grant) -> bool:
            d = g.device
            st = self.root.stat_resolved(f"{base}/{d.major}:{d.minor}")
            return st is not None and stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(d.major, d.minor)

        missing = [g for g in grants if not present(g)]
        if not missing or config is None:
            return
        from nvsymlinkd.devchar.reconcile import reconcile

        reconcile(self.root, config)
        still = [g for g in missing if not present(g)]
        steps.append("sync /dev/char" + (f" (still missing: {', '.join(g.device.dev_path for g in still)}; systemd "
                                          ">= 240 does not need them)" if still else ""))

    # -- cgroup v2 device programs

    def bpf_prepare(self, request: RepairRequest, grants: Sequence[Grant]) -> Prepared:
        from nvsymlinkd.repair import bpfrepair

        return bpfrepair.prepare(self.root, request, tuple(grants))

    def bpf_replace(self, prepared: Prepared, grants: Sequence[Grant], steps: list) -> None:
        from nvsymlinkd.repair import bpfrepair

        bpfrepair.replace(self.root, prepared, tuple(grants), steps)

    # -- what a repair puts back when it narrowed (a repair never narrows)

    def save(self, properties: str | None = None, programs: Sequence[str] = (), devices: str | None = None,
             scope_cgroup: str | None = None) -> Saved:
        """Read what put_back needs: a scope's device properties, cgroup v2 directories' own programs (held
        open), a v1 devices.list. RepairError when any cannot be read (nothing is held then)."""
        from nvsymlinkd.repair import bpfrepair

        saved = Saved(scope_cgroup=scope_cgroup)
        try:
            if properties is not None:
                policy, allow = self.systemd.device_policy(properties)
                saved.properties = (properties, policy, tuple(allow))
            for cgroup in programs:
                saved.programs.append(bpfrepair.hold(self.root, cgroup))
            if devices is not None:
                try:
                    saved.devices = (devices, self.read_rules(devices))
                except (OSError, NvsymlinkdError) as exc:
                    raise RepairError(f"cannot read {devices}/devices.list: {exc}")
        except BaseException:
            self.release(saved)
            raise
        return saved

    def put_back(self, saved: Saved, steps: list) -> list:
        """Put everything saved back, each part tried; returns what could not be (empty: all put back).
        systemd's properties first (its re-apply attaches a program of its own), then the programs, then v1."""
        from nvsymlinkd.repair import bpfrepair

        problems = []
        systemd_put_back = False
        if saved.properties is not None:
            scope, policy, allow = saved.properties
            try:
                ids = self.program_ids(saved.scope_cgroup)
                self.systemd.put_back_policy(scope, policy, allow)
                steps.append(f"SetUnitProperties {scope} DevicePolicy {policy} DeviceAllow reset to "
                             f"{len(allow)} entries (put back)")
                self.wait_reapplied(saved.scope_cgroup, ids, steps)
                systemd_put_back = True
            except RepairError as exc:
                problems.append(f"{scope}'s DevicePolicy/DeviceAllow: {exc}")
        for held in saved.programs:
            try:
                # the systemd mechanism attached no program itself: what systemd freed stays freed, and the program
                # its put-back re-apply attached holds the old policy now (bpfrepair.put_back); when that call
                # failed the held programs come back as they were (never narrowed, even if systemd lost track)
                bpfrepair.put_back(self.root, held, steps, attached_by_owners=systemd_put_back)
            except RepairError as exc:
                problems.append(str(exc))
        if saved.devices is not None:
            devices_dir, rules = saved.devices
            try:
                cgroupfiles.restore_rules(self.root, devices_dir, rules, steps)
            except (OSError, NvsymlinkdError) as exc:
                problems.append(str(exc))
        return problems

    def release(self, saved: Saved) -> None:
        from nvsymlinkd.repair import bpfrepair

        for held in saved.programs:
            bpfrepair.release(held)

    def program_ids(self, cgroup: str | None) -> list | None:
        """The ids of a cgroup v2 directory's own device programs; None when unknown or unreadable."""
        from nvsymlinkd.repair import bpfrepair

        return None if cgroup is None else bpfrepair.own_ids(self.root, cgroup)

    def wait_reapplied(self, cgroup: str | None, before: list | None, steps: list) -> None:
        """After a systemd call: wait until systemd's re-apply attached its program to the scope's cgroup (it
        answers first, bpfrepair.wait_attached), so that what is judged next is what systemd applied."""
        from nvsymlinkd.repair import bpfrepair

        if cgroup is None or before is None:
            return
        if not bpfrepair.wait_attached(self.root, cgroup, before, self.timeout):
            steps.append(f"{cgroup}: systemd attached no new device program within {self.timeout:g} s (judged as "
                         "it is now)")

    def leaf_program(self, cgroup: str) -> bool | None:
        from nvsymlinkd.repair import bpfrepair

        return bpfrepair.has_own_program(self.root, cgroup)
