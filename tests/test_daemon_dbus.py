"""The daemon against a private system bus (real dbus-daemon) with python-dbusmock as systemd."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.daemonproc import DEADLINE, DaemonProcess
from tests.privatebus import (
    MANAGER,
    MOCK_IFACE,
    SYSTEMD,
    SYSTEMD_PATH,
    TEMPLATE_HEAD,
    need_dbusmock,
    start_bus,
    start_mock,
)

# systemd's Manager as far as nvsymlinkd uses it; signals are sent with the mock's EmitSignal.
TEMPLATE = TEMPLATE_HEAD + """


def load(mock, parameters):
    mock.AddMethods(MAIN_IFACE, [("Subscribe", "", "", ""), ("Unsubscribe", "", "", "")])
"""


class PrivateBus:
    def __init__(self, tmp_path):
        self.dir = tmp_path
        self.template = tmp_path / "systemd_manager.py"
        self.template.write_text(TEMPLATE)
        self.daemon = None
        self.address = None
        self.proc = None
        self.mock = None

    def start(self):
        self.daemon = start_bus(self.dir)
        self.address, self.proc = self.daemon.address, self.daemon.proc

    def kill(self):
        self.daemon.kill()

    def connection(self):
        import dbus

        return dbus.bus.BusConnection(self.address)

    def start_mock(self):
        self.mock = start_mock(self.address, self.template)
        return self.connection()

    def stop_mock(self):
        self.mock.terminate()
        self.mock.wait()

    def manager(self, conn):
        return conn.get_object(SYSTEMD, SYSTEMD_PATH)

    def emit(self, conn, member, signature, args):
        self.manager(conn).EmitSignal(MANAGER, member, signature, args, dbus_interface=MOCK_IFACE)

    def subscribed(self, conn) -> bool:
        calls = self.manager(conn).GetCalls(dbus_interface=MOCK_IFACE)
        return any(str(c[1]) == "Subscribe" for c in calls)

    def close(self):
        for p in (self.mock, self.proc):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if self.proc is not None and self.proc.stdout and not self.proc.stdout.closed:
            self.proc.stdout.close()


@pytest.fixture
def bus(tmp_path, need_root):
    need_dbusmock()
    b = PrivateBus(tmp_path)
    b.start()
    yield b
    b.close()


def links(host):
    try:
        return host.links()
    except FileNotFoundError:
        return None


def test_reload_reexec_and_bus_loss(bus, gpu_host, tmp_path):
    conn = bus.start_mock()
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text("resync_interval = 0\n")  # only events can explain a resync
    d = DaemonProcess(gpu_host.root, config=cfg, journal=True,
                      env={"DBUS_SYSTEM_BUS_ADDRESS": bus.address, "NVSYMLINKD_DEBUG": "1"})
    try:
        d.wait_for_line(r"watching systemd on the system bus")
        d.wait_until(lambda: bus.subscribed(conn), "Subscribe() on the mock")
        assert len(links(gpu_host) or {}) == 6

        # a reload: the link that vanished behind the daemon's back comes back
        os.unlink(gpu_host.path("/dev/char/195:0"))
        mark = d.mark()
        # a forged Reloading from someone who does not own org.freedesktop.systemd1 is ignored;
        # it reaches the daemon before the mock's signals (our call below is ordered after it)
        import dbus

        forged = dbus.lowlevel.SignalMessage(SYSTEMD_PATH, MANAGER, "Reloading")
        forged.append(False, signature="b")
        conn.send_message(forged)
        bus.emit(conn, "Reloading", "b", [True])
        bus.emit(conn, "Reloading", "b", [False])
        d.wait_entry("reload-seen", after=mark, NVSYMLINKD_ACTION="reload")
        d.wait_until(lambda: (links(gpu_host) or {}).get("195:0") == "../nvidia0", "the link back after a reload")
        d.wait_for_line(r"verified \d+ GPU containers in [\d.]+ ms \(systemd reload finished\)", after=mark)
        assert len(d.entries(mark, "reload-seen")) == 1, d.output()

        # container scopes reach the hook, once each; CRI-O's conmon scope is not a container
        mark = d.mark()
        bus.emit(conn, "UnitNew", "so", ["crio-conmon-abc.scope", "/org/freedesktop/systemd1/unit/x"])
        bus.emit(conn, "UnitNew", "so", ["sshd.service", "/org/freedesktop/systemd1/unit/y"])
        bus.emit(conn, "UnitNew", "so", ["docker-0123abc.scope", "/org/freedesktop/systemd1/unit/z"])
        bus.emit(conn, "JobRemoved", "uoss", [7, "/org/freedesktop/systemd1/job/7", "docker-0123abc.scope", "done"])
        bus.emit(conn, "JobRemoved", "uoss", [8, "/org/freedesktop/systemd1/job/8", "cri-containerd-9f.scope",
                                              "done"])
        d.wait_for_line(r"container scope cri-containerd-9f\.scope appeared", after=mark)
        later = d.lines[mark:]
        assert sum("docker-0123abc.scope appeared" in line for line in later) == 1, d.output()
        assert not any("conmon" in line or "sshd" in line for line in later), d.output()

        # systemd drops off the bus and comes back (what daemon-reexec looks like)
        mark = d.mark()
        bus.stop_mock()
        d.wait_for_line(r"systemd left the system bus", after=mark)
        os.unlink(gpu_host.path("/dev/char/195:1"))
        conn = bus.start_mock()
        d.wait_entry("systemd-restarted", after=mark, NVSYMLINKD_ACTION="reexec")
        d.wait_until(lambda: bus.subscribed(conn), "Subscribe() again on the new systemd")
        d.wait_until(lambda: (links(gpu_host) or {}).get("195:1") == "../nvidia1", "a resync after the re-exec")

        # the whole bus dies: the daemon lives on and keeps links in sync
        mark = d.mark()
        bus.stop_mock()
        bus.kill()
        d.wait_entry("bus-lost", after=mark)
        gpu_host.node("/dev/nvidia3", 195, 3)
        d.wait_until(lambda: (links(gpu_host) or {}).get("195:3") == "../nvidia3", "a link while the bus is gone")
        assert d.alive()
        # and the bus comes back: reconnected (backoff), reloads are seen again
        bus.start()
        conn = bus.start_mock()
        d.wait_entry("bus-regained", after=mark)
        d.wait_until(lambda: bus.subscribed(conn), "Subscribe() after the bus came back")
        mark = d.mark()
        bus.emit(conn, "Reloading", "b", [False])
        d.wait_entry("reload-seen", after=mark)
        assert len(d.entries(kind="bus-lost")) == 1, d.output()
        d.signal(signal.SIGTERM)
        assert d.proc.wait(DEADLINE) == 0
    finally:
        d.stop()


def test_no_bus_at_start_is_logged_once(gpu_host, tmp_path):
    d = DaemonProcess(gpu_host.root, "--resync-interval", "0", journal=True,
                      env={"DBUS_SYSTEM_BUS_ADDRESS": f"unix:path={tmp_path}/no-bus-here"})
    try:
        message, _ = d.wait_entry("bus-lost")
        assert f"unix:path={tmp_path}/no-bus-here" in message  # names the address it tried
        gpu_host.node("/dev/nvidia4", 195, 4)
        d.wait_until(lambda: (links(gpu_host) or {}).get("195:4") == "../nvidia4", "links without a bus")
        # several reconnect attempts have happened by now (backoff 0.5 s, 1 s, ...)
        time.sleep(2)
        assert d.stop() == 0
        assert len(d.entries(kind="bus-lost")) == 1, d.output()
    finally:
        d.stop()


def test_reload_start_resyncs_at_once(bus, gpu_host, tmp_path):
    """Reloading(true) starts a pass: it may still beat systemd to re-applying device policies."""
    conn = bus.start_mock()
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text("resync_interval = 0\n")
    d = DaemonProcess(gpu_host.root, config=cfg, journal=True,
                      env={"DBUS_SYSTEM_BUS_ADDRESS": bus.address, "NVSYMLINKD_DEBUG": "1"})
    try:
        d.wait_until(lambda: bus.subscribed(conn), "Subscribe() on the mock")
        d.wait_until(lambda: len(links(gpu_host) or {}) == 6, "the first full sync")
        mark = d.mark()
        bus.emit(conn, "Reloading", "b", [True])  # no Reloading(false) follows
        d.wait_for_line(r"systemd reload started: resyncing links", after=mark)
        d.wait_for_line(r"pass \d+ \(systemd reload started\)", after=mark)
        assert d.entries(mark, "reload-seen") == [], d.output()
        assert d.stop() == 0
    finally:
        d.stop()


# systemd after a daemon-reexec: the new process restored its subscribers from the serialized state
# before serving the bus (src/core/manager.c, bus_track_coldplug), so a second Subscribe() from the
# same client is answered with AlreadySubscribed (src/core/dbus-manager.c, method_subscribe).
REEXECED_TEMPLATE = TEMPLATE.replace(
    '("Subscribe", "", "", "")',
    '("Subscribe", "", "", "raise dbus.exceptions.DBusException(\'Client is already subscribed.\', '
    'name=\'org.freedesktop.systemd1.AlreadySubscribed\')")')


def test_reexec_keeps_the_subscription(bus, gpu_host, tmp_path):
    """After a re-exec systemd still has the daemon subscribed and says so (AlreadySubscribed):
    that is a subscription, not a refusal (no retries, no "refused" notice), and container scopes
    are seen through D-Bus as before."""
    conn = bus.start_mock()
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text("resync_interval = 0\n")
    d = DaemonProcess(gpu_host.root, config=cfg,
                      env={"DBUS_SYSTEM_BUS_ADDRESS": bus.address, "NVSYMLINKD_DEBUG": "1"})
    try:
        d.wait_until(lambda: bus.subscribed(conn), "Subscribe() on the mock")
        mark = d.mark()
        bus.stop_mock()
        d.wait_for_line(r"systemd left the system bus", after=mark)
        bus.template.write_text(REEXECED_TEMPLATE)
        conn = bus.start_mock()
        d.wait_for_line(r"systemd is \(back\) on the system bus", after=mark)
        d.wait_for_line(r"systemd kept our subscription across the re-exec", after=mark)
        calls = [str(c[1]) for c in bus.manager(conn).GetCalls(dbus_interface=MOCK_IFACE)]
        assert calls.count("Subscribe") == 1, calls
        bus.emit(conn, "UnitNew", "so", ["docker-77aa.scope", "/org/freedesktop/systemd1/unit/d"])
        d.wait_for_line(r"container scope docker-77aa\.scope appeared", after=mark)
        assert not any("refused Subscribe" in line for line in d.lines), d.output()
        assert d.stop() == 0
    finally:
        d.stop()


def test_scopes_announced_again_by_a_reload_are_not_new(bus, gpu_host, tmp_path):
    """A daemon-reload frees and re-creates every unit: subscribers get UnitRemoved then UnitNew for
    each running scope (same unit, same cgroup). Those are the scopes the daemon knows, not new ones
    to verify at 1 s and 5 s; a scope removed outside a reload and started again is new."""
    conn = bus.start_mock()
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text("resync_interval = 0\n")
    d = DaemonProcess(gpu_host.root, config=cfg,
                      env={"DBUS_SYSTEM_BUS_ADDRESS": bus.address, "NVSYMLINKD_DEBUG": "1"})
    scopes = ["docker-aa01.scope", "cri-containerd-bb02.scope"]

    def path(unit):  # systemd escapes a unit's name into its object path
        return "/org/freedesktop/systemd1/unit/" + "".join(c if c.isalnum() else f"_{ord(c):02x}" for c in unit)

    def announce(unit):
        bus.emit(conn, "UnitNew", "so", [unit, path(unit)])

    def appeared(unit, mark):
        return sum(f"container scope {unit} appeared" in line for line in d.lines[mark:])

    def settled(sentinel, mark):
        # signals are handled in order: once a later scope appeared, the earlier ones were handled
        announce(sentinel)
        d.wait_for_line(rf"container scope {sentinel} appeared", after=mark)

    try:
        d.wait_until(lambda: bus.subscribed(conn), "Subscribe() on the mock")
        mark = d.mark()
        for unit in scopes:
            announce(unit)
        settled("docker-ff00.scope", mark)
        for unit in scopes:  # a new scope logs after an executor step (the drop-in check): not in order
            d.wait_for_line(rf"container scope {unit.replace('.', '[.]')} appeared", after=mark)
        assert all(appeared(u, mark) == 1 for u in scopes), d.output()

        for n in range(2):  # a daemon-reload, as systemd 252 signals it
            mark = d.mark()
            bus.emit(conn, "Reloading", "b", [True])
            for unit in scopes:
                bus.emit(conn, "UnitRemoved", "so", [unit, path(unit)])
            for unit in scopes:
                announce(unit)
            bus.emit(conn, "Reloading", "b", [False])
            d.wait_for_line(r"systemd finished a daemon-reload", after=mark)
            settled(f"docker-ff1{n}.scope", mark)
            assert [appeared(u, mark) for u in scopes] == [0, 0], d.output()

        # a re-exec: systemd leaves the bus, comes back and announces its units again
        mark = d.mark()
        bus.stop_mock()
        d.wait_for_line(r"systemd left the system bus", after=mark)
        conn = bus.start_mock()
        d.wait_for_line(r"systemd is \(back\) on the system bus", after=mark)
        d.wait_until(lambda: bus.subscribed(conn), "Subscribe() on the re-exec'ed systemd")
        for unit in scopes:
            announce(unit)
        settled("docker-ff20.scope", mark)
        assert [appeared(u, mark) for u in scopes] == [0, 0], d.output()

        # the container stops (its scope goes, no reload) and starts again: a new scope of that name
        mark = d.mark()
        bus.emit(conn, "UnitRemoved", "so", [scopes[0], path(scopes[0])])
        announce(scopes[0])
        settled("docker-ff30.scope", mark)
        d.wait_for_line(rf"container scope {scopes[0].replace('.', '[.]')} appeared", after=mark)
        assert appeared(scopes[0], mark) == 1, d.output()
        assert d.stop() == 0
    finally:
        d.stop()


def test_every_runtimes_scope_is_a_container_scope_on_the_bus(bus, gpu_host, tmp_path):
    """The bus's list of container scopes is the runtime table's (issue 36, item 5): crun run directly
    with the systemd cgroup manager names its scope crun-<id>.scope, and the daemon takes it for a
    container's as it takes runc's and Podman's; a unit of no runtime stays ignored."""
    conn = bus.start_mock()
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text("resync_interval = 0\n")
    d = DaemonProcess(gpu_host.root, config=cfg,
                      env={"DBUS_SYSTEM_BUS_ADDRESS": bus.address, "NVSYMLINKD_DEBUG": "1"})
    units = ["session-terminal36.scope", "crun-terminal36.scope", "libpod-terminal36.scope",
             "runc-terminal36.scope"]
    try:
        d.wait_until(lambda: bus.subscribed(conn), "Subscribe() on the mock")
        mark = d.mark()
        for unit in units:  # handled in order: once the last appeared, the others were handled
            bus.emit(conn, "UnitNew", "so", [unit, "/org/freedesktop/systemd1/unit/" + unit.replace("-", "_2d")
                                             .replace(".", "_2e")])
        # each new scope's handling starts in order but logs after an executor step (the drop-in check):
        # wait for every container scope, not for the last one
        for unit in units[1:]:
            d.wait_for_line(rf"container scope {unit.replace('.', '[.]')} appeared", after=mark)
        time.sleep(0.3)
        seen = [u for u in units if any(f"container scope {u} appeared" in line for line in d.lines[mark:])]
        assert seen == units[1:], d.output()
        assert d.stop() == 0
    finally:
        d.stop()
