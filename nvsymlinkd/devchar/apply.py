"""Doing: apply a Plan with syscalls, atomically and without clobbering.

- create: symlink(2) at the final name; it fails rather than overwrite.
- replace: symlink under a temporary name in the same directory, then
  rename(2) over the old link, after checking the old link is still the one
  we planned to replace.
- remove: unlink only if the link still has the text we planned on.
- create-node: mknod under a temporary name, chown and chmod it, then link(2)
  it to the final name (fails if anything appeared there) and drop the
  temporary name, so no node is ever visible with the wrong owner or mode.

Every syscall acts on a name inside a directory fd opened confined to the
host root (HostRoot.open_dir), once per directory per pass: a symlinked /dev,
/dev/char or driver root is followed as if the root were `/`, never out of it.
Temporaries a killed sync left behind (Plan.stale_temps) are removed first.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import NamedTuple

from nvsymlinkd.devchar.plan import CHANGES, CREATE, CREATE_NODE, REMOVE, REPLACE, Action, Plan
from nvsymlinkd.host.nodes import SUBDIRS, TMP_PREFIX
from nvsymlinkd.host.root import DIR_FLAGS, HostRoot

_new = tuple.__new__  # an Outcome without NamedTuple's keyword-handling __new__: one per action


class Outcome(NamedTuple):  # a tuple: one per action, thousands per MIG pass
    action: Action
    error: str | None = None  # None: applied (or nothing to do)
    raced: bool = False  # another writer changed the path between planning and applying

    def to_json(self) -> dict:
        out = self.action.to_json()
        if self.error is not None:
            out["error"] = self.error
        return out


class ChangedUnderUs(Exception):
    """The path is no longer what the plan saw; the next sync will re-plan."""


def apply_plan(root: HostRoot, plan: Plan) -> list:
    outcomes: list = []
    append = outcomes.append
    dirs = _Dirs(root)
    try:
        for path in plan.stale_temps:
            _remove_stale(dirs, path)
        for action in plan.actions:
            if action[0] not in CHANGES:  # action.action (the property, inlined): thousands of keeps per pass
                append(_new(Outcome, (action, None, False)))
                continue
            try:
                _APPLY[action.action](dirs, action)
            except ChangedUnderUs as exc:
                outcomes.append(Outcome(action, f"changed while applying ({exc}); next sync re-plans", raced=True))
            except OSError as exc:
                outcomes.append(Outcome(action, _describe(exc, action)))
            else:
                outcomes.append(_new(Outcome, (action, None, False)))
    finally:
        dirs.close()
    return outcomes


class _Dirs:
    """Directory fds of one pass, opened confined to the root, each once."""

    def __init__(self, root: HostRoot):
        self.root = root
        self.fds: dict = {}

    def open(self, inside_dir: str) -> int:
        fd = self.fds.get(inside_dir)
        if fd is None:
            fd = self.fds[inside_dir] = self.root.open_dir(inside_dir)
        return fd

    def make(self, inside_dir: str) -> int:
        """open(), creating missing directories (mode 0755)."""
        fd = self.fds.get(inside_dir)
        if fd is not None:
            return fd
        parent, _, name = inside_dir.rpartition("/")
        if name not in SUBDIRS:
            try:
                fd = self.root.make_dirs(inside_dir)
            except NotADirectoryError as exc:
                raise ChangedUnderUs(exc.strerror if exc.filename is None else f"{inside_dir} is not a directory")
        else:
            # like the node scan, never through a symlinked nvidia-caps/: the nodes would be invisible to it
            pfd = self.make(parent or "/")
            try:
                os.mkdir(name, 0o755, dir_fd=pfd)
            except FileExistsError:
                pass
            try:
                fd = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=pfd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise ChangedUnderUs(f"{inside_dir} is not a directory")
                raise
        self.fds[inside_dir] = fd
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _split(inside: str) -> tuple:
    parent, _, name = inside.rpartition("/")
    return parent or "/", name


def _tmp_name(name: str) -> str:
    return f"{TMP_PREFIX}{os.getpid()}-{name}"


def _current_link_text(dirfd: int, name: str) -> str | None:
    try:
        return os.readlink(name, dir_fd=dirfd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EINVAL):
            return None
        raise


def _create(dirs: _Dirs, a: Action) -> None:
    assert a.link is not None and a.target is not None  # a create action has both (devchar/plan.py)
    parent, name = _split(a.link)
    fd = dirs.make(parent)
    try:
        os.symlink(a.target, name, dir_fd=fd)
    except FileExistsError:
        raise ChangedUnderUs(f"{a.link} appeared")


def _replace(dirs: _Dirs, a: Action) -> None:
    assert a.link is not None and a.target is not None  # a replace action has both
    parent, name = _split(a.link)
    fd = dirs.open(parent)
    if _current_link_text(fd, name) != a.previous:
        raise ChangedUnderUs(f"{a.link} no longer points to {a.previous}")
    tmp = _tmp_name(name)
    _unlink_quietly(fd, tmp)
    os.symlink(a.target, tmp, dir_fd=fd)
    try:
        os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
    except BaseException:
        _unlink_quietly(fd, tmp)
        raise


def _remove(dirs: _Dirs, a: Action) -> None:
    assert a.link is not None  # a remove action names its link
    parent, name = _split(a.link)
    fd = dirs.open(parent)
    if _current_link_text(fd, name) != a.previous:
        raise ChangedUnderUs(f"{a.link} no longer points to {a.previous}")
    os.unlink(name, dir_fd=fd)


def _create_node(dirs: _Dirs, a: Action) -> None:
    # a create-node action has its node path and ownership (devchar/plan.py)
    assert a.target is not None and a.node_uid is not None and a.node_gid is not None and a.node_mode is not None
    parent, name = _split(a.target)
    fd = dirs.make(parent)
    tmp = _tmp_name(name)
    _unlink_quietly(fd, tmp)
    os.mknod(tmp, stat.S_IFCHR | 0o600, os.makedev(a.device.major, a.device.minor), dir_fd=fd)
    try:
        os.chown(tmp, a.node_uid, a.node_gid, dir_fd=fd, follow_symlinks=False)
        # fchmodat cannot refuse links before Linux 6.6; tmp is ours, in a root-owned directory
        os.chmod(tmp, a.node_mode, dir_fd=fd)
        try:
            os.link(tmp, name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
        except FileExistsError:
            raise ChangedUnderUs(f"{a.target} appeared")
    finally:
        _unlink_quietly(fd, tmp)


def _remove_stale(dirs: _Dirs, path: str) -> None:
    parent, name = _split(path)
    if not name.startswith(TMP_PREFIX):  # only ever our own temporary names
        return
    try:
        fd = dirs.open(parent)
    except OSError:
        return
    try:
        os.unlink(name, dir_fd=fd)
    except IsADirectoryError:
        # we only ever make links and nodes there, but a directory at one of our temporary names (left
        # by whatever) is reported as stale on every pass until it goes: an empty one goes
        try:
            os.rmdir(name, dir_fd=fd)
        except OSError:
            pass
    except OSError:
        pass


def _unlink_quietly(dirfd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dirfd)
    except OSError:
        pass


def _describe(exc: OSError, action: Action) -> str:
    if exc.errno == errno.EROFS:
        return "read-only file system"
    if exc.errno in (errno.EACCES, errno.EPERM):
        # CAP_MKNOD matters only for mknod; links need write access to the directory
        need = "root with CAP_MKNOD" if action.action == CREATE_NODE else "root"
        return f"permission denied (run as {need})"
    return exc.strerror or str(exc)


_APPLY = {CREATE: _create, REPLACE: _replace, REMOVE: _remove, CREATE_NODE: _create_node}
