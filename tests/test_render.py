"""`nvsymlinkd render`: the templates rendered for real configs, compared with reviewed golden files.

Regenerate after an intended template change with NVSYMLINKD_REGEN_GOLDEN=1 and review the diff.
"""

import os
from pathlib import Path

import pytest

from nvsymlinkd.config import Config, parse_config
from nvsymlinkd.render import RenderOptions, render_all, systemd_word

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
    assert ("ReadWritePaths=/sys/fs/cgroup -/run/nvidia/driver/dev "
            "-/var/lib/node_exporter/textfile_collector\n") in service
    assert "ReadWritePaths=-/run/nvidia/driver/dev\n" in sync


def test_defaults_pass_no_flags_so_the_config_file_decides():
    files = render_all(Config())
    assert "ExecStart=/usr/bin/nvsymlinkd run\n" in files["nvsymlinkd.service"]
    assert "ExecStart=/usr/bin/nvsymlinkd sync\n" in files["nvsymlinkd-sync.service"]
    assert "WatchdogSec=30\n" in files["nvsymlinkd.service"]
    assert "RuntimeDirectory=nvsymlinkd\n" in files["nvsymlinkd.service"]


def test_state_dir_outside_run_becomes_writable():
    files = render_all(Config(state_dir="/var/lib/nvsymlinkd", metrics_textfile=""))
    assert "RuntimeDirectory" not in files["nvsymlinkd.service"]
    assert "ReadWritePaths=/sys/fs/cgroup -/var/lib/nvsymlinkd\n" in files["nvsymlinkd.service"]
    assert "ReadWritePaths=\n" not in files["nvsymlinkd-sync.service"]


def test_odd_paths_are_quoted_and_escaped():
    assert systemd_word("/usr/bin") == "/usr/bin"
    assert systemd_word("/opt/my dir") == '"/opt/my dir"'
    assert systemd_word("/opt/100%") == '"/opt/100%%"'
    assert systemd_word("/opt/$x") == '"/opt/$$x"'
    assert systemd_word('/a"b') == '"/a\\"b"'
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
    import nvsymlinkd.render as render
    from nvsymlinkd.errors import NvsymlinkdError

    monkeypatch.setitem(render.TEMPLATES, "extra.rules", "no-such-template.j2")
    with pytest.raises(NvsymlinkdError, match=r"^nvsymlinkd/templates/no-such-template\.j2: missing .*reinstall"):
        render.render_all(Config())
