"""Prometheus metrics: counters the daemon updates, rendered as text exposition 0.0.4.

Where they go (both optional, both fed from one Metrics object):
- `metrics_textfile`: a file for node-exporter's textfile collector, replaced
  atomically (temp file in the same directory, fsync, rename, mode 0644), so
  the collector never reads half a file. Resolved under --root.
- `metrics_listen`: "HOST:PORT" of a tiny HTTP responder for GET /metrics.

The format is written by hand from its documented rules (no runtime
dependency): HELP and TYPE once per family, label values escaped (\\, ", \\n),
histograms with cumulative `le` buckets ending in +Inf, no timestamps (the
textfile collector refuses them). The tests parse the output with
prometheus_client's own parser.

`python3 -m nvsymlinkd.metrics check FILE` is the Kubernetes probe: it exits
0 while the file is fresh (the event loop rewrites it every HEARTBEAT_SECONDS)
and, with --max-sync-age, while the last successful sync is recent.
Standard library only: a probe must start fast.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import stat
import sys
import threading
import time
from typing import TYPE_CHECKING

from nvsymlinkd import __version__
from nvsymlinkd.verify.kinds import Verdict  # standard library only, like this module

if TYPE_CHECKING:  # the probe must not import the verifier
    from nvsymlinkd.verify.evaluate import ContainerReport, Report

# ~1 ms (an inotify event answered at once) to 10 s (a pass behind a slow resync)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LINK_ACTIONS = ("create", "replace", "remove", "create-node")
# the verifier's verdicts for GPU containers (label values, in the order the families list them)
CONTAINER_STATUSES = tuple(v.value for v in (Verdict.OK, Verdict.AT_RISK, Verdict.LOST, Verdict.DENIED,
                                               Verdict.UNKNOWN))
NOT_COUNTED = (Verdict.NOT_GPU.value, Verdict.NOT_RUNNING.value)
REPAIR_RESULTS = ("ok", "failed")
# Per-container series only for containers with findings, and at most this many: the label set stays
# bounded however many containers a node runs (a healthy node has none).
MAX_LABELLED_CONTAINERS = 100
# MIG devices and IMEX channels named: 8 GPUs x 7 MIG devices fit many times; a container asking for
# every IMEX channel (2048) does not, and is cut here rather than bloat every scrape
MAX_NAMED_DEVICES = 200
HEARTBEAT_SECONDS = 30.0  # the textfile is rewritten at least this often (liveness)
MIN_WRITE_GAP = 0.5  # coalesce bursts: at most two writes a second
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT = 5.0


class Metrics:
    """Everything the daemon counts. Update methods are cheap and thread-safe."""

    def __init__(self, root=None, config=None, journal=None, clock=time.time):
        self.root = root
        self._dirty = None  # asyncio.Event, made inside run()
        self._loop = None
        self.config = config
        self.journal = journal
        self.clock = clock
        self._lock = threading.Lock()
        self._write_error: str | None = None
        self.start_time = clock()
        self.nodes = 0
        self.links_managed = 0
        self.conflicts = 0
        self.foreign_links = 0
        self.changes = {a: 0 for a in LINK_ACTIONS}
        self.change_failures = {a: 0 for a in LINK_ACTIONS}
        self.syncs = 0
        self.sync_failures = 0
        self.last_success: float | None = None
        self.containers = {s: 0 for s in CONTAINER_STATUSES}
        self.container_findings: list = []  # label dicts, one per GPU container with findings
        self.container_devices: list = []  # label dicts, one per MIG device / IMEX channel a GPU container holds
        # when the verification the container gauges above come from began (None: none yet): the heartbeat rewrites
        # them as they were, and a reader tells their age from this, not from the file's
        self.last_verification: float | None = None
        self.repairs = {r: 0 for r in REPAIR_RESULTS}
        self.reloads = 0
        self.latency_buckets = [0] * len(LATENCY_BUCKETS)
        self.latency_sum = 0.0
        self.latency_count = 0

    # -- updates from the daemon -------------------------------------------

    def on_reconcile(self, result) -> None:
        """A finished pass (nvsymlinkd.devchar.reconcile.SyncResult)."""
        # the daemon's pass (devchar.incremental.Picture) says its counts itself: an event's pass then costs
        # its own outcomes, not a walk over every node and link of the host (issue 38)
        counted = getattr(result, "counts", None)
        with self._lock:
            self.syncs += 1
            counts = result.plan.summary()
            self.conflicts = counts["conflict"]
            failed = 0
            outcomes = result.pass_outcomes if counted is not None else result.outcomes
            for outcome in outcomes:
                action = outcome.action.action
                if action not in self.changes:
                    continue  # keep, conflict
                if outcome.error is None:
                    self.changes[action] += 1
                else:
                    self.change_failures[action] += 1
                    failed += 1
            if counted is not None:
                self.nodes, self.links_managed = counted()
            else:
                self.nodes = len(result.snapshot.nodes)
                # links in place now: wanted ones that were kept or written without error
                wanted = [o for o in outcomes if o.action.action in ("create", "replace", "keep")]
                self.links_managed = sum(1 for o in wanted if o.error is None)
            if not result.dry_run:
                self.last_success = self.clock()
        self._changed()

    def on_foreign_links(self, count: int) -> None:
        """Desired paths held by someone else's symlink after the last pass (a subset of the conflicts)."""
        with self._lock:
            changed = self.foreign_links != count
            self.foreign_links = count
        if changed:
            self._changed()

    def on_sync_failed(self) -> None:
        """A pass that raised (unreadable /proc/devices, ...): counted, no success time."""
        with self._lock:
            self.syncs += 1
            self.sync_failures += 1
        self._changed()

    def on_event_latency(self, seconds: float) -> None:
        """Time from the first device-node event of a pass to its links being written."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        with self._lock:
            for i, bound in enumerate(LATENCY_BUCKETS):
                if seconds <= bound:
                    self.latency_buckets[i] += 1
                    break
            self.latency_sum += seconds
            self.latency_count += 1
        self._changed()

    def on_reload(self) -> None:
        """systemd finished a daemon-reload or re-exec."""
        with self._lock:
            self.reloads += 1
        self._changed()

    def on_containers(self, report: Report) -> None:
        """GPU containers by verdict, from a verifier.Report; replaces the previous counts.

        Containers not running or not GPU containers are not counted; a verdict this module does
        not know counts as "unknown".
        """
        counts = {s: 0 for s in CONTAINER_STATUSES}
        for c in report.containers:
            verdict = str(c.verdict)
            if verdict in NOT_COUNTED:
                continue
            counts[verdict if verdict in counts else Verdict.UNKNOWN.value] += 1
        labelled = _finding_labels(report.containers)
        named = _device_labels(report.containers)
        began = self.clock() - max(0.0, float(report.seconds or 0.0))
        with self._lock:
            self.containers = counts
            self.container_findings = labelled
            self.container_devices = named
            self.last_verification = began
        self._changed()

    def on_repair(self, outcome=None, ok: bool = True) -> None:
        """One container repair attempt; `outcome` is kept for the caller's logging only."""
        with self._lock:
            self.repairs["ok" if ok else "failed"] += 1
        self._changed()

    # -- rendering -----------------------------------------------------------

    def render(self) -> str:
        with self._lock:
            return self._render_locked()

    def _render_locked(self) -> str:
        out: list = []
        fam = Family(out)
        fam.gauge("nvsymlinkd_build_info", "Version of the running nvsymlinkd (always 1).",
                  [({"version": __version__}, 1)])
        fam.gauge("nvsymlinkd_start_time_seconds", "Unix time the daemon started.", [({}, self.start_time)])
        fam.gauge("nvsymlinkd_nvidia_device_nodes", "NVIDIA device nodes seen by the last sync.", [({}, self.nodes)])
        fam.gauge("nvsymlinkd_links_managed", "/dev/char links in place for NVIDIA nodes after the last sync.",
                  [({}, self.links_managed)])
        fam.gauge("nvsymlinkd_link_conflicts",
                  "Desired /dev/char paths held by something nvsymlinkd does not own (left untouched).",
                  [({}, self.conflicts)])
        fam.gauge("nvsymlinkd_foreign_links",
                  "Desired /dev/char paths held by another tool's symlink to another device or to nothing "
                  "(left untouched).",
                  [({}, self.foreign_links)])
        fam.counter("nvsymlinkd_link_changes_total", "Link and node changes made, by action.",
                    [({"action": a}, n) for a, n in self.changes.items()])
        fam.counter("nvsymlinkd_link_change_failures_total", "Link and node changes that failed, by action.",
                    [({"action": a}, n) for a, n in self.change_failures.items()])
        fam.counter("nvsymlinkd_syncs_total", "Reconcile passes run.", [({}, self.syncs)])
        fam.counter("nvsymlinkd_sync_failures_total", "Reconcile passes that could not read the host.",
                    [({}, self.sync_failures)])
        if self.last_success is not None:
            fam.gauge("nvsymlinkd_last_successful_sync_timestamp_seconds",
                      "Unix time of the last reconcile pass that read the host.", [({}, self.last_success)])
        fam.gauge("nvsymlinkd_gpu_containers", "Running GPU containers by device-access status, as of "
                  "nvsymlinkd_last_verification_timestamp_seconds.",
                  [({"status": s}, n) for s, n in self.containers.items()])
        if self.last_verification is not None:
            fam.gauge("nvsymlinkd_last_verification_timestamp_seconds",
                      "Unix time the container verification that the container gauges come from "
                      "began; the file's heartbeat does not move it.", [({}, self.last_verification)])
        interval = getattr(self.config, "resync_interval", None) if self.config is not None else None
        if isinstance(interval, (int, float)):
            fam.gauge("nvsymlinkd_resync_interval_seconds",
                      "Seconds between the daemon's full resyncs, each of which verifies every container "
                      "(0: off, events only).", [({}, interval)])
        fam.gauge("nvsymlinkd_gpu_container_findings",
                  "1 per GPU container with findings (lost, at-risk, unknown), named for alerts; "
                  f"at most {MAX_LABELLED_CONTAINERS}.",
                  [(labels, 1) for labels in self.container_findings])
        fam.gauge("nvsymlinkd_gpu_container_devices",
                  "1 per MIG device and IMEX channel the NVIDIA hook granted a running GPU container, named as "
                  "check names them (kind mig: device the MIG UUID, index g:m, mig_instance gpuN/giG/ciC; kind "
                  f"imex: device the channel's node, index its number); at most {MAX_NAMED_DEVICES}.",
                  [(labels, 1) for labels in self.container_devices])
        fam.counter("nvsymlinkd_repairs_total", "Container device-access repairs, by result.",
                    [({"result": r}, n) for r, n in self.repairs.items()])
        fam.counter("nvsymlinkd_systemd_reloads_total", "systemd daemon-reloads and re-execs seen.",
                    [({}, self.reloads)])
        fam.histogram("nvsymlinkd_event_to_link_latency_seconds",
                      "Time from a device-node event to its /dev/char links being written.",
                      LATENCY_BUCKETS, self.latency_buckets, self.latency_sum, self.latency_count)
        return "".join(out)

    # -- output ----------------------------------------------------------------

    @property
    def config(self):
        return self._config

    @config.setter
    def config(self, config) -> None:
        # a reloaded config may turn the textfile on: run() sleeps without a heartbeat while it is off
        self._config = config
        self._changed()

    def textfile_path(self) -> str | None:
        """Real path of the textfile under --root, or None when disabled."""
        inside = getattr(self.config, "metrics_textfile", "") if self.config is not None else ""
        if not inside:
            return None
        return self.root.path(inside) if self.root is not None else inside

    def flush(self) -> bool:
        """Write the textfile now (if configured). False on failure, reported once per distinct error."""
        path = self.textfile_path()
        if path is None:
            return True
        # imported here: the Kubernetes probe imports this module and nothing else of the project
        from nvsymlinkd.host.atomicfile import write_atomic

        try:
            if self.root is not None:  # confined to --root: a link on the way never leads the write outside
                self.root.write_file(self.config.metrics_textfile, self.render(), 0o644, dir_mode=None)
            else:
                write_atomic(path, self.render())
        except OSError as exc:
            shown = self.config.metrics_textfile
            message = f"cannot write metrics to {shown}: {exc.strerror or exc}"
            if message != self._write_error and self.journal is not None:
                if isinstance(exc, FileNotFoundError):
                    # the usual host without node-exporter: say so once, quietly, and keep trying
                    self.journal.info(f"{message} (no node-exporter textfile directory?); "
                                      'set metrics_textfile = "" to stop trying')
                else:
                    self.journal.warning(message + "; fix metrics_textfile")
            self._write_error = message
            return False
        if self._write_error is not None and self.journal is not None:
            self.journal.info(f"metrics written to {self.config.metrics_textfile} again")
        self._write_error = None
        return True

    def _changed(self) -> None:
        dirty = self._dirty
        if dirty is not None:
            loop = self._loop
            if _in_loop(loop):
                dirty.set()
            else:
                loop.call_soon_threadsafe(dirty.set)

    async def run(self) -> None:
        """Serve metrics_listen and keep the textfile fresh until cancelled.

        Writes soon after every update (at most 1/MIN_WRITE_GAP per second) and
        every HEARTBEAT_SECONDS regardless (while a textfile is configured), so the file's age tells the event
        loop is alive. The write (with its fsync) runs in a thread.
        """
        self._loop = asyncio.get_running_loop()
        self._dirty = asyncio.Event()
        server = None
        listen = getattr(self.config, "metrics_listen", "") if self.config is not None else ""
        if listen:
            # not at the top: the probe imports nothing of the package but verify.kinds
            from nvsymlinkd.config import parse_listen

            try:
                server = await self.serve(*parse_listen(listen))
            except OSError as exc:
                if self.journal is not None:
                    self.journal.warning(f"cannot serve metrics on {listen}: {exc.strerror or exc}; "
                                         "the textfile is still written")
        try:
            while True:
                writing = self.textfile_path() is not None
                if writing:
                    await self._loop.run_in_executor(None, self.flush)
                # not wait_for: before 3.12 it can swallow a cancel that races the wake-up
                waiter = asyncio.ensure_future(self._dirty.wait())
                try:
                    # no textfile: no heartbeat either (an idle daemon wakes for its resync timer only)
                    await asyncio.wait({waiter}, timeout=HEARTBEAT_SECONDS if writing else None)
                finally:
                    waiter.cancel()
                self._dirty.clear()
                await asyncio.sleep(MIN_WRITE_GAP)
        finally:
            self._dirty = None
            if server is not None:
                server.close()
            # one last write so the file says what the daemon did before it stopped
            self.flush()

    async def serve(self, host: str | None, port: int):
        """Start the HTTP responder (host None: every address); returns the asyncio server."""
        return await asyncio.start_server(self._handle, host, port)

    async def _handle(self, reader, writer) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
            writer.close()
            return
        if len(head) > MAX_REQUEST_BYTES:
            writer.close()
            return
        request = head.split(b"\r\n", 1)[0].decode("latin-1").split()
        method, target = (request[0], request[1]) if len(request) >= 2 else ("", "")
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            status, body, ctype = "405 Method Not Allowed", b"only GET\n", "text/plain"
        elif path in ("/metrics", "/"):
            status, body, ctype = "200 OK", self.render().encode("utf-8"), CONTENT_TYPE
        else:
            status, body, ctype = "404 Not Found", b"see /metrics\n", "text/plain"
        headers = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                   "Connection: close\r\n\r\n").encode("ascii")
        try:
            writer.write(headers + (b"" if method == "HEAD" else body))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


def _finding_labels(reports: list[ContainerReport]) -> list:
    """Labels of the containers with findings: short id, pod namespace/name, container name, verdict."""
    out = []
    for c in reports:
        verdict = str(c.verdict)
        if verdict in NOT_COUNTED or verdict == Verdict.OK or not c.findings:
            continue
        out.append({"container_id": c.short_id,
                    "namespace": c.pod_namespace or "",
                    "pod": c.pod_name or "",
                    "container": c.container_name or "",
                    "status": verdict if verdict in CONTAINER_STATUSES else Verdict.UNKNOWN.value})
        if len(out) >= MAX_LABELLED_CONTAINERS:
            break
    return out


def _device_labels(reports: list[ContainerReport]) -> list:
    """Labels of the MIG devices and IMEX channels in each counted container's reconstructed hook grant
    (containers.hookgrant's mig_devices / imex_channels: only a trusted grant names them), containers with
    findings first, so that an alert's container is named within the bound."""
    out: list = []
    for c in sorted(reports, key=lambda c: not c.findings):
        hook = c.nvidia_hook or {}
        if str(c.verdict) in NOT_COUNTED or not hook:
            continue
        pod = {"container_id": c.short_id, "namespace": c.pod_namespace or "", "pod": c.pod_name or "",
               "container": c.container_name or ""}
        for mig in hook.get("mig_devices") or ():
            out.append({**pod, "kind": "mig", "device": mig["uuid"], "index": mig.get("index") or "",
                        "mig_instance": mig["instance"]})
        for imex in hook.get("imex_channels") or ():
            out.append({**pod, "kind": "imex", "device": imex["path"], "index": str(imex["channel"]),
                        "mig_instance": ""})
    return out[:MAX_NAMED_DEVICES]


def _in_loop(loop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class Family:
    """Appends families in exposition format 0.0.4 to a list of strings."""

    def __init__(self, out: list):
        self.out = out

    def _head(self, name: str, help_text: str, kind: str) -> None:
        self.out.append(f"# HELP {name} {escape_help(help_text)}\n# TYPE {name} {kind}\n")

    def _samples(self, name: str, samples) -> None:
        for labels, value in samples:
            self.out.append(f"{name}{format_labels(labels)} {format_value(value)}\n")

    def gauge(self, name, help_text, samples) -> None:
        self._head(name, help_text, "gauge")
        self._samples(name, samples)

    def counter(self, name, help_text, samples) -> None:
        assert name.endswith("_total"), name
        self._head(name, help_text, "counter")
        self._samples(name, samples)

    def histogram(self, name, help_text, bounds, counts, total, count) -> None:
        self._head(name, help_text, "histogram")
        running = 0
        for bound, n in zip(bounds, counts):
            running += n
            self._samples(name + "_bucket", [({"le": format_value(float(bound))}, running)])
        self._samples(name + "_bucket", [({"le": "+Inf"}, count)])
        self._samples(name + "_sum", [({}, total)])
        self._samples(name + "_count", [({}, count)])


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def escape_label_value(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


LABEL_NAME_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def format_labels(labels: dict) -> str:
    if not labels:
        return ""
    for key in labels:
        assert LABEL_NAME_RE.fullmatch(key) and not key.startswith("__"), key
    return "{" + ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels.items()) + "}"


def format_value(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return f"{value:.1f}"
    return repr(value)


# -- the probe --------------------------------------------------------------


def read_gauge(text: str, name: str) -> float | None:
    """Value of an unlabelled sample `name` in exposition text, or None."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            try:
                return float(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None


MAX_TEXTFILE_BYTES = 16 << 20  # 100 labelled containers and the families: tens of KiB


def _read_textfile(path: str) -> tuple:
    """(fstat, text) of the metrics file: a regular file only, bounded (host.root's rule for every host file,
    written out here: the probe imports nothing of the package but this module)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(0, "not a regular file")
        data = os.read(fd, MAX_TEXTFILE_BYTES + 1)
        if len(data) > MAX_TEXTFILE_BYTES:
            raise OSError(0, f"larger than {MAX_TEXTFILE_BYTES} bytes")
    finally:
        os.close(fd)
    return st, data.decode("utf-8", "replace")


def check(path: str, max_age: float, max_sync_age: float | None, now: float | None = None) -> tuple:
    """(ok, one-line message) for the metrics file at `path`."""
    now = time.time() if now is None else now
    try:
        st, text = _read_textfile(path)
    except OSError as exc:
        return False, f"{path}: {exc.strerror}; is the daemon running with metrics_textfile set?"
    age = now - st.st_mtime
    if age > max_age:
        return False, f"{path}: last written {age:.0f} s ago (limit {max_age:g} s): the daemon's loop is stuck"
    if max_sync_age is not None:
        last = read_gauge(text, "nvsymlinkd_last_successful_sync_timestamp_seconds")
        if last is None:
            return False, f"{path}: no successful sync yet"
        if now - last > max_sync_age:
            return False, f"{path}: last successful sync {now - last:.0f} s ago (limit {max_sync_age:g} s)"
    return True, f"{path}: fresh"


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python3 -m nvsymlinkd.metrics",
                                description="Probe: is the daemon's metrics file fresh (exit 0) or not (exit 1)?")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="exit 0 while FILE is fresh")
    c.add_argument("file")
    c.add_argument("--max-age", type=float, default=4 * HEARTBEAT_SECONDS, metavar="SEC",
                   help=f"FILE must have been written within SEC seconds (default {4 * HEARTBEAT_SECONDS:g})")
    c.add_argument("--max-sync-age", type=float, default=None, metavar="SEC",
                   help="and the last successful sync must be within SEC seconds")
    args = p.parse_args(argv)
    ok, message = check(args.file, args.max_age, args.max_sync_age)
    (sys.stdout if ok else sys.stderr).write(message + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
