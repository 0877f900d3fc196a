"""Config file: flags win, unknown keys and wrong types are one-line errors naming file and key."""

import pytest

from nvsymlinkd.config import Config, load_config, parse_config
from nvsymlinkd.errors import ConfigError
from nvsymlinkd.host.root import HostRoot


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
    ("resync_interval = -1\n", "must be a number of seconds >= 0"),
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
