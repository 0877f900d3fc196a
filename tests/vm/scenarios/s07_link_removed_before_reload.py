"""Scenario 7: a /dev/char link removed just before a daemon-reload.

A container's scope lists DeviceAllow=/dev/char/195:0 (the link was there when it started).
Someone removes the link and a daemon-reload comes at once: systemd re-applies the scope's
device policy, cannot resolve /dev/char/195:0, and drops the device. A poller inside the
container (busybox sh, open(O_RDWR) in a loop) records every denied open.

1. control, nvsymlinkd stopped: unlink, Manager.Reload() on an already-open bus connection
   (the call is on the wire within milliseconds): the poller sees denied opens. This is the
   failure, and proves the poller can see it.
2. the link is put back and the scope re-applied (another reload): access is back.
3. nvsymlinkd started: ROUNDS times unlink + Manager.Reload() at once, then once unlink +
   `systemctl daemon-reload` as a user types it: the DEV_CHAR_PATH watch puts the link back
   before systemd resolves it; the poller sees no denied open, and the link is back each time.
"""
# vm: nvsymlinkd=deb timeout=500
import asyncio
import os
import subprocess
import time

from vmguest import (
    Scenario,
    daemon_reload,
    expect_nvsymlinkd,
    load_fake_driver,
    make_char_link,
    mknod,
    nvsymlinkd_unit_active,
    sh,
    start_gpu_container,
    unit_property,
    wait_for,
)

ROUNDS = 3
LINK = "/dev/char/195:0"
# open() in a loop inside the container; "D" on every denial, "N <count>" now and then.
# `true` is a regular builtin: a failed redirection fails the command, not the shell.
POLLER = ('n=0; echo S; while :; do '
          'true 2>/dev/null 3<>/dev/nvidia0 || echo D; '
          'n=$((n+1)); [ $((n % 100)) -eq 0 ] && echo "N $n"; done')


class Poller:
    def __init__(self, ctr, tag):
        self.path = f"/run/vmtest/poller-{tag}.out"
        self.out = open(self.path, "w")
        self.proc = subprocess.Popen(["runc", "exec", ctr.name, "/bin/sh", "-c", POLLER],
                                     stdin=subprocess.DEVNULL, stdout=self.out, stderr=subprocess.STDOUT)
        # running, and through some opens, before the scenario does anything
        wait_for(lambda: self.opens() >= 200, timeout=60, interval=0.05)

    def text(self):
        with open(self.path) as f:
            return f.read()

    def opens(self):
        counts = [int(line.split()[1]) for line in self.text().splitlines() if line.startswith("N ")]
        return counts[-1] if counts else 0

    def stop(self, settle_opens=300):
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


with Scenario() as sc:
    expect_nvsymlinkd(sc)
    load_fake_driver()
    gpu0 = mknod("/dev/nvidia0", 195, 0)
    ok, _ = wait_for(lambda: os.path.realpath(LINK) == gpu0.path, timeout=15)
    sc.check(f"nvsymlinkd made {LINK}", bool(ok))
    ctr = start_gpu_container("gpu-s07", [gpu0])
    allow = unit_property(ctr.scope, "DeviceAllow")
    sc.check(f"{ctr.scope} DeviceAllow has {LINK} rw", f"{LINK} rw" in allow, ", ".join(allow.splitlines()))
    sc.expect_open(ctr, "/dev/nvidia0", "OK", "at start")

    # 1. control: the same steps with nvsymlinkd stopped lose the device
    sh("systemctl", "stop", "nvsymlinkd.service", timeout=120)
    poller = Poller(ctr, "control")
    gap, took = unlink_then_reload()
    denied, opens = poller.stop()
    sc.timing("control_unlink_to_reload_call_s", gap)
    sc.check("control (nvsymlinkd stopped): the poller saw denied opens after unlink + reload", denied > 0,
             f"{denied} of {opens} opens denied; Reload() sent {gap * 1000:.1f} ms after the unlink")
    sc.expect_open(ctr, "/dev/nvidia0", "EPERM", "control: after the reload without the link")

    # 2. back to a good state: the link, a reload to re-apply the scope
    make_char_link(gpu0)
    daemon_reload()
    sc.expect_open(ctr, "/dev/nvidia0", "OK", "after the link was put back and another reload")
    sh("systemctl", "start", "nvsymlinkd.service", timeout=120)
    ok, _ = wait_for(nvsymlinkd_unit_active, timeout=60)
    sc.check("nvsymlinkd.service active again", bool(ok))

    # 3. with nvsymlinkd: nothing lost
    rounds = [("reload-call", unlink_then_reload)] * ROUNDS + [("systemctl", unlink_then_systemctl)]
    for i, (how, step) in enumerate(rounds):
        poller = Poller(ctr, f"{i}")
        gap, took = step()
        back, waited = wait_for(lambda: os.path.realpath(LINK) == gpu0.path, timeout=15)
        denied, opens = poller.stop()
        sc.timing(f"round{i}_{how}_unlink_to_reload_s", gap)
        sc.check(f"round {i} ({how}): no denied open while the link was removed and systemd reloaded",
                 denied == 0, f"{denied} of {opens} opens denied; reload sent {gap * 1000:.1f} ms after "
                 f"the unlink, finished after {took:.2f} s")
        sc.check(f"round {i}: {LINK} is back", bool(back), f"checked {waited:.2f} s after the reload")
        sc.expect_open(ctr, "/dev/nvidia0", "OK", f"round {i}: after the reload")
    sc.check("nvsymlinkd.service still active", nvsymlinkd_unit_active())
