"""Config file: flags win, unknown keys and wrong types are one-line errors naming file and key."""

import json
import re
import signal

import pytest

from nvsymlinkd.config import Config, load_config, parse_config
from nvsymlinkd.errors import ConfigError
from nvsymlinkd.host.root import HostRoot
from tests.daemonproc import DaemonProcess
from tests.fakehost import standard_host


def test_absent_default_file_is_fine(tmp_path):
    assert load_config(HostRoot(str(tmp_path))) == Config()


def test_file_values_and_overrides(tmp_path):
    f = tmp_path / "etc/nvsymlinkd/nvsymlinkd.toml"
    f.parent.mkdir(parents=True)
    f.write_text('driver_root = "/run/nvidia/driver"\ncreate_nodes = true\nresync_interval = 30\n')
    cfg = load_config(HostRoot(str(tmp_path)))
    assert (cfg.driver_root, cfg.create_nodes, cfg.resync_interval) == ("/run/nvidia/driver", True, 30.0)
    assert cfg.source == "/etc/nvsymlinkd/nvsymlinkd.toml"
    cli = cfg.with_overrides(driver_root="/", create_nodes=None)
    assert cli.driver_root == "/" and cli.create_nodes is True


@pytest.mark.parametrize("text,message", [
    ("driver_rot = '/'\n", "unknown key 'driver_rot' (allowed: "),
    ("create_nodes = 'yes'\n", "key 'create_nodes' must be true or false, got 'yes'"),
    ("driver_root = 'run/nvidia'\n", "key 'driver_root' must be an absolute path"),
    ("resync_interval = -1\n", "must be 0 (off) or a number of seconds from 1 to 86400"),
    ("repair = 'always'\n", 'must be one of "off", "report", "auto"'),
    ("[sync]\ndriver_root = '/'\n", "unknown key 'sync'"),
    ("driver_root = \n", "invalid TOML"),
])
def test_errors_name_file_and_key(text, message):
    with pytest.raises(ConfigError) as err:
        parse_config(text.encode(), "/etc/nvsymlinkd/nvsymlinkd.toml")
    assert str(err.value).startswith("/etc/nvsymlinkd/nvsymlinkd.toml")
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_toml_error_has_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^/x.toml:2: invalid TOML"):
        parse_config(b"create_nodes = true\ndriver_root = [\n", "/x.toml")


def test_not_utf8():
    with pytest.raises(ConfigError, match="not UTF-8"):
        parse_config(b"driver_root = '\xff'\n", "/x.toml")


def test_explicit_missing_config_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(HostRoot(str(tmp_path)), str(tmp_path / "nope.toml"))


def test_cli_bad_config_exits_2_with_one_line(tmp_path, nvsymlinkd_cli):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/devices").write_text("Character devices:\n")
    f = tmp_path / "etc/nvsymlinkd/nvsymlinkd.toml"
    f.parent.mkdir(parents=True)
    f.write_text("create_nodes = 1\n")
    proc = nvsymlinkd_cli("--root", tmp_path, "sync")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "nvsymlinkd: /etc/nvsymlinkd/nvsymlinkd.toml: key 'create_nodes' must be true or false, got 1"]


def test_cli_usage_error_exits_2(nvsymlinkd_cli):
    assert nvsymlinkd_cli("sync", "--bogus").returncode == 2
    assert nvsymlinkd_cli().returncode == 2


def test_cli_malformed_proc_devices_exits_2(tmp_path, nvsymlinkd_cli):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/devices").write_text("Character devices:\nfoo bar\n")
    proc = nvsymlinkd_cli("--root", tmp_path, "sync")
    assert proc.returncode == 2
    assert proc.stderr.startswith("nvsymlinkd: /proc/devices:2: expected 'MAJOR NAME'")


# A newline in a path setting would start a new line in the rendered unit (issue 12.7).
INJECTED = "/run/x\nExecStartPre=/bin/touch /tmp/pwned\n#"


@pytest.mark.parametrize("key,value", [
    ("driver_root", INJECTED),
    ("dev_char_path", "/dev/char\nExecStartPre=/bin/true"),
    ("state_dir", "/run/nv\tsymlinkd"),
    ("metrics_textfile", "/var/lib/x.prom\r\nUser=nobody"),
    ("metrics_listen", "127.0.0.1:9402\n"),
    ("driver_root", "/run/x\x7f"),
])
def test_control_characters_in_a_setting_are_a_config_error(tmp_path, nvsymlinkd_cli, key, value):
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text(f"{key} = {json.dumps(value)}\n")  # JSON's string escapes are TOML's
    out = tmp_path / "units"
    proc = nvsymlinkd_cli("--config", cfg, "render", "--output", out)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"nvsymlinkd: {cfg}: key '{key}' "), proc.stderr
    assert "control character" in proc.stderr
    assert not out.exists(), "nothing rendered"


def test_control_characters_on_the_command_line_are_refused(tmp_path, nvsymlinkd_cli):
    proc = nvsymlinkd_cli("--config", "/dev/null", "render", "--state-dir", "/run/a\nExecStartPre=/bin/true")
    assert proc.returncode == 2 and "control character" in proc.stderr and proc.stdout == ""
    proc = nvsymlinkd_cli("--config", "/dev/null", "render", "--bindir", "/usr/bin\nUser=nobody")
    assert proc.returncode == 2 and "control character" in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("text,bound", [
    ("resync_interval = 1e-9\n", "from 1 to 86400"),
    ("resync_interval = 0.5\n", "from 1 to 86400"),
    ("resync_interval = inf\n", "from 1 to 86400"),
    ("watchdog_sec = 1e7\n", "from 5 to 3600"),
    ("watchdog_sec = 1e-7\n", "from 5 to 3600"),
    ("watchdog_sec = 1\n", "from 5 to 3600"),
])
@pytest.mark.parametrize("command", ["render", "run"])
def test_intervals_out_of_bounds_are_a_config_error(tmp_path, nvsymlinkd_cli, text, bound, command):
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text(text)
    key = text.split()[0]
    proc = nvsymlinkd_cli("--root", tmp_path, "--config", cfg, command)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"nvsymlinkd: {cfg}: key '{key}' must be 0 (off) or "), lines
    assert bound in lines[0]


def test_interval_bounds_on_the_command_line(nvsymlinkd_cli):
    proc = nvsymlinkd_cli("--config", "/dev/null", "render", "--watchdog-sec", "1e7")
    assert proc.returncode == 2 and "key 'watchdog_sec' must be 0 (off) or" in proc.stderr
    proc = nvsymlinkd_cli("--config", "/dev/null", "render", "--resync-interval", "1e-9")
    assert proc.returncode == 2 and "key 'resync_interval' must be 0 (off) or" in proc.stderr


def test_the_bounds_themselves_are_accepted():
    c = parse_config(b"resync_interval = 1\nwatchdog_sec = 3600\n", "/x.toml")
    assert (c.resync_interval, c.watchdog_sec) == (1.0, 3600.0)
    c = parse_config(b"resync_interval = 86400\nwatchdog_sec = 5\n", "/x.toml")
    assert (c.resync_interval, c.watchdog_sec) == (86400.0, 5.0)
    c = parse_config(b"resync_interval = 0\nwatchdog_sec = 0\n", "/x.toml")
    assert (c.resync_interval, c.watchdog_sec) == (0.0, 0.0)


def test_sighup_with_a_busy_loop_interval_keeps_the_old_config(tmp_path, need_root):
    host = standard_host(tmp_path / "root")
    host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510})
    cfg = tmp_path / "nvsymlinkd.toml"
    cfg.write_text("resync_interval = 0\n")
    d = DaemonProcess(host.root, config=cfg, journal=True)
    try:
        d.wait_entry("link-created")
        cfg.write_text("resync_interval = 1e-9\n")
        mark = d.mark()
        d.signal(signal.SIGHUP)
        message, _ = d.wait_entry("config-error", after=mark)
        # the words are the point: the file, the key and what it must be
        assert re.search(r"config not reloaded, keeping the old one: .*nvsymlinkd\.toml: key 'resync_interval' "
                         r"must be 0 \(off\) or a number of seconds from 1 to 86400", message), message
        assert d.alive()
        # still reloading: a good config is taken afterwards
        cfg.write_text("resync_interval = 0\n")
        mark = d.mark()
        d.signal(signal.SIGHUP)
        d.wait_entry("config-reloaded", after=mark)
    finally:
        assert d.stop() == 0, d.output()
