"""`nvsymlinkd render`: the templates rendered for real configs, compared with reviewed golden files.

Regenerate after an intended template change with NVSYMLINKD_REGEN_GOLDEN=1 and review the diff.
"""

import os
from pathlib import Path

import pytest

from nvsymlinkd.config import Config, parse_config
from nvsymlinkd.errors import NvsymlinkdError
from nvsymlinkd.systemd.render import RULES, RenderOptions, render_all, systemd_word

GOLDEN = Path(__file__).parent / "golden"
REPO = Path(__file__).parent.parent

# name -> (config file text, render command-line options)
CASES = {
    "default": ("", []),
    # GPU Operator: driver container root, nodes created by nvsymlinkd, faster resync, no watchdog
    "driver-container": ('driver_root = "/run/nvidia/driver"\ncreate_nodes = true\nresync_interval = 20\n',
                         ["--watchdog-sec", "0", "--bindir", "/usr/local/bin"]),
}


def render_case(tmp_path, nvsymlinkd_cli, name):
    text, options = CASES[name]
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(text)
    out = tmp_path / name
    nvsymlinkd_cli("--config", cfg, "render", "--output", out, *options, check=0)
    return {p.name: p.read_text() for p in sorted(out.iterdir())}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(tmp_path, nvsymlinkd_cli, name):
    files = render_case(tmp_path, nvsymlinkd_cli, name)
    assert sorted(files) == ["71-nvsymlinkd.rules", "nvsymlinkd-sync.service", "nvsymlinkd.service"]
    golden_dir = GOLDEN / name
    if os.environ.get("NVSYMLINKD_REGEN_GOLDEN") == "1":
        golden_dir.mkdir(parents=True, exist_ok=True)
        for fname, text in files.items():
            (golden_dir / fname).write_text(text)
    for fname, text in files.items():
        assert text == (golden_dir / fname).read_text(), f"{name}/{fname} differs from tests/golden"


def test_driver_container_values_reach_the_units(tmp_path, nvsymlinkd_cli):
    files = render_case(tmp_path, nvsymlinkd_cli, "driver-container")
    service, sync = files["nvsymlinkd.service"], files["nvsymlinkd-sync.service"]
    assert ("ExecStart=/usr/local/bin/nvsymlinkd run --driver-root /run/nvidia/driver --create-nodes "
            "--resync-interval 20\n") in service
    assert "ExecStart=/usr/local/bin/nvsymlinkd sync --driver-root /run/nvidia/driver --create-nodes\n" in sync
    assert "WatchdogSec" not in service.replace("# watchdog_sec = 0", "")
    # nodes are created under the driver root, outside /dev: it must be writable under ProtectSystem=strict
    assert "ReadWritePaths=/sys/fs/cgroup -/run/systemd/system -/run/nvidia/driver/dev\n" in service
    assert "ReadWritePaths=-/run/nvidia/driver/dev\n" in sync


def test_defaults_pass_no_flags_so_the_config_file_decides():
    files = render_all(Config())
    assert "ExecStart=/usr/bin/nvsymlinkd run\n" in files["nvsymlinkd.service"]
    assert "ExecStart=/usr/bin/nvsymlinkd sync\n" in files["nvsymlinkd-sync.service"]
    assert "WatchdogSec=30\n" in files["nvsymlinkd.service"]
    assert "RuntimeDirectory=nvsymlinkd\n" in files["nvsymlinkd.service"]


def test_state_dir_under_var_lib_is_made_by_systemd(tmp_path, nvsymlinkd_cli):
    """Issue 12.13: under ProtectSystem=strict the daemon cannot create /var/lib/X itself."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('state_dir = "/var/lib/nvsymlinkd-test"\n')
    service = nvsymlinkd_cli("--config", cfg, "render", check=0).stdout
    assert "\nStateDirectory=nvsymlinkd-test\n" in service
    assert "ReadWritePaths=/sys/fs/cgroup -/run/systemd/system\n" in service and "RuntimeDirectory" not in service
    cache = render_all(Config(state_dir="/var/cache/nv/state"))["nvsymlinkd.service"]
    assert "\nCacheDirectory=nv/state\n" in cache


def test_state_dir_elsewhere_must_exist():
    service = render_all(Config(state_dir="/srv/nvsymlinkd"))["nvsymlinkd.service"]
    # no "-": a missing directory fails the start instead of silently losing every baseline
    assert "ReadWritePaths=/sys/fs/cgroup -/run/systemd/system /srv/nvsymlinkd\n" in service
    assert "Directory=" not in service
    with pytest.raises(NvsymlinkdError, match="system directory"):  # normalized: /etc
        render_all(Config(state_dir="/var/lib/../../etc"))


def test_seconds_are_plain_decimals(tmp_path, nvsymlinkd_cli):
    """Issue 12.8: systemd ignores WatchdogSec=1e+07; and %g cut 1234.5678 to 1234.57."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("watchdog_sec = 2048.125\nresync_interval = 1234.5678\n")
    service = nvsymlinkd_cli("--config", cfg, "render", check=0).stdout
    assert "\nWatchdogSec=2048.125\n" in service
    assert "run --resync-interval 1234.5678\n" in service
    for value in (5, 3600):
        assert f"\nWatchdogSec={value}\n" in render_all(Config(watchdog_sec=value))["nvsymlinkd.service"]


def test_metrics_textfile_is_off_by_default(tmp_path, nvsymlinkd_cli):
    """Issue 15.10: no node-exporter path in the packaged unit, no 'cannot write metrics' on every start."""
    service = nvsymlinkd_cli("--config", "/dev/null", "render", check=0).stdout
    assert "node_exporter" not in service
    assert "ReadWritePaths=/sys/fs/cgroup -/run/systemd/system\n" in service


def test_daemon_says_nothing_about_metrics_nobody_asked_for(tmp_path, need_root):
    from tests.daemonproc import DaemonProcess
    from tests.fakehost import standard_host

    host = standard_host(tmp_path / "root")
    host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510})
    d = DaemonProcess(host.root, "--resync-interval", "0", config="/dev/null")
    try:
        d.wait_for_line(r"created link")
    finally:
        assert d.stop() == 0, d.output()
    assert "metrics" not in d.output(), d.output()
    assert not os.path.exists(host.path("/var/lib/node_exporter"))


def test_odd_paths_are_quoted_and_escaped():
    assert systemd_word("/usr/bin") == "/usr/bin"
    assert systemd_word("/opt/my dir") == '"/opt/my dir"'
    assert systemd_word("/opt/100%") == '"/opt/100%%"'
    assert systemd_word("/opt/$x") == '"/opt/$$x"'
    assert systemd_word('/a"b') == '"/a\\"b"'
    # config refuses control characters first; a Config built in code still cannot inject a line
    with pytest.raises(NvsymlinkdError, match="control character"):
        render_all(Config(state_dir="/run/x\nExecStartPre=/bin/true"))
    files = render_all(Config(dev_char_path="/srv/dev char"), RenderOptions(bindir="/opt/nv %i"))
    assert 'ExecStart="/opt/nv %%i/nvsymlinkd" run --dev-char-path "/srv/dev char"\n' in files["nvsymlinkd.service"]


def test_print_mode_matches_written_files(tmp_path, nvsymlinkd_cli):
    files = render_case(tmp_path, nvsymlinkd_cli, "default")
    printed = nvsymlinkd_cli("--config", tmp_path / "default.toml", "render", check=0).stdout
    expected = "\n".join(f"==> {name} <==\n{files[name]}"
                         for name in ("71-nvsymlinkd.rules", "nvsymlinkd.service", "nvsymlinkd-sync.service"))
    assert printed == expected


def test_bad_values_exit_2_with_one_line(tmp_path, nvsymlinkd_cli):
    proc = nvsymlinkd_cli("--config", "/dev/null", "render", "--driver-root", "run/nvidia", check=2)
    assert "must be an absolute path" in proc.stderr and proc.stderr.count("\n") == 1
    proc = nvsymlinkd_cli("--config", "/dev/null", "render", "--bindir", "bin", check=2)
    assert "--bindir bin: must be an absolute path" in proc.stderr
    (tmp_path / "file").write_text("")
    proc = nvsymlinkd_cli("--config", "/dev/null", "render", "--output", tmp_path / "file" / "sub", check=2)
    assert "cannot write" in proc.stderr and str(tmp_path / "file") in proc.stderr


def test_rewrite_is_atomic_and_leaves_no_temp_files(tmp_path, nvsymlinkd_cli):
    out = tmp_path / "out"
    nvsymlinkd_cli("--config", "/dev/null", "render", "--output", out, check=0)
    (out / "nvsymlinkd.service").write_text("old")
    nvsymlinkd_cli("--config", "/dev/null", "render", "--output", out, check=0)
    assert sorted(p.name for p in out.iterdir()) == ["71-nvsymlinkd.rules", "nvsymlinkd-sync.service",
                                                     "nvsymlinkd.service"]
    assert (out / "nvsymlinkd.service").read_text().startswith("# Generated by `nvsymlinkd render`")
    assert oct((out / "nvsymlinkd.service").stat().st_mode & 0o777) == "0o644"


def test_packaged_templates_are_the_repo_templates():
    """nvsymlinkd/templates links rules/ and units/: one source, no drifting copies."""
    templates = REPO / "nvsymlinkd" / "templates"
    for name in ("71-nvsymlinkd.rules.j2", "nvsymlinkd.service.j2", "nvsymlinkd-sync.service.j2"):
        link = templates / name
        assert link.is_symlink(), f"{link} must be a relative symlink into rules/ or units/"
        assert link.resolve().parent.name in ("rules", "units")


def test_example_config_documents_every_key_with_its_default():
    from nvsymlinkd.config import KEYS

    text = (REPO / "examples" / "nvsymlinkd.toml").read_text()
    assert parse_config(text.encode(), "examples/nvsymlinkd.toml") == Config(source="examples/nvsymlinkd.toml")
    for key in KEYS:
        uncommented = "\n".join(line[2:] if line.startswith("# ") else line for line in text.splitlines())
        assert f"\n{key.name} = " in uncommented, f"examples/nvsymlinkd.toml lacks '# {key.name} = ...'"
        # every commented default parses back to the built-in default
        line = next(ln for ln in uncommented.splitlines() if ln.startswith(f"{key.name} = "))
        value = getattr(parse_config(line.encode(), "example"), key.name)
        assert value == key.default, f"{key.name}: example says {value!r}, default is {key.default!r}"


def test_missing_template_is_a_one_line_error(tmp_path, monkeypatch):
    import nvsymlinkd.systemd.render as render
    from nvsymlinkd.errors import NvsymlinkdError

    monkeypatch.setitem(render.TEMPLATES, "extra.rules", "no-such-template.j2")
    with pytest.raises(NvsymlinkdError, match=r"^nvsymlinkd/templates/no-such-template\.j2: missing .*reinstall"):
        render.render_all(Config())


# -- drop-ins (issue 15.4) ---------------------------------------------------------------------------------

DROP_IN_CASES = {
    "drop-ins-driver-container": CASES["driver-container"],
    "drop-ins-everything": ('driver_root = "/run/nvidia/driver"\ncreate_nodes = true\n'
                            'state_dir = "/var/lib/nvsymlinkd-test"\nmetrics_listen = ":9402"\n'
                            'metrics_textfile = "/var/lib/node_exporter/textfile_collector/nvsymlinkd.prom"\n', []),
}
DROP_IN_FILES = ["nvsymlinkd-sync.service.d/50-nvsymlinkd-config.conf",
                 "nvsymlinkd.service.d/50-nvsymlinkd-config.conf"]


def render_drop_in_case(tmp_path, nvsymlinkd_cli, name):
    text, options = DROP_IN_CASES[name]
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(text)
    out = tmp_path / name
    nvsymlinkd_cli("--config", cfg, "render", "--drop-ins", out, *options, check=0)
    # the header names the file --config gave (the golden files: the default config's path)
    return {str(p.relative_to(out)): p.read_text().replace(f"the settings of {cfg}\n",
                                                           "the settings of /etc/nvsymlinkd/nvsymlinkd.toml\n")
            for p in sorted(out.rglob("*")) if p.is_file()}


def test_drop_in_header_names_the_config_file_used(tmp_path, nvsymlinkd_cli):
    cfg = tmp_path / "site.toml"
    cfg.write_text("resync_interval = 20\n")
    out = tmp_path / "out"
    nvsymlinkd_cli("--config", cfg, "render", "--drop-ins", out, check=0)
    head = (out / DROP_IN_FILES[1]).read_text().splitlines()[0]
    assert head == f"# Generated by `nvsymlinkd render --drop-ins`: the settings of {cfg}", head


@pytest.mark.parametrize("name", sorted(DROP_IN_CASES))
def test_drop_in_golden(tmp_path, nvsymlinkd_cli, name):
    files = render_drop_in_case(tmp_path, nvsymlinkd_cli, name)
    assert sorted(files) == DROP_IN_FILES
    golden_dir = GOLDEN / name
    if os.environ.get("NVSYMLINKD_REGEN_GOLDEN") == "1":
        for fname, text in files.items():
            (golden_dir / fname).parent.mkdir(parents=True, exist_ok=True)
            (golden_dir / fname).write_text(text)
    for fname, text in files.items():
        assert text == (golden_dir / fname).read_text(), f"{name}/{fname} differs from tests/golden"


def test_drop_ins_hold_only_the_changed_settings(tmp_path, nvsymlinkd_cli):
    files = render_drop_in_case(tmp_path, nvsymlinkd_cli, "drop-ins-driver-container")
    service = files["nvsymlinkd.service.d/50-nvsymlinkd-config.conf"]
    settings = [ln for ln in service.splitlines() if ln and not ln.startswith("#")]
    assert settings == ["[Service]", "ExecStart=",
                        "ExecStart=/usr/local/bin/nvsymlinkd run --driver-root /run/nvidia/driver --create-nodes "
                        "--resync-interval 20",
                        "WatchdogSec=0", "ReadWritePaths=-/run/nvidia/driver/dev"]


def test_default_config_needs_no_drop_in_and_removes_a_stale_one(tmp_path, nvsymlinkd_cli):
    out = tmp_path / "etc-systemd-system"
    cfg = tmp_path / "c.toml"
    cfg.write_text("create_nodes = true\n")
    nvsymlinkd_cli("--config", cfg, "render", "--drop-ins", out, check=0)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.conf")) == DROP_IN_FILES
    (out / "nvsymlinkd.service.d" / "90-admin.conf").write_text("[Service]\nNice=5\n")
    cfg.write_text("")  # back to the packaged defaults
    nvsymlinkd_cli("--config", cfg, "render", "--drop-ins", out, check=0)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.conf")) == ["nvsymlinkd.service.d/90-admin.conf"]
    assert not (out / RULES).exists() and not (out / "nvsymlinkd.service").exists()


def test_output_and_drop_ins_exclude_each_other(tmp_path, nvsymlinkd_cli):
    proc = nvsymlinkd_cli("--config", "/dev/null", "render", "--output", tmp_path / "a", "--drop-ins", tmp_path / "b")
    assert proc.returncode == 2 and "not allowed with" in proc.stderr


def test_udev_rule_does_not_depend_on_the_config():
    """So --drop-ins never has a rule to write (udev reads /etc/udev/rules.d, not a systemd directory)."""
    changed = Config(driver_root="/run/nvidia/driver", dev_char_path="/srv/char", create_nodes=True,
                     resync_interval=5, watchdog_sec=0, state_dir="/srv/state", metrics_listen=":9402",
                     metrics_textfile="/srv/m.prom")
    assert render_all(changed, RenderOptions(bindir="/opt/bin"))[RULES] == render_all(Config())[RULES]
