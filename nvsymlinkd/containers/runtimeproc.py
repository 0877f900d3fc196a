"""The bundle of a container runc is still creating, read from the runc process that creates it.

Plain runc and Podman with runc name the bundle only in state.json, and runc writes state.json
after the prestart hooks have run (libcontainer/container_linux.go at v1.1.5: newInitProcess ...
`c.saveState` once `runc init` has been through the hooks; during them only exec.fifo is in the state
directory). The daemon's creation-time drop-in needs the spec then. The process running `runc
create` / `runc run` names it by its working directory: runc chdirs into `--bundle`/`-b` before
it reads config.json (utils.go:70-76 at v1.1.5, `setupSpec`) and labels the container with its cwd
(libcontainer/specconv/spec_linux.go:333-359, "runc's cwd will always be the bundle path"); the flag
only confirms it (bundle_of). Its argv and cwd are trusted only when it runs the host's own runc
binary (/proc/<pid>/exe is the very file, by device and inode, of one of the runtime table's paths
under the root: also under the DaemonSet's --root /host, where that link reads as the host's path), run
by root (every uid 0), in the host's mount namespace: a container's processes fail at least one of
these, and nothing a container writes is read to decide. Its cwd, read the same way, is a host path:
the bundle as the host names it.

    parse_runc_argv(argv)   # (state root or None, bundle or None, container id) for create/run
    bundle_of(cwd, bundle)  # the bundle of such a process: its cwd, when --bundle agrees; else None
"""

from __future__ import annotations

import os
import posixpath
import stat

from nvsymlinkd.containers.ocispec import MAX_SMALL_BYTES, read_bounded
from nvsymlinkd.host.hostview import same_mount_ns
from nvsymlinkd.host.paths import normalize
from nvsymlinkd.host.root import HostRoot

RUNC_DEFAULT_ROOT = "/run/runc"  # runc's --root for uid 0 (main.go at v1.1.5: XDG_RUNTIME_DIR only rootless)
MAX_PROCS = 100_000
MAX_CMDLINE = 64 * 1024
# runc v1.1.5's flags (main.go, create.go, run.go: urfave/cli v1, which parses with Go's `flag`: one
# or two dashes, "-f value" or "-f=value", the first non-flag argument ends the flags)
GLOBAL_VALUE = frozenset({"root", "log", "log-format", "criu", "rootless"})
GLOBAL_BOOL = frozenset({"debug", "systemd-cgroup"})
CREATE_VALUE = frozenset({"bundle", "b", "console-socket", "pid-file", "preserve-fds"})
CREATE_BOOL = frozenset({"no-pivot", "no-new-keyring", "detach", "d", "keep"})
COMMANDS = frozenset({"create", "run"})


def _flags(argv: list, i: int, with_value: frozenset, boolean: frozenset, out: dict) -> int | None:
    """Go `flag` parsing from argv[i]: the index of the first non-flag argument; None for a flag it
    does not know (then nothing is trusted)."""
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return i + 1
        if not arg.startswith("-") or arg == "-":
            return i
        name, eq, value = arg.lstrip("-").partition("=")
        if arg.startswith("---") or not name:
            return None
        if name in boolean:
            i += 1
            continue
        if name not in with_value:
            return None
        if not eq:
            if i + 1 >= len(argv):
                return None
            value = argv[i + 1]
            i += 1
        out[name] = value
        i += 1
    return i


def parse_runc_argv(argv: list) -> tuple[str | None, str | None, str] | None:
    """(--root or None, --bundle or None, container id) of a `runc [global flags] create|run [flags] ID`
    command line; None for anything else (another command, a flag runc v1.1.5 does not have)."""
    if not argv:
        return None
    found: dict = {}
    i = _flags(argv, 1, GLOBAL_VALUE, GLOBAL_BOOL, found)
    if i is None or i >= len(argv) or argv[i] not in COMMANDS:
        return None
    sub: dict = {}
    j = _flags(argv, i + 1, CREATE_VALUE, CREATE_BOOL, sub)
    if j is None or j >= len(argv) or not argv[j]:
        return None
    bundle = sub.get("bundle", sub.get("b"))
    return found.get("root"), bundle, argv[j]


def bundle_of(cwd: str, bundle: str | None) -> str | None:
    """The bundle of a `runc create/run` process whose working directory is `cwd` (absolute, as
    /proc/PID/cwd says it), given its --bundle (None when absent). runc chdirs into --bundle first
    (utils.go:70-76 at v1.1.5) and reads config.json and labels `bundle=` from its cwd (spec_linux.go:
    333-359), so a relative --bundle is relative to a directory it has left: `runc run -b ctr id` from
    /root runs in /root/ctr, never /root/ctr/ctr. The flag must agree with the cwd: an absolute one
    equal to it, a relative one (no "..") its last components. Otherwise None: runc has not chdir'ed
    yet (its cwd is still the caller's), or the path goes through a link; the pass after state.json
    judges that container."""
    cwd = normalize(cwd)
    if bundle is None:
        return cwd  # no --bundle: runc reads ./config.json where it was started
    if bundle.startswith("/"):
        return cwd if normalize(bundle) == cwd else None
    if ".." in bundle.split("/"):
        return None  # the kernel resolves ".." after a link, not lexically: where it led is not known
    rel = posixpath.normpath(bundle)
    return cwd if rel == "." or cwd.endswith("/" + rel) else None


def _uid0(root: HostRoot, pid: int) -> bool:
    try:
        text = read_bounded(root.path(f"/proc/{pid}/status"), MAX_SMALL_BYTES).decode("ascii", "replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("Uid:"):
            return line.split()[1:] == ["0", "0", "0", "0"]
    return False


def _is_binary(root: HostRoot, pid: int, binaries: tuple) -> bool:
    """/proc/<pid>/exe is the very file of one of `binaries` under the root: the same device and inode. Not by
    its name: the kernel writes that link's text relative to the reader's root (fs/d_path.c d_path), and a
    process of another mount namespace reads the host's path, `/usr/sbin/runc`, not `/host/usr/sbin/runc` (the
    DaemonSet's --root /host sees the host's /proc there). stat() follows the link to the executable itself in
    whichever namespace it lives (fs/proc/base.c proc_exe_link); a bind mount keeps a file's st_dev and st_ino.
    A container's own copy of runc is another inode; one bind-mounted in from the host is refused by the mount
    namespace check (same_mount_ns), a non-root runner by the uid check."""
    try:
        st = os.stat(root.path(f"/proc/{pid}/exe"))
    except OSError:
        return False
    for inside in binaries:
        try:
            mine = os.stat(root.real_resolved(inside, follow_last=True))
        except OSError:
            continue
        if stat.S_ISREG(mine.st_mode) and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            return True
    return False


def creating_bundles(root: HostRoot, binaries: tuple) -> dict:
    """{(state root, container id): bundle}, real host paths as the runc processes now running
    `create`/`run` name them, for the trusted ones only (see the module's docstring)."""
    out: dict = {}
    torn: set = set()
    try:
        names = os.listdir(root.path("/proc"))
    except OSError:
        return out
    for n, name in enumerate(names):
        if n >= MAX_PROCS:
            break
        if not name.isdigit() or name == "1":
            continue
        pid = int(name)
        if not _is_binary(root, pid, binaries):
            continue
        try:
            raw = read_bounded(root.path(f"/proc/{pid}/cmdline"), MAX_CMDLINE)
        except OSError:
            continue
        parsed = parse_runc_argv(raw.decode("utf-8", "surrogateescape").split("\0")[:-1])
        if parsed is None or not _uid0(root, pid) or not same_mount_ns(root, pid):
            continue
        state_root, bundle, cid = parsed
        try:
            cwd = os.readlink(root.path(f"/proc/{pid}/cwd"))
        except OSError:
            continue
        if not cwd.startswith("/"):
            continue
        if state_root and not state_root.startswith("/"):
            continue  # runc made it absolute against the cwd it has since left (main.go:151, reviseRootDir)
        state_root = normalize(state_root) if state_root else RUNC_DEFAULT_ROOT
        bundle = bundle_of(cwd, bundle)
        key = (state_root, cid)
        if bundle is None:
            torn.add(key)  # a process for that container whose bundle is not known: none is trusted
            continue
        if key in out and out[key] != bundle:
            torn.add(key)  # two processes name two bundles for one container: neither is trusted
        out[key] = bundle
    return {k: v for k, v in out.items() if k not in torn}
