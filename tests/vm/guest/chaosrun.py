"""The chaos soak's I/O in the guest (issue 17): the containers of every stack, the steps, and
what the invariant judges of chaos.py are fed. The kernel is the judge: a poller's denied opens
(gpupoll, in each GPU container), and an open() of each NVIDIA node made by a process moved into
each container's cgroup (the device cgroup decides by the opener's cgroup, nothing else), with
nvsymlinkd's own access engine read on the same cgroup beside it.

    soak = Soak(sc); soak.setup()
    for seed in seeds: soak.run_sequence(seed, chaos.draw_sequence(seed))
    soak.finish()
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from nvsymlinkd.access.cgroup import read_access
from nvsymlinkd.access.rules import ALLOW
from nvsymlinkd.host.devices import RW, Device
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.messageids import MESSAGE_IDS
from tests.vm.guest import chaos
from tests.vm.guest.stacks import (
    IDLE,
    IMAGE,
    POLL_LOG,
    Containerd,
    Docker,
    Podman,
    PollLog,
    build_rootfs_tar,
    install_nvidia_toolkit,
    publish_gpu_list,
)
from tests.vm.guest.vmguest import (
    MODULES,
    SRC,
    WORK,
    daemon_reexec,
    daemon_reload,
    journal,
    journal_cursor,
    load_fake_driver,
    mknod,
    proc_devices_majors,
    sh,
    unit_property,
    wait_for,
)

HOOK_LOG = "/run/vmtest/nvidia-hook.log"
CONFIG = "/etc/nvsymlinkd/nvsymlinkd.toml"
FOREIGN_LINK = "10:250"          # planted by hand: nvsymlinkd must leave it alone
FILL = "/run/chaos-fill"
RUNC_ROOTFS = "/var/lib/vmtest/chaos-rootfs"
UNIT = "nvsymlinkd.service"
BPFDROP = os.path.join(SRC, "tests", "bpfdrop.py")


def unified() -> bool:
    return os.path.exists("/sys/fs/cgroup/cgroup.controllers")


def nvidia_nodes() -> Dict[str, chaos.Dev]:
    """The NVIDIA char nodes in /dev now: {path: (major, minor)}."""
    out = {}
    for name in os.listdir("/dev"):
        if not name.startswith("nvidia"):
            continue
        try:
            st = os.lstat("/dev/" + name)
        except FileNotFoundError:
            continue
        if stat.S_ISCHR(st.st_mode):
            out["/dev/" + name] = (os.major(st.st_rdev), os.minor(st.st_rdev))
    return out


def dev_char_entries() -> Dict[str, str]:
    out = {}
    for name in os.listdir("/dev/char"):
        try:
            out[name] = os.readlink("/dev/char/" + name)
        except OSError:
            out[name] = ""
    return out


def proc_cgroups(pid: int) -> Dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def cgroup_opens(pid: int, paths: List[str]) -> Dict[str, str]:
    """open(path, O_RDWR) of each path by a child moved into pid's (device) cgroup: "OK" or the
    errno name. The kernel's own verdict for that cgroup, without an exec in the container."""
    groups = proc_cgroups(pid)
    procs = (f"/sys/fs/cgroup{groups['']}/cgroup.procs" if unified()
             else f"/sys/fs/cgroup/devices{groups['devices']}/cgroup.procs")
    rd, wr = os.pipe()
    child = os.fork()
    if child == 0:      # pragma: no cover - the child
        os.close(rd)
        result = {}
        try:
            with open(procs, "w") as f:
                f.write("0")
            for p in paths:
                try:
                    os.close(os.open(p, os.O_RDWR | os.O_CLOEXEC))
                    result[p] = "OK"
                except OSError as e:
                    result[p] = errno.errorcode.get(e.errno, str(e.errno))
        except OSError as e:
            result = {p: f"JOIN-{errno.errorcode.get(e.errno, e.errno)}" for p in paths}
        os.write(wr, json.dumps(result).encode())
        os._exit(0)
    os.close(wr)
    data = b""
    while True:
        chunk = os.read(rd, 65536)
        if not chunk:
            break
        data += chunk
    os.close(rd)
    os.waitpid(child, 0)
    return json.loads(data or b"{}")


def engine_verdicts(pid: int, devs: List[chaos.Dev]) -> Dict[chaos.Dev, str]:
    """nvsymlinkd's access engine (devices.list or the BPF programs, evaluated) on pid's cgroup."""
    groups = proc_cgroups(pid)
    policy = read_access(HostRoot("/"), None if unified() else groups.get("devices"),
                         groups.get("") if unified() else None)
    return {d: policy.check(Device.char(d[0], d[1]), RW).state for d in devs}


# ---------------------------------------------------------------- containers

@dataclass
class Ctr:
    slot: str
    name: str
    id: str
    pid: int
    role: str                       # gpu, plain, rogue
    grant: set = field(default_factory=set)
    spec_path: str = ""
    log_text: str = ""              # the poll log, as last read (kept once the container is gone)

    def poll_log(self) -> PollLog:
        try:
            with open(f"/proc/{self.pid}/root{POLL_LOG}") as f:
                self.log_text = f.read()
        except OSError:
            pass
        return PollLog.parse(self.log_text)


class RuncPlain:
    """Plain runc, the devices in the spec (no hook): with the systemd cgroup driver (runc-spec), or with
    its cgroupfs driver (runc-cgroupfs, issue 28: cgroupsPath /chaos/<name>, outside systemd's units; on
    cgroup v2 its device program is runc's own, which only the bpf-program repair gives back)."""

    def ensure_rootfs(self) -> None:
        if not os.path.exists(os.path.join(RUNC_ROOTFS, "bin", "gpupoll")):
            os.makedirs(RUNC_ROOTFS, exist_ok=True)
            with tarfile.open(build_rootfs_tar()) as tar:
                tar.extractall(RUNC_ROOTFS)

    def run(self, name: str, systemd: bool = True) -> tuple:
        self.ensure_rootfs()
        bundle = os.path.join(WORK, "chaos-bundles", name)
        os.makedirs(bundle, exist_ok=True)
        sh("runc", "spec", cwd=bundle)
        path = os.path.join(bundle, "config.json")
        with open(path) as f:
            spec = json.load(f)
        spec["root"] = {"path": RUNC_ROOTFS, "readonly": True}
        spec["process"]["terminal"] = False
        spec["process"]["args"] = ["/bin/gpupoll", "/dev/nvidia0", POLL_LOG]
        spec["mounts"].append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                               "options": ["nosuid", "nodev", "mode=1777"]})
        nodes = {p: d for p, d in nvidia_nodes().items() if p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm")}
        linux = spec["linux"]
        linux["cgroupsPath"] = f"system.slice:runc:{name}" if systemd else f"/chaos/{name}"
        linux["devices"] = [{"path": p, "type": "c", "major": d[0], "minor": d[1], "fileMode": 0o666,
                             "uid": 0, "gid": 0} for p, d in nodes.items()]
        linux.setdefault("resources", {})["devices"] = (
            [{"allow": False, "access": "rwm"}]
            + [{"allow": True, "type": "c", "major": d[0], "minor": d[1], "access": "rw"} for d in nodes.values()])
        with open(path, "w") as f:
            json.dump(spec, f)
        with open(os.path.join(WORK, f"{name}.out"), "w") as out:
            proc = subprocess.run(["runc"] + (["--systemd-cgroup"] if systemd else [])
                                  + ["run", "--detach", "--bundle", bundle, name],
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"runc run {name} exited {proc.returncode}")
        pid = json.loads(sh("runc", "state", name).stdout)["pid"]
        return name, pid, path

    def remove(self, ctr: Ctr) -> None:
        sh("runc", "delete", "--force", ctr.id, check=False, timeout=60)

    def update(self, ctr: Ctr, cpus: str) -> None:
        sh("runc", "--systemd-cgroup", "update", "--cpuset-cpus", cpus, ctr.id, timeout=60)


class Soak:
    def __init__(self, sc, hierarchy: str = "v2"):
        self.sc = sc
        self.docker = Docker()
        self.containerd = Containerd()
        self.podman_runc, self.podman_crun = Podman("runc"), Podman("crun")
        self.runc = RuncPlain()
        self.ctrs: Dict[str, Ctr] = {}
        self.retired: List[Ctr] = []      # removed during the current step (their logs still judged)
        self.generation = 0
        self.foreign: Dict[str, str] = {}
        self.nvidia_majors = {195}
        self.uvm_major = 0
        self.rss_start: Optional[int] = None
        self.resync = 60.0                # the daemon's resync_interval now (its default until a sighup step)
        self.dropped: Optional[tuple] = None   # (container, wall time) of this step's cgroupfs-drop
        self.dropped_last = -1e9          # monotonic time of the last cgroupfs-drop (the repair rate limit)
        self.drop_to_repair: List[float] = []
        self.margins: List[tuple] = []    # (container, seconds its early prevention came before the hook's grant)
        self.records: List[dict] = []
        self.violations: List[str] = []
        self.cursor = ""

    # ------------------------------------------------------------ setup

    def setup(self) -> None:
        t0 = time.monotonic()
        if cmdline_option("chaos_debug") == "1":
            self.debug_daemon()
        majors = load_fake_driver(uvm=True)
        self.uvm_major = majors["nvidia-uvm"]
        self.nvidia_majors.add(self.uvm_major)
        for path, major, minor in (("/dev/nvidia0", 195, 0), ("/dev/nvidiactl", 195, 255),
                                   ("/dev/nvidia-uvm", self.uvm_major, 0)):
            mknod(path, major, minor)
        link = "/dev/char/" + FOREIGN_LINK
        if not os.path.lexists(link):
            os.symlink("../chaos-foreign", link)
        ok, _ = wait_for(lambda: not self.judge_links(), timeout=30, interval=0.2)
        self.sc.check("setup: /dev/char has the three NVIDIA links", bool(ok), "; ".join(self.judge_links()))
        # the NVIDIA hook's grant is reconstructed (trusted) only with the driver's GPU list: published
        # like s24 does, the unit restarted into it, before any container exists
        self.sc.check("setup: the driver's GPU list is published under /proc/driver/nvidia/gpus", publish_gpu_list())
        sh("systemctl", "restart", UNIT, timeout=120)
        install_nvidia_toolkit()
        self.sc.timing("setup_docker_s", self.docker.start())
        self.sc.timing("setup_containerd_s", self.containerd.start())
        self.sc.timing("setup_podman_s", self.podman_crun.start())
        for slot in chaos.GPU_SLOTS + chaos.PLAIN_SLOTS + (chaos.ROGUE_SLOT, chaos.CGROUPFS_SLOT):
            self.create(slot)
        for ctr in self.ctrs.values():
            if ctr.role == "gpu":
                ok, _ = wait_for(lambda c=ctr: c.poll_log().last_alive, timeout=60, interval=0.5)
                self.sc.check(f"setup: {ctr.name} polls /dev/nvidia0", bool(ok), ctr.poll_log().summary())
        # the initial state is settled: what needs prevention is prevented (the journal says so)
        self.wait_settled(timeout=60)
        ents = {e: t for e, t in dev_char_entries().items()}
        self.foreign = {n: t for n, t in ents.items()
                        if not (n.split(":")[0].isdigit() and int(n.split(":")[0]) in self.nvidia_majors)}
        self.sc.check("setup: the planted foreign link is there", FOREIGN_LINK in self.foreign)
        self.rss_start = self.daemon_rss()
        self.sc.fact("rss_start_kb", self.rss_start)
        self.cursor = journal_cursor()
        self.sc.timing("setup_s", time.monotonic() - t0)

    def debug_daemon(self) -> None:
        """NVSYMLINKD_CHAOS_DEBUG=1: the daemon journals its debug entries (every pass, its reasons
        and its duration), for a replay that must explain a late prevention."""
        dropin = "/run/systemd/system/nvsymlinkd.service.d"
        os.makedirs(dropin, exist_ok=True)
        with open(os.path.join(dropin, "50-chaos-debug.conf"), "w") as f:
            f.write("[Service]\nEnvironment=NVSYMLINKD_DEBUG=1\n")
        daemon_reload()
        sh("systemctl", "restart", UNIT, timeout=120)
        self.sc.fact("daemon_debug", True)

    def wait_settled(self, timeout: float) -> None:
        """Every hook-granted container prevented: `nvsymlinkd check --json` says ok for all."""
        from tests.vm.guest.stacks import check_json

        def settled():
            report = check_json()
            verdicts = {c.get("id"): c.get("verdict") for c in report.get("containers", [])}
            return all(verdicts.get(c.id) == "ok" for c in self.ctrs.values() if c.role == "gpu")
        ok, took = wait_for(settled, timeout=timeout, interval=1.0)
        self.sc.check("setup: every GPU container ok in check --json", bool(ok), f"{took:.1f} s")

    # ------------------------------------------------------------ containers

    def create(self, slot: str) -> Ctr:
        self.generation += 1
        name = f"{slot}-{self.generation}"
        spec_path = ""
        if slot == "docker-gpus":
            c = self.docker.run_gpu(name)
            role = "gpu"
        elif slot == "docker-plain":
            c = self.docker.run_plain(name)
            role = "plain"
        elif slot == chaos.ROGUE_SLOT:
            uvm = self.uvm_major
            cid = sh("docker", "run", "-d", "--name", name, "--network", "none", IMAGE, "/bin/sh", "-c",
                     f"mknod /dev/nvidia0 c 195 0; mknod /dev/nvidia-uvm c {uvm} 0; exec {' '.join(IDLE)}",
                     timeout=120).stdout.strip()
            c, role = type("C", (), {"id": cid, "name": name})(), "rogue"
        elif slot == "containerd-nvidia":
            c = self.containerd.run_gpu(name, k8s=("chaos", name, "cuda"))
            role = "gpu"
        elif slot == "podman-hook":
            c = self.podman_runc.run_gpu(name, "hook")
            role = "gpu"
        elif slot == "podman-cdi":
            c = self.podman_crun.run_gpu(name, "cdi")
            role = "gpu"
        elif slot == "podman-plain":
            c = self.podman_crun.run_plain(name)
            role = "plain"
        elif slot in ("runc-spec", chaos.CGROUPFS_SLOT):
            cid, pid, spec_path = self.runc.run(name, systemd=slot == "runc-spec")
            ctr = Ctr(slot, name, cid, pid, "gpu", spec_path=spec_path)
            ctr.grant = self.grant_of(ctr)
            self.ctrs[slot] = ctr
            return ctr
        else:
            raise ValueError(slot)
        if slot.startswith("docker"):
            pid = int(sh("docker", "inspect", "-f", "{{.State.Pid}}", c.id).stdout)
            spec_path = f"/run/containerd/io.containerd.runtime.v2.task/moby/{c.id}/config.json"
        elif slot.startswith("containerd"):
            pid = self.containerd.init_pid(c)
            spec_path = f"/run/containerd/io.containerd.runtime.v2.task/k8s.io/{c.id}/config.json"
        else:
            got = sh("podman", "inspect", "-f", "{{.State.Pid}} {{.OCIConfigPath}}", c.id).stdout.split()
            pid, spec_path = int(got[0]), got[1]
        ctr = Ctr(slot, name, c.id, pid, role, spec_path=spec_path)
        ctr.grant = self.grant_of(ctr)
        self.ctrs[slot] = ctr
        if role == "gpu":
            self.early_margin(ctr)
        return ctr

    def early_margin(self, ctr: Ctr) -> None:
        """For a hook-granted container: how long before the NVIDIA hook's grant the daemon had written it
        to the new scope's drop-in (its "being created: wrote" entry, journaled once the file was in
        place), in seconds; negative: a reload in between could have taken the grant (the race)."""
        grant_at = None
        try:
            with open(HOOK_LOG) as f:
                for line in f:
                    m = re.match(rf"pid {ctr.pid}: v[12] (?:grant|devices\.allow) \[.*?\].* at ([\d.]+)$", line)
                    if m:
                        grant_at = float(m.group(1))
        except OSError:
            return
        if grant_at is None:
            return
        added = [int(e["__REALTIME_TIMESTAMP"]) / 1e6 for e in journal(unit=UNIT, container_id=ctr.id)
                 if "being created: wrote" in str(e.get("MESSAGE"))]
        self.margins.append((ctr.name, round(grant_at - added[0], 3) if added else None))

    def grant_of(self, ctr: Ctr) -> set:
        """What the runtime granted (rw): the spec's device rules, plus what the NVIDIA hook wrote
        for this container's init pid (its log line)."""
        devs = list(nvidia_nodes().values())
        try:
            with open(ctr.spec_path) as f:
                rules = json.load(f).get("linux", {}).get("resources", {}).get("devices", [])
        except (OSError, ValueError) as e:
            self.sc.fact(f"{ctr.name}_spec_unreadable", str(e))
            rules = []
        grant = chaos.rules_grant(rules, devs)
        last = ""      # a pid can be reused: the newest line for it is this container's
        try:
            with open(HOOK_LOG) as f:
                for line in f:
                    m = re.match(rf"pid {ctr.pid}: v[12] (?:grant|devices\.allow) (\[.*?\])", line)
                    if m:
                        last = m.group(1)
        except OSError:
            pass
        return grant | {(int(a), int(b)) for a, b in re.findall(r"c (\d+):(\d+) rw", last)}

    def remove(self, slot: str) -> None:
        ctr = self.ctrs.pop(slot)
        ctr.poll_log()
        self.retired.append(ctr)
        if slot.startswith("docker"):
            sh("docker", "rm", "-f", ctr.id, timeout=120)
        elif slot.startswith("containerd"):
            self.containerd.ctr("task", "kill", "-s", "KILL", ctr.id, check=False)
            wait_for(lambda: self.containerd.ctr("task", "delete", ctr.id, check=False).returncode == 0,
                     timeout=30, interval=0.3)
            self.containerd.ctr("containers", "delete", ctr.id, check=False)
        elif slot.startswith("podman"):
            sh("podman", "rm", "-f", "-t", "0", ctr.id, timeout=120)
        else:
            self.runc.remove(ctr)

    def update(self, slot: str, cpus: str) -> None:
        ctr = self.ctrs[slot]
        if slot.startswith("docker"):
            sh("docker", "update", "--cpuset-cpus", cpus, ctr.id, timeout=60)
        elif slot.startswith("containerd"):
            # ctr 1.6 has no `task update`: the shim's path, runc update on containerd's runc root
            self.containerd.update(ctr, cpus)
        elif slot.startswith("podman"):
            sh("podman", "update", "--cpuset-cpus", cpus, ctr.id, timeout=60)
        else:
            self.runc.update(ctr, cpus)

    # ------------------------------------------------------------ steps

    def do(self, step: chaos.Step, seed: int) -> None:
        kind, args = step.kind, step.args
        then_reload = "reload" in args
        if kind == "daemon-reload":
            daemon_reload()
        elif kind == "daemon-reexec":
            daemon_reexec()
        elif kind == "uvm-reload":
            old = self.uvm_major
            os.unlink("/dev/nvidia-uvm")
            sh("rmmod", "nvidia_uvm", timeout=60)
            if then_reload:
                daemon_reload()     # while the node is gone: nothing can keep its rule
            taken = set(proc_devices_majors().values())
            major = old
            if args[0] == "new-major":
                major = next(m for m in range(230, 200, -1) if m not in taken and m != old)
            sh("insmod", os.path.join(MODULES, "nvidia-uvm.ko"), f"major={major}", timeout=60)
            self.uvm_major = proc_devices_majors()["nvidia-uvm"]
            self.nvidia_majors.add(self.uvm_major)
            mknod("/dev/nvidia-uvm", self.uvm_major, 0)
            return
        elif kind == "gpu-node-new":
            minors = [d[1] for p, d in nvidia_nodes().items() if re.fullmatch(r"/dev/nvidia\d+", p)]
            n = max(minors, default=-1) + 1
            mknod(f"/dev/nvidia{n}", 195, n)
        elif kind == "link-removed":
            nodes = nvidia_nodes()
            target = args[0]
            path = (max((p for p in nodes if re.fullmatch(r"/dev/nvidia\d+", p)), key=lambda p: nodes[p][1])
                    if target == "any" else f"/dev/{target}")
            major, minor = nodes[path]
            try:
                os.unlink(f"/dev/char/{major}:{minor}")
            except FileNotFoundError:
                pass
        elif kind == "resource-update":
            self.update(args[0], args[1])
        elif kind == "container-recreate":
            self.remove(args[0])
            self.create(args[0])
        elif kind == "runtime-restart":
            (self.docker if args[0] == "docker" else self.containerd).restart()
        elif kind == "nvsymlinkd-restart":
            sh("systemctl", "restart", UNIT, timeout=120)
        elif kind == "nvsymlinkd-sigkill":
            old_pid = unit_property(UNIT, "MainPID")
            sh("systemctl", "kill", "--kill-who=main", "-s", "KILL", UNIT, timeout=60)
            # until systemd has seen the death, the unit still reads active: wait for the new process
            wait_for(lambda: unit_property(UNIT, "MainPID") not in (old_pid, "0"), timeout=60, interval=0.2)
        elif kind == "nvsymlinkd-sighup":
            self.write_config(args[0])
            sh("systemctl", "reload", UNIT, timeout=60)
        elif kind == "run-full":
            free = os.statvfs("/run")
            try:
                with open(FILL, "wb") as f:
                    try:
                        os.posix_fallocate(f.fileno(), 0, free.f_bavail * free.f_frsize)
                    except OSError:
                        pass
                self.sc.fact(f"seed{seed}_run_full_blocks_left", os.statvfs("/run").f_bavail)
                # a pass of the daemon (SIGHUP: re-read the config, resync) with nothing left for its state dir
                sh("systemctl", "kill", "--kill-who=main", "-s", "HUP", UNIT, timeout=60)
                if then_reload:
                    # systemd 252 refuses with < 16 MiB free on /run: the reload does not happen (recorded)
                    proc = sh("systemctl", "daemon-reload", check=False, timeout=120)
                    self.sc.fact("run_full_reload", (proc.returncode, proc.stderr.strip()[-200:]))
                    if proc.returncode != 0 and "Refusing to reload" not in proc.stderr:
                        raise RuntimeError(f"daemon-reload with /run full: {proc.stderr.strip()}")
                time.sleep(1.0)
            finally:
                os.unlink(FILL)
            return
        elif kind == "dbus-restart":
            sh("systemctl", "restart", "dbus.service", timeout=120)
        elif kind == chaos.CGROUPFS_DROP:
            self.drop_gpu(seed)
        if then_reload:
            daemon_reload()

    def drop_gpu(self, seed: int) -> None:
        """cgroupfs-drop: the cgroupfs container's device program replaced by one without c 195:0, as a
        runtime's re-apply does (tests/bpfdrop.py: attached with BPF_F_ALLOW_MULTI, the old one detached).
        Within the daemon's repair rate limit of the last drop the slot first gets a new container."""
        if time.monotonic() - self.dropped_last < chaos.REPAIR_WINDOW_S + 30:
            self.remove(chaos.CGROUPFS_SLOT)
            self.create(chaos.CGROUPFS_SLOT)
            self.sc.fact(f"seed{seed}_cgroupfs_recreated_for_the_rate_limit", self.ctrs[chaos.CGROUPFS_SLOT].name)
        ctr = self.ctrs[chaos.CGROUPFS_SLOT]
        ok, _ = wait_for(lambda: ctr.poll_log().last_alive, timeout=30, interval=0.2)
        if not ok:
            raise RuntimeError(f"{ctr.name}: its poller is not polling; nothing to drop")
        cgroup = "/sys/fs/cgroup" + proc_cgroups(ctr.pid)[""]
        sh(sys.executable, BPFDROP, cgroup, "c 195:0", env=dict(os.environ, PYTHONPATH=SRC), timeout=60)
        self.dropped = (ctr, time.time())
        self.dropped_last = time.monotonic()

    def judge_drop(self, step: chaos.Step, rec: dict, t_action_end: float) -> List[str]:
        """After cgroupfs-drop: the daemon's repair-done for the container, by the bpf-program mechanism,
        within the step's bound after its action (the daemon's next pass), and no denied open after it."""
        ctr, t_drop = self.dropped
        self.dropped = None
        bound = t_action_end - t_drop + step.drop_budget_s(self.resync)

        def repaired():
            for e in journal(message_id=MESSAGE_IDS["repair-done"]):
                if e.get("CONTAINER_ID") == ctr.id and int(e.get("__REALTIME_TIMESTAMP", 0)) / 1e6 >= t_drop:
                    return e
            return None
        entry, _ = wait_for(repaired, timeout=max(1.0, t_drop + bound - time.time()), interval=0.5)
        if entry is None:
            return [f"{ctr.name}: no repair-done {bound:.0f} s after its device program lost c 195:0 "
                    f"(resync_interval {self.resync:g} s)"]
        at = int(entry["__REALTIME_TIMESTAMP"]) / 1e6
        took = at - t_drop
        rec["drop_to_repair_s"] = round(took, 3)
        self.drop_to_repair.append(round(took, 3))
        out = []
        if entry.get("NVSYMLINKD_MECHANISM") != "bpf-program" or "c 195:0:rw" not in str(entry.get("NVSYMLINKD_DEVICES")):
            out.append(f"{ctr.name}: repaired, but not by bpf-program with c 195:0 rw: "
                       f"{entry.get('NVSYMLINKD_MECHANISM')} {entry.get('NVSYMLINKD_DEVICES')}")
        if took > bound:
            out.append(f"{ctr.name}: repaired {took:.1f} s after the drop, beyond its next pass ({bound:.1f} s)")
        ok, _ = wait_for(lambda: ctr.poll_log().last_alive > at + 0.5, timeout=10, interval=0.2)
        log = ctr.poll_log()
        late = [round(t - at, 3) for t, _ in log.denied if t > at + 0.05]
        if late or log.open_window is not None:
            out.append(f"{ctr.name}: denied opens after its repair: {late[:5]} ({log.summary()})")
        if not log.denied:
            out.append(f"{ctr.name}: the poller never saw the drop (EPERM): {log.summary()}")
        return out

    def write_config(self, resync: str) -> None:
        try:
            with open(CONFIG) as f:
                lines = [ln for ln in f.read().splitlines() if not ln.startswith("resync_interval")]
        except FileNotFoundError:
            lines = []
        lines.append(f"resync_interval = {resync}")
        self.resync = float(resync)
        with open(CONFIG + ".tmp", "w") as f:
            f.write("\n".join(lines) + "\n")
        os.rename(CONFIG + ".tmp", CONFIG)

    # ------------------------------------------------------------ judging

    def daemon_state(self) -> tuple:
        """(ActiveState, VmRSS kB of the main process or None): one systemctl call."""
        got = dict(line.split("=", 1) for line in sh("systemctl", "show", "-p", "ActiveState", "-p", "MainPID",
                                                      UNIT).stdout.splitlines() if "=" in line)
        return got.get("ActiveState", ""), self.daemon_rss(got.get("MainPID", "0"))

    def daemon_rss(self, pid: Optional[str] = None) -> Optional[int]:
        pid = pid or unit_property(UNIT, "MainPID")
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except (OSError, ValueError):
            return None
        return None

    def judge_links(self) -> List[str]:
        return chaos.judge_dev_char(nvidia_nodes(), dev_char_entries(), self.foreign, sorted(self.nvidia_majors))

    def frozen(self) -> Dict[str, str]:
        out = {}
        base = "/sys/fs/cgroup" if unified() else "/sys/fs/cgroup/freezer"
        name = "cgroup.freeze" if unified() else "freezer.state"
        for top in ("system.slice", "machine.slice", "kubepods.slice"):
            for d, _, files in os.walk(os.path.join(base, top)):
                if name in files:
                    try:
                        with open(os.path.join(d, name)) as f:
                            out[d] = f.read()
                    except OSError:
                        pass
        return out

    def access(self) -> tuple:
        """(violations, lost, engine/kernel disagreements) for every container now."""
        nodes = nvidia_nodes()
        paths, devs = list(nodes), list(nodes.values())
        violations, lost, disagree = [], [], []
        for ctr in list(self.ctrs.values()):
            try:
                kernel = cgroup_opens(ctr.pid, paths)
                engine = engine_verdicts(ctr.pid, devs)
            except (OSError, KeyError, ValueError) as e:
                violations.append(f"{ctr.name}: cannot judge its access: {e!r}")
                continue
            by_dev = {nodes[p]: v for p, v in kernel.items()}
            bad, gone = chaos.judge_grants(ctr.name, ctr.grant, by_dev, engine)
            violations += bad
            lost += gone
            for d in devs:
                if (by_dev.get(d) == "OK") != (engine.get(d) == ALLOW):
                    disagree.append(f"{ctr.name} c {d[0]}:{d[1]}: kernel {by_dev.get(d)}, engine {engine.get(d)}")
        return violations, lost, disagree

    def judge(self, step: chaos.Step, t_start: float, t_action_end: float, label: str) -> dict:
        """All five invariants after a step; returns the step's record."""
        rec = {"label": label, "kind": step.kind, "step": str(step),
               "action_s": round(t_action_end - t_start, 2)}
        viol: List[str] = []
        # (d) active again (after a kill or restart systemd brings it back), no traceback, RSS
        ok, took = wait_for(lambda: self.daemon_state()[0] == "active", timeout=60, interval=0.2)
        rec["daemon_active_after_s"] = round(took, 2)
        out = sh("journalctl", "-b", "--no-pager", "-o", "cat", "-u", UNIT, "--show-cursor",
                 *(["--after-cursor", self.cursor] if self.cursor else []), check=False).stdout
        m = re.search(r"^-- cursor: (\S+)\s*$", out, re.M)
        self.cursor = m.group(1) if m else self.cursor
        state, rss = self.daemon_state()
        rec["rss_kb"] = rss
        viol += chaos.judge_daemon(state, [out], rss, self.rss_start)
        rec.setdefault("judge_parts_s", {})["d"] = round(time.time() - t_action_end, 2)
        # (c) /dev/char converges on exactly the NVIDIA nodes' links, foreign ones untouched
        ok, took = wait_for(lambda: not self.judge_links(), timeout=15, interval=0.1)
        rec["links_ok_after_s"] = round(took, 2)
        if not ok:
            viol += self.judge_links()
        rec.setdefault("judge_parts_s", {})["c"] = round(time.time() - t_action_end, 2)
        # (b) nothing unearned; a granted device lost beyond the budget
        bad, lost, disagree = self.access()
        budget = step.budget_s
        if step.kind == chaos.CGROUPFS_DROP and self.dropped is not None:  # the loss began at the drop
            budget = t_action_end - self.dropped[1] + step.drop_budget_s(self.resync)
        deadline = t_action_end + budget
        while lost and time.time() < deadline:
            time.sleep(0.1)
            bad2, lost, disagree = self.access()
            bad += bad2
        viol += sorted(set(bad)) + lost
        if disagree:
            rec["engine_disagrees"] = disagree
        rec.setdefault("judge_parts_s", {})["b"] = round(time.time() - t_action_end, 2)
        # (a) the pollers, this step's windows (the probes above took longer than a poll interval)
        windows, open_ = {}, {}
        for ctr in list(self.ctrs.values()) + self.retired:
            if ctr.role != "gpu":
                continue
            log = ctr.poll_log() if ctr in self.ctrs.values() else PollLog.parse(ctr.log_text)
            windows[ctr.name] = log.windows
            if log.open_window is not None:
                open_[ctr.name] = log.open_window
            # gpupoll says ALIVE a second after its start: a container made by this step may not have yet
            if ctr in self.ctrs.values() and not log.last_alive and not wait_for(
                    lambda c=ctr: c.poll_log().last_alive, timeout=30, interval=0.2)[0]:
                viol.append(f"{ctr.name}: its poller has not said ALIVE in 30 s (not running?)")
        if open_ and budget:
            time.sleep(min(budget, max(0.0, t_action_end + budget - time.time())))
        den = chaos.judge_denials(windows, open_, t_start, time.time(), budget)
        rec["worst_s"] = round(den.worst_s, 3)
        rec["denied_opens"] = den.denied_opens
        viol += den.violations
        rec.setdefault("judge_parts_s", {})["a"] = round(time.time() - t_action_end, 2)
        if self.dropped is not None:
            viol += self.judge_drop(step, rec, t_action_end)
        # (e) nothing frozen stays frozen
        viol += chaos.judge_frozen(self.frozen())
        self.retired = []
        rec["violations"] = viol
        rec["judge_s"] = round(time.time() - t_action_end, 2)
        return rec

    def run_sequence(self, seed: int, steps: List[chaos.Step]) -> bool:
        print(f"chaos seed {seed}: {chaos.format_sequence(steps)}", flush=True)
        self.sc.fact(f"seed{seed}_sequence", chaos.format_sequence(steps))
        t_seq = time.monotonic()
        failed = []
        for i, step in enumerate(steps):
            label = f"seed {seed} step {i + 1}/{len(steps)} {step}"
            t0 = time.time()
            try:
                self.do(step, seed)
                error = None
            except Exception as e:  # noqa: BLE001 - a step that cannot run is a finding, judged like one
                error = f"step failed: {e!r}"[:500]
            t1 = time.time()
            rec = self.judge(step, t0, t1, label)
            if error:
                rec["violations"].insert(0, error)
            rec["seed"] = seed
            self.records.append(rec)
            print(f"  {label}: {rec['action_s']} s + judge {rec['judge_s']} s, worst {rec['worst_s']} s"
                  + (f"; VIOLATIONS {rec['violations']}" if rec["violations"] else ""), flush=True)
            if rec["violations"]:
                failed.append(f"step {i + 1} {step}: {'; '.join(rec['violations'])[:600]}")
                self.keep_journal(f"seed{seed}-step{i + 1}", t0)
        self.sc.timing(f"seed{seed}_s", time.monotonic() - t_seq)
        return self.sc.check(f"seed {seed}: {len(steps)} steps, invariants (a)-(e) hold after each", not failed,
                             " | ".join(failed)[:3000])

    def keep_journal(self, what: str, since: float) -> None:
        """nvsymlinkd's, containerd's and Docker's journal from a violating step's start (and 30 s before it) into
        results/chaos-<what>-journal.txt at once: the boot's journal.txt comes only when the whole
        soak ends, and a soak that runs out of time never writes it."""
        out = sh("journalctl", "-b", "--no-pager", "-o", "short-monotonic", "-u", UNIT, "-u", "containerd",
                 "-u", "docker", "--since", f"@{since - 30:.0f}", check=False).stdout
        path = os.path.join(os.environ.get("VM_RESULTS", "/mnt/run/results"), f"chaos-{what}-journal.txt")
        with open(path, "w") as f:
            f.write(out)

    def finish(self) -> None:
        """At the end: every poller alive with no window open, and every container's access
        confirmed from inside it (an exec: open() in its own mount namespace)."""
        for ctr in self.ctrs.values():
            if ctr.role == "gpu":
                log = ctr.poll_log()
                self.sc.check(f"end: {ctr.name} poller alive, no denial window open",
                              bool(log.last_alive) and log.open_window is None, log.summary())
        rogue = self.ctrs[chaos.ROGUE_SLOT]
        script = 'for p in /dev/nvidia0 /dev/nvidia-uvm; do [ -c "$p" ] && { exec 3<>"$p" && echo "$p OK"; }; done'
        proc = sh("docker", "exec", rogue.id, "/bin/sh", "-c", script, check=False, timeout=60)
        made = sh("docker", "exec", rogue.id, "/bin/ls", "-l", "/dev/nvidia0", check=False).stdout.strip()
        self.sc.check("end: the container that made its own /dev/nvidia0 (mknod) cannot open it (EPERM)",
                      "OK" not in proc.stdout and "Operation not permitted" in proc.stderr,
                      f"node: {made}; {proc.stdout.strip()} {proc.stderr.strip()[:300]}")
        worst = chaos.worst_per_kind(self.records)
        self.sc.fact("worst_denial_window_per_kind_s", worst)
        counts: Dict[str, int] = {}
        for r in self.records:
            counts[r["kind"]] = counts.get(r["kind"], 0) + 1
        self.sc.fact("steps_per_kind", dict(sorted(counts.items())))
        slow: Dict[str, float] = {}
        for r in self.records:
            slow[r["kind"]] = max(slow.get(r["kind"], 0.0), r["action_s"] + r["judge_s"])
        self.sc.fact("slowest_step_per_kind_s", dict(sorted(slow.items())))
        disagree = [d for r in self.records for d in r.get("engine_disagrees", [])]
        self.sc.fact("engine_kernel_disagreements", disagree[:50])
        self.sc.fact("links_converge_worst_s", max((r["links_ok_after_s"] for r in self.records), default=0))
        self.sc.fact("cgroupfs_drop_to_repair_s", self.drop_to_repair)
        self.sc.fact("early_prevention_before_hook_grant_s", self.margins)
        late = [m for m in self.margins if m[1] is None or m[1] < 0]
        self.sc.fact("early_prevention_late_or_missing", late)
        results = os.environ.get("VM_RESULTS", "/mnt/run/results")
        with open(os.path.join(results, "chaos-steps.json"), "w") as f:
            json.dump(self.records, f, indent=1)
        if os.path.exists(HOOK_LOG):     # each grant's wall time, beside the daemon's journal (the race window)
            shutil.copy(HOOK_LOG, os.path.join(results, "nvidia-hook.log"))

    def cleanup(self) -> None:
        for slot in list(self.ctrs):
            try:
                self.remove(slot)
            except Exception:  # noqa: BLE001 - best effort at the end
                pass
        if os.path.exists(FILL):
            os.unlink(FILL)
        shutil.rmtree(os.path.join(WORK, "chaos-bundles"), ignore_errors=True)


def cmdline_option(key: str) -> Optional[str]:
    """The host's NVSYMLINKD_CHAOS_SEEDS / _STEPS: key in the run dir's options.json (vmhost.py
    writes it for every run: a guest restored from a base snapshot keeps the base's kernel
    command line), else nvsymlinkd.<key>=VALUE on the kernel command line (older hosts)."""
    try:
        with open(os.path.join(os.environ.get("VM_RUN", "/mnt/run"), "options.json")) as f:
            options = json.load(f)
        if key in options:
            return options[key] or None
    except (OSError, ValueError):
        pass
    with open("/proc/cmdline") as f:
        for word in f.read().split():
            if word.startswith(f"nvsymlinkd.{key}="):
                return word.split("=", 1)[1]
    return None


def seeds_for(mode: str) -> List[int]:
    given = cmdline_option("chaos_seeds")
    if given:
        return chaos.parse_seeds(given)
    if mode == "ci":
        return list(chaos.CI_SEEDS)
    return [s for s in chaos.FULL_SEEDS if s not in chaos.CI_SEEDS]


def run_soak(mode: str) -> None:
    """The scenario: setup, the seeds' sequences (or the one given on the command line), the end."""
    from tests.vm.guest.vmguest import Scenario, expect_nvsymlinkd

    with Scenario() as sc:
        expect_nvsymlinkd(sc)
        seeds = seeds_for(mode)
        given_steps = cmdline_option("chaos_steps")
        sc.fact("seeds", seeds)
        soak = Soak(sc)
        try:
            soak.setup()
            for seed in seeds:
                steps = chaos.parse_sequence(given_steps) if given_steps else chaos.draw_sequence(seed)
                soak.run_sequence(seed, steps)
            soak.finish()
        finally:
            soak.cleanup()
