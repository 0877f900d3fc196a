"""The `bpf-program` repair (cgroup v2, cgroupfs driver): give a cgroup back exactly the devices it
lost by attaching a new device program, as runc and systemd replace theirs.

  prepare(root, request, grants): read the cgroup's own programs and the inherited ones (all of
      them decoded, or RepairRefused), state the own programs' AND plus the grants as Rules
      (access.bpfproof.policy_rules), emit the program (access.bpfgen), and prove it: the new AND
      differs from the old one only by the grants (bpfproof.prove) -- or RepairRefused. Read only:
      `repair --dry-run` shows its rules.
  replace(prepared, steps): BPF_PROG_LOAD the program, BPF_PROG_ATTACH it to the container's cgroup
      with BPF_F_ALLOW_MULTI, then BPF_PROG_DETACH the old ones (by the fds taken before the attach);
      in between the cgroup runs old AND new, which allows only what both allow. A failed detach
      leaves that intersection (never wider) and is a failure. A cgroup whose program was attached
      without BPF_F_ALLOW_MULTI (flags 0 or BPF_F_ALLOW_OVERRIDE) gets the new one with the same
      flags: the kernel swaps the one program in place (kernel/bpf/cgroup.c, find_attach_entry).
      Then the programs are read back from the kernel, decoded and proven again; a read-back that
      does not prove puts the old programs back.

The caller (repair.apply) holds the repair lock around prepare and replace, so two repairs never
interleave, and verifies afterwards through the verifier's normal path (read_access).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from nvsymlinkd.access import bpfeval, bpfgen, bpfprog, bpfproof
from nvsymlinkd.access.cgroup import v2_cgroup_dir
from nvsymlinkd.containers.model import Grant
from nvsymlinkd.errors import BpfError, CannotEvaluate, CgroupPathError, RepairError, RepairRefused
from nvsymlinkd.host.devices import Rule
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.repair.model import RepairRequest

PROGRAM_NAME = "nvsymlinkd"  # BPF program name (15 characters at most): who attached it, for bpftool and us


@dataclass
class Prepared:
    cgroup_dir: str               # inside view
    own: list                     # [(DeviceProgram, insns)] attached to the cgroup itself
    inherited: list               # [(DeviceProgram, insns)] effective from ancestors
    attach_flags: int             # the own programs' attach flags
    rules: list                   # [Rule]: the new program's policy, first match, default deny
    insns: list                   # the new program
    proof: bpfproof.Proof

    @property
    def rule_lines(self) -> list:
        return [r.describe() for r in self.rules] + ["deny everything else"]

    def to_json(self) -> dict[str, Any]:
        return {"cgroup_dir": self.cgroup_dir, "replaces": [p.prog_id for p, _ in self.own],
                "inherited": [p.prog_id for p, _ in self.inherited], "rules": [str(r) for r in self.rules],
                "rules_allow": [r.allow for r in self.rules], "instructions": len(self.insns),
                "classes": self.proof.classes, "checked": self.proof.checked}


def _flags_text(flags: int) -> str:
    names = [n for bit, n in ((bpfprog.BPF_F_ALLOW_OVERRIDE, "BPF_F_ALLOW_OVERRIDE"),
                              (bpfprog.BPF_F_ALLOW_MULTI, "BPF_F_ALLOW_MULTI")) if flags & bit]
    return "|".join(names) or "no flags"


def _decoded(info: bpfprog.DeviceProgram) -> tuple:
    label = f"BPF prog {info.prog_id}" + (f" '{info.name}'" if info.name else "")
    if info.prog_type != bpfprog.BPF_PROG_TYPE_CGROUP_DEVICE:
        raise RepairRefused(f"{label} is not a BPF_CGROUP_DEVICE program (type {info.prog_type})")
    if not info.xlated:
        raise RepairRefused(f"{label}: the kernel did not return its instructions (kernel.kptr_restrict or "
                            "an LSM?); a program nvsymlinkd cannot read is never replaced")
    try:
        return info, bpfeval.decode(info.xlated)
    except ValueError as exc:
        raise RepairRefused(f"{label}: {exc}")


def _read(cgroup_dir_real: str) -> tuple:
    """(own [(info, insns)], inherited [(info, insns)], own attach flags) of a cgroup2 directory."""
    fd = bpfprog.open_cgroup_dir(cgroup_dir_real)
    try:
        own_ids, flags = bpfprog.query_device_programs(fd, effective=False)
        effective_ids, _ = bpfprog.query_device_programs(fd, effective=True)
    finally:
        os.close(fd)
    programs = {i: _decoded(bpfprog.read_program(i)) for i in dict.fromkeys(own_ids + effective_ids)}
    return ([programs[i] for i in own_ids], [programs[i] for i in effective_ids if i not in own_ids], flags)


def _grants(grants) -> list:
    return [(g.device, g.access) for g in grants]


def prepare(root: HostRoot, request: RepairRequest, grants: tuple[Grant, ...]) -> Prepared:
    """Read, derive and prove (see the module's text). RepairRefused: not repairable this way; RepairError:
    the cgroup could not be read."""
    if request.v2_cgroup is None:
        raise RepairRefused("no cgroup v2 path is known for the container")
    try:
        inside = v2_cgroup_dir(root, request.v2_cgroup)
    except CgroupPathError as exc:
        raise RepairRefused(f"refusing the cgroup v2 path {request.v2_cgroup!r}: {exc}") from exc
    try:
        own, inherited, flags = _read(root.path(inside))
    except OSError as exc:
        raise RepairError(f"cannot open {inside}: {exc.strerror}")
    except BpfError as exc:
        raise RepairError(f"cannot read the device programs of {inside}: {exc}")
    if not own:
        denied_by = ", ".join(f"BPF prog {p.prog_id}" for p, _ in inherited) or "nothing"
        raise RepairRefused(f"{inside} has no device program of its own (what applies comes from its parents: "
                            f"{denied_by}); a child never gets what its parent denies")
    pairs = _grants(grants)
    try:
        rules: list[Rule] = bpfproof.policy_rules([insns for _, insns in own], pairs)
        new = bpfgen.program(rules)
        proof = bpfproof.prove([i for _, i in own + inherited], [i for _, i in inherited] + [new], pairs)
    except CannotEvaluate as exc:
        raise RepairRefused(f"a device program of {inside} cannot be fully decoded ({exc}); only programs whose "
                            "every verdict nvsymlinkd can state are replaced")
    except ValueError as exc:
        raise RepairRefused(f"the device policy of {inside} cannot be stated as device rules: {exc}")
    if not proof.ok:
        more = f" (and {len(proof.problems) - 3} more)" if len(proof.problems) > 3 else ""
        raise RepairRefused(f"the new program for {inside} would not differ from the old by the grants only: "
                            + "; ".join(proof.problems[:3]) + more)
    return Prepared(inside, own, inherited, flags, rules, new, proof)


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def replace(root: HostRoot, prepared: Prepared, grants: tuple[Grant, ...], steps: list) -> None:
    """Attach the prepared program, detach the old ones, read back and prove (see the module's text)."""
    inside = prepared.cgroup_dir
    old_ids = [p.prog_id for p, _ in prepared.own]
    try:
        cg_fd = bpfprog.open_cgroup_dir(root.path(inside))
    except OSError as exc:
        raise RepairError(f"cannot open {inside}: {exc.strerror} (container gone?)")
    held: list = []
    try:
        try:
            now_ids, flags = bpfprog.query_device_programs(cg_fd, effective=False)
            if now_ids != old_ids or flags != prepared.attach_flags:
                raise RepairError(f"the device programs of {inside} changed while the repair was proven "
                                  f"({old_ids} -> {now_ids}): nothing attached; the next pass judges them again")
            for prog_id in old_ids:  # kept: they detach, and can be put back
                held.append(bpfprog.program_fd(prog_id))
            new_fd = bpfprog.load_device_program(bpfeval.encode(prepared.insns), PROGRAM_NAME)
        except BpfError as exc:
            raise RepairError(f"nothing attached: {exc}")
        held.append(new_fd)
        new_id = bpfprog.read_program_fd(new_fd).prog_id
        multi = bool(flags & bpfprog.BPF_F_ALLOW_MULTI)
        attach_flags = bpfprog.BPF_F_ALLOW_MULTI if multi else flags
        try:
            bpfprog.attach_device_program(cg_fd, new_fd, attach_flags)
        except BpfError as exc:
            raise RepairError(f"nothing changed: {exc}")
        steps.append(f"BPF_PROG_ATTACH {inside} prog {new_id} '{PROGRAM_NAME}' ({len(prepared.rules)} rules, "
                     f"{len(prepared.insns)} insns, {_flags_text(attach_flags)})")
        failed = []
        if multi:
            for prog_id, fd in zip(old_ids, held):
                try:
                    bpfprog.detach_device_program(cg_fd, fd)
                    steps.append(f"BPF_PROG_DETACH {inside} prog {prog_id}")
                except BpfError as exc:
                    failed.append(f"prog {prog_id}: {exc}")
        else:
            steps.append(f"prog {old_ids[0]} replaced in place (attached with {_flags_text(flags)})")
        if failed:
            raise RepairError(f"attached prog {new_id}, but could not detach {'; '.join(failed)}: the cgroup runs "
                              "both, which allows only what both allow (never more than before)")
        _read_back(root, prepared, grants, cg_fd, new_id, held[:-1], new_fd, attach_flags, steps)
    finally:
        _close_all(held)
        os.close(cg_fd)


def _read_back(root: HostRoot, prepared: Prepared, grants, cg_fd: int, new_id: int, old_fds: list, new_fd: int,
               attach_flags: int, steps: list) -> None:
    """The kernel's view after the swap: only our program is the cgroup's own, and its xlated code (what the
    kernel runs, after the verifier's rewrites) with the inherited programs proves like the emitted one."""
    inside = prepared.cgroup_dir
    try:
        own, inherited, _ = _read(root.path(inside))
        problems: list = []
        if [p.prog_id for p, _ in own] != [new_id]:
            problems.append(f"the cgroup's own programs are {[p.prog_id for p, _ in own]}, not [{new_id}]")
        else:
            old = [i for _, i in prepared.own + prepared.inherited]
            proof = bpfproof.prove(old, [i for _, i in inherited + own], _grants(grants))
            problems += proof.problems
    except (RepairError, BpfError, OSError, CannotEvaluate) as exc:
        problems = [f"cannot read the programs back: {exc}"]
    if not problems:
        steps.append(f"read back: {inside} runs prog {new_id}; decoded and proven on {prepared.proof.classes} device "
                     "classes: the grants are the only difference")
        return
    # put the old programs back before saying so: never leave a program we could not prove
    if len(old_fds) == len(prepared.own):
        try:
            for fd in old_fds:   # without BPF_F_ALLOW_MULTI the one old program takes our place again
                bpfprog.attach_device_program(cg_fd, fd, attach_flags)
            if attach_flags & bpfprog.BPF_F_ALLOW_MULTI:
                bpfprog.detach_device_program(cg_fd, new_fd)
            steps.append(f"put back the old programs of {inside}")
        except BpfError as exc:
            problems.append(f"could not put the old programs back: {exc}")
    raise RepairError(f"read back from the kernel, the new program of {inside} does not prove: "
                      + "; ".join(problems[:3]))


# --- what a repair puts back when the container can open less than before (repair.apply) --------------

@dataclass
class Held:
    """The device programs a cgroup had before a repair, held open so they can be attached again."""

    cgroup_dir: str  # inside
    ids: list
    flags: int
    fds: list


def hold(root: HostRoot, cgroup: str) -> Held:
    """Hold the cgroup's own programs (cgroup as /proc/<pid>/cgroup prints it); RepairError when it cannot."""
    try:
        inside = v2_cgroup_dir(root, cgroup)
    except CgroupPathError as exc:
        raise RepairRefused(f"refusing the cgroup v2 path {cgroup!r}: {exc}") from exc
    try:
        fd = bpfprog.open_cgroup_dir(root.path(inside))
    except OSError as exc:
        raise RepairError(f"cannot open {inside}: {exc.strerror}")
    fds: list = []
    try:
        ids, flags = bpfprog.query_device_programs(fd, effective=False)
        for prog_id in ids:
            fds.append(bpfprog.program_fd(prog_id))
    except BpfError as exc:
        _close_all(fds)
        raise RepairError(f"cannot hold the device programs of {inside}: {exc}")
    finally:
        os.close(fd)
    return Held(inside, ids, flags, fds)


def has_own_program(root: HostRoot, cgroup: str) -> bool | None:
    """Whether the cgroup has a device program of its own; None when that cannot be read."""
    ids = own_ids(root, cgroup)
    return None if ids is None else bool(ids)


def own_ids(root: HostRoot, cgroup: str) -> list | None:
    """The ids of the device programs attached to the cgroup itself (cgroup as /proc/<pid>/cgroup prints it);
    None when they cannot be read (no cgroup v2 directory there, no BPF)."""
    try:
        inside = v2_cgroup_dir(root, cgroup)
    except CgroupPathError:  # no such directory to read: cannot be read, as the docstring says
        return None
    try:
        fd = bpfprog.open_cgroup_dir(root.path(inside))
    except OSError:
        return None
    try:
        return list(bpfprog.query_device_programs(fd, effective=False)[0])
    except BpfError:
        return None
    finally:
        os.close(fd)


def wait_attached(root: HostRoot, cgroup: str, before: list, timeout: float, poll: float = 0.002) -> bool:
    """Wait until the cgroup's own programs are no longer `before`: systemd answers SetUnitProperties before it
    re-applies the unit's cgroup (dbus-cgroup.c only calls unit_invalidate_cgroup(u, CGROUP_MASK_DEVICES); the
    realize queue attaches the new program later, src/core/cgroup.c, v252). False when nothing changed in time."""
    deadline = time.monotonic() + timeout
    while True:
        now = own_ids(root, cgroup)
        if now is None or now != before:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)


def put_back(root: HostRoot, held: Held, steps: list, attached_by_owners: bool = False) -> None:
    """Make the cgroup's own programs those it held again: each held one not attached now is attached (with
    BPF_F_ALLOW_MULTI, or in the one program's place with its old flags), then every other one detached. In
    between the cgroup runs both, which allows only what both allow: never more than before.

    attached_by_owners: the repair attached and detached nothing itself; every change of the cgroup's programs
    was their owners' (the systemd mechanism: systemd attaches its new program and detaches the one it installed
    before, src/core/bpf-devices.c bpf_devices_apply_policy, v252). A held program gone now was then freed by its
    owner, whose put-back re-apply attached the program that holds that policy now: the freed one is not
    attached again (its owner no longer knows it, so no later re-apply would ever detach it), and the owner's new
    one stays. Only when no held program is gone (systemd's own program was not attached before: runc had
    replaced it with BPF_F_REPLACE) is a program not held detached: it was not there before the repair."""
    inside = held.cgroup_dir
    try:
        cg_fd = bpfprog.open_cgroup_dir(root.path(inside))
    except OSError as exc:
        raise RepairError(f"cannot open {inside}: {exc.strerror} (container gone?)")
    try:
        now, _ = bpfprog.query_device_programs(cg_fd, effective=False)
        if now == held.ids:
            return
        gone = [i for i in held.ids if i not in now]
        if attached_by_owners and gone:
            steps.append(f"{inside}: prog {', '.join(map(str, gone))} freed by its owner, not attached again; "
                         f"prog {', '.join(str(i) for i in now if i not in held.ids) or 'none'} holds its place")
            return
        multi = bool(held.flags & bpfprog.BPF_F_ALLOW_MULTI)
        for prog_id, fd in zip(held.ids, held.fds):
            if prog_id not in now:
                bpfprog.attach_device_program(cg_fd, fd, bpfprog.BPF_F_ALLOW_MULTI if multi else held.flags)
                steps.append(f"BPF_PROG_ATTACH {inside} prog {prog_id} (put back)")
        if multi or not held.ids:
            for prog_id in bpfprog.query_device_programs(cg_fd, effective=False)[0]:
                if prog_id in held.ids:
                    continue
                fd = bpfprog.program_fd(prog_id)
                try:
                    bpfprog.detach_device_program(cg_fd, fd)
                finally:
                    os.close(fd)
                steps.append(f"BPF_PROG_DETACH {inside} prog {prog_id} (not there before the repair)")
    except BpfError as exc:
        raise RepairError(f"could not put back the device programs of {inside}: {exc}")
    finally:
        os.close(cg_fd)


def release(held: Held) -> None:
    _close_all(held.fds)
    held.fds = []
