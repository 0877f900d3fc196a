"""The CLI as an operator meets it: warnings, summaries that match what happened, JSON errors,
option placement, one wording per error (issue 15, items 5, 6, 8, 9)."""

import json
import os
import subprocess
import sys

import pytest

from tests.fakehost import FakeHost, standard_host

pytestmark = pytest.mark.root


def cli(*argv, check=None, prefix=()):
    proc = subprocess.run([*prefix, sys.executable, "-m", "nvsymlinkd", *map(str, argv)],
                          capture_output=True, text=True, timeout=120)
    if check is not None and proc.returncode != check:
        raise AssertionError(f"exit {proc.returncode} != {check}\nstdout:{proc.stdout}\nstderr:{proc.stderr}")
    return proc


# --- item 5: an empty pass says why ------------------------------------------------------------


def test_sync_without_driver_warns_and_exits_0(tmp_path, need_root):
    host = FakeHost(tmp_path)
    host.proc_devices({})
    proc = cli("--root", host.root, "sync", check=0)
    assert "warning: NVIDIA driver not loaded" in proc.stderr
    assert proc.stdout.splitlines() == ["sync: 0 NVIDIA nodes; 0 links created, 0 kept"]
    doc = json.loads(cli("--root", host.root, "sync", "--json", check=0).stdout)
    assert any("NVIDIA driver not loaded" in w for w in doc["warnings"])


def test_sync_with_missing_driver_root_warns_and_exits_0(tmp_path, need_root):
    host = standard_host(tmp_path)
    proc = cli("--root", host.root, "sync", "--driver-root", "/run/nvidia/drvier", check=0)
    assert "warning: driver root /run/nvidia/drvier does not exist" in proc.stderr
    assert str(host.root) not in proc.stderr
    # a driver root that is there: no word
    host.path("/run/nvidia/driver/dev").mkdir(parents=True)
    proc = cli("--root", host.root, "sync", "--driver-root", "/run/nvidia/driver", check=0)
    assert "does not exist" not in proc.stderr


# --- item 6: summaries count what happened -------------------------------------------------------


def test_failed_link_creates_are_not_counted_as_created(tmp_path, need_root):
    host = standard_host(tmp_path, gpus=1)
    d = host.path("/dev/char")
    d.mkdir()
    os.chown(d, 12345, 12345)  # not root's: without CAP_DAC_OVERRIDE root cannot write here
    nocaps = ("setpriv", "--bounding-set=-all", "--inh-caps=-all")
    proc = cli("--root", host.root, "sync", check=1, prefix=nocaps)
    lines = proc.stdout.splitlines()
    assert lines[-1] == "sync: 5 NVIDIA nodes; 0 links created, 0 kept, 5 failed (5 create)"
    assert "CAP_MKNOD" not in proc.stdout  # links need no CAP_MKNOD
    assert "FAILED: permission denied (run as root)" in lines[0]
    doc = json.loads(cli("--root", host.root, "sync", "--json", check=1, prefix=nocaps).stdout)
    assert doc["summary"]["create"] == 0 and doc["summary"]["error"] == 5
    assert doc["summary"]["failed"] == {"create": 5}


def test_create_nodes_summary_counts_the_nodes_it_made(tmp_path, need_root):
    host = FakeHost(tmp_path)
    host.proc_devices({"nvidia": 195})
    host.gpu("0000:3b:00.0", 0)
    dry = cli("--root", host.root, "sync", "--create-nodes", "--dry-run", check=1).stdout.splitlines()
    assert dry[-1] == "sync (dry run): 0 NVIDIA nodes (2 would be created); would create 2 links, 0 kept"
    out = cli("--root", host.root, "sync", "--create-nodes", check=0).stdout.splitlines()
    assert out[-1] == "sync: 2 NVIDIA nodes (2 created); 2 links created, 0 kept"
    again = cli("--root", host.root, "sync", "--create-nodes", check=0).stdout.splitlines()
    assert again[-1] == "sync: 2 NVIDIA nodes; 0 links created, 2 kept"


def test_dry_run_says_would(tmp_path, need_root):
    host = standard_host(tmp_path, gpus=1)
    host.symlink("/dev/char/510:0", "../nvidia-uvm-old")
    out = cli("--root", host.root, "sync", "--dry-run", check=1).stdout.splitlines()
    assert out[-1] == "sync (dry run): 5 NVIDIA nodes; would create 4 links, would replace 1, 0 kept"
    host2 = standard_host(tmp_path / "one", gpus=0)
    for name in os.listdir(host2.path("/dev")):
        if name != "nvidiactl" and name != "char":
            os.unlink(host2.path(f"/dev/{name}"))
    out = cli("--root", host2.root, "sync", "--dry-run", check=1).stdout.splitlines()
    assert out[-1] == "sync (dry run): 1 NVIDIA node; would create 1 link, 0 kept"


def test_check_counts_in_words_that_match(tmp_path, need_root):
    host = standard_host(tmp_path, gpus=1)
    cli("--root", host.root, "sync", check=0)
    os.unlink(host.path("/dev/char/195:0"))
    out = cli("--root", host.root, "check", "--no-bus", check=1).stdout
    assert "warn dev-char: 1 /dev/char link missing or wrong: /dev/char/195:0" in out


# --- item 8: --json errors, option placement, hints under --root, one wording ---------------------


@pytest.mark.parametrize("argv", [
    ("sync", "--json"),  # /proc/devices missing: exit 2 from the host read
    ("check", "--json", "--no-bus", "deadbeef"),  # no such container
    ("sync", "--json", "--bogus"),  # a usage error
])
def test_json_runs_that_fail_print_a_json_error(tmp_path, need_root, argv):
    host = FakeHost(tmp_path)
    if argv[0] == "check":
        host.proc_devices({"nvidia-frontend": 195})
    proc = cli("--root", host.root, *argv, check=2)
    doc = json.loads(proc.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 2 and doc["error"]
    assert doc["error"] in proc.stderr


def test_global_options_after_the_subcommand(tmp_path, need_root):
    host = standard_host(tmp_path, gpus=1)
    before = cli("--root", host.root, "sync", "--dry-run", check=1).stdout
    after = cli("sync", "--dry-run", "--root", host.root, check=1).stdout
    assert before == after
    conf = host.write("/etc/other.toml", 'dev_char_path = "/dev/char2"\n')
    cli("sync", "--root", host.root, "--config", conf, check=0)
    assert host.links("/dev/char2")["195:0"] == "../nvidia0"
    # given after the subcommand, it wins over the one before
    cli("--root", "/nonexistent-root", "sync", "--root", host.root, check=0)


def test_fix_hints_under_root_carry_it(tmp_path, need_root):
    host = standard_host(tmp_path, gpus=1)
    out = cli("--root", host.root, "check", "--no-bus", check=1).stdout
    assert f"fix: nvsymlinkd --root {host.root} sync" in out
    proc = cli("--root", host.root, "check", "--no-bus", "deadbeef", check=2)
    assert f"`nvsymlinkd --root {host.root} check` lists them" in proc.stderr


def test_check_and_repair_word_an_unknown_container_the_same(tmp_path, need_root):
    host = standard_host(tmp_path, gpus=1)
    check = cli("--root", host.root, "check", "--no-bus", "deadbeef", check=2).stderr.strip()
    repair = cli("--root", host.root, "repair", "deadbeef", check=2).stderr.strip()
    assert check == repair
    assert check.startswith("nvsymlinkd: no container matches 'deadbeef' (give an id")


# --- item 9: the runc range names this host's version; the distribution's way to install pynvml ---

DPKG = ("Package: runc\nStatus: install ok installed\nVersion: {runc}\n\n"
        "Package: systemd\nStatus: install ok installed\nVersion: 252.39-1\n\n")


@pytest.mark.parametrize("runc, systemd_driver, status", [
    ("1.1.5+ds1-1+deb12u1", True, "warn"), ("1.1.5+ds1-1+deb12u1", False, "info"),
    ("1.1.12-0ubuntu3", True, None), ("1.1.7-1", True, None),
])
def test_runc_in_the_affected_range_is_a_warning_naming_the_version(tmp_path, need_root, runc, systemd_driver,
                                                                     status):
    host = standard_host(tmp_path, gpus=1)
    cli("--root", host.root, "sync", check=0)
    host.write("/var/lib/dpkg/status", DPKG.format(runc=runc))
    host.write("/etc/docker/daemon.json",
               json.dumps({"exec-opts": [f"native.cgroupdriver={'systemd' if systemd_driver else 'cgroupfs'}"]}))
    proc = cli("--root", host.root, "check", "--no-bus", "--json", check=1 if status == "warn" else 0)
    found = [h for h in json.loads(proc.stdout)["host"] if h["kind"] == "runc"]
    if status is None:
        assert found == []
        return
    (h,) = found
    assert h["status"] == status
    assert f"this host's runc {runc} is in 1.1.3-1.1.6" in h["detail"]
    human = cli("--root", host.root, "check", "--no-bus").stdout
    assert f"{status:4s} runc: this host's runc {runc}" in human


def test_podman_and_crun_versions_are_in_the_host_findings(tmp_path, need_root):
    """Every runtime's packages from the runtime table, Podman's and crun's as runc's (issue 36, item 5);
    a package dpkg lists as removed is not reported."""
    host = standard_host(tmp_path, gpus=1)
    host.write("/var/lib/dpkg/status", DPKG.format(runc="1.1.12-1")
               + "Package: podman\nStatus: install ok installed\nVersion: 4.3.1+ds1-8+deb12u1\n\n"
               + "Package: crun\nStatus: install ok installed\nVersion: 1.8.1-1+deb12u1\n\n"
               + "Package: cri-o\nStatus: deinstall ok config-files\nVersion: 1.25.0-1\n\n")
    doc = json.loads(cli("--root", host.root, "check", "--no-bus", "--json").stdout)
    (versions,) = [h for h in doc["host"] if h["kind"] == "versions"]
    assert versions["detail"] == "crun 1.8.1-1+deb12u1, podman 4.3.1+ds1-8+deb12u1, runc 1.1.12-1, systemd 252.39-1"


def test_pynvml_advice_is_the_distributions_way(need_root):
    try:
        import pynvml  # noqa: F401
        pytest.skip("pynvml is installed here: no advice to give")
    except ImportError:
        pass
    ids = set()
    for line in open("/etc/os-release").read().splitlines():
        key, _, value = line.partition("=")
        if key in ("ID", "ID_LIKE"):
            ids |= set(value.strip('"').split())
    doc = json.loads(cli("check", "--no-bus", "--json").stdout)
    (nvml,) = [h for h in doc["host"] if h["kind"] == "nvml"]
    if ids & {"debian", "ubuntu"}:
        assert "apt install python3-pynvml" in nvml["detail"]
        assert "pip install" not in nvml["detail"]  # Debian 12 refuses it (externally managed)
    else:
        assert "virtualenv" in nvml["detail"]
