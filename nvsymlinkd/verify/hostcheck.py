"""Host findings: cgroup version, each runtime's cgroup driver, versions, /dev/char links, NVML.

Read-only and cheap: config files and sysfs, no subprocess. Each finding is
`ok`, `warn` (counts as a finding for the exit code) or `info`.
"""

from __future__ import annotations

import json
import os
import re

from nvsymlinkd.containers.ocispec import read_bounded
from nvsymlinkd.containers.runtimes import BY_NAME, PACKAGES, RUNTIMES, DriverConfig
from nvsymlinkd.text import plural
from nvsymlinkd.verify.evaluate import HostFinding

MAX_CONFIG_BYTES = 4 << 20
DPKG_STATUS = "/var/lib/dpkg/status"
MAX_DPKG_BYTES = 32 << 20
OS_RELEASE = ("/etc/os-release", "/usr/lib/os-release")
# runc 1.1.3 to 1.1.6 leave out of the scope's DeviceAllow= a device rule whose /dev/char/M:m link is
# missing at container start: the container loses that device at the next daemon-reload (>= 1.1.7 does
# so only with systemd < 240). An optional dpkg epoch; "1.1.5+ds1-1", "1.1.5-0ubuntu1" all count.
RUNC_AFFECTED = re.compile(r"(?:\d+:)?1\.1\.([3-6])(?![0-9])")


def cgroup_version(root) -> str:
    """v2 (unified at /sys/fs/cgroup), hybrid (v1 controllers + /sys/fs/cgroup/unified), v1, or unknown."""
    base = root.path("/sys/fs/cgroup")
    if os.path.exists(os.path.join(base, "cgroup.controllers")):
        return "v2"
    if os.path.exists(os.path.join(base, "unified", "cgroup.controllers")):
        return "hybrid"
    if os.path.isdir(os.path.join(base, "devices")) or os.path.isdir(os.path.join(base, "memory")):
        return "v1"
    return "unknown"


def _read_text(root, inside: str) -> str | None:
    try:
        return read_bounded(root.path(inside), MAX_CONFIG_BYTES).decode("utf-8", "replace")
    except OSError:
        return None


def _toml(text: str):
    from nvsymlinkd.config import toml_module

    return toml_module().loads(text)


def _driver(runtime: str) -> DriverConfig:
    config = BY_NAME[runtime].driver
    assert config is not None  # the table's entry for a runtime whose reader is named after it
    return config


def _installed(root, inside: str) -> bool:
    """Whether a path that says a runtime is installed exists (ending in "/": as a directory)."""
    if inside.endswith("/"):
        return os.path.isdir(root.path(inside.rstrip("/")))
    return os.path.exists(root.path(inside))


def docker_driver(root, version: str, config: DriverConfig | None = None):
    """(driver, where) from Docker's daemon.json; None when Docker is not configured here."""
    config = config or _driver("docker")
    text = _read_text(root, config.config)
    if text is None:
        if any(_installed(root, p) for p in config.installed):
            default = "systemd" if version == "v2" else "cgroupfs"
            return default, f"default (no {config.config})"
        return None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return "unknown", f"{config.config} is not valid JSON ({exc})"
    opts = doc.get("exec-opts") if isinstance(doc, dict) else None
    for opt in opts if isinstance(opts, list) else []:
        if isinstance(opt, str) and opt.replace(" ", "").startswith("native.cgroupdriver="):
            return opt.split("=", 1)[1].strip(), f"{config.config} exec-opts"
    return ("systemd" if version == "v2" else "cgroupfs"), "default (no native.cgroupdriver in exec-opts)"


def _find_systemd_cgroup(node, path=()):
    """Every (runtime name, value) of a SystemdCgroup key in containerd's config tree."""
    out = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "SystemdCgroup" and isinstance(value, bool):
                name = path[-2] if len(path) >= 2 and path[-1] == "options" else ".".join(path)
                out.append((name, value))
            else:
                out.extend(_find_systemd_cgroup(value, path + (key,)))
    return out


def containerd_driver(root, version: str = "", config: DriverConfig | None = None):
    """(driver, where) from containerd's config.toml (SystemdCgroup of each runtime); None without it."""
    path = (config or _driver("containerd")).config
    text = _read_text(root, path)
    if text is None:
        return None
    try:
        doc = _toml(text)
    except Exception as exc:  # noqa: BLE001 - tomllib's error type differs by version
        return "unknown", f"{path} is not valid TOML ({exc})"
    found = _find_systemd_cgroup(doc)
    if not found:
        return "cgroupfs", f"{path} (no SystemdCgroup: default false)"
    drivers = sorted({"systemd" if v else "cgroupfs" for _, v in found})
    where = ", ".join(f"{n}: SystemdCgroup={'true' if v else 'false'}" for n, v in found)
    return "/".join(drivers), f"{path} ({where})"


CGROUP_MANAGER = re.compile(r'^\s*cgroup_manager\s*=\s*"([^"]*)"', re.M)


def crio_driver(root, version: str = "", config: DriverConfig | None = None):
    """(driver, where) from CRI-O's crio.conf and its crio.conf.d/*.conf; None without either."""
    path = (config or _driver("cri-o")).config
    files = []
    if os.path.exists(root.path(path)):
        files.append(path)
    try:
        names = sorted(n for n in os.listdir(root.path(f"{path}.d")) if n.endswith(".conf"))
    except OSError:
        names = []
    files += [f"{path}.d/{n}" for n in names]
    if not files:
        return None
    value, where = "systemd", "CRI-O default"
    for inside in files:  # later files override earlier ones, as CRI-O merges them
        text = _read_text(root, inside) or ""
        hits = CGROUP_MANAGER.findall(text)
        if hits:
            value, where = hits[-1], inside
    return value, where


# containers.runtimes.DriverConfig.reader -> (root, cgroup version, config) -> (driver, where) or None
DRIVER_READERS = {"docker-json": docker_driver, "containerd-toml": containerd_driver, "crio-conf": crio_driver}


def package_versions(root, names=("systemd", *PACKAGES)) -> dict:
    """Installed versions from dpkg's status file (cheap; no subprocess). {} if not a dpkg system."""
    try:
        data = read_bounded(root.path(DPKG_STATUS), MAX_DPKG_BYTES).decode("utf-8", "replace")
    except OSError:
        return {}
    wanted = set(names)
    out = {}
    for para in data.split("\n\n"):
        if not para.startswith("Package: "):
            continue
        name = para[9:para.find("\n")] if "\n" in para else para[9:]
        if name not in wanted or "Status: install ok installed" not in para:
            continue
        m = re.search(r"^Version: (\S+)", para, re.M)
        if m:
            out[name] = m.group(1)
    return out


def dev_char_findings(snapshot) -> list:
    from nvsymlinkd.devchar.plan import plan_sync

    plan = plan_sync(snapshot)
    wrong = [a for a in plan.actions if a.action in ("create", "replace", "remove")]
    conflicts = plan.conflicts
    if not snapshot.nodes:
        return [HostFinding("dev-char", "info", "no NVIDIA device nodes on this host")]
    out = []
    if wrong:
        what = ", ".join(f"{a.link} ({a.action}: {a.reason})" for a in wrong[:8])
        more = f" and {len(wrong) - 8} more" if len(wrong) > 8 else ""
        out.append(HostFinding("dev-char", "warn", f"{plural(len(wrong), '/dev/char link')} missing or wrong: {what}{more}",
                               "nvsymlinkd sync"))
    if conflicts:
        what = ", ".join(f"{a.link}: {a.reason}" for a in conflicts[:8])
        out.append(HostFinding("dev-char", "warn", f"{plural(len(conflicts), '/dev/char conflict')}: {what}",
                               "remove what is in the way, then nvsymlinkd sync"))
    if not out:
        out.append(HostFinding("dev-char", "ok", f"{plural(len(snapshot.nodes), 'NVIDIA node')}, every /dev/char link exact"))
    return out


def nvml_finding(root, snapshot) -> HostFinding:
    if not root.is_real_root:
        return HostFinding("nvml", "info", "not checked (--root is not /)")
    try:
        import pynvml
    except ImportError:
        return HostFinding("nvml", "info", f"not checked (pynvml not installed: {pynvml_install_hint(root)})")
    gpu_nodes = sum(1 for n in snapshot.nodes if n.kind == "gpu")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError and friends
        if not snapshot.nodes and not snapshot.majors:
            return HostFinding("nvml", "info", f"no NVIDIA driver on this host ({exc})")
        return HostFinding("nvml", "warn", f"NVML does not initialise: {exc}",
                           "check the driver (dmesg, nvidia-smi); nodes and modules must match the driver")
    try:
        count = pynvml.nvmlDeviceGetCount()
    except Exception as exc:  # noqa: BLE001
        return HostFinding("nvml", "warn", f"NVML initialised but cannot count GPUs: {exc}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
    if count != gpu_nodes:
        return HostFinding("nvml", "warn", f"NVML sees {count} GPUs but there are {gpu_nodes} /dev/nvidiaN nodes",
                           "nvidia-modprobe -c N for missing nodes, or nvsymlinkd sync --create-nodes")
    return HostFinding("nvml", "ok", f"NVML initialises; {count} GPUs, matching the nodes")


def os_release(root) -> dict:
    """KEY=value pairs of os-release(5) (quotes removed); {} when there is none."""
    for inside in OS_RELEASE:
        text = _read_text(root, inside)
        if text is None:
            continue
        out = {}
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep and re.fullmatch(r"[A-Z_]+", key):
                out[key] = value.strip().strip("\"'")
        return out
    return {}


def pynvml_install_hint(root) -> str:
    """The distribution's way to get pynvml: Debian 12 and newer refuse a system-wide `pip install`."""
    info = os_release(root)
    ids = {info.get("ID", "")} | set(info.get("ID_LIKE", "").split())
    if ids & {"debian", "ubuntu"}:
        return "apt install python3-pynvml (Debian: from contrib)"
    if ids & {"fedora", "rhel", "centos"}:
        return "pip install nvidia-ml-py into a virtualenv, or the distribution's pynvml package if it has one"
    return "the distribution's pynvml package, or pip install nvidia-ml-py into a virtualenv"


# Other /dev/char link keepers: nvidia-ctk's create-dev-char-symlinks run from a udev rule (NVIDIA's
# documented workaround, usually /lib/udev/rules.d/71-nvidia-dev-char.rules) or a systemd unit, and
# the GPU Operator's validator (which writes its status files to /run/nvidia/validations).
UDEV_RULE_DIRS = ("/etc/udev/rules.d", "/run/udev/rules.d", "/usr/local/lib/udev/rules.d", "/lib/udev/rules.d",
                  "/usr/lib/udev/rules.d")
UNIT_DIRS_ALL = ("/etc/systemd/system", "/run/systemd/system")  # the admin's own units: every one is read
UNIT_DIRS_NVIDIA = ("/lib/systemd/system", "/usr/lib/systemd/system")  # packaged: only nvidia* names
CTK_COMMAND = re.compile(r"create-dev-char-symlinks")
OPERATOR_VALIDATIONS = "/run/nvidia/validations"


def _runs_ctk(root, inside: str) -> bool:
    text = _read_text(root, inside)
    return text is not None and any(CTK_COMMAND.search(line) for line in text.splitlines()
                                    if not line.lstrip().startswith(("#", ";")))


def _names(root, inside: str) -> list:
    try:
        return sorted(os.listdir(root.path(inside)))
    except OSError:
        return []


def other_link_keepers(root) -> list:
    """Paths (as seen inside the root) of udev rules and units that run nvidia-ctk's
    create-dev-char-symlinks, then the GPU Operator's validations directory when present."""
    found, seen = [], set()
    for d in UDEV_RULE_DIRS:
        for name in _names(root, d):
            # a rule file in /etc or /run masks the one of the same name in /lib or /usr/lib
            if not name.endswith(".rules") or name in seen or name == "71-nvsymlinkd.rules":
                continue
            seen.add(name)
            if _runs_ctk(root, f"{d}/{name}"):
                found.append(f"{d}/{name}")
    for dirs, every in ((UNIT_DIRS_ALL, True), (UNIT_DIRS_NVIDIA, False)):
        for d in dirs:
            for name in _names(root, d):
                if not name.endswith(".service") or name.startswith("nvsymlinkd") or not (every or "nvidia" in name):
                    continue
                if _runs_ctk(root, f"{d}/{name}"):
                    found.append(f"{d}/{name}")
    if os.path.isdir(root.path(OPERATOR_VALIDATIONS)):
        found.append(OPERATOR_VALIDATIONS)
    return found


def link_keepers_finding(root):
    """One info line naming every other link keeper found, or None."""
    found = other_link_keepers(root)
    if not found:
        return None
    ctk = [p for p in found if p != OPERATOR_VALIDATIONS]
    parts = []
    if ctk:
        parts.append("nvidia-ctk system create-dev-char-symlinks runs from " + ", ".join(ctk))
    if OPERATOR_VALIDATIONS in found:
        parts.append(f"the GPU Operator's validator is here ({OPERATOR_VALIDATIONS}; it makes links unless "
                     "DISABLE_DEV_CHAR_SYMLINK_CREATION=true)")
    return HostFinding("link-keepers", "info",
                       "; ".join(parts) + ": nvsymlinkd keeps their links (an absolute link to the right node is "
                       "kept), so both can run",
                       "optional: remove the other keeper to leave one owner of /dev/char (install guide, "
                       "\"Coming from nvidia-ctk\", in /usr/share/doc/nvsymlinkd/docs)")


def check_host(root, config, snapshot=None) -> list:
    if snapshot is None:
        from nvsymlinkd.devchar.snapshot import observe

        snapshot = observe(root, config.driver_root, config.dev_char_path, with_driver_info=False)
    out = []
    if os.geteuid() != 0:  # with --root too: the tree's runtime files are as root-only as the host's
        out.append(HostFinding("privilege", "warn", "not running as root: runtime state (/run/runc, "
                               "/run/containerd) and cgroups may be unreadable, containers may be missing",
                               "run nvsymlinkd check as root"))
    version = cgroup_version(root)
    out.append(HostFinding("cgroup-version", "info", f"cgroup {version}"))
    drivers, systemd_driver = _cgroup_driver_findings(root, version)
    out += drivers
    out += _version_findings(root, systemd_driver)
    out.extend(dev_char_findings(snapshot))
    keepers = link_keepers_finding(root)
    if keepers is not None:
        out.append(keepers)
    out.append(nvml_finding(root, snapshot))
    return out


def _cgroup_driver_findings(root, version: str) -> tuple:
    """Each runtime's cgroup driver -> (findings, whether one may use systemd's)."""
    out, systemd_driver = [], False
    for runtime in RUNTIMES:
        if runtime.driver is None:
            continue
        result = DRIVER_READERS[runtime.driver.reader](root, version, runtime.driver)
        if result is None:
            continue
        driver, where = result
        if "systemd" in driver or driver == "unknown":
            systemd_driver = True
        if "systemd" in driver:
            out.append(HostFinding("cgroup-driver", "info",
                                   f"{runtime.name}: {driver} cgroup driver ({where}); containers depend on "
                                   "/dev/char links and their scopes' DeviceAllow surviving daemon-reload"))
        else:
            out.append(HostFinding("cgroup-driver", "info", f"{runtime.name}: {driver} cgroup driver ({where})"))
    return out, systemd_driver


def _version_findings(root, systemd_driver: bool) -> list:
    """The packages' versions, and a warning when this runc drops device rules (with the systemd driver)."""
    versions = package_versions(root)
    if not versions:
        return []
    runc = versions.get("runc", "")
    out = [HostFinding("versions", "info", ", ".join(f"{k} {v}" for k, v in sorted(versions.items())))]
    if "systemd" in versions and not os.path.isdir(root.path("/run/systemd/system")):
        # sd_booted(): systemd as PID 1 makes /run/systemd/system; a package alone runs nothing
        out.append(HostFinding("systemd", "info", f"systemd {versions['systemd']} is installed but not running "
                               "(PID 1 is not systemd: no /run/systemd/system): no scopes, no daemon-reload, "
                               "nvsymlinkd.service will not start",
                               "run `nvsymlinkd run` under this host's init (or the DaemonSet); the reload "
                               "failure cannot happen here, but links and verification still matter"))
    if RUNC_AFFECTED.match(runc):
        affected = (f"this host's runc {runc} is in 1.1.3-1.1.6, which drops a device rule whose /dev/char "
                    "link is missing at container start when it uses the systemd cgroup driver")
        if systemd_driver:
            out.append(HostFinding("runc", "warn", f"{affected}; a runtime here uses that driver",
                                   "keep /dev/char links exact before containers start (nvsymlinkd-sync.service "
                                   "at boot, nvsymlinkd.service), or upgrade runc to 1.1.7 or later"))
        else:
            out.append(HostFinding("runc", "info", f"{affected}; no runtime here uses that driver"))
    return out
