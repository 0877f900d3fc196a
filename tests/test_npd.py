"""node-problem-detector's journald monitor config against nvsymlinkd's real journal entries.

The entries are captured from the real code paths (the daemon's reconcile
loop against a fake root with a read-only /dev/char and a broken
/proc/devices; the repairer against real runc containers), with the Journal's
journald sender swapped for a recorder: each entry is exactly the
MESSAGE/SYSLOG_IDENTIFIER/MESSAGE_ID set journald would store.

NPD's matching is reproduced: a rule's pattern gets `\\z` appended and is
searched in the last `bufferSize` MESSAGEs joined by newlines, so it must
match the tail of the newest entry. Patterns stay in the RE2 subset (no
look-around, no back-references) so Python's re answers what Go's would.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from nvsymlinkd import journal as journalmod
from nvsymlinkd.config import Config
from nvsymlinkd.host.root import HostRoot
from tests.fakehost import standard_host

NPD_DIR = Path(__file__).parent.parent / "deploy/node-problem-detector"
CONFIG = NPD_DIR / "nvsymlinkd-monitor.json"
PLUGIN_CONFIG = NPD_DIR / "nvsymlinkd-plugin-monitor.json"
PLUGIN = NPD_DIR / "nvsymlinkd-condition"
DEADLINE = 30.0


def load(path=CONFIG):
    with open(path) as f:
        return json.load(f)


class NPD:
    """The system-log-monitor's rule evaluation (pkg/systemlogmonitor: log_buffer.go, log_monitor.go)."""

    def __init__(self, config: dict):
        self.size = config["bufferSize"]
        self.rules = [(r, re.compile(r["pattern"] + r"\Z")) for r in config["rules"]]
        self.buffer = [""] * self.size
        self.current = 0
        # generateStatus: a permanent rule sets its condition True; nothing in a log monitor sets it back
        self.conditions = {c["type"]: False for c in config["conditions"]}

    def push(self, message: str) -> list:
        """Add one MESSAGE (trimmed, as the journald watcher does); the reasons of the rules that fire."""
        self.buffer[self.current % self.size] = message.strip()
        self.current += 1
        i = self.current % self.size
        text = "\n".join(self.buffer[i:] + self.buffer[:i])
        fired = [r for r, rx in self.rules if rx.search(text)]
        for r in fired:
            if r["type"] == "permanent":
                self.conditions[r["condition"]] = True
        return [r["reason"] for r in fired]


def recording_journal(entries: list) -> journalmod.Journal:
    j = journalmod.Journal(target="stderr", stream=open(os.devnull, "w"))

    def send(message, **fields):
        entries.append(dict(fields, MESSAGE=message))

    j._send = send  # what journald would receive, field for field
    j.target = "journal"
    return j


# -- the config file itself -----------------------------------------------------------


def test_config_shape():
    cfg = load()
    assert cfg["plugin"] == "journald"
    assert cfg["pluginConfig"]["source"] == journalmod.IDENTIFIER  # SYSLOG_IDENTIFIER NPD filters on
    assert cfg["logPath"] == "/var/log/journal"
    # A log monitor's condition never clears (generateStatus only ever sets True): its rules are events,
    # and the conditions come from the plugin monitor, which says False again once containers are fine.
    assert cfg["conditions"] == []
    reasons = [r["reason"] for r in cfg["rules"]]
    assert len(reasons) == len(set(reasons))
    for r in cfg["rules"]:
        assert r["type"] == "temporary", r
        assert re.fullmatch(r"[A-Z][A-Za-z]+", r["reason"]), r["reason"]  # CamelCase, as NPD's own
        # RE2 has no look-around or back-references, and `.` never crosses a line in either engine
        assert not re.search(r"\(\?[=!<]|\\[1-9]|\(\?s", r["pattern"]), r["pattern"]
        re.compile(r["pattern"])


def test_plugin_config_shape():
    cfg = load(PLUGIN_CONFIG)
    assert cfg["plugin"] == "custom"
    conditions = {c["type"] for c in cfg["conditions"]}
    assert conditions == {"GPUDeviceAccessLost", "GPUDeviceAccessAtRisk"}
    for c in cfg["conditions"]:
        assert c["reason"] and c["message"]
    for r in cfg["rules"]:
        assert r["type"] == "permanent" and r["condition"] in conditions
        assert r["path"].endswith("/" + PLUGIN.name) and r["args"][0] in ("lost,denied", "at-risk")
    assert {r["condition"] for r in cfg["rules"]} == conditions


# -- real entries from the daemon and the repairer ----------------------------------------


def _wait(predicate, what, entries):
    async def poll():
        loop = asyncio.get_running_loop()
        end = loop.time() + DEADLINE
        while not predicate():
            if loop.time() > end:
                raise AssertionError(f"timed out waiting for {what}; entries: {entries}")
            await asyncio.sleep(0.02)

    return poll()


def _kinds(entries) -> set:
    by_id = {v: k for k, v in journalmod.MESSAGE_IDS.items()}
    return {by_id.get(e.get("MESSAGE_ID")) for e in entries}


def daemon_entries(tmp_path) -> list:
    """Run the real daemon (in-process, no udev, no bus) through conflicts, failed writes, a failed sync."""
    from nvsymlinkd.daemon.loop import Daemon

    host = standard_host(tmp_path / "root")
    dev_char = host.path("/dev/char")
    dev_char.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(dev_char)], check=True)
    entries: list = []
    try:
        (dev_char / "195:1").write_text("something else's file")
        os.symlink("../null", dev_char / "195:0")  # another tool's link to another device
        subprocess.run(["mount", "-o", "remount,ro", str(dev_char)], check=True)

        async def scenario():
            daemon = Daemon(HostRoot(str(host.root)), Config(resync_interval=0, metrics_textfile=""),
                            journal=recording_journal(entries), use_udev=False, use_bus=False)
            task = asyncio.ensure_future(daemon.run())
            await _wait(lambda: {"link-conflict", "link-foreign", "link-failed"} <= _kinds(entries),
                        "conflicts and failure", entries)
            subprocess.run(["umount", str(dev_char)], check=True)
            host.node("/dev/nvidia3", 195, 3)
            await _wait(lambda: "link-created" in _kinds(entries), "created links", entries)
            devices = host.path("/proc/devices")
            devices.rename(devices.with_name("devices.good"))
            devices.mkdir()
            # a major the last full pass did not know: only a full pass (which reads /proc/devices)
            # can decide on it; a node of a known major is linked per name, /proc/devices unread
            host.node("/dev/nvidia-nvswitch0", 240, 0)
            await _wait(lambda: "sync-failed" in _kinds(entries), "a failed sync", entries)
            os.kill(os.getpid(), signal.SIGTERM)  # the daemon's own handler stops it
            assert await asyncio.wait_for(task, DEADLINE) == 0

        asyncio.run(scenario())
    finally:
        subprocess.run(["umount", str(dev_char)], capture_output=True)
    return entries


def gpu0():
    from tests.runcfixture import device_node, device_rule

    return dict(rules=[device_rule(195, 0)], nodes=[device_node("/dev/nvidia0", 195, 0)],
                env=["NVIDIA_VISIBLE_DEVICES=0"])


def repair_entries(runc_host, monkeypatch) -> list:
    """Real repairs of real runc containers: reported, done, refused (rate limit), failed (parent denies)."""
    from nvsymlinkd.repair.apply import repair_all, repair_container
    from nvsymlinkd.repair.plan import RepairHistory, requests_from_report
    from nvsymlinkd.verify.verifier import verify_container

    monkeypatch.delenv("DBUS_SYSTEM_BUS_ADDRESS", raising=False)  # never the machine's own systemd
    entries: list = []
    j = recording_journal(entries)
    root = HostRoot(str(runc_host.root))
    c = runc_host.run("gpu-npd", **gpu0())
    c.deny("c 195:0 rw")
    history = RepairHistory()
    statuses = [r.status for r in repair_all(root, Config(repair="report"), ["gpu-npd"], journal=j, history=history)]
    statuses += [r.status for r in repair_all(root, Config(), ["gpu-npd"], journal=j, history=history)]
    c.deny("c 195:0 rw")  # lost again at once: the rate limit refuses
    statuses += [r.status for r in repair_all(root, Config(), ["gpu-npd"], journal=j, history=history)]
    assert statuses == ["would-repair", "repaired", "cannot-repair"], statuses

    p = runc_host.run("gpu-npd-parent", **gpu0())
    parent = Path("/sys/fs/cgroup/devices") / runc_host.parent.lstrip("/")
    p.deny("c 195:0 rw")
    (parent / "devices.deny").write_text("c 195:0 rw\n")
    report = verify_container(root, Config(), "gpu-npd-parent", use_bus=False)
    res = repair_container(root, Config(), requests_from_report(report), journal=j)
    assert res.status == "failed"
    return entries


# Which rule must fire for which journal kind (MESSAGE_ID); every other entry fires nothing.
EXPECTED = {
    "link-conflict": "NVIDIADevCharConflict",
    "link-foreign": "NVIDIADevCharConflict",
    "link-failed": "NVIDIADevCharLinkFailed",
    "sync-failed": "NVSymlinkdSyncFailed",
    "repair-reported": "GPUDeviceRepairWithheld",
    "repair-done": "GPUDeviceAccessRepaired",
    "repair-refused": "GPUDeviceRepairRefused",
    "repair-failed": "GPUDeviceRepairFailed",
}


def test_rules_match_the_real_entries_and_nothing_else(tmp_path, runc_host, monkeypatch):
    entries = daemon_entries(tmp_path / "d") + repair_entries(runc_host, monkeypatch)
    by_id = {v: k for k, v in journalmod.MESSAGE_IDS.items()}
    assert all(e["SYSLOG_IDENTIFIER"] == load()["pluginConfig"]["source"] for e in entries)
    npd = NPD(load())
    seen = {}
    for e in entries:
        kind = by_id.get(e.get("MESSAGE_ID"))
        fired = npd.push(e["MESSAGE"])
        want = [EXPECTED[kind]] if kind in EXPECTED else []
        assert fired == want, (kind, e["MESSAGE"], fired)
        seen.setdefault(kind, e["MESSAGE"])
    assert set(EXPECTED) <= set(seen), sorted(set(EXPECTED) - set(seen))
    # the unrelated entries really were there to not match
    assert {"daemon-started", "link-created", "daemon-stopped"} <= set(seen)
    # and nothing in the log monitor sets a condition that could never clear
    assert npd.conditions == {}


def test_rules_also_match_with_the_stderr_prefix():
    """Under a unit without python3-systemd, stderr lines reach the journal as `nvsymlinkd: MESSAGE`."""
    npd = NPD(load())
    line = "nvsymlinkd: container 0123456789ab (cri-containerd-0123.scope): FAILED to grant " \
           "c 195:0 rw via devices.allow: EPERM"
    assert npd.push(line) == ["GPUDeviceRepairFailed"]


# -- the stories: what the node's conditions say while they happen, and after ------------------------


def plugin(status: str, textfile: Path) -> tuple:
    """The custom plugin as node-problem-detector runs it: (exit status, first output line)."""
    proc = subprocess.run(["sh", str(PLUGIN), status, str(textfile)], capture_output=True, text=True, timeout=10)
    return proc.returncode, proc.stdout.strip()


def conditions_now(root, textfile: Path) -> dict:
    """The plugin monitor's conditions from a textfile the daemon's Metrics would write for this host now."""
    from nvsymlinkd.metrics import Metrics
    from nvsymlinkd.verify.verifier import verify_all

    m = Metrics()
    m.on_containers(verify_all(root, Config(), with_host=False, use_bus=False))
    textfile.write_text(m.render())
    out = {}
    for rule in load(PLUGIN_CONFIG)["rules"]:
        code, message = plugin(rule["args"][0], textfile)
        assert code in (0, 1), message  # 2 would be Unknown
        out[rule["condition"]] = code == 1  # cpm: OK -> False, NonOK -> True
    return out


def test_stories_set_conditions_that_clear(runc_host, monkeypatch, tmp_path):
    """Each story through the real repairer, its journal lines through the log monitor, the node's
    conditions through the plugin: a hook's grant at risk that cgroupfs cannot protect (a refused
    prevention), lost and repaired, at risk again; a loss refused by the rate limit; a failed repair.
    A condition is True exactly while its story's container is in that state, and False after."""
    from nvsymlinkd.repair.apply import repair_all
    from nvsymlinkd.repair.plan import RepairHistory
    from nvsymlinkd.verify.verifier import verify_all
    from tests.runcfixture import device_node, device_rule

    monkeypatch.delenv("DBUS_SYSTEM_BUS_ADDRESS", raising=False)
    root = HostRoot(str(runc_host.root))
    textfile = tmp_path / "nvsymlinkd.prom"
    entries: list = []
    j = recording_journal(entries)
    history, now = RepairHistory(), [1000.0]
    npd = NPD(load())

    def daemon_pass() -> list:
        mark = len(entries)
        results = repair_all(root, Config(), journal=j, history=history, clock=lambda: now[0], use_bus=False)
        for e in entries[mark:]:
            npd.push(e["MESSAGE"])
        return [(r.request.container_id, str(r.status)) for r in results]

    # the hook's story: granted outside the spec, at risk; cgroupfs cannot make that stick
    c = runc_host.run("gpu-story", rules=[device_rule(195, 0)], env=["NVIDIA_VISIBLE_DEVICES=0,1"],
                      nodes=[device_node("/dev/nvidia0", 195, 0), device_node("/dev/nvidia1", 195, 1)])
    c.allow("c 195:1 rw")
    verify_all(root, Config(), update_baseline=True, use_bus=False)
    assert daemon_pass() == [("gpu-story", "cannot-repair")]
    assert entries[-1]["MESSAGE"].startswith("container gpu-story: cannot prevent the loss: with the cgroupfs")
    assert conditions_now(root, textfile) == {"GPUDeviceAccessLost": False, "GPUDeviceAccessAtRisk": True}
    c.deny("c 195:1 rw")
    assert conditions_now(root, textfile) == {"GPUDeviceAccessLost": True, "GPUDeviceAccessAtRisk": False}
    mark = len(entries)
    assert daemon_pass() == [("gpu-story", "repaired")]
    now[0] += 4
    assert daemon_pass() == [("gpu-story", "cannot-repair")]  # at risk again, as before the loss
    after = [e["MESSAGE"] for e in entries[mark:]]
    assert after[0].endswith("verified: repaired"), after
    # a container that is fine is never said to be unrepairable, nor rate-limited
    assert not [m for m in after[1:] if "cannot repair" in m or "last repair attempt" in m], after
    assert conditions_now(root, textfile) == {"GPUDeviceAccessLost": False, "GPUDeviceAccessAtRisk": True}
    assert c.open_error("/dev/nvidia1") == "ENXIO"
    runc_host.runc("delete", "--force", c.id)
    assert conditions_now(root, textfile) == {"GPUDeviceAccessLost": False, "GPUDeviceAccessAtRisk": False}

    # lost again within the window: the rate limit refuses, the loss stays (and says so), until it is repaired
    lo = runc_host.run("gpu-loop", rules=[device_rule(195, 0)], env=["NVIDIA_VISIBLE_DEVICES=0"],
                       nodes=[device_node("/dev/nvidia0", 195, 0)])
    lo.deny("c 195:0 rw")
    assert daemon_pass() == [("gpu-loop", "repaired")]
    lo.deny("c 195:0 rw")
    now[0] += 60
    mark = len(entries)
    assert daemon_pass() == [("gpu-loop", "cannot-repair")]
    assert "cannot repair automatically: the last repair attempt was 60 s ago" in entries[mark]["MESSAGE"]
    assert conditions_now(root, textfile)["GPUDeviceAccessLost"] is True
    now[0] += 600
    assert daemon_pass() == [("gpu-loop", "repaired")]
    assert conditions_now(root, textfile)["GPUDeviceAccessLost"] is False
    runc_host.runc("delete", "--force", lo.id)

    # a failed repair (the parent denies): lost while it fails, fine once the parent allows it again
    p = runc_host.run("gpu-parent", rules=[device_rule(195, 0)], env=["NVIDIA_VISIBLE_DEVICES=0"],
                      nodes=[device_node("/dev/nvidia0", 195, 0)])
    parent = Path("/sys/fs/cgroup/devices") / runc_host.parent.lstrip("/")
    p.deny("c 195:0 rw")
    (parent / "devices.deny").write_text("c 195:0 rw\n")
    statuses = dict(daemon_pass())
    assert statuses["gpu-parent"] in ("failed", "cannot-repair"), statuses
    assert conditions_now(root, textfile)["GPUDeviceAccessLost"] is True
    (parent / "devices.allow").write_text("c 195:0 rw\n")
    now[0] += 600
    assert dict(daemon_pass())["gpu-parent"] == "repaired"
    assert conditions_now(root, textfile) == {"GPUDeviceAccessLost": False, "GPUDeviceAccessAtRisk": False}
    # and through all of it the log monitor set no condition that could never clear
    assert npd.conditions == {} and load()["conditions"] == []


def test_prevented_and_forced_lines_fire_their_events():
    """The prevention's line (systemd driver) as the repairer words it, plain and forced."""
    from nvsymlinkd.containers.model import Grant
    from nvsymlinkd.host.devices import Device
    from nvsymlinkd.repair.apply import RepairResult
    from nvsymlinkd.repair.model import (
        AT_RISK,
        LOST,
        MechanismFacts,
        RepairRequest,
        RepairStatus,
        ScopeFacts,
    )
    from nvsymlinkd.repair.plan import RepairHistory, plan_repair

    grant = Grant(Device.char(195, 0), "rw", "spec")
    for kind, status, reason in ((AT_RISK, RepairStatus.PREVENTED, "GPUDeviceAccessLossPrevented"),
                                 (LOST, RepairStatus.REPAIRED, "GPUDeviceAccessRepaired")):
        req = RepairRequest("0123456789ab", "runc", "runc-0123456789ab.scope", None, "/x", None, "systemd",
                            (grant,), kind)
        history = RepairHistory({"0123456789ab": 990.0})
        for force in (False, True):
            plan = plan_repair(req, now=1000.0 + (0 if force else 700), history=history, force=force,
                               facts=MechanismFacts(scope=ScopeFacts("strict", (), leaf_program=False)))  # runc's: an allow-list
            assert plan.forced is force
            line = "container " + RepairResult(plan, status).human_lines()[0]
            assert NPD(load()).push(line) == [reason], line


# The container verdict lines the daemon's verifier hook writes when a container turns lost or
# at risk (format agreed for the hook; these two rules are the node conditions GPUDeviceAccessLost
# and GPUDeviceAccessAtRisk).
VERDICT_LINES = {
    "container 0123456789ab (cri-containerd-0123456789ab.scope): GPU device access lost: c 195:0 rw: "
    "open() of /dev/nvidia0 is denied by the device cgroup": "GPUContainerLostDevices",
    "container 0123456789ab: GPU device access lost: c 195:0 rw: denied": "GPUContainerLostDevices",
    "container 0123456789ab (gpu-team/trainer-0/cuda): GPU device access denied: c 195:0, c 195:255: its NVIDIA "
    "nodes are denied by the device cgroup, and nothing trusted ...": "GPUContainerDeniedDevices",
    "container abc (docker-abc.scope): GPU device access at risk (at-risk-scope): c 195:0 rw: "
    "the scope's DeviceAllow lacks /dev/char/195:0": "GPUContainerAtRisk",
    "container abc: GPU device access at risk: c 510:0 rw: nvidia-uvm not granted": "GPUContainerAtRisk",
}
UNRELATED = [
    "created link /dev/char/195:0 -> ../nvidia0 (c 195:0)",
    "container abc: nothing to grant",
    "note: nvidia-uvm is not loaded",
    "Started Kubernetes kubelet.",
    "conflict resolution finished",
    "container abc: GPU device access restored",
    "failed to create pod sandbox",
]


@pytest.mark.parametrize("line,reason", sorted(VERDICT_LINES.items()))
def test_verdict_rules(line, reason):
    assert NPD(load()).push(line) == [reason]


@pytest.mark.parametrize("line", UNRELATED)
def test_unrelated_lines_fire_nothing(line):
    assert NPD(load()).push(line) == []


def test_a_match_needs_the_newest_line():
    """NPD matches at the end of its buffer: an old failure does not fire again on each new line."""
    npd = NPD(load())
    assert npd.push("sync failed: /proc/devices: is a directory") == ["NVSymlinkdSyncFailed"]
    assert npd.push("created link /dev/char/195:0 -> ../nvidia0 (c 195:0)") == []


def test_prevented_and_forced_stories_through_systemd(tmp_path, need_root, monkeypatch):
    """The systemd stories with real entries: the repairer against test_repair_dbus's systemd (a private
    bus, SetUnitProperties) and a real cgroup2 directory: prevented, repaired, refused at the keyboard
    (no "automatically"), forced by hand. Each fires its event; no condition is set."""
    from nvsymlinkd.repair.apply import repair_container
    from nvsymlinkd.repair.model import RepairRequest
    from nvsymlinkd.repair.plan import RepairHistory
    from tests.privatebus import need_dbusmock
    from tests.test_repair_dbus import SystemdMock, gpu0, link_cgroups, v2_cgroup

    need_dbusmock()
    host = standard_host(tmp_path / "root")
    link_cgroups(host)
    m = SystemdMock(tmp_path / "bus")
    m.start()
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", m.address)
    cgdir, cgpath = v2_cgroup()
    entries: list = []
    j, history, now = recording_journal(entries), RepairHistory(), [1000.0]
    unit = "docker-npdprev.scope"
    try:
        m.add_scope(unit, [("/dev/null", "rwm")], root=str(host.root))

        def repair(kind, **kw):
            req = RepairRequest("npdprev", "docker", unit, None, cgpath, None, "systemd", gpu0(), kind)
            return repair_container(HostRoot(str(host.root)), Config(), req, journal=j, history=history,
                                    clock=lambda: now[0], **kw).status

        statuses = [repair("at-risk"), repair("lost")]
        now[0] += 10
        statuses += [repair("lost", by_hand=True), repair("lost", by_hand=True, force=True)]
    finally:
        cgdir.rmdir()
        m.close()
    assert statuses == ["prevented", "repaired", "cannot-repair", "repaired"], (statuses, entries)
    npd = NPD(load())
    fired = [npd.push(e["MESSAGE"]) for e in entries]
    assert fired == [["GPUDeviceAccessLossPrevented"], ["GPUDeviceAccessRepaired"], ["GPUDeviceRepairRefused"],
                     ["GPUDeviceAccessRepaired"]], [e["MESSAGE"] for e in entries]
    assert ": cannot repair: the last repair attempt was 10 s ago" in entries[2]["MESSAGE"]
    assert entries[3]["NVSYMLINKD_FORCED"] == "1" and "FORCED" not in "".join(entries[1])
    assert npd.conditions == {}


# -- a condition says what is true now, or Unknown (issue 39, item 3) ---------------------------------------


def plugin_run(status: str, textfile: Path, *extra: str) -> tuple:
    proc = subprocess.run(["sh", str(PLUGIN), status, str(textfile), *extra], capture_output=True, text=True,
                          timeout=10)
    return proc.returncode, proc.stdout.strip()


def test_an_unknown_container_makes_the_conditions_unknown(runc_host, monkeypatch, tmp_path):
    """A GPU container nvsymlinkd cannot judge (here: its scope's DeviceAllow, with no bus and no unit file
    to read it from) is not a healthy one: with none lost or at risk, both conditions are Unknown (exit 2),
    not False."""
    from nvsymlinkd.metrics import Metrics
    from nvsymlinkd.verify.verifier import verify_all

    monkeypatch.delenv("DBUS_SYSTEM_BUS_ADDRESS", raising=False)
    runc_host.run("gpu-edges-unknown", driver="systemd", **gpu0())
    root = HostRoot(str(runc_host.root))
    m = Metrics()
    report = verify_all(root, Config(), with_host=False, use_bus=False)
    assert [str(c.verdict) for c in report.containers] == ["unknown"], [c.findings for c in report.containers]
    m.on_containers(report)
    textfile = tmp_path / "nvsymlinkd.prom"
    textfile.write_text(m.render())
    for rule in load(PLUGIN_CONFIG)["rules"]:
        code, message = plugin_run(rule["args"][0], textfile)
        assert code == 2 and "1 GPU containers unknown" in message and len(message) <= 120, (rule, message)


def test_a_stuck_verifier_makes_the_conditions_unknown(tmp_path, need_root, monkeypatch):
    """The real daemon: its verifier hangs after a first pass (a read that never returns), its metrics
    heartbeat goes on rewriting the textfile with the container gauges of that pass. The conditions are
    False while verifications come, then Unknown once the last one is older than the plugin's bound."""
    import threading
    import time

    from nvsymlinkd import metrics
    from nvsymlinkd.daemon.containerwatch import ContainerWatch
    from nvsymlinkd.daemon.loop import Daemon
    from nvsymlinkd.verify import verifier

    host = standard_host(tmp_path / "root")
    inside = "/var/lib/node_exporter/textfile_collector/nvsymlinkd.prom"
    host.path(os.path.dirname(inside)).mkdir(parents=True)
    textfile = host.path(inside)
    monkeypatch.setattr(metrics, "HEARTBEAT_SECONDS", 0.2)
    real, stuck, release = verifier.verify_all, threading.Event(), threading.Event()
    passes = []

    def verify_all(*args, **kwargs):
        if stuck.is_set():
            release.wait(DEADLINE)  # hung: a read that never comes back
        passes.append(time.time())
        return real(*args, **kwargs)

    monkeypatch.setattr(verifier, "verify_all", verify_all)
    seen = {}

    async def scenario():
        journal = recording_journal([])
        daemon = Daemon(HostRoot(str(host.root)), Config(resync_interval=1, metrics_textfile=inside),
                        journal=journal, use_udev=False, use_bus=False)
        # as `nvsymlinkd run` wires it (commands/run.py)
        daemon.hook = ContainerWatch(journal, daemon.root, lambda: daemon.config, use_bus=False,
                                     metrics=daemon.metrics)
        task = asyncio.ensure_future(daemon.run())
        try:
            await _wait(lambda: len(passes) >= 2 and textfile.exists(), "two verifications", passes)
            seen["healthy"] = [plugin_run(s, textfile, "3") for s in ("lost,denied", "at-risk")]
            stuck.set()
            written = textfile.stat().st_mtime
            await asyncio.sleep(4.5)  # the heartbeat rewrites the file; no verification comes
            assert textfile.stat().st_mtime > written + 3, "the heartbeat stopped too"
            seen["stuck"] = [plugin_run(s, textfile, "3") for s in ("lost,denied", "at-risk")]
            seen["default"] = plugin_run("lost,denied", textfile)  # twice the resync interval and a minute
        finally:
            release.set()
            os.kill(os.getpid(), signal.SIGTERM)  # the daemon's own handler stops it
            await asyncio.wait_for(task, DEADLINE)

    asyncio.run(scenario())
    assert seen["healthy"] == [(0, "no GPU container is lost or denied"), (0, "no GPU container is at-risk")]
    for code, message in seen["stuck"]:
        assert code == 2 and "verifier stuck" in message and len(message) <= 120, message
    assert seen["default"] == (0, "no GPU container is lost or denied")  # 62 s not passed yet
