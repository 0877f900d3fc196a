# vm: nvsymlinkd=off packages=upgrade timeout=1500 hierarchies=v2,v1 matrix=full
"""Scenario 16: installing, upgrading, reinstalling, removing, purging and installing the package again
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
import glob
import json
import os
import re
import shutil
import subprocess
import tarfile
import time

from stacks import (
    POLL_ARGV,
    POLL_LOG,
    V1_WINDOW_BOUND_S,
    Events,
    PollLog,
    build_rootfs_tar,
    hierarchy,
)
from vmguest import (
    WORK,
    Container,
    Scenario,
    _cgroup_rule,
    _device_spec,
    daemon_reload,
    load_fake_driver,
    mknod,
    sh,
    unit_property,
    wait_for,
)

DEBS = "/mnt/run/debs"
PKGS = "/root/nvsymlinkd-pkgs"
LINK = "/dev/char/195:0"
UNIT = "nvsymlinkd.service"
# an operator's shell: not the runner's PYTHONPATH (the 9p source tree), or the scripts' `nvsymlinkd`
# would import the source instead of the installed package
OPERATOR_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
STEPS = ("install", "upgrade", "reinstall", "remove", "purge", "again")
PREVENT_BLOCK = re.compile(r"^# nvsymlinkd-prevent:.*?^# end nvsymlinkd-prevent\n", re.M | re.S)


def operator(*argv, timeout=300):
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, cwd=PKGS,
                          env=dict(OPERATOR_ENV, DEBIAN_FRONTEND="noninteractive"))


def without_prevention(deb: str, dest: str) -> str:
    """The package with its maintainer scripts less the prevention step: the scripts before issue 25."""
    tree = os.path.join(WORK, "repack-" + os.path.basename(deb))
    shutil.rmtree(tree, ignore_errors=True)
    sh("dpkg-deb", "-R", deb, tree)
    cut = 0
    for script in ("postinst", "prerm"):
        path = os.path.join(tree, "DEBIAN", script)
        with open(path) as f:
            text = f.read()
        stripped, n = PREVENT_BLOCK.subn("", text)
        cut += n
        with open(path, "w") as f:
            f.write(stripped)
    assert cut == 2, f"{deb}: expected one prevention step in postinst and one in prerm, cut {cut}"
    sh("dpkg-deb", "-b", tree, dest, timeout=120)
    return dest


class Polled(Container):
    """A runc container in runc-<name>.scope whose PID 1 is gpupoll (its log in its own rootfs)."""

    def __init__(self, name: str, nodes):
        bundle = os.path.join(WORK, "bundles", name)
        rootfs = os.path.join(bundle, "rootfs")
        os.makedirs(rootfs, exist_ok=True)
        with tarfile.open(build_rootfs_tar()) as tar:
            tar.extractall(rootfs)
        sh("runc", "spec", cwd=bundle)
        with open(os.path.join(bundle, "config.json")) as f:
            spec = json.load(f)
        spec["root"] = {"path": rootfs, "readonly": False}
        spec["process"]["terminal"] = False
        spec["process"]["args"] = list(POLL_ARGV)
        linux = spec["linux"]
        linux["cgroupsPath"] = f"system.slice:runc:{name}"
        linux["devices"] = [_device_spec(n) for n in nodes]
        linux.setdefault("resources", {}).setdefault("devices", [{"allow": False, "access": "rwm"}])
        linux["resources"]["devices"] += [_cgroup_rule(n) for n in nodes]
        with open(os.path.join(bundle, "config.json"), "w") as f:
            json.dump(spec, f, indent=1)
        runc_log = os.path.join(WORK, f"{name}.runc.log")
        output = os.path.join(WORK, f"{name}.out")
        with open(output, "w") as out:
            proc = subprocess.run(["runc", "--systemd-cgroup", "--log", runc_log, "--log-format", "text", "run",
                                   "--detach", "--bundle", bundle, name], stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=out, timeout=60)
        super().__init__(name, bundle, runc_log, output)
        if proc.returncode != 0:
            raise RuntimeError(f"runc run {name} exited {proc.returncode}: {self.runc_log()[-2000:]}")
        self.log_path = rootfs + POLL_LOG
        wait_for(lambda: self.poll().last_alive, timeout=30, interval=0.1)

    def poll(self) -> PollLog:
        try:
            with open(self.log_path) as f:
                return PollLog.parse(f.read())
        except OSError:
            return PollLog()

    def skipped_for_systemd(self) -> bool:
        return "skipping device /dev/char/195:0 for systemd" in self.runc_log()


def frozen_scopes() -> list:
    if hierarchy() == "v1":
        states = glob.glob("/sys/fs/cgroup/freezer/system.slice/runc-*.scope/freezer.state")
        return [p for p in states if open(p).read().strip() != "THAWED"]
    return [p for p in glob.glob("/sys/fs/cgroup/system.slice/runc-*.scope/cgroup.freeze")
            if open(p).read().strip() != "0"]


def package_step(step: str, deb_for: dict) -> "subprocess.CompletedProcess":
    if step in ("install", "upgrade", "reinstall", "again"):
        return operator("dpkg", "-i", deb_for[step])
    return operator("apt", "-y", step, "nvsymlinkd")


def run_sequence(sc, phase: str, deb_for: dict, gpu0, events: Events, control: bool) -> dict:
    """The six steps; returns {step: {container name: denied opens in that step}} and checks each."""
    containers, denied = [], {}
    for step in STEPS:
        installed = operator("dpkg-query", "-W", "-f=${Status}", "nvsymlinkd").stdout.startswith("install ok")
        if installed:
            operator("systemctl", "stop", UNIT)  # nothing but the scripts may protect the new container
        ctr = None
        if step != "purge":  # (after a remove nvsymlinkd is not there: a container made at risk then is no
            # business of the package's; the purge itself reloads nothing)
            if os.path.lexists(LINK):
                os.unlink(LINK)  # as on a node that never had nvsymlinkd, or after a reboot
            ctr = Polled(f"{phase}-{step}", [gpu0])
            containers.append(ctr)
            sc.check(f"{phase} {step}: {ctr.name} created while {LINK} was missing: runc left it out of the scope",
                     ctr.skipped_for_systemd() and "/dev/char/195:0" not in unit_property(ctr.scope, "DeviceAllow"),
                     unit_property(ctr.scope, "DeviceAllow"))
        start = time.time()
        proc = events.run(f"{phase} {step}", package_step, step, deb_for)
        sc.fact(f"{phase}_{step}_output", (proc.stdout + proc.stderr)[-2500:])
        sc.timing(f"{phase}_{step}_s", time.time() - start)
        sc.check(f"{phase} {step}: exits 0", proc.returncode == 0, (proc.stdout + proc.stderr)[-600:])
        events.run(f"{phase} {step}: the operator's daemon-reload", daemon_reload)
        time.sleep(1.5)  # a denial after the reload has time to show in every poller
        end = time.time()
        counts = {}
        for c in containers:
            log = c.poll()
            counts[c.name] = sum(1 for t, _ in log.denied if start <= t <= end)
        denied[step] = counts
        sc.fact(f"{phase}_{step}_denied_opens", counts)
        if control:
            if ctr is not None:
                # a loss, not a v1 re-apply window: still denied, or denied longer than any such window (the
                # daemon the install or upgrade started may have given it back since)
                log = ctr.poll()
                windows = [round(d, 2) for t, d, _ in log.windows if start <= t <= end]
                sc.check(f"control {step}: the package's daemon-reload took {ctr.name}'s GPU",
                         log.open_window is not None or any(d >= V1_WINDOW_BOUND_S for d in windows),
                         f"closed windows {windows} s; {log.summary()}")
        else:
            judge_step(sc, f"{phase} {step}", containers, start, end, events)
        sc.check(f"{phase} {step}: nothing left frozen", not frozen_scopes() and not glob.glob(
            "/run/nvsymlinkd/frozen/*.json"), f"{frozen_scopes()} {glob.glob('/run/nvsymlinkd/frozen/*')}")
        if step == "purge":
            sc.check(f"{phase} purge: /run/nvsymlinkd is gone", not os.path.exists("/run/nvsymlinkd"))
    return {"containers": containers, "denied": denied}


def judge_step(sc, what: str, containers, start: float, end: float, events: Events) -> None:
    for c in containers:
        log = c.poll()
        in_step = [(t, e) for t, e in log.denied if start <= t <= end]
        if hierarchy() == "v2":
            sc.check(f"{what}: {c.name} zero denied opens", bool(log.last_alive) and not in_step,
                     f"{len(in_step)} denied in the step; {log.summary()}")
            continue
        windows = [(t, d) for t, d, _ in log.windows if start <= t <= end]
        stray = [(round(t, 3), round(d, 3)) for t, d in windows if events.at(t) is None]
        long_ = [(round(t, 3), round(d, 3)) for t, d in windows if d >= V1_WINDOW_BOUND_S]
        sc.check(f"{what}: {c.name} only systemd's v1 re-apply windows (closed, < "
                 f"{V1_WINDOW_BOUND_S * 1000:.0f} ms, during a reload)",
                 bool(log.last_alive) and log.open_window is None and not stray and not long_,
                 f"{len(in_step)} denied in the step; {log.summary()}; outside events {stray}; too long {long_}")


with Scenario() as sc:
    wall = time.monotonic()
    os.makedirs(PKGS, exist_ok=True)
    debs = sorted(os.listdir(DEBS), key=lambda n: [int(x) for x in re.findall(r"\d+", n.split("_")[1])])
    sc.check("two packages of the same source to install and upgrade to", len(debs) == 2, str(debs))
    old_deb, new_deb = (shutil.copy(os.path.join(DEBS, n), os.path.join(PKGS, n)) for n in debs)
    sc.fact("hierarchy", hierarchy())
    load_fake_driver()
    gpu0 = mknod("/dev/nvidia0", 195, 0)
    mknod("/dev/nvidiactl", 195, 255)
    events = Events()

    # ---- the control: the same packages, their scripts without the prevention step
    old_ctl = without_prevention(old_deb, os.path.join(PKGS, "control-" + os.path.basename(old_deb)))
    new_ctl = without_prevention(new_deb, os.path.join(PKGS, "control-" + os.path.basename(new_deb)))
    t0 = time.monotonic()
    control = run_sequence(sc, "control", {"install": old_ctl, "upgrade": new_ctl, "reinstall": new_ctl,
                                           "again": new_ctl}, gpu0, events, control=True)
    sc.timing("control_sequence_s", time.monotonic() - t0)
    operator("apt", "-y", "purge", "nvsymlinkd")
    for c in control["containers"]:
        c.delete()

    # ---- the proof: the packages as built
    t0 = time.monotonic()
    proof = run_sequence(sc, "proof", {"install": old_deb, "upgrade": new_deb, "reinstall": new_deb,
                                       "again": new_deb}, gpu0, events, control=False)
    sc.timing("proof_sequence_s", time.monotonic() - t0)
    for c in proof["containers"]:
        sc.fact(f"{c.name}_poll", c.poll().summary())
    sc.check("proof: every container can still open its GPU at the end", all(
        not c.poll().lost and c.poll().last_alive for c in proof["containers"]))
    sc.check("proof: the postinst said what it prevented", "added to DeviceAllow before a reload took it"
             in sc.facts.get("proof_install_output", ""), sc.facts.get("proof_install_output", "")[-800:])
    for c in proof["containers"]:
        c.delete()
    sc.timing("scenario_wall_s", time.monotonic() - wall)
