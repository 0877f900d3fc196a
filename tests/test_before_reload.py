"""`repair --before-reload`, as apt and dnf run it before their daemon-reload (issue 39, items 7-9): it
never fails or stalls the package operation and names every container it leaves at risk, whatever
goes wrong around it: a bus that accepts and never answers, a config file that does not load, no
dbus_next. Real runc containers (cgroup v1) whose systemd scope lacks their GPU (systemd's transient
unit file says so); the CLI as the package scripts call it. And `repair`'s exit status keeps `check`'s
contract: a finding left is exit 1, a user who cannot see is told so.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import need_tool
from tests.runcfixture import device_node, device_rule

pytestmark = pytest.mark.root

CONTAINERS = 50
# Under the bound the docs state: one wait for the bus (systemd.client.CALL_TIMEOUT, 5 s) and the
# repairs' own work. Measured for 50 containers on 2 shared cores: 5.4-5.6 s with the hung bus, 0.3-0.5 s
# without a bus; before, one 5 s wait per container (about 250 s).
BOUND_SECONDS = 30.0
SCOPE_KEEP = "DeviceAllow=/dev/char/1:3 rwm\nDeviceAllow=char-pts rwm\n"
BLOCK_DBUS_NEXT = (
    "import sys\n"
    "class Blocker:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'dbus_next' or name.startswith('dbus_next.'):\n"
    "            raise ModuleNotFoundError(f'No module named {name!r} (blocked)', name=name)\n"
    "sys.meta_path.insert(0, Blocker())\n"
    "from nvsymlinkd.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n")


class HungBus:
    """A unix socket that accepts every connection and never says a word (dbus-daemon stuck)."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(64)
        self.held: list = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"unix:path={self.path}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture
def at_risk(runc_host):
    """CONTAINERS real runc containers, each in a cgroup named like its systemd scope, the scope's transient
    unit file lacking the container's GPU: every one at risk of the next reload."""
    ids = []
    for i in range(CONTAINERS):
        cid = f"gpu-brl-{i}"
        scope = f"runc-{cid}.scope"
        runc_host.fake.write(f"/run/systemd/transient/{scope}",
                             "# transient\n[Scope]\nDevicePolicy=strict\nDeviceAllow=\n" + SCOPE_KEEP)
        runc_host.run(cid, driver="systemd", rules=[device_rule(195, 0)],
                      nodes=[device_node("/dev/nvidia0", 195, 0)], env=["NVIDIA_VISIBLE_DEVICES=0"])
        ids.append(cid)
    (runc_host.root / "run/systemd/system").mkdir(parents=True, exist_ok=True)  # systemd runs on this tree
    return ids


def before_reload(root, *pre, env=None, argv=None):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *(argv or ["-m", "nvsymlinkd"]), "--root", str(root), *pre,
                           "repair", "--before-reload"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    return proc, time.monotonic() - start


def assert_named_and_bounded(proc, seconds, ids, what):
    assert proc.returncode == 0, (what, proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert seconds < BOUND_SECONDS, f"{what}: {seconds:.1f} s"
    missing = [cid for cid in ids if not re.search(rf"\b{re.escape(cid)}\b", proc.stderr)]
    assert not missing, (what, missing, proc.stderr[-3000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("nvsymlinkd: not every GPU container could be kept safe from this daemon-reload ("), last
    print(f"{what}: {seconds:.1f} s for {len(ids)} containers")


def test_a_hung_bus_costs_one_wait_not_one_per_container(runc_host, at_risk, tmp_path):
    bus = HungBus(str(tmp_path / "hung-bus-brl"))
    try:
        proc, seconds = before_reload(runc_host.root, env={"DBUS_SYSTEM_BUS_ADDRESS": bus.address})
    finally:
        bus.close()
    assert_named_and_bounded(proc, seconds, at_risk, "hung bus")
    assert len(bus.held) == 1, len(bus.held)


def test_a_bad_config_is_named_and_the_containers_still_protected(runc_host, at_risk, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("repair = [\n")
    env = {"DBUS_SYSTEM_BUS_ADDRESS": ""}
    proc, seconds = before_reload(runc_host.root, "--config", str(bad), env=env)
    assert_named_and_bounded(proc, seconds, at_risk, "bad config")
    first = proc.stderr.splitlines()[0]
    assert first.startswith(f"nvsymlinkd: before a daemon-reload: {bad}") and "default settings" in first, first


def test_without_dbus_next_it_says_so_and_names_them(runc_host, at_risk, tmp_path):
    bus = HungBus(str(tmp_path / "hung-bus-brl2"))
    try:
        proc, seconds = before_reload(runc_host.root, env={"DBUS_SYSTEM_BUS_ADDRESS": bus.address},
                                      argv=["-c", BLOCK_DBUS_NEXT])
    finally:
        bus.close()
    assert_named_and_bounded(proc, seconds, at_risk, "no dbus_next")
    assert "dbus_next is not importable" in proc.stderr and "python3-dbus-next" in proc.stderr, proc.stderr[-2000:]
    assert not bus.held  # never tried to connect


def test_repair_exits_1_while_a_finding_remains(runc_host, nvsymlinkd_cli, monkeypatch):
    """A device the hook granted, no baseline: `check` finds it at risk (exit 1); `repair` can grant nothing
    (nothing trusted expects it) and used to say "nothing to do", exit 0."""
    monkeypatch.delenv("DBUS_SYSTEM_BUS_ADDRESS", raising=False)
    scope = "runc-gpu-brl-hook.scope"
    runc_host.fake.write(f"/run/systemd/transient/{scope}",
                         "# transient\n[Scope]\nDevicePolicy=strict\nDeviceAllow=\n" + SCOPE_KEEP)
    c = runc_host.run("gpu-brl-hook", driver="systemd", nodes=[device_node("/dev/nvidia0", 195, 0)],
                      env=["NVIDIA_VISIBLE_DEVICES=0"])
    c.allow("c 195:0 rw")  # the hook's grant, outside the spec
    root = str(runc_host.root)
    nvsymlinkd_cli("--root", root, "check", "--no-bus", "--no-host", check=1)
    proc = nvsymlinkd_cli("--root", root, "repair", check=1)
    assert "nothing to grant" in proc.stdout, proc.stdout


def test_repair_as_a_user_who_cannot_see_says_so(tmp_path, need_root):
    need_tool("runuser")
    """Not root: the runtimes' state is unreadable; "0 containers with findings", exit 0, was a false ok."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    probe = subprocess.run(["runuser", "-u", "nobody", "--", sys.executable, "-c", "import nvsymlinkd"], cwd="/",
                           capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": repo})
    if probe.returncode != 0:  # a checkout or interpreter only root may read (a CI home directory)
        pytest.skip(f"user nobody cannot run {sys.executable} on {repo}: {probe.stderr.strip()[-200:]}")
    proc = subprocess.run(["runuser", "-u", "nobody", "--", sys.executable, "-m", "nvsymlinkd", "repair"],
                          capture_output=True, text=True, timeout=120, cwd="/",
                          env={**os.environ, "PYTHONPATH": repo})
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "nvsymlinkd: repair: not running as root:" in proc.stderr, proc.stderr


def test_a_held_repair_lock_cannot_stretch_it_past_its_bound(runc_host, tmp_path):
    """Another repair holds the host's repair lock and never lets go (a stuck CLI): each repair waited 30 s
    for it, one container after the other (6 containers: 3 minutes of apt). Now repairs start within
    30 s, each waits 10 s at most, and the containers whose turn came later are named, not tried."""
    import fcntl

    from tests.privatebus import need_dbusmock
    from tests.test_repair_dbus import SystemdMock

    need_dbusmock()
    mock = SystemdMock(tmp_path / "sdbus-brl")
    try:
        mock.start()
        ids = []
        for i in range(6):
            cid, scope = f"gpu-brl-lock-{i}", f"runc-gpu-brl-lock-{i}.scope"
            runc_host.fake.write(f"/run/systemd/transient/{scope}",
                                 "# transient\n[Scope]\nDevicePolicy=strict\nDeviceAllow=\n" + SCOPE_KEEP)
            c = runc_host.run(cid, driver="systemd", rules=[device_rule(195, 0)],
                              nodes=[device_node("/dev/nvidia0", 195, 0)], env=["NVIDIA_VISIBLE_DEVICES=0"])
            freezer = f"/sys/fs/cgroup/freezer/{c.cgroups_path.lstrip('/')}/freezer.state"
            mock.add_scope(scope, [("/dev/char/1:3", "rwm")], root=str(runc_host.root), devices=str(c.devices_dir()),
                           freezer=freezer)
            ids.append(cid)
        (runc_host.root / "run/systemd/system").mkdir(parents=True, exist_ok=True)
        state = runc_host.root / "run/nvsymlinkd"
        state.mkdir(parents=True, exist_ok=True)
        held = os.open(state, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(held, fcntl.LOCK_EX)  # the state directory: the lock every repair takes first
        try:
            proc, seconds = before_reload(runc_host.root, env={"DBUS_SYSTEM_BUS_ADDRESS": mock.address})
        finally:
            os.close(held)
    finally:
        mock.close()
    assert proc.returncode == 0 and seconds < 30 + 10 + 15 + 10, (seconds, proc.stderr[-3000:])
    missing = [cid for cid in ids if not re.search(rf"\b{re.escape(cid)}\b", proc.stderr)]
    assert not missing, (missing, proc.stderr[-3000:])
    assert "another repair is running" in proc.stderr, proc.stderr[-3000:]
    late = [line for line in proc.stderr.splitlines() if "its turn came after the 30 s" in line]
    assert late, proc.stderr[-3000:]
    print(f"held lock: {seconds:.1f} s, {len(late)} of {len(ids)} not tried")
