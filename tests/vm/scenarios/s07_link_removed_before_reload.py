"""Scenario 7: a /dev/char link removed by someone else, then a container and a daemon-reload at once.

systemd >= 240 parses DeviceAllow=/dev/char/M:m without stat(): a running container whose scope
lists the device keeps it through a reload while the link is missing. The link is needed when a
container is created: runc 1.1.3-1.1.6 (Debian 12: 1.1.5) stat()s /dev/char/M:m, leaves a
missing one out of the scope ("skipping device"), and the next reload takes the device.
A poller in each container (busybox sh, open(O_RDWR) in a loop) records every denied open.
A. running container; unlink, then at once Manager.Reload() on an open bus connection (3x; the
   default run 1x) and `systemctl daemon-reload` (1x): with nvsymlinkd no denied open and the link back; with it
   stopped, recorded as a fact (no loss expected with systemd >= 240).
B. unlink, then at once a new container, then Manager.Reload(). Control, nvsymlinkd stopped: runc
   skips 195:0, the poller sees denied opens (the failure; proves the poller can see it). With
   nvsymlinkd (3x; the default run 1x): runc skipped nothing, no denied open, the link back.
"""
# vm: nvsymlinkd=deb timeout=500
import asyncio
import os
import subprocess
import time

from tests.vm.guest.vmguest import (
    Scenario,
    expect_nvsymlinkd,
    full_matrix,
    load_fake_driver,
    make_char_link,
    mknod,
    nvsymlinkd_unit_active,
    sh,
    start_gpu_container,
    unit_property,
    wait_for,
)

# the full matrix: three rounds of A and of B (the race, many times); the default run one (CI time)
ROUNDS = 3 if full_matrix() else 1
LINK = "/dev/char/195:0"
# open() in a loop inside the container; "D" on every denial, "N <count>" now and then.
# A subshell per open, as Container.open_errno does: a failed redirection ends it, not the loop.
POLLER = ('n=0; while :; do '
          '( exec 3<>/dev/nvidia0 ) 2>/dev/null || echo D; '
          'n=$((n+1)); [ $((n % 10)) -eq 0 ] && echo "N $n"; done')


class Poller:
    def __init__(self, ctr, tag):
        self.path = f"/run/vmtest/poller-{tag}.out"
        self.out = open(self.path, "w")
        self.proc = subprocess.Popen(["runc", "exec", ctr.name, "/bin/sh", "-c", POLLER],
                                     stdin=subprocess.DEVNULL, stdout=self.out, stderr=subprocess.STDOUT)
        # running, and through some opens, before the scenario does anything
        wait_for(lambda: self.opens() >= 50, timeout=60, interval=0.05)

    def text(self):
        with open(self.path) as f:
            return f.read()

    def opens(self):
        counts = [int(line.split()[1]) for line in self.text().splitlines() if line.startswith("N ")]
        return counts[-1] if counts else 0

    def stop(self, settle_opens=100):
        """Let it run SETTLE_OPENS more opens (past the reload), stop it -> (denied, opens)."""
        target = self.opens() + settle_opens
        wait_for(lambda: self.opens() >= target, timeout=60, interval=0.05)
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        text = self.text()
        return sum(1 for line in text.splitlines() if line == "D"), self.opens()


async def _unlink_then_reload():
    """unlink, then Manager.Reload() on a connection opened beforehand -> (gap s, reload s)."""
    from dbus_next import BusType, Message
    from dbus_next.aio import MessageBus

    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    try:
        t0 = time.monotonic()
        os.unlink(LINK)
        call = asyncio.ensure_future(bus.call(Message(
            destination="org.freedesktop.systemd1", path="/org/freedesktop/systemd1",
            interface="org.freedesktop.systemd1.Manager", member="Reload")))
        await asyncio.sleep(0)  # the call is written to the socket here
        gap = time.monotonic() - t0
        reply = await call
        if reply.message_type.name == "ERROR":
            raise RuntimeError(f"Reload failed: {reply.error_name} {reply.body}")
        return gap, time.monotonic() - t0
    finally:
        bus.disconnect()


def unlink_then_reload():
    return asyncio.run(_unlink_then_reload())


def unlink_then_systemctl():
    t0 = time.monotonic()
    os.unlink(LINK)
    proc = subprocess.Popen(["systemctl", "daemon-reload"])
    gap = time.monotonic() - t0
    proc.wait(120)
    return gap, time.monotonic() - t0


def start_container_at_once(name, gpu0):
    """unlink, then `runc run` at once -> (container, seconds from the unlink to runc's start)."""
    t0 = time.monotonic()
    os.unlink(LINK)
    gap = time.monotonic() - t0
    return start_gpu_container(name, [gpu0]), gap


def reload_now():
    return asyncio.run(_reload())


async def _reload():
    from dbus_next import BusType, Message
    from dbus_next.aio import MessageBus

    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    try:
        reply = await bus.call(Message(destination="org.freedesktop.systemd1", path="/org/freedesktop/systemd1",
                                       interface="org.freedesktop.systemd1.Manager", member="Reload"))
        if reply.message_type.name == "ERROR":
            raise RuntimeError(f"Reload failed: {reply.error_name} {reply.body}")
    finally:
        bus.disconnect()


def link_back(gpu0):
    return wait_for(lambda: os.path.realpath(LINK) == gpu0.path, timeout=15)


with Scenario() as sc:
    expect_nvsymlinkd(sc)
    load_fake_driver()
    gpu0 = mknod("/dev/nvidia0", 195, 0)
    ok, _ = link_back(gpu0)
    sc.check(f"nvsymlinkd made {LINK}", bool(ok))
    ctr = start_gpu_container("gpu-s07", [gpu0])
    allow = unit_property(ctr.scope, "DeviceAllow")
    sc.check(f"{ctr.scope} DeviceAllow has {LINK} rw", f"{LINK} rw" in allow, ", ".join(allow.splitlines()))
    sc.expect_open(ctr, "/dev/nvidia0", "OK", "at start")

    # A. a running container, the link removed, a reload at once
    rounds = [("reload-call", unlink_then_reload)] * ROUNDS + [("systemctl", unlink_then_systemctl)]
    for i, (how, step) in enumerate(rounds):
        poller = Poller(ctr, f"a{i}")
        gap, took = step()
        back, waited = link_back(gpu0)
        denied, opens = poller.stop()
        sc.timing(f"a{i}_{how}_unlink_to_reload_s", gap)
        sc.check(f"A{i} ({how}): no denied open while the link was removed and systemd reloaded",
                 denied == 0 and opens > 0, f"{denied} of {opens} opens denied; reload sent {gap * 1000:.1f} ms "
                 f"after the unlink, finished after {took:.2f} s")
        sc.check(f"A{i}: {LINK} is back", bool(back), f"checked {waited:.2f} s after the reload")
    sh("systemctl", "stop", "nvsymlinkd.service", timeout=120)
    poller = Poller(ctr, "a-stopped")
    gap, took = unlink_then_reload()
    denied, opens = poller.stop()
    sc.fact("a_nvsymlinkd_stopped_denied_opens", f"{denied} of {opens} (systemd >= 240 parses /dev/char/M:m: 0)")
    make_char_link(gpu0)
    ctr.delete()

    # B control: nvsymlinkd stopped; the container starts while the link is missing
    ctr, gap = start_container_at_once("gpu-s07-control", gpu0)
    sc.check("B control (nvsymlinkd stopped): runc skipped /dev/char/195:0",
             "skipping device /dev/char/195:0" in ctr.runc_log(), ctr.runc_log()[-300:])
    poller = Poller(ctr, "b-control")
    reload_now()
    denied, opens = poller.stop()
    sc.check("B control: the poller saw denied opens after the reload", denied > 0,
             f"{denied} of {opens} opens denied")
    sc.expect_open(ctr, "/dev/nvidia0", "EPERM", "B control: after the reload")
    ctr.delete()
    make_char_link(gpu0)
    sh("systemctl", "start", "nvsymlinkd.service", timeout=120)
    ok, _ = wait_for(nvsymlinkd_unit_active, timeout=60)
    sc.check("nvsymlinkd.service active again", bool(ok))

    # B with nvsymlinkd: the link is back before runc looks
    for i in range(ROUNDS):
        ctr, gap = start_container_at_once(f"gpu-s07-b{i}", gpu0)
        sc.check(f"B{i}: runc skipped no device (the link was back before runc looked)",
                 "skipping device /dev/char/195:" not in ctr.runc_log(), ctr.runc_log()[-300:])
        poller = Poller(ctr, f"b{i}")
        reload_now()
        denied, opens = poller.stop()
        sc.check(f"B{i}: no denied open across the reload", denied == 0 and opens > 0,
                 f"{denied} of {opens} opens denied")
        back, _ = link_back(gpu0)
        sc.check(f"B{i}: {LINK} is back", bool(back))
        ctr.delete()
    sc.check("nvsymlinkd.service still active", nvsymlinkd_unit_active())
