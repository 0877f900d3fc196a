"""The NVIDIA container hook's shape, for the guest (libnvidia-container's legacy mode).

    python3 nvidia_hook.py c:195:0:rw [...]     createRuntime hook: grant exactly these devices
    python3 nvidia_hook.py [-config FILE] prestart
                                                prestart hook, as /usr/bin/nvidia-container-runtime-hook:
                                                grant what NVIDIA_VISIBLE_DEVICES in the spec asks for
                                                (all, GPU indexes, MIG-<uuid>: its GPU and both caps),
                                                unless the toolkit config the hook of that release reads
                                                refuses it (below)

The runtime passes the container state on stdin. The grant is the way libnvidia-container makes
it: cgroup v2, allow blocks prepended to the device program the runtime attached to the
container's cgroup (the new program attached, the old one detached); cgroup v1, `c M:m rw`
written to the container's devices.allow. In prestart mode the device nodes are also created in
the container's /dev (before or after pivot_root: runc runs prestart hooks before it, crun may
run them after). None of this is in the spec's rules or the scope's DeviceAllow, so a systemd
reload takes it (failure 2), which is what the scenarios prove nvsymlinkd prevents.

In prestart mode the hook reads its config.toml where the real hook of the toolkit release it plays
($VMTEST_TOOLKIT_VERSION, set by its .real; default 1.17.8, stacks.install_nvidia_toolkit's) reads it,
written here from the upstream hook, not from nvsymlinkd's reconstruction: -config FILE (required),
else 1.18+ $NVIDIA_CTK_CONFIG_FILE_PATH (required), then $XDG_CONFIG_HOME or /etc
(cmd/nvidia-container-runtime-hook/hook_config.go:39 getConfigFilePath, v1.18.0); up to 1.17
/run/nvidia/driver/etc/... then /etc/... (hook_config.go:27 loadConfig, v1.17.8; first found; none:
the defaults). `accept-nvidia-visible-devices-envvar-when-unprivileged = false` there refuses
NVIDIA_VISIBLE_DEVICES from a container without CAP_SYS_ADMIN in its bounding set
(internal/config/image/cuda_image.go:281 VisibleDevices, privileged.go:36 IsPrivileged, v1.18.0):
nothing granted, no node made.
"""
import ctypes
import json
import os
import re
import stat
import sys
import time

if __name__ == "__main__":
    # run by runc (stacks.py's /usr/bin/nvidia-container-runtime-hook, vmguest's createRuntime hook)
    # with no PYTHONPATH: the checkout's root (/mnt/src) on the path, for nvsymlinkd and tests.bpfasm
    sys.path[:0] = [os.path.realpath(os.path.join(os.path.dirname(os.path.realpath(__file__)), "..", "..", ".."))]

from nvsymlinkd.access import bpfeval, bpfprog  # noqa: E402
from nvsymlinkd.host.devices import Rule  # noqa: E402
from tests.bpfasm import nvidia_prepend  # noqa: E402  (libnvidia-container's shape)

CLONE_NEWNS = 0x00020000
# /dev/nvidia<N> for the GPUs asked for, then the control nodes every GPU container gets.
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
LOG = "/run/vmtest/nvidia-hook.log"
# In the container's env: the hook runs `systemctl daemon-reload` right after its grant, inside runc create
# (before state.json): the chaos soak's old race, made certain (s11). It first waits (at most
# RELOAD_WAIT_S) for nvsymlinkd's drop-in of the scope, and logs how long that took.
RELOAD_AFTER_GRANT = "VMTEST_RELOAD_AFTER_GRANT=1"
RELOAD_WAIT_S = 5.0
VERSION_ENV = "VMTEST_TOOLKIT_VERSION"
DEFAULT_VERSION = "1.17.8"
DRIVER_CONFIG = "/run/nvidia/driver/etc/nvidia-container-runtime/config.toml"
ETC_CONFIG = "/etc/nvidia-container-runtime/config.toml"
MIG_NVML = "/run/vmtest/nvml-mig.json"  # NVML's MIG UUID -> [GPU minor, GI, CI], for MIG-<uuid> requests


def log(msg: str) -> None:
    """One line, the wall time at its end (the chaos soak measures the grant against the daemon's journal)."""
    os.makedirs(os.path.dirname(LOG), exist_ok=True)
    with open(LOG, "a") as f:
        f.write(f"{msg} at {time.time():.3f}\n")


def unified() -> bool:
    return os.path.exists("/sys/fs/cgroup/cgroup.controllers")


def proc_cgroups(pid: int) -> dict:
    """controller (or '' for the v2 line) -> path, from /proc/PID/cgroup."""
    out = {}
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def grant_v2(pid: int, rules) -> None:
    path = "/sys/fs/cgroup" + proc_cgroups(pid)[""]
    fd = bpfprog.open_cgroup_dir(path)
    try:
        for prog_id in bpfprog.query_device_program_ids(fd, effective=False):
            old = bpfprog.read_program(prog_id)
            new = nvidia_prepend(rules, bpfeval.decode(old.xlated))
            new_fd = bpfprog.load_device_program(bpfeval.encode(new), name="nvidia_hook")
            bpfprog.attach_device_program(fd, new_fd)
            old_fd = bpfprog._bpf(bpfprog.BPF_PROG_GET_FD_BY_ID, bpfprog._attr((0, "=I", prog_id)), 12)
            bpfprog.detach_device_program(fd, old_fd)
            os.close(old_fd)
            os.close(new_fd)
    finally:
        os.close(fd)
    log(f"pid {pid}: v2 grant {[str(r) for r, _ in rules]} on {path}")


def grant_v1(pid: int, rules) -> None:
    path = "/sys/fs/cgroup/devices" + proc_cgroups(pid)["devices"]
    for rule, _ in rules:
        with open(os.path.join(path, "devices.allow"), "w") as f:
            f.write(str(rule))     # "c 195:0 rw"
    log(f"pid {pid}: v1 devices.allow {[str(r) for r, _ in rules]} on {path}")


def grant(pid: int, rules) -> None:
    (grant_v2 if unified() else grant_v1)(pid, rules)


def requested_nodes(env: list) -> list:
    """Host device nodes NVIDIA_VISIBLE_DEVICES (all, none, void, 0,1,...) asks for."""
    value = None
    for item in env:
        if item.startswith("NVIDIA_VISIBLE_DEVICES="):
            value = item.split("=", 1)[1]
    if value is None or value in ("", "none", "void"):
        return []
    caps = []
    if value == "all":
        gpus = sorted((n for n in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", n)), key=lambda n: int(n[6:]))
    else:
        items = [i.strip() for i in value.split(",") if i.strip()]
        gpus = [f"nvidia{i}" for i in items if i.isdigit()]
        for i in items:
            if i[:4].lower() == "mig-":
                gpu, mig_caps = mig_device(i)
                gpus.append(f"nvidia{gpu}")
                caps += mig_caps
    return ([f"/dev/{n}" for n in gpus if os.path.exists(f"/dev/{n}")] + caps
            + [p for p in CONTROL_NODES if os.path.exists(p)])


def mig_device(uuid: str) -> tuple:
    """(parent GPU minor, [GI cap node, CI cap node]) of a MIG UUID, as libnvidia-container resolves it: NVML
    names the UUID's GPU, GPU instance and compute instance (src/cli/common.c select_mig_device, strcasecmp);
    NVML is played by MIG_NVML (migdriver.publish_mig_layout writes it: no NVML in the VM); the caps' minors
    come from the driver's access files (src/nvc_mount.c nvc_mig_device_access_caps_mount -> cap_device_mount
    -> nvc_nvcaps_device_from_proc_path: DeviceFileMinor of capabilities/gpu<N>/mig/gi<G>[/ci<C>]/access).
    An unknown UUID fails the hook, as the cli's "unknown device" does."""
    try:
        with open(MIG_NVML) as f:
            table = json.load(f)
    except FileNotFoundError:
        table = {}
    hit = [v for k, v in table.items() if k.lower() == uuid.lower()]
    if len(hit) != 1:
        raise SystemExit(f"nvidia-container-cli: device error: {uuid}: unknown device")
    gpu, gi, ci = hit[0]
    base = f"/proc/driver/nvidia/capabilities/gpu{gpu}/mig/gi{gi}"
    caps = []
    for access in (f"{base}/access", f"{base}/ci{ci}/access"):
        with open(access) as f:
            minor = int(re.search(r"^DeviceFileMinor: (\d+)$", f.read(), re.M).group(1))
        caps.append(f"/dev/nvidia-caps/nvidia-cap{minor}")
    return gpu, caps


def make_nodes(pid: int, rootfs: str, nodes: list) -> None:
    """mknod the nodes inside the container's mount namespace (last: setns is one-way)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
    if libc.setns(fd, CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), f"setns into pid {pid}'s mount namespace")
    os.close(fd)
    # Before pivot_root the rootfs is still a path in the namespace; after it, it is /.
    base = rootfs if os.path.isdir(os.path.join(rootfs, "dev")) else "/"
    for path, st in nodes:
        target = os.path.join(base, path.lstrip("/"))
        if os.path.lexists(target):
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)  # /dev/nvidia-caps for MIG capabilities
        os.mknod(target, 0o666 | stat.S_IFCHR, st.st_rdev)
        os.chmod(target, 0o666)


def hook_flags(argv: list) -> tuple:
    """(-config's value, the positional arguments), as Go's flag package parses the hook's command line
    (cmd/nvidia-container-runtime-hook/main.go: -config, -debug, -version; flags stop at the first
    positional argument or `--`)."""
    config, i = "", 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-") or arg == "-":
            break
        name, eq, value = arg.lstrip("-").partition("=")
        if name == "config":
            if not eq:
                i += 1
                value = argv[i]
            config = value
        elif name not in ("debug", "version"):
            raise SystemExit(f"flag provided but not defined: -{name}")
        i += 1
    return config, argv[i:]


def toolkit_config(config_flag: str) -> tuple:
    """(the path read or None, its keys) where the hook of this toolkit release looks (hook_config.go)."""
    import tomllib  # novermin (the guest is Debian 12: Python 3.11)

    version = tuple(int(x) for x in os.environ.get(VERSION_ENV, DEFAULT_VERSION).split("."))
    if config_flag:
        paths, required = [config_flag], True
    elif version >= (1, 18, 0) and os.environ.get("NVIDIA_CTK_CONFIG_FILE_PATH"):
        paths, required = [os.environ["NVIDIA_CTK_CONFIG_FILE_PATH"]], True
    elif version >= (1, 18, 0):
        paths, required = [os.path.join(os.environ.get("XDG_CONFIG_HOME") or "/etc",
                                        "nvidia-container-runtime", "config.toml")], False
    else:
        paths, required = [DRIVER_CONFIG, ETC_CONFIG], False
    for path in paths:
        try:
            with open(path, "rb") as f:
                return path, tomllib.load(f)
        except FileNotFoundError:
            if required:
                raise SystemExit(f"the config {path} does not exist")
    return None, {}


def prestart(state: dict, config_flag: str = "") -> None:
    bundle = state["bundle"]
    with open(os.path.join(bundle, "config.json")) as f:
        spec = json.load(f)
    paths = requested_nodes(spec.get("process", {}).get("env", []))
    if not paths:
        log(f"{state['id']}: no NVIDIA_VISIBLE_DEVICES: nothing to do")
        return
    path, config = toolkit_config(config_flag)
    privileged = "CAP_SYS_ADMIN" in ((spec.get("process") or {}).get("capabilities") or {}).get("bounding", [])
    if not privileged and not config.get("accept-nvidia-visible-devices-envvar-when-unprivileged", True):
        log(f"{state['id']}: REFUSED: NVIDIA_VISIBLE_DEVICES in an unprivileged container, config {path}: "
            "nothing granted")
        return
    log(f"{state['id']}: config {path or 'none (the defaults)'}, privileged {privileged}")
    nodes = [(p, os.stat(p)) for p in paths]
    rules = [(Rule(True, "c", os.major(st.st_rdev), os.minor(st.st_rdev), "rw"), True) for _, st in nodes]
    grant(state["pid"], rules)
    if RELOAD_AFTER_GRANT in spec.get("process", {}).get("env", []):
        reload_after_grant(state)
    rootfs = spec.get("root", {}).get("path", "rootfs")
    log(f"{state['id']}: making {paths} in the container")
    make_nodes(state["pid"], os.path.join(bundle, rootfs), nodes)


def reload_after_grant(state: dict) -> None:
    """systemctl daemon-reload between the grant and state.json, once nvsymlinkd's drop-in of the
    container's scope is there (or RELOAD_WAIT_S passed): one log line with the wait."""
    import subprocess

    scope = proc_cgroups(state["pid"]).get("", proc_cgroups(state["pid"]).get("devices", "")).rpartition("/")[2]
    dropin = f"/run/systemd/system/{scope}.d/90-nvsymlinkd-keep.conf"
    start = time.monotonic()
    while not os.path.exists(dropin) and time.monotonic() - start < RELOAD_WAIT_S:
        time.sleep(0.005)
    waited = time.monotonic() - start
    there = os.path.exists(dropin)
    subprocess.run(["systemctl", "daemon-reload"], check=True, timeout=120)
    log(f"{state['id']}: daemon-reload after the grant; the drop-in of {scope} "
        f"{'was there' if there else 'MISSING'} after {waited:.3f} s")


def main() -> None:
    state = json.load(sys.stdin)
    log(f"{state.get('id')}: hook started for pid {state.get('pid')}")
    try:
        if not re.fullmatch(r"[cb]:\d+:\d+:[rwm]+", (sys.argv[1:] or [""])[0]):
            config_flag, positional = hook_flags(sys.argv[1:])
            if positional[:1] == ["prestart"]:
                prestart(state, config_flag)
            return
        rules = []
        for arg in sys.argv[1:]:
            dev_type, major, minor, access = arg.split(":")
            rules.append((Rule(True, dev_type, int(major), int(minor), access), True))
        grant(state["pid"], rules)
    except Exception as e:
        log(f"{state.get('id')}: FAILED {e!r}")
        raise


if __name__ == "__main__":
    main()
