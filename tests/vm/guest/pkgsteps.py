"""The package's own life cycle on a node with running GPU containers (issue 25): s23 and s25.

    from tests.vm.guest.pkgsteps import PackageSteps, Polled, without_prevention
    steps = PackageSteps(sc, events)
    steps.run("proof", debs, make_containers, control=False)

Each step (install, upgrade, reinstall, remove, purge, again) is run the way an operator does it
(dpkg -i, apt remove/purge), then one daemon-reload of the operator's; before it, new containers are
made by the scenario's `make` (at risk: the daemon stopped, /dev/char links gone), and every
container's gpupoll log is judged over the step: v2 zero denied opens, v1 only systemd's re-apply
windows. The control is the same with the packages repacked without the scripts' prevention step.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import tarfile
import time
from typing import Callable, Dict

from tests.vm.guest.stacks import (
    POLL_ARGV,
    POLL_LOG,
    V1_WINDOW_BOUND_S,
    Events,
    PollLog,
    build_rootfs_tar,
    hierarchy,
)
from tests.vm.guest.vmguest import (
    WORK,
    Container,
    cgroup_rule,
    daemon_reload,
    device_spec,
    sh,
    wait_for,
)

PKGS = "/root/nvsymlinkd-pkgs"
BUNDLES = "/var/lib/vmtest/bundles"
UNIT = "nvsymlinkd.service"
# an operator's shell: not the runner's PYTHONPATH (the 9p source tree), or the scripts' `nvsymlinkd`
# would import the source instead of the installed package
OPERATOR_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
STEPS = ("install", "upgrade", "reinstall", "remove", "purge", "again")
PREVENT_BLOCK = re.compile(r"^# nvsymlinkd-prevent:.*?^# end nvsymlinkd-prevent\n", re.M | re.S)


def operator(*argv, timeout=300) -> subprocess.CompletedProcess:
    os.makedirs(PKGS, exist_ok=True)
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, cwd=PKGS,
                          env=dict(OPERATOR_ENV, DEBIAN_FRONTEND="noninteractive"))


def the_debs(debs_dir: str = "/mnt/run/debs") -> tuple:
    """(V, V+1) as the operator copied them."""
    os.makedirs(PKGS, exist_ok=True)
    names = sorted(os.listdir(debs_dir), key=lambda n: [int(x) for x in re.findall(r"\d+", n.split("_")[1])])
    return tuple(shutil.copy(os.path.join(debs_dir, n), os.path.join(PKGS, n)) for n in names)


def without_prevention(deb: str) -> str:
    """The package with its maintainer scripts less the prevention step: the scripts before issue 25."""
    dest = os.path.join(PKGS, "control-" + os.path.basename(deb))
    tree = os.path.join(WORK, "repack-" + os.path.basename(deb))
    shutil.rmtree(tree, ignore_errors=True)
    os.makedirs(WORK, exist_ok=True)
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
    if cut != 2:
        raise RuntimeError(f"{deb}: expected one prevention step in postinst and one in prerm, cut {cut}")
    sh("dpkg-deb", "-b", tree, dest, timeout=120)
    return dest


class Polled(Container):
    """A runc container in runc-<name>.scope whose PID 1 is gpupoll (its log read from its own rootfs).
    nodes: in the spec (linux.devices and the rules); hook_grants: none of that, the legacy NVIDIA prestart
    hook makes and grants them (NVIDIA_VISIBLE_DEVICES=visible), never the spec; args: its process (gpupoll's)."""

    shape = "runc"

    def __init__(self, name: str, nodes=(), hook_grants=(), visible: str = "all", args=POLL_ARGV):
        bundle = os.path.join(BUNDLES, name)  # not under /run: noexec
        rootfs = os.path.join(bundle, "rootfs")
        os.makedirs(rootfs, exist_ok=True)
        with tarfile.open(build_rootfs_tar()) as tar:
            tar.extractall(rootfs)
        sh("runc", "spec", cwd=bundle)
        with open(os.path.join(bundle, "config.json")) as f:
            spec = json.load(f)
        spec["root"] = {"path": rootfs, "readonly": False}
        spec["process"]["terminal"] = False
        spec["process"]["args"] = list(args)
        linux = spec["linux"]
        linux["cgroupsPath"] = f"system.slice:runc:{name}"
        linux["devices"] = [device_spec(n) for n in nodes]  # the hook makes its own nodes
        linux.setdefault("resources", {}).setdefault("devices", [{"allow": False, "access": "rwm"}])
        linux["resources"]["devices"] += [cgroup_rule(n) for n in nodes]
        if hook_grants:
            # the legacy NVIDIA hook as a runtime wrapper adds it: prestart, granting what
            # NVIDIA_VISIBLE_DEVICES asks for (stacks.install_nvidia_toolkit puts it at HOOK)
            from tests.vm.guest.stacks import HOOK

            spec["process"]["env"].append(f"NVIDIA_VISIBLE_DEVICES={visible}")
            spec.setdefault("hooks", {})["prestart"] = [{"path": HOOK, "args": [HOOK, "prestart"]}]
            self.shape = "runc+hook"
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

    def remove(self) -> None:
        self.delete()


class StackPolled:
    """A stacks.StackContainer (Docker, containerd, Podman) with the same poll() as Polled."""

    def __init__(self, ctr, shape: str):
        self.ctr, self.name, self.shape = ctr, ctr.name, shape
        ctr.wait_polling(timeout=60)

    def poll(self) -> PollLog:
        return self.ctr.poll_log()


def frozen() -> list:
    """Container cgroups left frozen (v1 freezer.state, v2 cgroup.freeze) and freeze records left, read while
    holding the repair lock (STATE_DIR/repair.lock, docs/repair.md): a repair in flight (the daemon's, on
    v1 with the systemd driver) has its container frozen and its record written until it thaws, and
    holds the lock all that time; what is left once the lock is free is left for good."""
    import fcntl

    lock = "/run/nvsymlinkd/repair.lock"
    fd = os.open(lock, os.O_RDWR) if os.path.exists(lock) else None
    try:
        if fd is not None:
            deadline = time.monotonic() + 60
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        return [f"{lock} held for 60 s"]
                    time.sleep(0.1)
        return _frozen_now()
    finally:
        if fd is not None:
            os.close(fd)


def _frozen_now() -> list:
    if hierarchy() == "v1":
        states = glob.glob("/sys/fs/cgroup/freezer/system.slice/*.scope/freezer.state")
        left = [p for p in states if open(p).read().strip() != "THAWED"]
    else:
        left = [p for p in glob.glob("/sys/fs/cgroup/system.slice/*.scope/cgroup.freeze")
                if open(p).read().strip() != "0"]
    return left + glob.glob("/run/nvsymlinkd/frozen/*.json")


def unlink_nvidia_links() -> None:
    """/dev/char without NVIDIA links, as on a node that never had nvsymlinkd, or after a reboot."""
    for link in glob.glob("/dev/char/*"):
        if os.path.islink(link) and "nvidia" in os.readlink(link):
            os.unlink(link)


class PackageSteps:
    def __init__(self, sc, events: Events):
        self.sc, self.events = sc, events

    def step(self, step: str, debs: Dict[str, str]) -> subprocess.CompletedProcess:
        if step in ("install", "upgrade", "reinstall", "again"):
            return operator("dpkg", "-i", debs[step])
        return operator("apt", "-y", step, "nvsymlinkd")

    def run(self, phase: str, debs: Dict[str, str], make: Callable[[str, str], list], control: bool) -> list:
        """The six steps. make(phase, step) -> the new containers made at risk before the step (not
        before purge: with nvsymlinkd removed a container made at risk then is no business of the
        package's, and a purge reloads nothing). Returns every container made."""
        sc, containers = self.sc, []
        for step in STEPS:
            installed = operator("dpkg-query", "-W", "-f=${Status}", "nvsymlinkd").stdout.startswith("install ok")
            if installed:
                operator("systemctl", "stop", UNIT)  # nothing but the scripts may protect the new containers
            new = []
            if step != "purge":
                unlink_nvidia_links()
                made_at = time.monotonic()
                new = make(phase, step)
                sc.timing(f"{phase}_{step}_containers_made_s", time.monotonic() - made_at)
                containers += new
            if installed:  # what the scripts about to run say, and what nvsymlinkd sees now
                scripts = operator("grep", "-c", "nvsymlinkd repair --before-reload",
                                   "/var/lib/dpkg/info/nvsymlinkd.postinst", "/var/lib/dpkg/info/nvsymlinkd.prerm")
                sc.fact(f"{phase}_{step}_installed_scripts_prevent", scripts.stdout.split())
                seen = operator("nvsymlinkd", "check", "--json")
                try:
                    sc.fact(f"{phase}_{step}_verdicts_before", {c["id"]: c["verdict"] for c in
                                                                json.loads(seen.stdout)["containers"]})
                except (ValueError, KeyError):
                    sc.fact(f"{phase}_{step}_verdicts_before", (seen.stdout + seen.stderr)[-500:])
            start = time.time()
            proc = self.events.run(f"{phase} {step}", self.step, step, debs)
            said = operator("journalctl", "--no-pager", "-o", "short-monotonic", "-t", "nvsymlinkd",
                            f"--since=@{int(start)}")
            sc.fact(f"{phase}_{step}_journal", said.stdout[-3000:])
            sc.fact(f"{phase}_{step}_output", (proc.stdout + proc.stderr)[-3000:])
            sc.timing(f"{phase}_{step}_s", time.time() - start)
            sc.check(f"{phase} {step}: exits 0", proc.returncode == 0, (proc.stdout + proc.stderr)[-600:])
            self.events.run(f"{phase} {step}: the operator's daemon-reload", daemon_reload)
            time.sleep(1.5)  # a denial after the reload has time to show in every poller
            end = time.time()
            logs = {c.name: c.poll() for c in containers}
            sc.fact(f"{phase}_{step}_denied_opens",
                    {n: sum(1 for t, _ in log.denied if start <= t <= end) for n, log in logs.items()})
            if control:
                for c in new:
                    self.judge_lost(f"control {step}", c, logs[c.name], start, end)
            else:
                for c in containers:
                    self.judge_kept(f"{phase} {step}", c, logs[c.name], start, end)
            left = frozen()
            sc.check(f"{phase} {step}: nothing left frozen, no freeze record", not left, str(left))
            if step == "purge":
                sc.check(f"{phase} purge: /run/nvsymlinkd is gone", not os.path.exists("/run/nvsymlinkd"))
        return containers

    def judge_lost(self, what: str, c, log: PollLog, start: float, end: float) -> None:
        """A loss, not a v1 re-apply window: still denied, or denied longer than any such window (the
        daemon the install or upgrade started may have given it back since)."""
        windows = [round(d, 2) for t, d, _ in log.windows if start <= t <= end]
        self.sc.check(f"{what}: the package's daemon-reload took {c.name}'s GPU ({c.shape})",
                      log.open_window is not None or any(d >= V1_WINDOW_BOUND_S for d in windows),
                      f"closed windows {windows} s; {log.summary()}")

    def judge_kept(self, what: str, c, log: PollLog, start: float, end: float) -> None:
        in_step = [(t, e) for t, e in log.denied if start <= t <= end]
        if hierarchy() == "v2":
            self.sc.check(f"{what}: {c.name} ({c.shape}) zero denied opens", bool(log.last_alive) and not in_step,
                          f"{len(in_step)} denied in the step; {log.summary()}")
            return
        windows = [(t, d) for t, d, _ in log.windows if start <= t <= end]
        stray = [(round(t, 3), round(d, 3)) for t, d in windows if self.events.at(t) is None]
        long_ = [(round(t, 3), round(d, 3)) for t, d in windows if d >= V1_WINDOW_BOUND_S]
        self.sc.check(f"{what}: {c.name} ({c.shape}) only systemd's v1 re-apply windows (closed, < "
                      f"{V1_WINDOW_BOUND_S * 1000:.0f} ms, during a reload)",
                      bool(log.last_alive) and log.open_window is None and not stray and not long_,
                      f"{len(in_step)} denied in the step; {log.summary()}; outside events {stray}; "
                      f"too long {long_}")
