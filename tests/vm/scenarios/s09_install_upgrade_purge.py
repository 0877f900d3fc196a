"""Scenario 9: docs/install.md followed literally on a host that used nvidia-ctk (issues 15, 36).

Before: nvidia-ctk's udev rule (/lib/udev/rules.d/71-nvidia-dev-char.rules, NVIDIA's workaround)
and the absolute links it makes, a GPU container running. Then, as the guide says, through apt-get
from the apt repository scripts/make-repos made on the host (the step of build-packages --repo),
as a fleet's configuration management would:
- Install: the repository in sources.list.d, `apt-get update`, `apt-get install nvsymlinkd`,
  `systemctl status`, `nvsymlinkd check` (names the other link keeper once, as info); nvidia-ctk's
  absolute links are kept, the daemon adds the rest.
- Coming from nvidia-ctk: delete the rule, `udevadm control --reload`; check no longer names it.
- A config change the documented way: edit the toml, `render --drop-ins /etc/systemd/system`,
  daemon-reload, restart.
- Upgrade: V+1 (the same source rebuilt as a higher version) published next to V in the same
  repository, `apt-get update`, `apt-get install nvsymlinkd`: the daemon restarted on the new
  version, the operator's config and drop-in kept, /run state kept, no duplicate units.
- Uninstall: `apt-get remove` (conffile kept), the drop-ins removed as the guide says, `apt-get
  purge`: nothing of the package left; the /dev/char links stay (the guide says why) and a
  daemon-reload after the purge leaves the container its GPU.
"""
# vm: nvsymlinkd=off packages=upgrade timeout=400
import glob
import json
import os
import re
import shutil
import time

from tests.vm.guest.vmguest import (
    Scenario,
    daemon_reload,
    load_fake_driver,
    mknod,
    sh,
    start_gpu_container,
    unit_property,
    wait_for,
)

RELEASES = "/mnt/run/repos"   # vmhost.package_repos: first/deb (V), second/deb (V and V+1)
MIRROR = "/srv/nvsymlinkd"     # the fleet's repository, as docs/packaging.md's example serves it
# Unsigned ([trusted=yes], docs/packaging.md): apt's signature check is held on the host by
# tests/test_packages.py (signed-by taken, refused after a re-index); what dpkg and systemd do is the same.
SOURCE = "/etc/apt/sources.list.d/nvsymlinkd.list"
# check-date=no: a guest restored from a base snapshot runs on the snapshot's clock, minutes behind the host
# that dated the Release file, and apt refuses a Release "not valid yet" (sources.list(5), Check-Date). A
# fleet's hosts keep their clocks by NTP; the first CI run on a fresh machine met this, the fresh boots did not.
SOURCE_LINE = f"deb [trusted=yes check-date=no] file://{MIRROR}/deb ./\n"
CTK_RULE = "/lib/udev/rules.d/71-nvidia-dev-char.rules"
CTK_RULE_TEXT = ('ACTION=="add", DEVPATH=="/bus/pci/drivers/nvidia", '
                 'RUN+="/usr/bin/nvidia-ctk system create-dev-char-symlinks --create-all"\n')
# A stand-in for nvidia-ctk: absolute /dev/char/M:m -> /dev/nvidiaX links for every NVIDIA node,
# which is what `nvidia-ctk system create-dev-char-symlinks --create-all` leaves behind.
FAKE_CTK = """#!/bin/sh
[ "$1 $2" = "system create-dev-char-symlinks" ] || exit 2
mkdir -p /dev/char
for n in /dev/nvidia*; do
    [ -c "$n" ] || continue
    ln -sfn "$n" "/dev/char/$((0x$(stat -c %t "$n"))):$((0x$(stat -c %T "$n")))"
done
"""
CONFIG = "/etc/nvsymlinkd/nvsymlinkd.toml"
DROP_IN = "/etc/systemd/system/nvsymlinkd.service.d/50-nvsymlinkd-config.conf"
# docs/install.md, Uninstall: the operator's drop-ins, which the package does not own
DROP_IN_RM = "rm -rf /etc/systemd/system/nvsymlinkd.service.d /etc/systemd/system/nvsymlinkd-sync.service.d"
UNIT = "nvsymlinkd.service"
PACKAGED_UNITS = ["/lib/systemd/system/nvsymlinkd-sync.service", "/lib/systemd/system/nvsymlinkd.service"]
# An operator's shell: not the runner's PYTHONPATH (the 9p source tree), or `nvsymlinkd` and the
# postinst's sync would import the source instead of the installed package.
OPERATOR_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}


APT_SECONDS: dict = {}  # apt-get/apt-cache command -> seconds, summed (the scenario's timings)


def apt_get(*argv, tool="apt-get"):
    """apt-get as configuration management runs it (-y, noninteractive)."""
    start = time.monotonic()
    proc = sh(tool, *argv, check=False, timeout=300, env=dict(OPERATOR_ENV, DEBIAN_FRONTEND="noninteractive"))
    key = f"{tool}_{argv[0]}"
    APT_SECONDS[key] = APT_SECONDS.get(key, 0.0) + time.monotonic() - start
    return proc


def publish(release):
    """The operator's repository gets a release: its .debs added next to the ones there, the indexes replaced."""
    shutil.copytree(os.path.join(RELEASES, release, "deb"), os.path.join(MIRROR, "deb"), dirs_exist_ok=True)


def apt_update():
    """`apt-get update` of the nvsymlinkd source alone: the guest has no network, and the image's Debian
    mirrors cannot be reached (a fleet's plain `apt-get update` reads this source the same way)."""
    return apt_get("update", f"-oDir::Etc::SourceList={SOURCE}", "-oDir::Etc::SourceParts=-",
                   "-oAPT::Get::List-Cleanup=0")


def candidate():
    """(installed, candidate, versions the repository offers) from apt-cache policy."""
    out = apt_get("policy", "nvsymlinkd", tool="apt-cache").stdout
    field = lambda name: (re.search(rf"^\s+{name}: (\S+)$", out, re.M) or [None, None])[1]  # noqa: E731
    offered = re.findall(rf"^\s+(?:\*\*\* )?(\S+) \d+\n\s+\d+ file:{MIRROR}/deb \./ Packages$", out, re.M)
    return field("Installed"), field("Candidate"), sorted(offered)


def taken_from_repo(output, version):
    """apt-get's own line for taking nvsymlinkd VERSION from the repository."""
    return re.search(rf"^Get:\d+ file:{MIRROR}/deb \./ nvsymlinkd {re.escape(version)} ", output, re.M) is not None


def cli(*argv):
    return sh("nvsymlinkd", *argv, check=False, timeout=120, env=OPERATOR_ENV)


def operator_sh(command):
    return sh("sh", "-c", command, check=False, env=OPERATOR_ENV)


def links():
    """/dev/char link -> its target, for every NVIDIA major."""
    out = {}
    for path in sorted(glob.glob("/dev/char/*")):
        if os.path.islink(path) and os.path.basename(path).startswith("195:"):
            out[os.path.basename(path)] = os.readlink(path)
    return out


def keeper_lines():
    """(check's exit code, its link-keepers lines in text, its link-keepers entries in --json)."""
    text = cli("check")
    doc = cli("check", "--json")
    try:
        host = json.loads(doc.stdout).get("host", [])
    except ValueError:
        host = [{"kind": "unparsable --json", "detail": doc.stdout[-300:] + doc.stderr[-300:]}]
    return (text.returncode, [ln.strip() for ln in text.stdout.splitlines() if "link-keepers" in ln],
            [h for h in host if h.get("kind") == "link-keepers"])


def package_status():
    return sh("dpkg-query", "-W", "-f=${Status} ${Version}", "nvsymlinkd", check=False).stdout.strip()


def ours(*roots):
    """Every path named *nvsymlinkd* under roots (the package's files, dpkg's and systemd's records)."""
    out = sh("find", *roots, "-xdev", "-name", "*nvsymlinkd*", check=False).stdout.split()
    # the operator's: the repository's apt source and apt's lists of it (not the package's, left to them)
    return sorted(p for p in out if not p.startswith(("/run/vmtest", SOURCE, "/var/lib/apt/lists/")))


def unit_files():
    listed = sh("systemctl", "list-unit-files", "--no-legend", "--no-pager", "nvsymlinkd*", check=False).stdout
    return sorted(line.split()[0] for line in listed.splitlines() if line.strip())


def units_known():
    listed = sh("systemctl", "list-units", "--all", "--no-legend", "--no-pager", "nvsymlinkd*", check=False).stdout
    return [line.split()[0 if not line.startswith("●") else 1] for line in listed.splitlines() if line.strip()]


def baselines():
    return sorted(os.path.basename(p) for p in glob.glob("/run/nvsymlinkd/baselines/*.json"))


with Scenario() as sc:
    releases = {}
    for release in ("first", "second"):
        with open(os.path.join(RELEASES, release, "deb", "Packages")) as f:
            releases[release] = sorted(re.findall(r"^Version: (\S+)$", f.read(), re.M),
                                       key=lambda v: [int(x) for x in re.findall(r"\d+", v)])
    sc.check("the repository's first release has one package, the second adds a higher version next to it",
             len(releases["first"]) == 1 and len(releases["second"]) == 2
             and releases["second"][0] == releases["first"][0], str(releases))
    old_version, new_version = releases["second"]

    # ---- before: a GPU host running nvidia-ctk's workaround, a GPU container on it
    load_fake_driver()
    gpu0 = mknod("/dev/nvidia0", 195, 0)
    ctl = mknod("/dev/nvidiactl", 195, 255)
    with open("/usr/bin/nvidia-ctk", "w") as f:
        f.write(FAKE_CTK)
    os.chmod("/usr/bin/nvidia-ctk", 0o755)
    with open(CTK_RULE, "w") as f:
        f.write(CTK_RULE_TEXT)
    sh("udevadm", "control", "--reload")
    sh("nvidia-ctk", "system", "create-dev-char-symlinks", "--create-all")   # what the rule runs at driver bind
    ctk_links = links()
    sc.check("nvidia-ctk's absolute links are there before the install",
             ctk_links == {"195:0": "/dev/nvidia0", "195:255": "/dev/nvidiactl"}, str(ctk_links))
    ctr = start_gpu_container("gpu-s09", [gpu0, ctl])
    sc.expect_open(ctr, "/dev/nvidia0", "OK", "before the install")
    # A GPU the rule never saw (nvidia-ctk runs once, at driver bind): nvsymlinkd links it.
    gpu1 = mknod("/dev/nvidia1", 195, 1)

    # ---- Install, from the repository
    publish("first")
    with open(SOURCE, "w") as f:
        f.write(SOURCE_LINE)
    proc = apt_update()
    sc.check("apt-get update reads the repository", proc.returncode == 0 and "Err:" not in proc.stdout
             and "E:" not in proc.stderr, (proc.stdout + proc.stderr)[-800:])
    sc.check(f"apt-cache policy: not installed, candidate {old_version} from the repository",
             candidate() == ("(none)", old_version, [old_version]), str(candidate()))
    proc = apt_get("install", "-y", "nvsymlinkd")
    sc.check("apt-get install nvsymlinkd exits 0, the package taken from the repository",
             proc.returncode == 0 and taken_from_repo(proc.stdout, old_version), (proc.stdout + proc.stderr)[-800:])
    sc.fact("apt_install_output", (proc.stdout + proc.stderr)[-3000:])
    sc.check(f"dpkg: install ok installed {old_version}", package_status() == f"install ok installed {old_version}",
             package_status())
    status = sh("systemctl", "status", "--no-pager", UNIT, check=False)
    sc.check("systemctl status nvsymlinkd: active (running), enabled",
             "Active: active (running)" in status.stdout and "enabled;" in status.stdout,
             status.stdout.splitlines()[1:3].__str__())
    first_pid = unit_property(UNIT, "MainPID")
    want = {"195:0": "/dev/nvidia0", "195:255": "/dev/nvidiactl", "195:1": "../nvidia1"}
    got, _ = wait_for(lambda: links() == want and links(), timeout=15)
    sc.check("links exact: nvidia-ctk's absolute ones kept as they were, the new GPU's made by nvsymlinkd",
             got == want, str(links()))
    dry = cli("sync", "--dry-run", "--json")
    try:
        actions = sorted({a["action"] for a in json.loads(dry.stdout)["actions"]})
    except (ValueError, KeyError):
        actions = [f"unparsable: {dry.stdout[-200:]} {dry.stderr[-200:]}"]
    sc.check("nvsymlinkd sync --dry-run: every link is keep (absolute links are not rewritten)",
             dry.returncode == 0 and actions == ["keep"], f"exit {dry.returncode}, actions {actions}")
    rc, text_lines, json_entries = keeper_lines()
    sc.fact("check_link_keepers_before", text_lines)
    sc.check("nvsymlinkd check names nvidia-ctk's rule once, as info (exit 0)",
             rc == 0 and len(text_lines) == 1 and text_lines[0].startswith("info link-keepers:")
             and CTK_RULE in text_lines[0]
             and len(json_entries) == 1 and json_entries[0].get("status") == "info",
             f"exit {rc}: {text_lines} / {json_entries}")
    sc.expect_open(ctr, "/dev/nvidia0", "OK", "after the install")
    found, waited = wait_for(baselines, timeout=30, interval=0.2)
    sc.check("the daemon recorded the running container's baseline in /run/nvsymlinkd", bool(found),
             f"{found} after {waited:.1f} s")

    # ---- Coming from nvidia-ctk: leave one owner
    os.unlink(CTK_RULE)
    sh("udevadm", "control", "--reload")
    rc, text_lines, json_entries = keeper_lines()
    sc.check("after removing the rule, nvsymlinkd check names no other link keeper",
             rc == 0 and not text_lines and not json_entries, f"exit {rc}: {text_lines}")
    sc.check("nvidia-ctk's absolute links are still there, unchanged", links() == want, str(links()))

    # ---- A config change the documented way
    with open(CONFIG, "a") as f:
        f.write("\nwatchdog_sec = 60\n")
    proc = cli("render", "--drop-ins", "/etc/systemd/system")
    sc.check("nvsymlinkd render --drop-ins /etc/systemd/system exits 0", proc.returncode == 0,
             (proc.stdout + proc.stderr)[-500:])
    daemon_reload()
    sh("systemctl", "restart", UNIT, timeout=120)
    sc.check("the drop-in is in force on the packaged unit (WatchdogSec=60)",
             unit_property(UNIT, "WatchdogUSec") == "1min" and DROP_IN in unit_property(UNIT, "DropInPaths")
             and unit_property(UNIT, "FragmentPath") == PACKAGED_UNITS[1],
             f"{unit_property(UNIT, 'WatchdogUSec')} {unit_property(UNIT, 'DropInPaths')}")
    config_before = open(CONFIG).read()
    drop_in_before = open(DROP_IN).read()
    state_before = baselines()
    pid_before = unit_property(UNIT, "MainPID")
    sc.check("restarted with the config change", pid_before not in ("0", first_pid), f"{first_pid} -> {pid_before}")

    # ---- Upgrade: the next release published next to the first
    publish("second")
    proc = apt_update()
    sc.check("apt-get update reads the repository's next release", proc.returncode == 0 and "Err:" not in proc.stdout
             and "E:" not in proc.stderr, (proc.stdout + proc.stderr)[-800:])
    sc.check(f"apt-cache policy: {old_version} installed, candidate {new_version}, both offered (a rollback stays "
             "possible)", candidate() == (old_version, new_version, sorted([old_version, new_version])),
             str(candidate()))
    before_upgrade = time.monotonic()
    proc = apt_get("install", "-y", "nvsymlinkd")
    sc.fact("apt_upgrade_output", (proc.stdout + proc.stderr)[-3000:])
    sc.check(f"apt-get install nvsymlinkd upgrades to {new_version} from the repository, without a conffile "
             "question", proc.returncode == 0 and taken_from_repo(proc.stdout, new_version)
             and "Configuration file" not in proc.stdout, (proc.stdout + proc.stderr)[-800:])
    sc.check(f"dpkg: install ok installed {new_version}", package_status() == f"install ok installed {new_version}",
             package_status())
    pid_after = unit_property(UNIT, "MainPID")
    version = cli("--version").stdout.strip()
    started = int(unit_property(UNIT, "ExecMainStartTimestampMonotonic") or 0) / 1e6   # CLOCK_MONOTONIC
    sc.check(f"the daemon was restarted by the upgrade, on the new version ({version})",
             unit_property(UNIT, "ActiveState") == "active" and pid_after not in ("0", pid_before)
             and started > before_upgrade and version == f"nvsymlinkd {new_version}",
             f"MainPID {pid_before} -> {pid_after} started {started - before_upgrade:+.1f} s after apt began, "
             f"{version}")
    daemon_cmd = open(f"/proc/{pid_after}/cmdline").read().replace("\0", " ") if pid_after != "0" else ""
    sc.fact("daemon_cmdline_after_upgrade", daemon_cmd)
    sc.check("the operator's config file kept (conffile)", open(CONFIG).read() == config_before
             and not glob.glob(CONFIG + ".dpkg-*"), str(glob.glob(CONFIG + ".dpkg-*")))
    sc.check("the drop-in kept and still in force", os.path.exists(DROP_IN) and open(DROP_IN).read() == drop_in_before
             and unit_property(UNIT, "WatchdogUSec") == "1min", unit_property(UNIT, "WatchdogUSec"))
    unit_paths = sorted({os.path.realpath(p) for d in ("/lib", "/usr/lib", "/etc", "/run", "/usr/local/lib")
                         for p in glob.glob(f"{d}/systemd/system/nvsymlinkd*.service")})
    sc.check("no duplicate units: the two packaged ones, each once, nothing in /etc or /run",
             unit_files() == ["nvsymlinkd-sync.service", "nvsymlinkd.service"]
             and unit_paths == [os.path.realpath(p) for p in PACKAGED_UNITS], f"{unit_files()} {unit_paths}")
    sc.check("/run/nvsymlinkd kept across the upgrade (baselines)", set(state_before) <= set(baselines())
             and bool(state_before), f"{state_before} -> {baselines()}")
    sc.check("links unchanged by the upgrade", links() == want, str(links()))
    sc.expect_open(ctr, "/dev/nvidia0", "OK", "after the upgrade")

    # ---- Uninstall: remove, then the drop-ins as the guide says, then purge
    state_before = baselines()
    proc = apt_get("remove", "-y", "nvsymlinkd")
    sc.fact("apt_remove_output", (proc.stdout + proc.stderr)[-2000:])
    sc.check("apt-get remove nvsymlinkd exits 0", proc.returncode == 0, (proc.stdout + proc.stderr)[-800:])
    sc.check("dpkg: removed, config files kept", package_status().startswith("deinstall ok config-files"),
             package_status())
    sc.check("the daemon stopped", unit_property(UNIT, "ActiveState") in ("inactive", ""),
             unit_property(UNIT, "ActiveState"))
    sc.check("the config file stays until purge (conffile)", open(CONFIG).read() == config_before)
    sc.check("the udev rule and units gone", not os.path.exists("/lib/udev/rules.d/71-nvsymlinkd.rules")
             and not any(os.path.exists(p) for p in PACKAGED_UNITS))
    left = ours("/usr", "/lib", "/etc", "/var")
    sc.fact("left_after_remove", left)
    # Debian policy: remove keeps the conffile and the units' enablement (dangling *.wants links and
    # deb-systemd-helper's record: a reinstall comes back enabled) until purge; dpkg keeps its record.
    sc.check("after remove only what policy keeps until purge is left (conffile, enablement, dpkg's record), "
             "the operator's drop-in, the state in /run",
             all(p.startswith(("/etc/nvsymlinkd", "/etc/systemd/system/nvsymlinkd.service.d", "/var/lib/dpkg/info/",
                               "/var/lib/systemd/deb-systemd-helper-enabled/"))
                 or re.match(r"/etc/systemd/system/[\w.-]+\.wants/nvsymlinkd(-sync)?\.service$", p)
                 for p in left) and baselines() == state_before, f"{left} {baselines()}")
    proc = operator_sh(DROP_IN_RM)
    sc.check("the guide's removal of the drop-ins works", proc.returncode == 0, proc.stderr)
    proc = apt_get("purge", "-y", "nvsymlinkd")
    sc.fact("apt_purge_output", (proc.stdout + proc.stderr)[-2000:])
    sc.check("apt-get purge nvsymlinkd exits 0", proc.returncode == 0, (proc.stdout + proc.stderr)[-800:])
    listed = sh("dpkg", "-l", "nvsymlinkd", check=False)
    sc.check("dpkg -l nvsymlinkd: no such package", listed.returncode != 0 and "no packages found" in listed.stderr,
             (listed.stdout + listed.stderr)[-300:])
    left = ours("/usr", "/lib", "/etc", "/var", "/run")
    sc.check("after purge nothing of ours under /usr, /lib, /etc, /var or /run", not left, str(left))
    sc.check("systemctl knows no nvsymlinkd units", not unit_files() and not units_known(),
             f"{unit_files()} {units_known()}")
    sc.check("the /dev/char links stay after the purge (install.md: Uninstall)", links() == want, str(links()))
    daemon_reload()
    sc.expect_open(ctr, "/dev/nvidia0", "OK", "after the purge and a daemon-reload (links kept)")
    for key, seconds in sorted(APT_SECONDS.items()):
        sc.timing(key, seconds)
    ctr.delete()
