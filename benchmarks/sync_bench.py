#!/usr/bin/env python3
"""Benchmark `sync` against its floor: 8 GPUs and 2,000 MIG capability nodes in a fake root (needs root).

Prints, each beside a floor measured in the same run and the ratio to it:
- the daemon's periodic full pass on an unchanged host (its directories' listings kept from the
  last pass, host/listings.py: O(directories) syscalls) beside the same no-op floor, which does the
  per-node syscalls that pass no longer makes;
- the in-process cold pass (observe + plan + apply, every link created) and no-op pass
  (observe + plan, nothing to change) vs the floor (and, for the no-op pass, the tightest Python
  loop doing the same syscalls, vs the C floor and vs the pass: what Python costs before any logic): a minimal pass doing only the syscalls
  the job needs (scandir of DRIVER_ROOT/dev and dev/nvidia-caps, lstat of each nvidia* entry,
  scandir of /dev/char and readlink of each link; for the cold floor, symlink of each link).
  The floor is a C program built here with the machine's cc; without a compiler, the
  tightest Python os.scandir loop (the output says which). Each as wall time and as the
  thread's CPU time (user + system: on a shared, loaded machine the wall time counts the
  preemptions too, the CPU time does not);
- the wall time of a `nvsymlinkd sync` process (no-op) vs a bare `python3 -c pass`, both with
  the modules read from bytecode (as installed) and both with PYTHONDONTWRITEBYTECODE (as measured
  before: a checkout without __pycache__ compiles nvsymlinkd's modules at every start).

Figures only, no asserts. Usage:
    sudo .venv/bin/python benchmarks/sync_bench.py [--runs 20] [--caps 2000] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from figures import emit, use_tree  # noqa: E402

use_tree()  # a script: the repository root, for tests.* (and benchmarks/run --tree's nvsymlinkd)

from nvsymlinkd.config import Config  # noqa: E402
from nvsymlinkd.devchar.reconcile import reconcile  # noqa: E402
from nvsymlinkd.host.root import HostRoot  # noqa: E402
from tests.fakehost import standard_host  # noqa: E402

CAPS_MAJOR = 236

FLOOR_C = r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

static long nodes;
static unsigned rdevs[65536][2];

static void scan(int dfd, int depth) {
    DIR *d = fdopendir(dfd);
    struct dirent *e;
    struct stat st;
    while ((e = readdir(d))) {
        if (depth == 0 && strncmp(e->d_name, "nvidia", 6)) continue;
        if (e->d_name[0] == '.') continue;
        if (depth == 0 && !strcmp(e->d_name, "nvidia-caps")) {
            scan(openat(dirfd(d), e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC), 1);
            continue;
        }
        if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISCHR(st.st_mode) && nodes < 65536) {
            rdevs[nodes][0] = major(st.st_rdev);
            rdevs[nodes][1] = minor(st.st_rdev);
            nodes++;
        }
    }
    closedir(d);
}

static double now(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* argv: root, mode (noop|cold), runs; prints per run the wall and the thread CPU seconds */
int main(int argc, char **argv) {
    char path[4096], buf[4096], name[64];
    int runs = atoi(argv[3]), cold = !strcmp(argv[2], "cold");
    for (int r = 0; r < runs; r++) {
        double t = now(CLOCK_MONOTONIC), c = now(CLOCK_THREAD_CPUTIME_ID);
        nodes = 0;
        snprintf(path, sizeof path, "%s/dev", argv[1]);
        scan(open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC), 0);
        snprintf(path, sizeof path, "%s/dev/char", argv[1]);
        int cfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (cold) {
            for (long i = 0; i < nodes; i++) {
                snprintf(name, sizeof name, "%u:%u", rdevs[i][0], rdevs[i][1]);
                symlinkat("../nvidia-caps/x", cfd, name);
            }
        } else {
            DIR *d = fdopendir(dup(cfd));
            struct dirent *e;
            while ((e = readdir(d)))
                if (e->d_name[0] != '.') readlinkat(dirfd(d), e->d_name, buf, sizeof buf);
            closedir(d);
        }
        close(cfd);
        printf("%.9f %.9f\n", now(CLOCK_MONOTONIC) - t, now(CLOCK_THREAD_CPUTIME_ID) - c);
        if (cold && r + 1 < runs) {  /* back to an empty /dev/char for the next cold run (not timed) */
            for (long i = 0; i < nodes; i++) {
                snprintf(name, sizeof name, "%u:%u", rdevs[i][0], rdevs[i][1]);
                snprintf(path, sizeof path, "%s/dev/char/%s", argv[1], name);
                unlink(path);
            }
        }
    }
    return 0;
}
"""


def build(root: Path, caps: int):
    host = standard_host(root, gpus=8)
    host.proc_devices({"nvidia-frontend": 195, "nvidia-uvm": 510, "nvidia-caps": CAPS_MAJOR})
    for minor in range(1, caps + 1):
        host.node(f"/dev/nvidia-caps/nvidia-cap{minor}", CAPS_MAJOR, minor)
    return host


def build_floor(work: Path):
    """-> (kind, argv prefix): the C floor when a compiler is here, else None."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src = work / "floor.c"
    src.write_text(FLOOR_C)
    exe = work / "floor"
    subprocess.run([cc, "-O2", "-o", str(exe), str(src)], check=True)
    return str(exe)


def floor_runs(exe, root: Path, mode: str, runs: int) -> tuple:
    """-> ([wall seconds], [thread CPU seconds]), one per run."""
    if exe is not None:
        out = subprocess.run([exe, str(root), mode, str(runs)], check=True, capture_output=True, text=True).stdout
        pairs = [line.split() for line in out.splitlines()]
        return [float(w) for w, _ in pairs], [float(c) for _, c in pairs]
    pairs = [python_floor(root, mode) for _ in range(runs)]
    return [w for w, _ in pairs], [c for _, c in pairs]


def python_floor(root: Path, mode: str) -> tuple:
    """The tightest Python loop over os.scandir doing the same syscalls (no compiler here)."""
    t, c = time.perf_counter(), time.thread_time()
    rdevs = []
    with os.scandir(root / "dev") as it:
        for e in it:
            if not e.name.startswith("nvidia"):
                continue
            if e.name == "nvidia-caps":
                with os.scandir(e.path) as inner:
                    rdevs += [i.stat(follow_symlinks=False).st_rdev for i in inner]
            else:
                rdevs.append(e.stat(follow_symlinks=False).st_rdev)
    char = root / "dev" / "char"
    if mode == "cold":
        for r in rdevs:
            os.symlink("../nvidia-caps/x", f"{char}/{os.major(r)}:{os.minor(r)}")
    else:
        with os.scandir(char) as it:
            for e in it:
                os.readlink(e.path)
    took = (time.perf_counter() - t, time.thread_time() - c)
    if mode == "cold":
        for r in rdevs:
            os.unlink(f"{char}/{os.major(r)}:{os.minor(r)}")
    return took


def kept_listings():
    """The daemon's kept listings (host/listings.py), or None in a tree without them."""
    try:
        from nvsymlinkd.host.listings import Listings
    except ImportError:
        return None
    return Listings()


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def line(what: str, values: list, floor: list) -> str:
    m, f = statistics.median(values), statistics.median(floor)
    return (f"{what}: median {ms(m)} (min {ms(min(values))}); floor {ms(f)} (min {ms(min(floor))}); "
            f"ratio {m / f:.1f}x (of the minimums {min(values) / min(floor):.1f}x: a loaded machine adds to both)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--caps", type=int, default=2000)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="where the fake root goes (default /dev/shm: tmpfs like the real /dev)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        exe = build_floor(work)
        host = build(work / "root", args.caps)
        root = HostRoot(str(host.root))
        cfg = Config()
        char = host.path("/dev/char")
        char.mkdir()
        # cold: every link created; the floor gets an empty /dev/char for each of its runs the same way
        cold_floor, cold_floor_cpu = floor_runs(exe, host.root, "cold", args.runs)
        for name in os.listdir(char):
            os.unlink(char / name)
        cold, cold_cpu = [], []
        for _ in range(args.runs):
            t, c = time.perf_counter(), time.thread_time()
            reconcile(root, cfg)
            cold.append(time.perf_counter() - t)
            cold_cpu.append(time.thread_time() - c)
            for name in os.listdir(char):
                os.unlink(char / name)
        r = reconcile(root, cfg)
        nodes = len(r.snapshot.nodes)
        noop, noop_cpu = [], []
        for _ in range(args.runs):
            t, c = time.perf_counter(), time.thread_time()
            r = reconcile(root, cfg)
            noop.append(time.perf_counter() - t)
            noop_cpu.append(time.thread_time() - c)
            assert not r.plan.changes
        # the daemon's periodic full pass: its directories as the last pass read them, listed again only
        # where changed (host/listings.py; a tree without it reads everything, as that daemon does); the
        # directories' mtimes set long before the listing, as on a host whose /dev settled at boot
        for d in ("/dev", "/dev/nvidia-caps", "/dev/char"):
            os.utime(host.path(d), (1e9, 1e9))
        listings = kept_listings()
        kw = {"listings": listings} if listings is not None else {}
        reconcile(root, cfg, **kw)
        kept, kept_cpu = [], []
        for _ in range(args.runs):
            t, c = time.perf_counter(), time.thread_time()
            r = reconcile(root, cfg, **kw)
            kept.append(time.perf_counter() - t)
            kept_cpu.append(time.thread_time() - c)
            assert not r.plan.changes
        noop_floor, noop_floor_cpu = floor_runs(exe, host.root, "noop", args.runs)
        # the same syscalls from the tightest Python loop: what any Python pass pays before its logic
        py_floor_cpu = [python_floor(host.root, "noop")[1] for _ in range(args.runs)] if exe else None
        sync = [sys.executable, "-m", "nvsymlinkd", "--root", str(host.root), "sync"]
        # as installed: modules read from bytecode (a package ships or compiles it), kept in a
        # cache of this run (PYTHONPYCACHEPREFIX, the interpreter's too); and as before, with
        # PYTHONDONTWRITEBYTECODE (a checkout without __pycache__ compiles nvsymlinkd at each start)
        cache = dict(os.environ, PYTHONPYCACHEPREFIX=str(work / "pycache"))
        cache.pop("PYTHONDONTWRITEBYTECODE", None)
        subprocess.run(sync, check=True, stdout=subprocess.DEVNULL, env=cache)  # writes the cache
        subprocess.run([sys.executable, "-c", "pass"], check=True, env=cache)
        cache["PYTHONDONTWRITEBYTECODE"] = "1"
        source = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        walls: dict = {"bytecode": ([], []), "source": ([], [])}
        for _ in range(max(5, args.runs // 2)):  # interleaved: both see the same machine load
            for kind, env in (("bytecode", cache), ("source", source)):
                wall, base = walls[kind]
                t = time.perf_counter()
                subprocess.run(sync, check=True, stdout=subprocess.DEVNULL, env=env)
                wall.append(time.perf_counter() - t)
                t = time.perf_counter()
                subprocess.run([sys.executable, "-c", "pass"], check=True, env=env)
                base.append(time.perf_counter() - t)
    floor_kind = "C, built with cc -O2" if exe else "Python os.scandir loop (no compiler found)"
    print(f"nodes: {nodes} ({args.caps} MIG caps + 8 GPUs + 4 control nodes); fake root on {args.dir}; "
          f"floor: {floor_kind}; {args.runs} runs each")
    print(line("cold pass in-process (every link created), wall", cold, cold_floor))
    print(line("cold pass in-process (every link created), thread CPU", cold_cpu, cold_floor_cpu))
    print(line("no-op pass in-process, wall", noop, noop_floor))
    print(line("no-op pass in-process, thread CPU", noop_cpu, noop_floor_cpu))
    print(line("the daemon's no-op full pass (directories unchanged since its last pass), thread CPU",
               kept_cpu, noop_floor_cpu))
    if py_floor_cpu:
        print(line("  the tightest Python os.scandir loop over the same syscalls (no-op), thread CPU, vs the C floor",
                   py_floor_cpu, noop_floor_cpu))
        print(line("  no-op pass in-process, thread CPU, vs that Python loop", noop_cpu, py_floor_cpu))
    print(line("`nvsymlinkd sync` process wall (no-op) vs bare `python3 -c pass`, from bytecode", *walls["bytecode"]))
    print(line("`nvsymlinkd sync` process wall (no-op) vs bare `python3 -c pass`, PYTHONDONTWRITEBYTECODE", *walls["source"]))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    med = statistics.median
    emit(f"no-op reconcile, {nodes} nodes (thread CPU; floor: C)", med(noop_cpu) * 1e3, med(noop_floor_cpu) * 1e3,
         goal="<= 2x floor", met=med(noop_cpu) <= 2 * med(noop_floor_cpu))
    emit(f"daemon's no-op full pass, {nodes} nodes, directories unchanged (thread CPU; floor: C, every node)",
         med(kept_cpu) * 1e3, med(noop_floor_cpu) * 1e3, goal="<= 2x floor", met=med(kept_cpu) <= 2 * med(noop_floor_cpu))
    emit(f"cold reconcile, {nodes} nodes (thread CPU; floor: C)", med(cold_cpu) * 1e3, med(cold_floor_cpu) * 1e3,
         goal="<= 2x floor", met=med(cold_cpu) <= 2 * med(cold_floor_cpu))


if __name__ == "__main__":
    main()
