"""Crash safety of repairs that freeze a container (cgroup v1 + systemd driver), on real parts.

- a real runc container (busybox, cgroup v1) whose cgroup is shaped like a systemd scope, so the
  repair is devices.allow+systemd: freeze, SetUnitProperties, thaw;
- python-dbusmock as systemd (tests/test_repair_dbus.py's SystemdMock) with a slow SetUnitProperties:
  `hold` keeps the reply back (the container stays frozen meanwhile) and logs, from the mock's side,
  who called and what freezer.state read at each step;
- the real CLI and the real daemon as subprocesses, killed with SIGKILL where the test says so;
- the kernel as judge: the real freezer's state, and open() of the mknod'ed node from inside the
  container (ENXIO: allowed, no driver behind it; EPERM: denied).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvsymlinkd.config import Config
from nvsymlinkd.host.root import HostRoot
from tests.daemonproc import DEADLINE
from tests.runcfixture import device_node, device_rule
from tests.test_daemon_containers import start_daemon  # noqa: F401  (a fixture; F811 on its users)

HOLD = 4.0  # seconds the mock keeps a SetUnitProperties reply back (under the repair's 5 s call timeout)
# what the scope keeps in DeviceAllow (runc's defaults); it lacks the GPU: the container is at-risk-scope
KEEP = [("/dev/char/1:3", "rwm"), ("/dev/char/1:5", "rwm"), ("/dev/char/1:8", "rwm"), ("/dev/char/1:9", "rwm"),
        ("/dev/char/5:0", "rwm"), ("/dev/char/5:2", "rwm")]


def gpu0():
    return dict(rules=[device_rule(195, 0)], nodes=[device_node("/dev/nvidia0", 195, 0)],
                env=["NVIDIA_VISIBLE_DEVICES=0"])


def freezer_of(c) -> Path:
    return Path("/sys/fs/cgroup/freezer") / c.cgroups_path.lstrip("/") / "freezer.state"


def state(c) -> str:
    return freezer_of(c).read_text().strip()


@pytest.fixture
def held(runc_host, subscribing_systemd):
    """(make(name) -> container in a scope whose SetUnitProperties is held); every freezer thawed at the end.

    Thawed before runc_host tears down: runc cannot kill and delete a frozen container.
    """
    made = []

    def make(name: str):
        scope = f"runc-{name}.scope"
        c = runc_host.run(name, driver="systemd", **gpu0())
        made.append(c)
        subscribing_systemd.add_scope(scope, KEEP, root=str(runc_host.root), devices=str(c.devices_dir()),
                               freezer=str(freezer_of(c)), hold=HOLD)
        assert state(c) == "THAWED"
        return c, scope

    yield make
    for c in made:
        try:
            freezer_of(c).write_text("THAWED")
        except OSError:
            pass


def start_repair(host, bus, *args) -> subprocess.Popen:
    env = dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=bus.address, NVSYMLINKD_LOG="stderr")
    return subprocess.Popen([sys.executable, "-m", "nvsymlinkd", "--root", str(host.root), "repair", *args],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def wait_for(predicate, what: str):
    end = time.monotonic() + DEADLINE
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def gone(pid: int) -> bool:
    """Exited (a zombie counts: its files, and so its flock, are closed)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in text


def test_repair_killed_while_frozen_is_thawed_by_the_next_repair(runc_host, subscribing_systemd, held):
    c, scope = held("gpu-killed")
    first = start_repair(runc_host, subscribing_systemd, "--json", c.id)
    try:
        (enter,) = wait_for(subscribing_systemd.entered, "the repair's SetUnitProperties")
        assert enter == {"event": "enter", "pid": first.pid, "freezer": "FROZEN"}
        first.kill()  # SIGKILL between freeze and thaw
    finally:
        first.kill()
        first.communicate()
    assert state(c) == "FROZEN"  # nobody is left to thaw it
    wait_for(subscribing_systemd.observed, "the held call's work")  # systemd finished: nothing left to repair

    # a dry run says what it would thaw, and thaws nothing
    dry = subprocess.run([sys.executable, "-m", "nvsymlinkd", "--root", str(runc_host.root), "repair", "--dry-run",
                          "--json"], env=dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=subscribing_systemd.address),
                         capture_output=True, text=True, timeout=120)
    assert json.loads(dry.stdout)["thawed"] == [
        {"container": c.id, "unit": scope, "freezer": c.cgroups_path,
         "freezer_dir": f"/sys/fs/cgroup/freezer{c.cgroups_path}", "pid": first.pid, "state": "FROZEN",
         "action": "would-thaw"}], dry.stdout + dry.stderr
    assert state(c) == "FROZEN"

    proc = subprocess.run([sys.executable, "-m", "nvsymlinkd", "--root", str(runc_host.root), "repair", c.id],
                          env=dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=subscribing_systemd.address),
                          capture_output=True, text=True, timeout=120)
    assert state(c) == "THAWED", proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (f"thawed /sys/fs/cgroup/freezer{c.cgroups_path} (container {c.id}, {scope}): a repair (pid {first.pid}) "
            "froze it and did not finish") in proc.stdout
    assert c.open_error("/dev/nvidia0", rw=True) == "ENXIO"
    assert os.listdir(runc_host.root / "run/nvsymlinkd/frozen") == []  # the record is gone with the freeze
    # said once: the next run has nothing to thaw
    again = subprocess.run([sys.executable, "-m", "nvsymlinkd", "--root", str(runc_host.root), "repair", "--json"],
                           env=dict(os.environ, DBUS_SYSTEM_BUS_ADDRESS=subscribing_systemd.address),
                           capture_output=True, text=True, timeout=120)
    assert json.loads(again.stdout)["thawed"] == [], again.stdout + again.stderr


def test_daemon_killed_while_frozen_thaws_it_when_it_starts_again(runc_host, subscribing_systemd, start_daemon,  # noqa: F811
                                                                  held):
    c, scope = held("gpu-daemon-killed")
    d = start_daemon(subscribing_systemd, "--resync-interval", "0")
    (enter,) = wait_for(subscribing_systemd.entered, "the daemon's SetUnitProperties")
    assert enter["freezer"] == "FROZEN"
    daemon_pid = enter["pid"]
    d.proc.kill()  # the journal relay; the daemon dies with it (PR_SET_PDEATHSIG SIGKILL)
    d.proc.wait()
    wait_for(lambda: gone(daemon_pid), "the killed daemon to exit")
    assert state(c) == "FROZEN"
    wait_for(subscribing_systemd.observed, "the held call's work")

    d2 = start_daemon(subscribing_systemd, "--resync-interval", "0")
    d2.wait_until(lambda: state(c) == "THAWED", "the restarted daemon to thaw the container")
    message, fields = d2.wait_entry("repair-thawed", c.id)
    assert message == (f"thawed /sys/fs/cgroup/freezer{c.cgroups_path} (container {c.id}, {scope}): a repair "
                       f"(pid {daemon_pid}) froze it and did not finish")
    assert fields["UNIT"] == scope and fields["PRIORITY"] == "4"
    assert fields["NVSYMLINKD_FREEZER"] == c.cgroups_path and fields["NVSYMLINKD_PID"] == str(daemon_pid)
    assert c.open_error("/dev/nvidia0", rw=True) == "ENXIO"
    assert d2.alive()


def test_two_repairs_of_one_container_never_interleave_freeze_and_thaw(runc_host, subscribing_systemd, held):
    c, scope = held("gpu-twice")
    first = start_repair(runc_host, subscribing_systemd, "--json", c.id)
    second = None
    try:
        wait_for(subscribing_systemd.entered, "the first repair's SetUnitProperties")
        # both see the container at risk: the second starts, and verifies, while the first is held (HOLD s)
        second = start_repair(runc_host, subscribing_systemd, "--json", c.id)
        out1, err1 = first.communicate(timeout=120)
        out2, err2 = second.communicate(timeout=120)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()
    assert first.returncode == 0, out1 + err1
    assert second.returncode == 0, out2 + err2
    # seen from systemd's side, in order: each call arrives and is done with the container frozen, and the
    # second call only comes after the first is done (with freezes interleaved, the second repair found the
    # first's FROZEN, left it "as it is", and its re-apply ran after the first had thawed the container)
    log = [(e.get("event", "work"), e.get("pid"), e["freezer"]) for e in subscribing_systemd.log_lines()]
    assert log == [("enter", first.pid, "FROZEN"), ("work", None, "FROZEN"),
                   ("enter", second.pid, "FROZEN"), ("work", None, "FROZEN")], out1 + err1 + out2 + err2
    for out in (out1, out2):
        (res,) = json.loads(out)["containers"]
        assert res["status"] == "prevented", res
        assert "freeze" in res["steps"] and res["steps"][-1] == "thaw", res["steps"]
    assert state(c) == "THAWED"
    assert ("/dev/char/195:0", "rw") in subscribing_systemd.device_allow(scope)
    assert c.open_error("/dev/nvidia0", rw=True) == "ENXIO"


def test_busy_lock_fails_the_repair_without_freezing(runc_host, subscribing_systemd, held, monkeypatch):
    """Another repair holds the host's repair lock for longer than we wait: a clear failure, nothing frozen,
    and no rate-limit record (nothing was tried)."""
    from nvsymlinkd.repair.apply import repair_all
    from nvsymlinkd.repair.plan import RepairHistory

    c, scope = held("gpu-busy")
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", subscribing_systemd.address)
    lock = runc_host.root / "run/nvsymlinkd/repair.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write("4242\n")
        f.flush()
        history = RepairHistory()
        (res,) = repair_all(HostRoot(str(runc_host.root)), Config(repair="auto"), [c.id], history=history,
                            lock_wait=0.2)
    assert res.status == "failed"
    assert res.error.startswith("another repair is running (pid 4242)"), res.error
    assert "freeze" not in res.steps
    assert history.since_last(c.id, 0.0) is None
    assert subscribing_systemd.calls() == []
    assert state(c) == "THAWED"


def test_a_created_container_is_never_frozen_so_runc_start_works(runc_host, subscribing_systemd):
    """Found by the pod scenario on cgroup v1 (s20@v1): a prevention landed between `runc create` and
    `runc start` (the runtime state watch fires when runc writes state.json, before start) and froze
    the container; containerd's `runc start` then failed "cannot start a container in the paused state"
    and `docker run` with it. A created container runs nothing but runc's init, blocked on exec.fifo:
    systemd's re-apply cannot hurt it, so the repair leaves its freezer alone."""
    scope = "runc-gpu-created.scope"
    c, proc = runc_host.create_async("gpu-created", driver="systemd", **gpu0())
    assert proc.wait(timeout=60) == 0, (runc_host.state_root / "gpu-created").exists()
    runc_host.link_proc(c)
    subscribing_systemd.add_scope(scope, KEEP, root=str(runc_host.root), devices=str(c.devices_dir()),
                           freezer=str(freezer_of(c)), hold=HOLD)
    repair = start_repair(runc_host, subscribing_systemd, "--json", c.id)
    try:
        (enter,) = wait_for(subscribing_systemd.entered, "the repair's SetUnitProperties")
        assert enter["freezer"] == "THAWED", enter
        # the runtime starts the container while systemd re-applies its devices
        start = c.runc("start", c.id, check=False)
        assert start.returncode == 0, start.stderr
        out, err = repair.communicate(timeout=120)
    finally:
        repair.kill()
        freezer_of(c).write_text("THAWED")
    (result,) = json.loads(out)["containers"]
    assert result["status"] == "prevented", (result, err)
    assert any("not frozen" in s for s in result["steps"]), result["steps"]
    assert state(c) == "THAWED"
