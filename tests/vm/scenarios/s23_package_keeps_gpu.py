# vm: nvsymlinkd=off packages=upgrade timeout=2400 hierarchies=v2,v1 matrix=full
"""Scenario 23: installing, upgrading, reinstalling, removing, purging and installing the package again
takes no GPU from a running container (issue 25).

Before each step a new GPU container is made at risk the way it happens on real nodes: its spec names
/dev/nvidia0, but /dev/char/195:0 is missing when runc creates it (a node without nvsymlinkd; later,
with the daemon stopped and the link gone), so runc 1.1.5 leaves the rule out of its systemd scope and
the next daemon-reload takes the device. Every container runs gpupoll (open(O_RDWR) of /dev/nvidia0
every 10 ms, /dev/null as control) from its start to the end, so a denial in any step shows.

The steps, each followed by one daemon-reload of the operator's (the entries must stay in the scopes):
  install    dpkg -i nvsymlinkd_V_all.deb on a node without nvsymlinkd
  upgrade    dpkg -i nvsymlinkd_V+1_all.deb (the daemon stopped first, so only the scripts can help)
  reinstall  dpkg -i nvsymlinkd_V+1_all.deb again (likewise)
  remove     apt remove nvsymlinkd (likewise; postrm's reload runs without nvsymlinkd)
  purge      apt purge nvsymlinkd (no reload; the state directory goes)
  again      dpkg -i nvsymlinkd_V+1_all.deb (a node without nvsymlinkd again; the link removed, as a
             reboot does)

The control runs the same steps first, with the same two packages repacked without the maintainer
scripts' prevention step (the scripts as they were before issue 25): each step's new container loses
its GPU to the package's reload, except purge (no reload). Then the proof, on fresh containers.
Verdict: cgroup v2, zero denied opens in every container through every step; cgroup v1, only systemd's
own re-apply windows (each closed by itself, shorter than 250 ms, during a reload: stacks.judge_poll).
Nothing is left frozen, /run/nvsymlinkd/frozen is empty, the state directory is gone after the purge.
"""

import time

from tests.vm.guest.pkgsteps import PackageSteps, Polled, operator, the_debs, without_prevention
from tests.vm.guest.stacks import Events, hierarchy
from tests.vm.guest.vmguest import Scenario, load_fake_driver, mknod, unit_property

with Scenario() as sc:
    wall = time.monotonic()
    old_deb, new_deb = the_debs()
    sc.fact("hierarchy", hierarchy())
    load_fake_driver()
    gpu0 = mknod("/dev/nvidia0", 195, 0)
    mknod("/dev/nvidiactl", 195, 255)

    def make(phase, step):
        ctr = Polled(f"{phase}-{step}", nodes=[gpu0])
        allowed = unit_property(ctr.scope, "DeviceAllow")
        sc.check(f"{phase} {step}: {ctr.name} created while /dev/char/195:0 was missing: runc left it out of "
                 "its scope", ctr.skipped_for_systemd() and "/dev/char/195:0" not in allowed, allowed)
        return [ctr]

    events = Events()
    steps = PackageSteps(sc, events)
    t0 = time.monotonic()
    control = steps.run("control", {"install": without_prevention(old_deb), "upgrade": without_prevention(new_deb),
                                    "reinstall": without_prevention(new_deb), "again": without_prevention(new_deb)},
                        make, control=True)
    sc.timing("control_sequence_s", time.monotonic() - t0)
    operator("apt", "-y", "purge", "nvsymlinkd")
    for c in control:
        c.remove()

    t0 = time.monotonic()
    proof = steps.run("proof", {"install": old_deb, "upgrade": new_deb, "reinstall": new_deb, "again": new_deb},
                      make, control=False)
    sc.timing("proof_sequence_s", time.monotonic() - t0)
    for c in proof:
        sc.fact(f"{c.name}_poll", c.poll().summary())
    sc.check("proof: the postinst said what it prevented", "added to DeviceAllow before a reload took it"
             in sc.facts.get("proof_install_output", ""), sc.facts.get("proof_install_output", "")[-800:])
    operator("apt", "-y", "purge", "nvsymlinkd")
    for c in proof:
        c.remove()
    sc.timing("scenario_wall_s", time.monotonic() - wall)
