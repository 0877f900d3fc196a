"""What the daemon keeps resident (issue 16 item 5: RSS <= 32 MiB with 2,000 nodes; figures in
benchmarks/daemon_latency.py): libraries it loads only because something imported them on the way,
checked in the running daemon's own memory map after its link pass and a container verification."""

from __future__ import annotations

import hashlib

from nvsymlinkd.containers import baseline as baselinemod
from tests.daemonproc import DaemonProcess
from tests.fakehost import standard_host

# OpenSSL's libcrypto (hashlib's backend: ~3.5 MiB) and GObject introspection (dbus_next's GLib
# backend, when python3-gi is installed: ~3.7 MiB); bz2 and lzma (shutil's archive formats, which
# pyudev's ctypes.util import brought in: ~0.3 MiB); the daemon needs none of them.
NOT_RESIDENT = ("libcrypto", "libgirepository", "_gi.cpython", "libgobject", "_bz2.cpython", "_lzma.cpython",
                "libbz2", "liblzma")


def test_daemon_maps_neither_openssl_nor_glib_nor_compression(tmp_path, need_root):
    host = standard_host(tmp_path / "root")
    d = DaemonProcess(host.root, "--resync-interval", "0", env={"NVSYMLINKD_DEBUG": "1"})
    try:
        d.wait_for_line(r"verified \d+ GPU containers in")  # the verifier (baselines: sha256) has run
        maps = open(f"/proc/{d.proc.pid}/maps").read()
        loaded = sorted({line.split()[-1] for line in maps.splitlines() if any(n in line for n in NOT_RESIDENT)})
        assert not loaded, f"the daemon mapped {loaded}"
    finally:
        assert d.stop() == 0


def test_baseline_names_hash_like_openssl():
    """The daemon's sha256 (Python's built-in module) names baselines as OpenSSL's would."""
    odd = "id with spaces/and/slashes"
    assert baselinemod._file_name(odd) == "sha256-" + hashlib.sha256(odd.encode()).hexdigest() + ".json"


def test_metrics_without_a_textfile_keep_no_heartbeat(tmp_path, monkeypatch):
    """Idle, the daemon wakes for its resync timer only: no metrics heartbeat (nor a thread hand-off
    for a write that writes nothing) while no textfile is configured; a reload that sets one starts it."""
    import asyncio

    from nvsymlinkd import metrics as metricsmod
    from nvsymlinkd.config import Config
    from nvsymlinkd.host.root import HostRoot

    monkeypatch.setattr(metricsmod, "HEARTBEAT_SECONDS", 0.02)
    monkeypatch.setattr(metricsmod, "MIN_WRITE_GAP", 0.01)
    metrics = metricsmod.Metrics(HostRoot(str(tmp_path)), Config())
    flushes = []
    real_flush = metrics.flush
    metrics.flush = lambda: flushes.append(1) or real_flush()

    async def main() -> int:
        task = asyncio.ensure_future(metrics.run())
        await asyncio.sleep(0.4)  # 20 heartbeats' time
        idle = len(flushes)
        metrics.config = Config(metrics_textfile="/nvsymlinkd.prom")  # what SIGHUP does
        for _ in range(250):
            if (tmp_path / "nvsymlinkd.prom").exists():
                break
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return idle

    assert asyncio.run(main()) == 0
    assert (tmp_path / "nvsymlinkd.prom").exists(), "a textfile set by a reload was never written"
