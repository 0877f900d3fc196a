"""containers.early: the scope runc's systemd driver makes from a cgroupsPath, and what a scope lacks."""

from __future__ import annotations

from nvsymlinkd.containers.early import missing_entries, scope_of_cgroups_path
from nvsymlinkd.containers.expected import Expected
from nvsymlinkd.host.devices import Access, Device, Rule
from nvsymlinkd.systemd.scopes import ScopeDevices


def test_scope_of_cgroups_path_is_runcs_unit_name():
    assert scope_of_cgroups_path("system.slice:cri-containerd:abc") == "cri-containerd-abc.scope"
    assert scope_of_cgroups_path("kubepods-besteffort.slice:crio:0123") == "crio-0123.scope"
    assert scope_of_cgroups_path("system.slice:docker:f00") == "docker-f00.scope"
    assert scope_of_cgroups_path(":runc:x") == "runc-x.scope"
    for no_scope in (None, "", "/kubepods/abc", "system.slice:docker:my.slice", "a:b", "a:b:c:d",
                     "system.slice:docker:", "system.slice:do cker:x", "system.slice:docker:../x/y"):
        assert scope_of_cgroups_path(no_scope) is None, no_scope


def test_missing_entries_only_trusted_sources_and_only_what_the_scope_lacks():
    gpu, ctl, other = Device.char(195, 1), Device.char(195, 255), Device.char(195, 2)
    expected = Expected({gpu: Access("rw"), ctl: Access("rw"), other: Access("rw")}, frozenset(),
                        {gpu: ("nvidia-hook",), ctl: ("spec", "nvidia-hook"), other: ("baseline",)})
    assert missing_entries(expected, None) == [(gpu, Access("rw")), (ctl, Access("rw"))]
    scope = ScopeDevices("s.scope", "dbus", "strict", (("/dev/char/195:255", "rw"),),
                         (Rule(True, "c", 195, 255, Access("rw")),))
    assert missing_entries(expected, scope) == [(gpu, Access("rw"))]


def test_runtime_policy_set_is_what_runcs_set_sends():
    """runc starts the scope with no device properties and sends DevicePolicy=strict and its DeviceAllow in Set,
    right before the hooks: auto with no entries is "not yet" (and, when it stays so, "not restricted")."""
    from nvsymlinkd.containers.early import runtime_policy_set

    assert not runtime_policy_set(None)
    assert not runtime_policy_set(ScopeDevices("s.scope", "dbus", "auto", (), ()))
    assert runtime_policy_set(ScopeDevices("s.scope", "dbus", "strict", (), ()))
    assert runtime_policy_set(ScopeDevices("s.scope", "dbus", "closed", (), ()))
    assert runtime_policy_set(ScopeDevices("s.scope", "files", "auto", (("/dev/char/1:3", "rwm"),), ()))


def test_would_narrow_unless_the_scope_is_an_allow_list_already():
    """Issue 39 item 6: a drop-in's DeviceAllow= on an `auto` scope (or one whose policy is unknown)
    would make it an allow-list at the next reload."""
    from nvsymlinkd.containers.early import would_narrow

    assert "cannot be read" in would_narrow(None)
    assert "auto" in would_narrow(ScopeDevices("s.scope", "dbus", "auto", (), ()))
    assert "auto" in would_narrow(ScopeDevices("s.scope", "files", "auto", (("/dev/char/1:3", "rwm"),), ()))
    assert would_narrow(ScopeDevices("s.scope", "dbus", "strict", (), ())) is None
    assert would_narrow(ScopeDevices("s.scope", "dbus", "closed", (), ())) is None


def test_runc_argv_as_go_flag_parses_it():
    """Issue 34 item 7: the bundle a `runc create`/`runc run` names (containers.runtimeproc)."""
    from nvsymlinkd.containers.runtimeproc import parse_runc_argv

    assert parse_runc_argv(["runc", "create", "--bundle", "/b", "id"]) == (None, "/b", "id")
    assert parse_runc_argv(["runc", "--root", "/r", "--debug", "run", "-d", "-b=/b", "--pid-file", "p", "id"]) == \
        ("/r", "/b", "id")
    assert parse_runc_argv(["runc", "-root=/r", "create", "id"]) == ("/r", None, "id")
    assert parse_runc_argv(["runc", "--systemd-cgroup", "create", "--", "id"]) == (None, None, "id")
    for other in (["runc", "start", "id"], ["runc", "init"], ["runc", "create"], ["runc", "--nope", "create", "x"],
                  ["runc", "create", "--bundle"], ["runc", "create", "--unknown", "x", "id"], []):
        assert parse_runc_argv(other) is None, other


def test_the_bundle_is_runcs_cwd_which_bundle_only_confirms():
    """Issue 34 item 7 review: runc chdirs into --bundle before anything (utils.go setupSpec at v1.1.5), so a
    relative --bundle is not relative to its cwd: `runc run -b ctr id` from /root runs in /root/ctr."""
    from nvsymlinkd.containers.runtimeproc import bundle_of

    assert bundle_of("/root/ctr", "ctr") == "/root/ctr"
    assert bundle_of("/root/ctr", "./ctr/") == "/root/ctr"
    assert bundle_of("/b/x/ctr", "x/ctr") == "/b/x/ctr"
    assert bundle_of("/root/ctr", None) == "/root/ctr"
    assert bundle_of("/root/ctr", ".") == "/root/ctr"
    assert bundle_of("/root/ctr", "/root/ctr/") == "/root/ctr"
    # runc has not chdir'ed yet (its cwd is still the caller's), or a link on the way: nothing trusted
    assert bundle_of("/root", "/root/ctr") is None
    assert bundle_of("/root", "ctr") is None
    assert bundle_of("/root/xctr", "ctr") is None
    assert bundle_of("/root/ctr", "../ctr") is None
    assert bundle_of("/root/ctr", "a/../ctr") is None  # "a" may be a link: ".." is the kernel's to resolve
