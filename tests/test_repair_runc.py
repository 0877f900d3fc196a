"""`nvsymlinkd repair` against real runc containers and the real kernel (cgroup v1, cgroupfs driver).

Ground truth comes from inside the container: an open() of the mknod'ed
/dev/nvidia0 gives EPERM while the device cgroup denies it and ENXIO once it
is allowed (no driver behind the node).
"""

from __future__ import annotations

import json

import pytest

from nvsymlinkd.config import Config
from nvsymlinkd.host.root import HostRoot
from tests.runcfixture import device_node, device_rule

pytestmark = pytest.mark.usefixtures("no_system_bus")


def gpu0():
    return dict(rules=[device_rule(195, 0)], nodes=[device_node("/dev/nvidia0", 195, 0)],
                env=["NVIDIA_VISIBLE_DEVICES=0"])


def repair_cli(nvsymlinkd_cli, host, *args):
    return nvsymlinkd_cli("--root", host.root, "repair", "--json", *args)


def test_lost_device_is_granted_back_and_the_kernel_agrees(runc_host, nvsymlinkd_cli):
    c = runc_host.run("gpu-lost", **gpu0())
    assert c.open_error("/dev/nvidia0") == "ENXIO"
    c.deny("c 195:0 rw")
    assert c.open_error("/dev/nvidia0") == "EPERM"

    proc = repair_cli(nvsymlinkd_cli, runc_host, "gpu-lost")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    (res,) = doc["containers"]
    assert res["status"] == "repaired"
    assert res["mechanism"] == "devices.allow"
    assert [(g["major"], g["minor"], g["access"]) for g in res["grants"]] == [(195, 0, "rw")]
    assert res["steps"] == ["devices.allow c 195:0 rw"]
    assert res["verification"]["c 195:0"]["state"] == "allow"
    assert "c 195:0 rw" in c.devices_list()
    assert c.open_error("/dev/nvidia0") == "ENXIO"  # the kernel agrees, from inside the container


def test_repair_all_without_ids_and_nothing_left(runc_host, nvsymlinkd_cli):
    lost = runc_host.run("gpu-a", **gpu0())
    ok = runc_host.run("gpu-b", **gpu0())
    lost.deny("c 195:0 rw")
    before_ok = ok.devices_list()
    proc = repair_cli(nvsymlinkd_cli, runc_host)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert [r["container"] for r in doc["containers"]] == ["gpu-a"]
    assert ok.devices_list() == before_ok  # a healthy container is not touched
    assert lost.open_error("/dev/nvidia0") == "ENXIO"
    # a second run finds nothing to do
    again = repair_cli(nvsymlinkd_cli, runc_host)
    assert again.returncode == 0
    assert json.loads(again.stdout)["containers"] == []


def test_dry_run_changes_nothing(runc_host, nvsymlinkd_cli):
    c = runc_host.run("gpu-dry", **gpu0())
    c.deny("c 195:0 rw")
    listed = c.devices_list()
    proc = repair_cli(nvsymlinkd_cli, runc_host, "--dry-run", "gpu-dry")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # something is left unrepaired
    (res,) = json.loads(proc.stdout)["containers"]
    assert res["status"] == "would-repair"
    assert res["steps"] == [] and res["verification"] == {}
    assert c.devices_list() == listed
    assert c.open_error("/dev/nvidia0") == "EPERM"
    assert not (runc_host.root / "run" / "nvsymlinkd" / "repairs.json").exists()  # no rate-limit record
    human = nvsymlinkd_cli("--root", runc_host.root, "repair", "--dry-run", "gpu-dry")
    assert "would grant c 195:0 rw via devices.allow" in human.stdout
    # counted in words that match (was "1 containers ...: 1 would-repair")
    assert human.stdout.splitlines()[-1] == "repair (dry run): 1 container with findings: 1 would repair"


def test_losing_it_again_right_after_a_repair_is_reported_not_looped(runc_host, nvsymlinkd_cli):
    c = runc_host.run("gpu-loop", **gpu0())
    c.deny("c 195:0 rw")
    assert repair_cli(nvsymlinkd_cli, runc_host, "gpu-loop").returncode == 0
    c.deny("c 195:0 rw")  # something takes it away again at once
    proc = repair_cli(nvsymlinkd_cli, runc_host, "gpu-loop")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (res,) = json.loads(proc.stdout)["containers"]
    assert res["status"] == "cannot-repair"
    assert "rate limit" in res["cannot"]
    assert c.open_error("/dev/nvidia0") == "EPERM"  # left as found: reported, not re-granted


def test_node_made_inside_the_container_is_never_granted(runc_host, nvsymlinkd_cli):
    # a "GPU container" by its env, but the runtime granted no NVIDIA device: the only node is its own mknod
    c = runc_host.run("gpu-mknod", env=["NVIDIA_VISIBLE_DEVICES=all"])
    made = c.exec("mknod", "/dev/nvidia0", "c", "195", "0")
    assert made.returncode == 0, made.stderr  # runc's default rules allow mknod (c *:* m)
    assert c.open_error("/dev/nvidia0") == "EPERM"
    listed = c.devices_list()
    proc = repair_cli(nvsymlinkd_cli, runc_host, "gpu-mknod")
    # it cannot open the node it holds, and nothing trusted granted it: denied, reported, exit 1
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["containers"] == []  # nothing trusted expects it: no request at all
    assert [(d["container"], d["devices"]) for d in doc["denied"]] == [("gpu-mknod", ["c 195:0"])]
    assert c.devices_list() == listed
    assert c.open_error("/dev/nvidia0") == "EPERM"


def test_mknod_grant_is_refused_even_when_passed_in(runc_host):
    """The planner's own guard, below the adapter: a container-dev grant on a real cgroup stays denied."""
    from nvsymlinkd.containers.model import Grant
    from nvsymlinkd.host.devices import Device
    from nvsymlinkd.repair.apply import repair_container
    from nvsymlinkd.repair.model import RepairRequest

    c = runc_host.run("gpu-guard", env=["NVIDIA_VISIBLE_DEVICES=all"])
    assert c.exec("mknod", "/dev/nvidia0", "c", "195", "0").returncode == 0
    listed = c.devices_list()
    req = RepairRequest("gpu-guard", "runc", None, c.cgroups_path, None, None, "cgroupfs",
                        (Grant(Device("c", 195, 0), "rw", "container-dev", "/dev/nvidia0"),))
    res = repair_container(HostRoot(str(runc_host.root)), Config(), req)
    assert res.status == "nothing-to-do" and res.steps == []
    assert "mknod" in res.plan.refused[0][1]
    assert c.devices_list() == listed
    assert c.open_error("/dev/nvidia0") == "EPERM"


def test_parent_that_denies_is_a_failure_naming_the_parent(runc_host):
    """A child never gets what its parent denies. The parent here is in allow-all mode with a deny
    exception, which devices.list cannot show: the kernel's EPERM is the answer, and it is a failure."""
    from pathlib import Path

    from nvsymlinkd.host.devices import Device
    from nvsymlinkd.repair.apply import repair_container
    from nvsymlinkd.repair.plan import requests_from_report
    from nvsymlinkd.verify.verifier import verify_container

    c = runc_host.run("gpu-parent", **gpu0())
    parent = Path("/sys/fs/cgroup/devices") / runc_host.parent.lstrip("/")
    c.deny("c 195:0 rw")
    (parent / "devices.deny").write_text("c 195:0 rw\n")
    root = HostRoot(str(runc_host.root))
    report = verify_container(root, Config(), "gpu-parent", use_bus=False)
    req = requests_from_report(report)
    res = repair_container(root, Config(), req)
    assert res.status == "failed"
    assert "parent cgroup does not allow it" in res.error and "EPERM" in res.error
    assert res.verification[Device.char(195, 0)].state == "deny"
    assert c.open_error("/dev/nvidia0") == "EPERM"


def test_daemon_entry_point_honours_the_repair_key_and_its_clock(runc_host):
    """repair_all as the daemon calls it: config.repair off/report/auto, one history, an injected clock."""
    from nvsymlinkd.repair.apply import repair_all
    from nvsymlinkd.repair.plan import RepairHistory

    c = runc_host.run("gpu-daemon", **gpu0())
    root = HostRoot(str(runc_host.root))
    c.deny("c 195:0 rw")
    assert repair_all(root, Config(repair="off"), use_bus=False) == []
    (res,) = repair_all(root, Config(repair="report"), use_bus=False)
    assert res.status == "would-repair" and c.open_error("/dev/nvidia0") == "EPERM"

    now = [5000.0]
    history = RepairHistory()
    auto = Config(repair="auto")
    (res,) = repair_all(root, auto, history=history, clock=lambda: now[0], use_bus=False)
    assert res.status == "repaired" and c.open_error("/dev/nvidia0") == "ENXIO"
    c.deny("c 195:0 rw")
    now[0] += 60
    (res,) = repair_all(root, auto, history=history, clock=lambda: now[0], use_bus=False)
    assert res.status == "cannot-repair" and c.open_error("/dev/nvidia0") == "EPERM"
    now[0] += 600  # the window has passed: repaired again
    (res,) = repair_all(root, auto, history=history, clock=lambda: now[0], use_bus=False)
    assert res.status == "repaired" and c.open_error("/dev/nvidia0") == "ENXIO"


def test_before_reload_is_silent_with_nothing_to_do_and_a_no_op_without_systemd(runc_host, nvsymlinkd_cli):
    """What package scripts run before their daemon-reload: nothing printed when nothing is to be done,
    nothing done where systemd does not run (no /run/systemd/system: no reload to prevent)."""
    c = runc_host.run("gpu-br", **gpu0())
    c.deny("c 195:0 rw")
    proc = nvsymlinkd_cli("--root", runc_host.root, "repair", "--before-reload")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert c.open_error("/dev/nvidia0") == "EPERM"  # no systemd on this tree: left alone
    (runc_host.root / "run/systemd/system").mkdir(parents=True)
    proc = nvsymlinkd_cli("--root", runc_host.root, "repair", "--before-reload")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout == ("nvsymlinkd: gpu-br: granted c 195:0 rw via devices.allow; verified: repaired\n"
                           "nvsymlinkd:   note: cgroupfs driver: lasts until the runtime rewrites the cgroup "
                           "(`runc update`) from a spec that lacks the device\n"
                           "nvsymlinkd: repair: 1 container with findings: 1 repaired (before a daemon-reload)\n")
    assert c.open_error("/dev/nvidia0") == "ENXIO"
    again = nvsymlinkd_cli("--root", runc_host.root, "repair", "--before-reload")
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")  # healthy: silent
    wrong = nvsymlinkd_cli("--root", runc_host.root, "repair", "--before-reload", "gpu-br")
    assert wrong.returncode == 2 and "not with CONTAINER, --dry-run or --json" in wrong.stderr


def test_before_reload_leaves_a_cgroupfs_hook_grant_to_the_daemon(runc_host, nvsymlinkd_cli):
    """A device only granted outside the spec (a hook), cgroupfs driver: no reload can take it (only a
    `runc update`), so a package script is not told about it; `repair` itself names the refusal."""
    c = runc_host.run("gpu-hook", nodes=[device_node("/dev/nvidia0", 195, 0)], env=["NVIDIA_VISIBLE_DEVICES=0"])
    c.allow("c 195:0 rw")  # what the hook does
    (runc_host.root / "run/systemd/system").mkdir(parents=True)
    proc = nvsymlinkd_cli("--root", runc_host.root, "repair", "--before-reload")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    plain = nvsymlinkd_cli("--root", runc_host.root, "repair")
    assert "not granted c 195:0 rw (unexpected)" in plain.stdout


def test_a_person_can_force_a_repair_within_the_rate_limit(runc_host, nvsymlinkd_cli):
    """The rate limit guards against loops; `repair --force` is a person's decision, and says so."""
    c = runc_host.run("gpu-force", **gpu0())
    c.deny("c 195:0 rw")
    assert repair_cli(nvsymlinkd_cli, runc_host, "gpu-force").returncode == 0
    c.deny("c 195:0 rw")
    human = nvsymlinkd_cli("--root", runc_host.root, "repair", "gpu-force")
    assert human.returncode == 1, human.stdout + human.stderr
    assert "cannot repair: the last repair attempt was" in human.stdout, human.stdout
    assert "automatically" not in human.stdout  # a typed command is no automatic repair
    assert "nvsymlinkd repair --force" in human.stdout
    assert c.open_error("/dev/nvidia0") == "EPERM"

    proc = repair_cli(nvsymlinkd_cli, runc_host, "--force", "gpu-force")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (res,) = json.loads(proc.stdout)["containers"]
    assert (res["status"], res["forced"]) == ("repaired", True)
    assert any(n.startswith("forced: the last repair attempt was") for n in res["notes"]), res["notes"]
    assert c.open_error("/dev/nvidia0") == "ENXIO"


def test_a_forced_repair_is_journaled_as_forced(runc_host):
    from nvsymlinkd.repair.apply import repair_all
    from nvsymlinkd.repair.plan import RepairHistory
    from tests.test_npd import recording_journal

    c = runc_host.run("gpu-forcej", **gpu0())
    root = HostRoot(str(runc_host.root))
    history, entries = RepairHistory(), []
    c.deny("c 195:0 rw")
    (res,) = repair_all(root, Config(), history=history, use_bus=False)
    assert res.status == "repaired" and not res.plan.forced
    c.deny("c 195:0 rw")
    (res,) = repair_all(root, Config(), history=history, use_bus=False, force=True, by_hand=True,
                        journal=recording_journal(entries))
    assert res.status == "repaired" and res.plan.forced
    (entry,) = entries
    assert entry["NVSYMLINKD_FORCED"] == "1"
    assert entry["MESSAGE"].endswith("verified: repaired (forced by hand: rate limit bypassed)"), entry
