"""Prometheus metrics: exposition parsed by prometheus_client's own parser, fed by real reconciles."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import stat
import subprocess
import sys
import time

import prometheus_client.parser as parser  # test-only: python3-prometheus-client (.ci/apt.d/cluster.txt)
import pytest

from nvsymlinkd import metrics as m
from nvsymlinkd.config import Config, parse_config, parse_listen
from nvsymlinkd.host.root import HostRoot
from nvsymlinkd.journal import Journal
from nvsymlinkd.verify.evaluate import ContainerReport, Report
from tests.fakehost import standard_host

TEXTFILE = "/var/lib/node_exporter/textfile_collector/nvsymlinkd.prom"


def families(text: str) -> dict:
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def sample(text: str, name: str, **labels):
    """Value of the one sample `name` with exactly `labels` (None when absent)."""
    found = [s.value for f in parser.text_string_to_metric_families(text) for s in f.samples
             if s.name == name and s.labels == labels]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def quiet_journal():
    stream = io.StringIO()
    return Journal(target="stderr", stream=stream), stream


# -- format ---------------------------------------------------------------------


def test_fresh_metrics_parse_with_types_and_help():
    text = m.Metrics().render()
    fams = families(text)
    # the parser drops _total from counter family names and keeps it on the samples
    assert fams["nvsymlinkd_link_changes"].type == "counter"
    assert fams["nvsymlinkd_repairs"].type == "counter"
    assert fams["nvsymlinkd_systemd_reloads"].type == "counter"
    assert fams["nvsymlinkd_gpu_containers"].type == "gauge"
    assert fams["nvsymlinkd_event_to_link_latency_seconds"].type == "histogram"
    assert all(f.documentation for f in fams.values())
    # every status and action is present from the start: rate() and alerts need the zero
    for status in ("ok", "at-risk", "lost", "unknown"):
        assert sample(text, "nvsymlinkd_gpu_containers", status=status) == 0
    for action in ("create", "replace", "remove", "create-node"):
        assert sample(text, "nvsymlinkd_link_changes_total", action=action) == 0
    assert sample(text, "nvsymlinkd_build_info", version=m.__version__) == 1
    # no success yet: no timestamp rather than a misleading 0
    assert "nvsymlinkd_last_successful_sync_timestamp_seconds" not in fams
    # one HELP and one TYPE per family, no sample timestamps (the textfile collector refuses them)
    helps = [line for line in text.splitlines() if line.startswith("# HELP ")]
    assert len(helps) == len({h.split()[2] for h in helps}) == len(fams)
    for line in text.splitlines():
        if not line.startswith("#"):
            assert len(line.rsplit("}", 1)[-1].split()) <= 2, line


def test_counter_names_end_in_total_and_units_are_base_units():
    text = m.Metrics().render()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if kind == "counter":
                assert name.endswith("_total"), name
            assert "_milliseconds" not in name and "_ms" not in name


def test_label_and_help_escaping_round_trips():
    out = []
    fam = m.Family(out)
    weird = 'back\\slash "quoted"\nnewline'
    fam.gauge("x_info", "help with \\ and\nnewline", [({"v": weird}, 1)])
    text = "".join(out)
    assert "\n" not in text.split("# TYPE")[0].rstrip("\n")  # HELP stayed one line
    (f,) = parser.text_string_to_metric_families(text)
    assert f.documentation == "help with \\ and\nnewline"
    assert f.samples[0].labels == {"v": weird}


@pytest.mark.parametrize("value,text", [(0, "0"), (7, "7"), (1.5, "1.5"), (2.0, "2.0"), (True, "1"),
                                        (float("inf"), "+Inf"), (float("-inf"), "-Inf"), (float("nan"), "NaN"),
                                        (1763780000.123456, "1763780000.123456")])
def test_format_value(value, text):
    assert m.format_value(value) == text


def test_histogram_buckets_are_cumulative():
    metrics = m.Metrics()
    for seconds in (0.0005, 0.001, 0.003, 0.2, 7.0, 60.0):
        metrics.on_event_latency(seconds)
    metrics.on_event_latency(float("nan"))  # ignored, not a poisoned sum
    metrics.on_event_latency(-1)
    text = metrics.render()
    name = "nvsymlinkd_event_to_link_latency_seconds"
    assert sample(text, name + "_bucket", le="0.001") == 2  # le is inclusive
    assert sample(text, name + "_bucket", le="0.005") == 3
    assert sample(text, name + "_bucket", le="0.25") == 4
    assert sample(text, name + "_bucket", le="10.0") == 5
    assert sample(text, name + "_bucket", le="+Inf") == 6
    assert sample(text, name + "_count") == 6
    assert sample(text, name + "_sum") == pytest.approx(67.2045)
    les = [s.labels["le"] for f in parser.text_string_to_metric_families(text) if f.name == name
           for s in f.samples if s.name.endswith("_bucket")]
    assert les[0] == "0.001" and les[-2] == "10.0" and les[-1] == "+Inf"


def test_containers_repairs_reloads():
    metrics = m.Metrics()

    def report(*verdicts):  # `status` is the runtime's, `verdict` is ours
        return Report([ContainerReport(f"c{i}", "runc", None, "running", v) for i, v in enumerate(verdicts)], [])

    metrics.on_containers(report("ok", "ok", "at-risk", "lost", "weird", "not-running", "not-gpu"))
    metrics.on_repair("repaired docker-abc.scope", ok=True)
    metrics.on_repair("could not repair", ok=False)
    metrics.on_repair(None, ok=True)
    metrics.on_reload()
    metrics.on_reload()
    text = metrics.render()
    assert sample(text, "nvsymlinkd_gpu_containers", status="ok") == 2
    assert sample(text, "nvsymlinkd_gpu_containers", status="at-risk") == 1
    assert sample(text, "nvsymlinkd_gpu_containers", status="lost") == 1
    assert sample(text, "nvsymlinkd_gpu_containers", status="unknown") == 1
    assert sample(text, "nvsymlinkd_repairs_total", result="ok") == 2
    assert sample(text, "nvsymlinkd_repairs_total", result="failed") == 1
    assert sample(text, "nvsymlinkd_systemd_reloads_total") == 2
    # a later report replaces the gauge (containers come and go)
    metrics.on_containers(report("ok", "ok", "ok"))
    text = metrics.render()
    assert sample(text, "nvsymlinkd_gpu_containers", status="ok") == 3
    assert sample(text, "nvsymlinkd_gpu_containers", status="lost") == 0


# -- fed by real reconcile passes against a fake root (real mknod nodes) ----------------


def test_reconcile_counts_move_with_real_links(tmp_path, need_root):
    from nvsymlinkd.devchar.reconcile import reconcile

    host = standard_host(tmp_path / "root")
    root = HostRoot(str(host.root))
    config = Config()
    now = [1_700_000_000.0]
    metrics = m.Metrics(root, config, clock=lambda: now[0])

    metrics.on_reconcile(reconcile(root, config))
    text = metrics.render()
    assert len(host.links()) == 6
    assert sample(text, "nvsymlinkd_link_changes_total", action="create") == 6
    assert sample(text, "nvsymlinkd_links_managed") == 6
    assert sample(text, "nvsymlinkd_nvidia_device_nodes") == 6
    assert sample(text, "nvsymlinkd_syncs_total") == 1
    assert sample(text, "nvsymlinkd_last_successful_sync_timestamp_seconds") == now[0]

    # a GPU goes away and a foreign file sits where a new link must go
    os.unlink(host.path("/dev/nvidia1"))
    host.node("/dev/nvidia5", 195, 5)
    host.path("/dev/char/195:5").write_text("not ours")
    now[0] += 60
    metrics.on_reconcile(reconcile(root, config))
    text = metrics.render()
    assert sample(text, "nvsymlinkd_link_changes_total", action="remove") == 1
    assert sample(text, "nvsymlinkd_link_changes_total", action="create") == 6
    assert sample(text, "nvsymlinkd_link_conflicts") == 1
    assert sample(text, "nvsymlinkd_links_managed") == 5
    assert sample(text, "nvsymlinkd_syncs_total") == 2
    assert sample(text, "nvsymlinkd_last_successful_sync_timestamp_seconds") == now[0]

    metrics.on_sync_failed()
    text = metrics.render()
    assert sample(text, "nvsymlinkd_sync_failures_total") == 1
    assert sample(text, "nvsymlinkd_last_successful_sync_timestamp_seconds") == now[0]


def test_failed_link_write_is_counted(tmp_path, need_root):
    from nvsymlinkd.devchar.reconcile import reconcile

    host = standard_host(tmp_path / "root")
    # root ignores directory modes: a read-only mount makes every link write fail (EROFS)
    dev_char = host.path("/dev/char")
    dev_char.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(dev_char)], check=True)
    try:
        root = HostRoot(str(host.root))
        metrics = m.Metrics(root, Config())
        result = reconcile(root, Config())
    finally:
        subprocess.run(["umount", str(dev_char)], check=True)
    metrics.on_reconcile(result)
    text = metrics.render()
    assert sample(text, "nvsymlinkd_link_change_failures_total", action="create") == len(result.errors) == 6
    assert sample(text, "nvsymlinkd_link_changes_total", action="create") == 0
    assert sample(text, "nvsymlinkd_links_managed") == 0


# -- the textfile -------------------------------------------------------------------


def test_flush_writes_atomically_under_root_with_mode_0644(tmp_path):
    root = tmp_path / "root"
    (root / "var/lib/node_exporter/textfile_collector").mkdir(parents=True)
    metrics = m.Metrics(HostRoot(str(root)), Config(metrics_textfile=TEXTFILE))
    old = os.umask(0o077)
    try:
        assert metrics.flush()
        metrics.on_reload()
        assert metrics.flush()
    finally:
        os.umask(old)
    path = root / TEXTFILE.lstrip("/")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sample(path.read_text(), "nvsymlinkd_systemd_reloads_total") == 1
    assert os.listdir(path.parent) == ["nvsymlinkd.prom"]  # no temp file left behind


def test_flush_replaces_a_symlink_instead_of_writing_through_it(tmp_path):
    d = tmp_path / "collector"
    d.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (d / "nvsymlinkd.prom").symlink_to(victim)
    from nvsymlinkd.host.atomicfile import write_atomic

    write_atomic(str(d / "nvsymlinkd.prom"), "x 1\n")
    assert victim.read_text() == "keep me"
    assert not (d / "nvsymlinkd.prom").is_symlink()


def test_flush_disabled_and_missing_directory(tmp_path):
    root = HostRoot(str(tmp_path))
    off = m.Metrics(root, Config(metrics_textfile=""))
    assert off.textfile_path() is None and off.flush()
    assert os.listdir(tmp_path) == []

    journal, said = quiet_journal()
    metrics = m.Metrics(root, Config(metrics_textfile="/nope/nvsymlinkd.prom"), journal=journal)
    assert not metrics.flush()
    assert not metrics.flush()
    lines = said.getvalue().splitlines()
    assert len(lines) == 1 and "cannot write metrics to /nope/nvsymlinkd.prom" in lines[0], lines
    assert str(tmp_path) not in lines[0]  # the inside view, never the real path
    (tmp_path / "nope").mkdir()
    assert metrics.flush()
    assert "written to /nope/nvsymlinkd.prom again" in said.getvalue()


def test_config_keys():
    c = parse_config(b'metrics_textfile = ""\nmetrics_listen = "[::1]:9402"\n', "t.toml")
    assert c.metrics_textfile == "" and c.metrics_listen == "[::1]:9402"
    assert Config().metrics_textfile == "" and Config().metrics_listen == ""  # off unless asked for
    for bad in (b'metrics_textfile = "relative.prom"', b'metrics_listen = "9402"', b'metrics_listen = "h:0"',
                b"metrics_listen = 9402"):
        with pytest.raises(Exception, match="metrics_"):
            parse_config(bad, "t.toml")


@pytest.mark.parametrize("text,want", [("127.0.0.1:9402", ("127.0.0.1", 9402)), ("[::1]:1", ("::1", 1)),
                                       (":9402", (None, 9402)), ("localhost:80", ("localhost", 80))])
def test_parse_listen(text, want):
    assert parse_listen(text) == want


# -- the HTTP responder (loopback only) --------------------------------------------------


async def _http(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return data


def test_http_serves_metrics_on_loopback():
    async def main():
        metrics = m.Metrics()
        metrics.on_reload()
        server = await metrics.serve("127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            ok = await _http(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await _http(port, b"HEAD /metrics HTTP/1.0\r\n\r\n")
            missing = await _http(port, b"GET /secret HTTP/1.1\r\n\r\n")
            post = await _http(port, b"POST /metrics HTTP/1.1\r\n\r\n")
            junk = await _http(port, b"x" * (m.MAX_REQUEST_BYTES * 10))
        finally:
            server.close()
        return ok, head, missing, post, junk

    ok, head, missing, post, junk = asyncio.run(main())
    status, _, body = ok.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 200 ")
    assert b"Content-Type: text/plain; version=0.0.4" in status
    assert f"Content-Length: {len(body)}".encode() in status
    assert sample(body.decode(), "nvsymlinkd_systemd_reloads_total") == 1
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
    assert missing.startswith(b"HTTP/1.1 404 ")
    assert post.startswith(b"HTTP/1.1 405 ")
    assert junk == b""  # an oversized request gets no answer, just a closed connection


def test_run_keeps_the_textfile_current_and_flushes_on_stop(tmp_path):
    (tmp_path / "prom").mkdir()
    path = tmp_path / "prom/nvsymlinkd.prom"
    metrics = m.Metrics(HostRoot("/"), Config(metrics_textfile=str(path)))

    async def main():
        task = asyncio.ensure_future(metrics.run())
        while not path.exists():
            await asyncio.sleep(0.01)
        metrics.on_reload()  # from the loop
        while sample(path.read_text(), "nvsymlinkd_systemd_reloads_total") != 1:
            await asyncio.sleep(0.01)
        # from a worker thread, as the reconcile pass would
        await asyncio.get_running_loop().run_in_executor(None, metrics.on_reload)
        while sample(path.read_text(), "nvsymlinkd_systemd_reloads_total") != 2:
            await asyncio.sleep(0.01)
        metrics.on_repair(ok=False)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(main(), 30))
    assert sample(path.read_text(), "nvsymlinkd_repairs_total", result="failed") == 1  # the final flush


# -- the probe ------------------------------------------------------------------------


def test_check_fresh_stale_and_sync_age(tmp_path):
    path = tmp_path / "nvsymlinkd.prom"
    now = time.time()
    metrics = m.Metrics(clock=lambda: now - 500)
    path.write_text(metrics.render())
    assert m.check(str(path), 120, None, now=now)[0]
    ok, why = m.check(str(path), 120, 180, now=now)
    assert not ok and "no successful sync yet" in why

    class R:  # the smallest SyncResult-shaped value: an empty host
        class plan:
            @staticmethod
            def summary():
                return {"conflict": 0}

        class snapshot:
            nodes = ()

        outcomes = ()
        dry_run = False

    metrics.on_reconcile(R)
    path.write_text(metrics.render())
    ok, why = m.check(str(path), 120, 180, now=now)
    assert not ok and "last successful sync 500 s ago" in why
    assert m.check(str(path), 120, 600, now=now)[0]
    os.utime(path, (now - 300, now - 300))
    ok, why = m.check(str(path), 120, None, now=now)
    assert not ok and "loop is stuck" in why
    ok, why = m.check(str(tmp_path / "absent.prom"), 120, None, now=now)
    assert not ok and "No such file" in why


def test_check_command_exit_codes(tmp_path):
    path = tmp_path / "nvsymlinkd.prom"
    path.write_text(m.Metrics().render())
    run = [sys.executable, "-m", "nvsymlinkd.metrics", "check"]
    assert subprocess.run([*run, str(path)], capture_output=True).returncode == 0
    bad = subprocess.run([*run, str(path), "--max-sync-age", "60"], capture_output=True, text=True)
    assert bad.returncode == 1 and "no successful sync yet" in bad.stderr
    assert subprocess.run([*run, str(tmp_path / "x")], capture_output=True).returncode == 1


# -- the real daemon against a fake root ----------------------------------------------------


def test_daemon_writes_the_textfile_and_counts_move(tmp_path, need_root):
    from tests.daemonproc import DaemonProcess

    host = standard_host(tmp_path / "root")
    host.path(os.path.dirname(TEXTFILE)).mkdir(parents=True)
    path = host.path(TEXTFILE)

    def value(name, **labels):
        try:
            return sample(path.read_text(), name, **labels)
        except FileNotFoundError:
            return None

    with socket.socket() as s:  # a free loopback port for metrics_listen
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = tmp_path / "nvsymlinkd.toml"
    config.write_text(f'metrics_listen = "127.0.0.1:{port}"\nmetrics_textfile = "{TEXTFILE}"\n')
    d = DaemonProcess(host.root, "--resync-interval", "0", config=config)
    try:
        # metrics_textfile, resolved under --root
        d.wait_until(lambda: value("nvsymlinkd_link_changes_total", action="create") == 6,
                     "6 created links in the metrics textfile (is the daemon wired to nvsymlinkd.metrics?)")
        assert value("nvsymlinkd_links_managed") == 6
        assert value("nvsymlinkd_last_successful_sync_timestamp_seconds") > 0
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        host.node("/dev/nvidia3", 195, 3)
        d.wait_until(lambda: value("nvsymlinkd_link_changes_total", action="create") == 7, "a 7th created link")
        d.wait_until(lambda: (value("nvsymlinkd_event_to_link_latency_seconds_count") or 0) >= 1,
                     "an event-to-link latency observation")
        os.unlink(host.path("/dev/nvidia0"))
        d.wait_until(lambda: value("nvsymlinkd_link_changes_total", action="remove") == 1, "a removed link")
        assert value("nvsymlinkd_links_managed") == 6
        served = asyncio.run(_http(port, b"GET /metrics HTTP/1.0\r\n\r\n")).partition(b"\r\n\r\n")[2].decode()
        assert sample(served, "nvsymlinkd_link_changes_total", action="remove") == 1
    finally:
        assert d.stop() == 0, d.output()
    assert value("nvsymlinkd_syncs_total") >= 3
    assert [n for n in os.listdir(path.parent)] == ["nvsymlinkd.prom"]


# -- real runc containers: verdicts and repairs move the container and repair metrics ------------


@pytest.mark.usefixtures("no_system_bus")  # never the machine's own systemd
def test_container_verdicts_and_repairs_from_real_runc_containers(runc_host):
    from nvsymlinkd.repair.apply import SUCCESS, repair_all
    from nvsymlinkd.repair.plan import RepairHistory
    from nvsymlinkd.verify.verifier import verify_all
    from tests.runcfixture import device_node, device_rule

    gpu0 = dict(rules=[device_rule(195, 0)], nodes=[device_node("/dev/nvidia0", 195, 0)],
                env=["NVIDIA_VISIBLE_DEVICES=0"])
    ok = runc_host.run("gpu-ok", **gpu0)
    lost = runc_host.run("gpu-lost", **gpu0)
    lost.deny("c 195:0 rw")
    assert ok.open_error("/dev/nvidia0") == "ENXIO" and lost.open_error("/dev/nvidia0") == "EPERM"
    root = HostRoot(str(runc_host.root))
    metrics = m.Metrics(root, Config())

    metrics.on_containers(verify_all(root, Config(), use_bus=False))
    text = metrics.render()
    assert sample(text, "nvsymlinkd_gpu_containers", status="ok") == 1
    assert sample(text, "nvsymlinkd_gpu_containers", status="lost") == 1

    history = RepairHistory()
    for r in repair_all(root, Config(), history=history):
        metrics.on_repair(r, ok=r.status in SUCCESS)
    lost.deny("c 195:0 rw")  # lost again at once: refused by the rate limit, counted as failed
    for r in repair_all(root, Config(), history=history):
        metrics.on_repair(r, ok=r.status in SUCCESS)
    metrics.on_containers(verify_all(root, Config(), use_bus=False))
    text = metrics.render()
    assert sample(text, "nvsymlinkd_repairs_total", result="ok") == 1
    assert sample(text, "nvsymlinkd_repairs_total", result="failed") == 1
    assert sample(text, "nvsymlinkd_gpu_containers", status="lost") == 1
    assert sample(text, "nvsymlinkd_gpu_containers", status="ok") == 1


def test_named_devices_are_bounded_with_the_containers_with_findings_first():
    """nvsymlinkd_gpu_container_devices: one series per MIG device / IMEX channel of a counted container's hook
    grant, cut at MAX_NAMED_DEVICES with the containers that have findings first (so an alert's container is
    named), nothing for containers not counted."""
    from nvsymlinkd.verify.evaluate import Finding

    def hook(n: int) -> dict:
        return {"mig_devices": [], "imex_channels": [
            {"channel": i, "path": f"/dev/nvidia-caps-imex-channels/channel{i}", "device": f"c 242:{i}"}
            for i in range(n)]}

    many = ContainerReport("a" * 64, "runc", "", "running", "ok", nvidia_hook=hook(m.MAX_NAMED_DEVICES))
    lost = ContainerReport("b" * 64, "runc", "", "running", "lost", findings=[Finding("lost", (), "t", "t")],
                           nvidia_hook=hook(1))
    stopped = ContainerReport("c" * 64, "runc", "", "stopped", "not-running", nvidia_hook=hook(1))
    metrics = m.Metrics()
    metrics.on_containers(Report([many, lost, stopped], []))
    got = [s.labels for s in families(metrics.render())["nvsymlinkd_gpu_container_devices"].samples]
    assert len(got) == m.MAX_NAMED_DEVICES
    assert got[0] == {"container_id": "b" * 12, "namespace": "", "pod": "", "container": "", "kind": "imex",
                      "device": "/dev/nvidia-caps-imex-channels/channel0", "index": "0", "mig_instance": ""}
    assert {g["container_id"] for g in got[1:]} == {"a" * 12}
