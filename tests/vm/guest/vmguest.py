"""Guest-side helpers for VM scenarios: one small script per scenario builds on these.

Runs as root inside the Debian 12 guest (systemd 252, runc 1.1.5, cgroup v2). The kernel is
the judge: a container's access is whatever open() returns inside it ("OK" or an errno name
such as "EPERM"), never what some configuration file claims.

    from tests.vm.guest.vmguest import Scenario, load_fake_driver, mknod, start_gpu_container, daemon_reload
    with Scenario() as sc:
        majors = load_fake_driver()
        gpu0 = mknod("/dev/nvidia0", 195, 0)
        ctr = start_gpu_container("gpu", [gpu0])
        sc.expect_open(ctr, "/dev/nvidia0", "OK")
        daemon_reload()
        sc.expect_open(ctr, "/dev/nvidia0", "EPERM")
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

RESULTS = os.environ.get("VM_RESULTS", "/mnt/run/results")
MODULES = os.environ.get("VM_MODULES", "/mnt/run/modules")
SRC = "/mnt/src"
WORK = "/run/vmtest"
ROOTFS = "/var/lib/vmtest/rootfs"

# strerror text (as busybox sh prints it) -> errno name
_STRERROR = {os.strerror(code): name for code, name in errno.errorcode.items()}


def sh(*argv: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


def wait_for(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.02):
    """Poll until predicate() is truthy; returns (value, seconds) or (None, seconds) on timeout."""
    start = time.monotonic()
    while True:
        value = predicate()
        elapsed = time.monotonic() - start
        if value or elapsed >= timeout:
            return value, elapsed
        time.sleep(interval)


# ---------------------------------------------------------------- verdict

class Scenario:
    """Collects checks and timings, writes <results>/<name>.json on exit (also on a crash)."""

    def __init__(self, name: Optional[str] = None):
        self.name = name or os.environ.get("VM_SCENARIO") or os.path.splitext(os.path.basename(sys.argv[0]))[0]
        self.checks: List[dict] = []
        self.timings: Dict[str, object] = {}
        self.facts: Dict[str, object] = {}
        self.error: Optional[str] = None
        self._start = time.monotonic()

    def check(self, what: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"what": what, "ok": bool(ok), "detail": detail})
        print(f"[{'ok' if ok else 'FAIL'}] {what}" + (f": {detail}" if detail else ""), flush=True)
        return bool(ok)

    def expect_open(self, ctr: Container, path: str, want: str, when: str = "") -> bool:
        got = ctr.open_errno(path)
        label = f"open({path}) in {ctr.name}" + (f" {when}" if when else "")
        return self.check(f"{label} -> {want}", got == want, f"got {got}")

    def timing(self, key: str, seconds: float) -> None:
        self.timings[key] = round(seconds, 4)
        print(f"timing {key}: {seconds:.4f} s", flush=True)

    def fact(self, key: str, value) -> None:
        self.facts[key] = value

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.checks) and all(c["ok"] for c in self.checks)

    def __enter__(self) -> Scenario:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None:
            self.error = "".join(traceback.format_exception(exc_type, exc, tb))
            print(self.error, file=sys.stderr, flush=True)
        verdict = {"name": self.name, "ok": self.ok, "checks": self.checks, "timings": self.timings,
                   "facts": self.facts, "error": self.error,
                   "elapsed_s": round(time.monotonic() - self._start, 2)}
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, f"{self.name}.json"), "w") as f:
            json.dump(verdict, f, indent=1)
        sys.exit(0 if self.ok else 1)


# ---------------------------------------------------------------- driver and nodes

@dataclass(frozen=True)
class DeviceNode:
    path: str
    major: int
    minor: int

    @property
    def char_link(self) -> str:
        return f"/dev/char/{self.major}:{self.minor}"


def proc_devices_majors() -> Dict[str, int]:
    """Character device names -> major from /proc/devices."""
    majors: Dict[str, int] = {}
    section = None
    with open("/proc/devices") as f:
        for line in f:
            line = line.strip()
            if line.endswith("devices:"):
                section = line
            elif line and section == "Character devices:":
                major, name = line.split(None, 1)
                majors[name] = int(major)
    return majors


def load_fake_driver(uvm: bool = False) -> Dict[str, int]:
    """insmod the fake nvidia (and nvidia-uvm) modules; returns their majors from /proc/devices."""
    sh("insmod", os.path.join(MODULES, "nvidia.ko"))
    if uvm:
        load_fake_uvm()
    return {k: v for k, v in proc_devices_majors().items() if k.startswith("nvidia")}


def load_fake_uvm() -> int:
    sh("insmod", os.path.join(MODULES, "nvidia-uvm.ko"))
    return proc_devices_majors()["nvidia-uvm"]


def mknod(path: str, major: int, minor: int, mode: int = 0o666) -> DeviceNode:
    """A real character node, as nvidia-modprobe or a driver container would make it."""
    if os.path.lexists(path):
        os.unlink(path)
    os.mknod(path, mode | stat.S_IFCHR, os.makedev(major, minor))
    os.chmod(path, mode)
    return DeviceNode(path, major, minor)


def gpu_nodes_linked(sc: Scenario, suffix: str = "") -> Tuple[Dict[str, int], List[DeviceNode]]:
    """The daemon scenarios' start: the fake driver with uvm loaded, nvidia0, nvidiactl and nvidia-uvm made by
    mknod (no uevent, as a driver container makes them), and a check that the daemon linked each within
    15 s. (majors, nodes)."""
    majors = load_fake_driver(uvm=True)
    nodes = [mknod("/dev/nvidia0", 195, 0), mknod("/dev/nvidiactl", 195, 255),
             mknod("/dev/nvidia-uvm", majors["nvidia-uvm"], 0)]
    for node in nodes:
        ok, waited = wait_for(lambda node=node: os.path.realpath(node.char_link) == node.path, timeout=15)
        sc.check(f"{node.char_link} -> {node.path}{suffix}", bool(ok), f"after {waited:.2f} s")
    return majors, nodes


def make_char_link(node: DeviceNode) -> str:
    """/dev/char/M:m -> ../<node> (relative, like udev makes them)."""
    link = node.char_link
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(os.path.relpath(node.path, "/dev/char"), link)
    return link


# ---------------------------------------------------------------- containers

def _busybox_rootfs() -> str:
    if not os.path.exists(os.path.join(ROOTFS, "bin", "busybox")):
        os.makedirs(os.path.join(ROOTFS, "bin"), exist_ok=True)
        for d in ("dev", "proc", "sys", "tmp", "etc"):
            os.makedirs(os.path.join(ROOTFS, d), exist_ok=True)
        shutil.copy("/bin/busybox", os.path.join(ROOTFS, "bin", "busybox"))
        for applet in ("sh", "sleep", "cat", "ls", "echo", "true"):
            os.symlink("busybox", os.path.join(ROOTFS, "bin", applet))
    gpupoll = os.path.join(MODULES, "gpupoll")   # the static poller (tests/vm/poller), for args=
    if os.path.exists(gpupoll) and not os.path.exists(os.path.join(ROOTFS, "bin", "gpupoll")):
        shutil.copy(gpupoll, os.path.join(ROOTFS, "bin", "gpupoll"))
    return ROOTFS


def device_spec(node: DeviceNode) -> dict:
    return {"path": node.path, "type": "c", "major": node.major, "minor": node.minor,
            "fileMode": 0o666, "uid": 0, "gid": 0}


def cgroup_rule(node: DeviceNode, access: str = "rw") -> dict:
    return {"allow": True, "type": "c", "major": node.major, "minor": node.minor, "access": access}


class Container:
    """A runc container in its own systemd scope (runc-<name>.scope) running busybox sleep."""

    def __init__(self, name: str, bundle: str, runc_log: str, output: str):
        self.name = name
        self.bundle = bundle
        self.runc_log_path = runc_log
        self.output_path = output

    @property
    def scope(self) -> str:
        return f"runc-{self.name}.scope"

    def runc_log(self) -> str:
        """What runc said while creating the container (its --log file and its stderr)."""
        text = ""
        for path in (self.runc_log_path, self.output_path):
            try:
                with open(path) as f:
                    text += f.read()
            except OSError:
                pass
        return text

    def state(self) -> dict:
        return json.loads(sh("runc", "state", self.name).stdout)

    def exec(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return sh("runc", "exec", self.name, *argv, check=False, timeout=timeout)

    def open_errno(self, path: str) -> str:
        """open(path, O_RDWR) inside the container: "OK" or the errno name (EPERM: cgroup denied);
        "ENOENT" when there is no such path, "NOTCHR" when it is not a character device."""
        # sh's <> opens with O_CREAT: test for the node first, or a missing one becomes a file.
        script = ('[ -e "$1" ] || { echo NO_SUCH_PATH; exit 0; }; '
                  '[ -c "$1" ] || { echo NOT_CHAR; exit 0; }; exec 3<>"$1" && echo OPEN_OK')
        proc = self.exec("/bin/sh", "-c", script, "sh", path)
        for marker, verdict in (("OPEN_OK", "OK"), ("NO_SUCH_PATH", "ENOENT"), ("NOT_CHAR", "NOTCHR")):
            if marker in proc.stdout:
                return verdict
        message = proc.stderr.strip().rsplit(": ", 1)[-1]
        return _STRERROR.get(message, f"UNKNOWN({proc.returncode}: {proc.stderr.strip()})")

    def delete(self) -> None:
        sh("runc", "delete", "--force", self.name, check=False)


def start_gpu_container(name: str, devices: List[DeviceNode],
                        cgroup_allow: Optional[List[DeviceNode]] = None,
                        hook_grants: Optional[List[DeviceNode]] = None,
                        systemd_cgroup: bool = True, args: Optional[List[str]] = None) -> Container:
    """runc run -d with the nodes in linux.devices and the same nodes granted rw in
    linux.resources.devices, cgroupsPath system.slice:runc:<name> -> runc-<name>.scope.
    cgroup_allow: extra rw rules in the spec. hook_grants: nodes created in the container
    (linux.devices) but granted only by a createRuntime hook that rewrites the cgroup's BPF
    program like the legacy NVIDIA hook (guest/nvidia_hook.py), never by the spec.
    systemd_cgroup=False: runc's cgroupfs driver, cgroupsPath /vmtest/<name>. args: the process
    (e.g. stacks.POLL_ARGV, gpupoll), with a tmpfs on /tmp for what it writes."""
    bundle = os.path.join(WORK, "bundles", name)
    os.makedirs(bundle, exist_ok=True)
    if not os.path.exists(os.path.join(bundle, "config.json")):
        sh("runc", "spec", cwd=bundle)
    with open(os.path.join(bundle, "config.json")) as f:
        spec = json.load(f)
    spec["root"] = {"path": _busybox_rootfs(), "readonly": True}
    spec["process"]["terminal"] = False
    spec["process"]["args"] = list(args) if args else ["/bin/sleep", "100000"]
    if args:
        spec["mounts"].append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                               "options": ["nosuid", "nodev", "mode=1777"]})
    linux = spec["linux"]
    linux["cgroupsPath"] = f"system.slice:runc:{name}" if systemd_cgroup else f"/vmtest/{name}"
    linux["devices"] = [device_spec(n) for n in devices + list(hook_grants or [])]
    rules = linux.setdefault("resources", {}).setdefault("devices", [{"allow": False, "access": "rwm"}])
    rules += [cgroup_rule(n) for n in devices + list(cgroup_allow or [])]
    if hook_grants:
        hook = os.path.join(SRC, "tests", "vm", "guest", "nvidia_hook.py")
        spec.setdefault("hooks", {})["createRuntime"] = [{
            "path": sys.executable,
            "args": [sys.executable, hook] + [f"c:{n.major}:{n.minor}:rw" for n in hook_grants]}]
    with open(os.path.join(bundle, "config.json"), "w") as f:
        json.dump(spec, f, indent=1)
    runc_log = os.path.join(WORK, f"{name}.runc.log")
    output = os.path.join(WORK, f"{name}.out")
    global_opts = ["--log", runc_log, "--log-format", "text"]
    if systemd_cgroup:
        global_opts.insert(0, "--systemd-cgroup")
    # Detached: the container inherits runc's stdio, so it must be a file, never a pipe.
    with open(output, "w") as out:
        proc = subprocess.run(["runc", *global_opts, "run", "--detach", "--bundle", bundle, name],
                              stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=60)
    ctr = Container(name, bundle, runc_log, output)
    if proc.returncode != 0:
        raise RuntimeError(f"runc run {name} exited {proc.returncode}: {ctr.runc_log()[-2000:]}")
    return ctr


# ---------------------------------------------------------------- systemd

def daemon_reload() -> float:
    start = time.monotonic()
    sh("systemctl", "daemon-reload", timeout=120)
    return time.monotonic() - start


def daemon_reexec() -> float:
    start = time.monotonic()
    sh("systemctl", "daemon-reexec", timeout=120)
    return time.monotonic() - start


def unit_property(unit: str, prop: str) -> str:
    return sh("systemctl", "show", "--property", prop, "--value", unit).stdout.strip()


def set_device_allow(scope: str, path: str, access: str = "rw", runtime: bool = True) -> float:
    """SetUnitProperties(scope, runtime, [DeviceAllow=[(path, access)]]) over the system bus,
    the call the repair makes; returns how long the call took."""
    start = time.monotonic()
    sh("busctl", "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
       "org.freedesktop.systemd1.Manager", "SetUnitProperties", "sba(sv)", scope,
       "true" if runtime else "false", "1", "DeviceAllow", "a(ss)", "1", path, access)
    return time.monotonic() - start


def journal(unit: Optional[str] = None, message_id: Optional[str] = None,
            after_cursor: Optional[str] = None, container_id: Optional[str] = None) -> List[dict]:
    """Journal entries of this boot as dicts (journalctl -o json), optionally filtered."""
    argv = ["journalctl", "-b", "--no-pager", "-o", "json"]
    if unit:
        argv += ["-u", unit]
    if after_cursor:
        argv += ["--after-cursor", after_cursor]
    if message_id:
        argv.append(f"MESSAGE_ID={message_id}")
    if container_id:
        argv.append(f"CONTAINER_ID={container_id}")
    out = sh(*argv, check=False).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def journal_cursor() -> str:
    """Cursor of the newest journal entry: pass to journal(after_cursor=...) to see only what follows."""
    out = sh("journalctl", "-b", "-n", "1", "-o", "json", "--no-pager").stdout.strip()
    return json.loads(out.splitlines()[-1])["__CURSOR"] if out else ""


# ---------------------------------------------------------------- nvsymlinkd

# What the runner did before the scenario: {"mode", "seconds", "error", "log"}.
INSTALL_RECORD = os.path.join(WORK, "nvsymlinkd-install.json")
DEB_BINARY = "/usr/bin/nvsymlinkd"
DEB_UNIT = "/lib/systemd/system/nvsymlinkd.service"


def nvsymlinkd_mode() -> str:
    """nvsymlinkd.vm=off|deb|source on the kernel command line (the scenario's '# vm:' line)."""
    with open("/proc/cmdline") as f:
        for word in f.read().split():
            if word.startswith("nvsymlinkd.vm="):
                return word.split("=", 1)[1]
    return "off"


def full_matrix() -> bool:
    """Whether the host runs the full matrix (NVSYMLINKD_VM_MATRIX=full: "matrix" in the run dir's
    options.json, vmhost.guest_options): scenarios then repeat their events the full number of times;
    the default run does each kind of event fewer times (CI time, docs/vm.md "The runtime matrix")."""
    try:
        with open(os.path.join(os.environ.get("VM_RUN", "/mnt/run"), "options.json")) as f:
            return json.load(f).get("matrix") == "full"
    except (OSError, ValueError):
        return False


def nvsymlinkd_unit_active(unit: str = "nvsymlinkd.service") -> bool:
    return unit_property(unit, "ActiveState") == "active"


def status_in_systemctl_status(unit: str = "nvsymlinkd.service"):
    """(StatusText, the 'Status: "..."' line of `systemctl status`), read until both agree: the
    daemon updates STATUS= up to once a second, so one read each can straddle an update."""
    for _ in range(10):
        before = unit_property(unit, "StatusText")
        shown = sh("systemctl", "status", "--no-pager", unit, check=False).stdout
        line = next((ln.strip() for ln in shown.splitlines() if ln.strip().startswith("Status: ")), "")
        if before and line == f'Status: "{before}"':
            return before, line
        time.sleep(0.3)
    return before, line


def install_nvsymlinkd_deb(deb: str) -> float:
    """dpkg -i the package the host built, with no network (every Depends must be in the image).
    Its postinst reloads the udev rules, runs one sync, enables nvsymlinkd.service and starts it
    (Type=notify: the start returns once the daemon is ready). Returns seconds for dpkg -i."""
    begin = time.monotonic()
    proc = sh("dpkg", "-i", deb, check=False, timeout=300)
    elapsed = time.monotonic() - begin
    _record_install("deb", elapsed, proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"dpkg -i {deb} exited {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
    return elapsed


def _record_install(mode: str, seconds: float, log: str, error: Optional[str] = None) -> None:
    os.makedirs(WORK, exist_ok=True)
    with open(INSTALL_RECORD, "w") as f:
        json.dump({"mode": mode, "seconds": round(seconds, 2), "error": error, "log": log}, f)


def expect_nvsymlinkd(sc: Scenario) -> bool:
    """Checks that the daemon under test is the one the scenario asked for, installed and active:
    for 'deb', the package is installed and the unit runs /usr/bin/nvsymlinkd from
    /lib/systemd/system (not a leftover of the source mode)."""
    mode = nvsymlinkd_mode()
    try:
        with open(INSTALL_RECORD) as f:
            record = json.load(f)
    except (OSError, ValueError):
        record = {"error": f"the runner left no {INSTALL_RECORD}"}
    ok = sc.check(f"nvsymlinkd installed ({mode}) by the runner", not record.get("error"),
                  str(record.get("error") or f"{record.get('seconds')} s"))
    if mode == "deb":
        status = sh("dpkg-query", "-W", "-f=${Status} ${Version}", "nvsymlinkd", check=False).stdout
        ok &= sc.check("dpkg: nvsymlinkd is 'install ok installed'", status.startswith("install ok installed"),
                       status)
        fragment = unit_property("nvsymlinkd.service", "FragmentPath")
        exec_start = unit_property("nvsymlinkd.service", "ExecStart")
        ok &= sc.check(f"nvsymlinkd.service is the packaged unit running {DEB_BINARY}",
                       fragment == DEB_UNIT and f"path={DEB_BINARY} " in exec_start,
                       f"{fragment}: {exec_start[:160]}")
        ok &= sc.check("nvsymlinkd.service is enabled", unit_property("nvsymlinkd.service", "UnitFileState")
                       == "enabled", unit_property("nvsymlinkd.service", "UnitFileState"))
    ok &= sc.check("nvsymlinkd.service is active", nvsymlinkd_unit_active(),
                   unit_property("nvsymlinkd.service", "ActiveState"))
    return ok


def install_nvsymlinkd_from_source(start: bool = True) -> float:
    """Install nvsymlinkd from the 9p tree the way the package does: the project's own rendered
    units (Type=notify, hardening) in /run/systemd/system, its udev rule in /run/udev/rules.d,
    /usr/local/sbin/nvsymlinkd a wrapper running `python3 -m nvsymlinkd` from /mnt/src; enabled
    and started. Returns seconds until the unit is active.

    This reloads systemd: the runner calls it before any scenario code for '# vm:
    nvsymlinkd=source', so no container exists yet. For quick iteration on the daemon (no
    package build); the scenarios that prove the fix use the .deb (install_nvsymlinkd_deb)."""
    begin = time.monotonic()
    wrapper = "/usr/local/sbin/nvsymlinkd"
    with open(wrapper, "w") as f:
        f.write(f"#!/bin/sh\nexport PYTHONPATH={SRC} PYTHONDONTWRITEBYTECODE=1\n"
                "exec /usr/bin/python3 -m nvsymlinkd \"$@\"\n")
    os.chmod(wrapper, 0o755)
    rendered = os.path.join(WORK, "rendered")
    proc = nvsymlinkd("--config", "/dev/null", "render", "--bindir", "/usr/local/sbin", "--output", rendered)
    if proc.returncode != 0:
        raise RuntimeError(f"nvsymlinkd render exited {proc.returncode}: {proc.stderr.strip()}")
    os.makedirs("/run/systemd/system", exist_ok=True)
    os.makedirs("/run/udev/rules.d", exist_ok=True)
    for name in os.listdir(rendered):
        dest = "/run/udev/rules.d" if name.endswith(".rules") else "/run/systemd/system"
        shutil.copy(os.path.join(rendered, name), os.path.join(dest, name))
    sh("udevadm", "control", "--reload")
    daemon_reload()
    sh("systemctl", "enable", "--runtime", "nvsymlinkd.service")
    if start:
        sh("systemctl", "start", "nvsymlinkd.service", timeout=120)
    _record_install("source", time.monotonic() - begin, "")
    return time.monotonic() - begin


def nvsymlinkd(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the project's CLI (e.g. nvsymlinkd('check', '--json')): the packaged /usr/bin/nvsymlinkd
    in 'deb' scenarios, else the source tree."""
    if nvsymlinkd_mode() == "deb":
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
        return subprocess.run([DEB_BINARY, *argv], capture_output=True, text=True, timeout=timeout, env=env)
    env = dict(os.environ, PYTHONPATH=SRC, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "nvsymlinkd", *argv], capture_output=True,
                          text=True, timeout=timeout, env=env)
