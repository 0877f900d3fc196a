"""The rendered systemd units: accepted by systemd itself, and as locked down as measured in the docs."""

import re
import subprocess

import pytest

from nvsymlinkd.config import Config
from nvsymlinkd.systemd.render import RenderOptions, render_all
from tests.conftest import need_tool

# Configs that change the units: defaults, driver container, odd paths, metrics over HTTP.
CONFIGS = {
    "default": Config(),
    "driver-container": Config(driver_root="/run/nvidia/driver", create_nodes=True, resync_interval=20,
                               watchdog_sec=0),
    "odd-paths": Config(dev_char_path="/srv/dev char%", state_dir="/var/lib/nv symlinkd"),
    "metrics-local": Config(metrics_listen="127.0.0.1:9402", metrics_textfile=""),
    "metrics-remote": Config(metrics_listen=":9402"),
    # issue 12.8: the bounds of watchdog_sec render as values systemd takes
    "watchdog-min": Config(watchdog_sec=5, resync_interval=1),
    "watchdog-max": Config(watchdog_sec=3600, resync_interval=86400),
    # issue 12.13: state_dir outside /run
    "state-var-lib": Config(state_dir="/var/lib/nvsymlinkd-test"),
    "textfile": Config(metrics_textfile="/var/lib/node_exporter/textfile_collector/nvsymlinkd.prom"),
    # issue 26.4: `$` in path lists (no variables there), paths systemd would ignore unless normalized
    "dollar-paths": Config(dev_char_path="/srv/d$v", state_dir="/var/lib/nv$x", metrics_textfile="/srv/m$t/n.prom",
                           driver_root="/run/nv$d", create_nodes=True),
    "not-normalized": Config(state_dir="/var/lib/../srv/nvs/", dev_char_path="/srv//char/.",
                             metrics_textfile="/srv/./m/n.prom"),
}
MAX_EXPOSURE = 3.0  # docs/packaging.md quotes the measured figure


def rendered_units(tmp_path, name):
    """Units whose ExecStart= names an existing executable, as systemd-analyze verify requires."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    exe = bindir / "nvsymlinkd"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    files = render_all(CONFIGS[name], RenderOptions(bindir=str(bindir)))
    out = tmp_path / name
    out.mkdir()
    units = []
    for fname, text in files.items():
        if fname.endswith(".service"):
            (out / fname).write_text(text)
            units.append(out / fname)
    return units


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_systemd_analyze_verify_is_silent(tmp_path, name):
    tool = need_tool("systemd-analyze")
    for unit in rendered_units(tmp_path, name):
        # --man=no: the man page is checked by the package tests (it is built there)
        proc = subprocess.run([tool, "verify", "--man=no", str(unit)], capture_output=True, text=True,
                              timeout=120, cwd=unit.parent)
        assert proc.returncode == 0 and proc.stderr == "", f"{unit.name} ({name}):\n{proc.stderr}"


def test_verify_would_catch_a_broken_unit(tmp_path):
    """The check above is not vacuous: systemd-analyze reports a bad directive on stderr."""
    tool = need_tool("systemd-analyze")
    unit = rendered_units(tmp_path, "default")[0]
    unit.write_text(unit.read_text().replace("Type=notify", "Type=notifyy"))
    proc = subprocess.run([tool, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=120)
    assert "notifyy" in proc.stderr


def exposure(tool, unit) -> float:
    proc = subprocess.run([tool, "security", "--offline=true", "--no-pager", str(unit)], capture_output=True,
                          text=True, timeout=120, cwd=unit.parent)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d)", proc.stdout)
    assert m, proc.stdout + proc.stderr
    return float(m.group(1))


@pytest.mark.parametrize("name", ["default", "driver-container"])
def test_security_exposure(tmp_path, name):
    tool = need_tool("systemd-analyze")
    for unit in rendered_units(tmp_path, name):
        score = exposure(tool, unit)
        assert score <= MAX_EXPOSURE, f"{unit.name}: exposure {score} > {MAX_EXPOSURE}"


def test_daemon_unit_contract():
    service = render_all(Config())["nvsymlinkd.service"]
    for line in ("Type=notify", "WatchdogSec=30", "Restart=on-failure", "ExecReload=/bin/kill -HUP $MAINPID",
                 "Before=containerd.service docker.service crio.service kubelet.service",
                 "Documentation=man:nvsymlinkd(8)", "ProtectSystem=strict", "NoNewPrivileges=yes",
                 "RestrictAddressFamilies=AF_UNIX AF_NETLINK", "WantedBy=multi-user.target"):
        assert f"\n{line}\n" in service, line
    assert re.search(r"\nAfter=.*systemd-udevd\.service", service)
    caps = re.search(r"\nCapabilityBoundingSet=(.*)\n", service).group(1).split()
    assert sorted(caps) == sorted(["CAP_MKNOD", "CAP_CHOWN", "CAP_FOWNER", "CAP_DAC_OVERRIDE", "CAP_SYS_ADMIN",
                                   "CAP_NET_ADMIN", "CAP_SYS_PTRACE"])
    for cap in caps:  # each one is justified in a comment
        assert re.search(rf"\n#\s+{cap}\s+\S", service) or re.search(rf"\n#\s+[A-Z_, ]*{cap}", service), cap


def test_metrics_listen_opens_only_what_it_needs():
    local = render_all(CONFIGS["metrics-local"])["nvsymlinkd.service"]
    assert "RestrictAddressFamilies=AF_UNIX AF_NETLINK AF_INET AF_INET6\n" in local
    assert "IPAddressAllow=localhost\nIPAddressDeny=any\n" in local
    remote = render_all(CONFIGS["metrics-remote"])["nvsymlinkd.service"]
    assert "IPAddressDeny" not in remote and "AF_INET6" in remote
    assert "IPAddressDeny=any\n" in render_all(Config())["nvsymlinkd.service"]


def test_state_dir_outside_run_gets_state_directory():
    service = render_all(CONFIGS["state-var-lib"])["nvsymlinkd.service"]
    assert "\nStateDirectory=nvsymlinkd-test\n" in service
    assert "\nProtectSystem=strict\n" in service


@pytest.mark.parametrize("name", ["driver-container", "state-var-lib", "metrics-remote", "odd-paths"])
def test_packaged_unit_plus_drop_in_verifies(tmp_path, name):
    """What `render --drop-ins` writes, on top of the packaged units, is accepted by systemd."""
    from nvsymlinkd.systemd.render import render_drop_ins

    tool = need_tool("systemd-analyze")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvsymlinkd").write_text("#!/bin/sh\nexit 0\n")
    (bindir / "nvsymlinkd").chmod(0o755)
    packaged = render_all(Config(), RenderOptions(bindir=str(bindir)))
    drop_ins = render_drop_ins(CONFIGS[name], RenderOptions(bindir=str(bindir)))
    out = tmp_path / "system"
    out.mkdir()
    for unit in ("nvsymlinkd.service", "nvsymlinkd-sync.service"):
        (out / unit).write_text(packaged[unit])
    for rel, text in drop_ins.items():
        if text is not None:
            (out / rel).parent.mkdir(exist_ok=True)
            (out / rel).write_text(text)
    assert any(drop_ins.values())
    for unit in ("nvsymlinkd.service", "nvsymlinkd-sync.service"):
        proc = subprocess.run([tool, "verify", "--man=no", str(out / unit)], capture_output=True, text=True,
                              timeout=120, cwd=out)
        assert proc.returncode == 0 and proc.stderr == "", f"{unit} + drop-in ({name}):\n{proc.stderr}"
    # not vacuous: verify reads the drop-in next to the unit
    conf = out / "nvsymlinkd.service.d" / "50-nvsymlinkd-config.conf"
    conf.write_text(conf.read_text() + "WatchdogSec=soon\n")
    proc = subprocess.run([tool, "verify", "--man=no", str(out / "nvsymlinkd.service")], capture_output=True,
                          text=True, timeout=120, cwd=out)
    assert "soon" in proc.stderr, proc.stderr
