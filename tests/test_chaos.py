"""The chaos soak's pure parts (tests/vm/guest/chaos.py, issue 17), on the host: a seed always
draws the same sequence, a printed sequence re-runs as is, and each invariant judge fails on a
hand-made violating input (and passes the matching clean one)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vm.guest import chaos
from tests.vm.guest.stacks import PollLog

REPO = Path(__file__).parent.parent

GPU0, CTL, UVM = (195, 0), (195, 255), (237, 0)


def test_same_seed_same_sequence():
    assert chaos.draw_sequence(7) == chaos.draw_sequence(7)
    assert len(chaos.draw_sequence(7)) == chaos.STEPS_PER_SEQUENCE + 1  # the cgroupfs drop added
    assert chaos.draw_sequence(7) != chaos.draw_sequence(8)


def test_the_cgroupfs_drop_leaves_the_drawn_steps_as_they_were():
    """issue 28's step comes from a generator of its own: without it every seed's 20 steps are the ones it
    drew before (a seed that failed once replays as it did), and each seed has exactly one drop."""
    # seed 23 as it was drawn before issue 28 (docs/vm.md's runs of 2026-11-23)
    assert chaos.format_sequence(chaos.draw_sequence(23, weights=chaos.WEIGHTS)).startswith(
        "run-full,nvsymlinkd-sighup=60/reload,uvm-reload=new-major/reload,runtime-restart=docker/reload,")
    for seed in chaos.FULL_SEEDS:
        steps = chaos.draw_sequence(seed)
        drops = [s for s in steps if s.kind == chaos.CGROUPFS_DROP]
        assert len(drops) == 1 and drops[0].args in ((), ("reload",)), steps
        assert [s for s in steps if s.kind != chaos.CGROUPFS_DROP] == chaos.draw_sequence(seed, weights=chaos.WEIGHTS)
    assert {chaos.draw_sequence(s).index(next(x for x in chaos.draw_sequence(s) if x.kind == chaos.CGROUPFS_DROP))
            for s in chaos.FULL_SEEDS} != {0}, "placed anywhere, not always first"


def test_same_seed_same_sequence_in_another_interpreter():
    """Not an accident of this process's state: a fresh Python draws the same steps."""
    code = "from tests.vm.guest import chaos; print(chaos.format_sequence(chaos.draw_sequence(23)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == chaos.format_sequence(chaos.draw_sequence(23))


def test_printed_sequence_parses_back():
    for seed in chaos.FULL_SEEDS:
        steps = chaos.draw_sequence(seed)
        text = chaos.format_sequence(steps)
        assert " " not in text, "must fit one kernel command line word"
        assert chaos.parse_sequence(text) == steps


def test_weights_steer_the_draw():
    steps = chaos.draw_sequence(3, length=50, weights={"daemon-reload": 1})
    assert {s.kind for s in steps} == {"daemon-reload"}
    with pytest.raises(ValueError, match="unknown step kinds"):
        chaos.draw_sequence(3, weights={"reboot": 1})
    with pytest.raises(ValueError, match="unknown step kind"):
        chaos.parse_sequence("daemon-reload,reboot")


def test_every_kind_is_drawn_over_the_full_seeds():
    kinds = {s.kind for seed in chaos.FULL_SEEDS for s in chaos.draw_sequence(seed)}
    assert kinds == set(chaos.KINDS) == set(chaos.WEIGHTS) | {chaos.CGROUPFS_DROP}


def test_every_kind_is_drawn_over_the_ci_seeds():
    """The default run's soak (s30, chaos.CI_SEEDS, fewer seeds than the full matrix's to keep CI
    time) still meets every kind of step at least once: cut the seeds below that and this fails."""
    kinds = {s.kind for seed in chaos.CI_SEEDS for s in chaos.draw_sequence(seed)}
    assert kinds == set(chaos.KINDS), sorted(set(chaos.KINDS) - kinds)


def test_parse_seeds():
    assert chaos.parse_seeds("3") == [3]
    assert chaos.parse_seeds("1,4, 9") == [1, 4, 9]
    assert chaos.parse_seeds("11-13,2") == [11, 12, 13, 2]
    assert set(chaos.CI_SEEDS) <= set(chaos.FULL_SEEDS) and len(chaos.FULL_SEEDS) == 50


def test_budget_is_zero_except_where_nodes_are_remade():
    assert chaos.Step("daemon-reload").budget_s == 0.0
    assert chaos.Step("uvm-reload", ("new-major",)).budget_s == 1.0
    assert chaos.Step("container-recreate", ("docker-gpus",)).budget_s == 0.0
    # a reload during a container's creation: kept by the daemon's drop-in (issue 24), no budget for any
    # runtime, Podman's hook-granted one included (its runc process names its bundle: issue 34 item 7)
    for slot in chaos.GPU_SLOTS:
        assert chaos.Step("container-recreate", (slot, "reload")).budget_s == 0.0
    assert not hasattr(chaos, "EARLY_UNSEEN") and not hasattr(chaos, "RACE_BUDGET_S")
    assert chaos.Step("container-recreate", ("docker-gpus",)).budget_s == 0.0
    # issue 28: a loss nothing announces lasts until the daemon's next pass (the reload's, or the periodic one)
    assert chaos.Step(chaos.CGROUPFS_DROP).drop_budget_s(60.0) == 60.0 + chaos.PASS_SLACK_S
    assert chaos.Step(chaos.CGROUPFS_DROP, ("reload",)).drop_budget_s(60.0) == chaos.PASS_SLACK_S


# ---------------------------------------------------------------- (a)

def test_denials_from_a_real_poll_log():
    log = PollLog.parse("START 100.0 /dev/nvidia0\n"
                        "DENIED 105.00 EPERM\nDENIED 105.01 EPERM\nWINDOW 105.00 105.02 0.020 2\n"
                        "ALIVE 106.0 600 2\nDENIED 107.5 EPERM\n")
    windows, open_ = {"gpu": log.windows}, {"gpu": log.open_window}
    clean = chaos.judge_denials({"gpu": log.windows}, {}, since=106.0, now=108.0, budget_s=0.0)
    assert clean.violations == [] and clean.worst_s == 0.0, "the window before the step is not this step's"
    closed = chaos.judge_denials(windows, {}, since=104.0, now=108.0, budget_s=0.0)
    assert len(closed.violations) == 1 and "2 denied opens over 20 ms" in closed.violations[0]
    assert closed.worst_s == pytest.approx(0.02)
    assert chaos.judge_denials(windows, {}, since=104.0, now=108.0, budget_s=1.0).violations == []
    still = chaos.judge_denials({}, open_, since=107.0, now=109.0, budget_s=1.0)
    assert len(still.violations) == 1 and "still denied" in still.violations[0]
    assert still.worst_s == pytest.approx(1.5)


# ---------------------------------------------------------------- (b)

def test_grants_unearned_and_lost():
    grant = {GPU0, CTL}
    ok, lost = chaos.judge_grants("gpu", grant, {GPU0: "OK", CTL: "OK", UVM: "EPERM"}, {GPU0: "allow", UVM: "deny"})
    assert ok == [] and lost == []
    bad, _ = chaos.judge_grants("gpu", grant, {GPU0: "OK", UVM: "OK"})
    assert len(bad) == 1 and "237:0" in bad[0] and "never granted" in bad[0]
    _, lost = chaos.judge_grants("gpu", grant, {GPU0: "EPERM", CTL: "OK"})
    assert len(lost) == 1 and "195:0" in lost[0]
    engine_bad, _ = chaos.judge_grants("gpu", grant, {UVM: "EPERM"}, {UVM: "allow"})
    assert len(engine_bad) == 1 and "access engine" in engine_bad[0]


def test_rogue_container_with_its_own_node_is_never_granted():
    """The container that mknods its own NVIDIA node has no grant: any successful open violates."""
    bad, _ = chaos.judge_grants("rogue", set(), {GPU0: "OK"})
    assert bad
    unknown, _ = chaos.judge_grants("rogue", None, {GPU0: "OK"})
    assert unknown and "grant unknown" in unknown[0]
    assert chaos.judge_grants("rogue", set(), {GPU0: "EPERM", CTL: "EPERM"}) == ([], [])


def test_rules_grant_reads_oci_rules_like_the_runtime():
    rules = [{"allow": False, "access": "rwm"}, {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rw"},
             {"allow": True, "type": "c", "access": "m"}, {"allow": True, "type": "c", "major": 237, "minor": 0,
                                                            "access": "r"}]
    assert chaos.rules_grant(rules, [GPU0, CTL, UVM]) == {GPU0}
    assert chaos.rules_grant(rules + [{"allow": False, "type": "c", "major": 195, "access": "rw"}], [GPU0]) == set()


# ---------------------------------------------------------------- (c)

def test_dev_char_exact_links_and_foreign_untouched():
    nodes = {"/dev/nvidia0": GPU0, "/dev/nvidia-uvm": UVM}
    foreign = {"10:250": "../chaos-foreign", "1:3": "../null"}
    links = {"195:0": "../nvidia0", "237:0": "../nvidia-uvm", **foreign}
    assert chaos.judge_dev_char(nodes, links, foreign, [195, 237]) == []
    missing = dict(links)
    del missing["237:0"]
    assert chaos.judge_dev_char(nodes, missing, foreign, [195, 237]) == ["/dev/char/237:0 missing for /dev/nvidia-uvm"]
    stale = dict(links, **{"236:0": "../nvidia-uvm"})
    assert "stale link" in chaos.judge_dev_char(nodes, stale, foreign, [195, 236, 237])[0]
    wrong = dict(links, **{"195:0": "../nvidiactl"})
    assert "not /dev/nvidia0" in chaos.judge_dev_char(nodes, wrong, foreign, [195, 237])[0]
    touched = {k: v for k, v in links.items() if k != "10:250"}
    assert "foreign /dev/char/10:250" in chaos.judge_dev_char(nodes, touched, foreign, [195, 237])[0]


# ---------------------------------------------------------------- (d), (e)

def test_daemon_judge():
    assert chaos.judge_daemon("active", ["link created"], 30000, 25000) == []
    assert "not active" in chaos.judge_daemon("activating", [], 30000, 25000)[0]
    tb = chaos.judge_daemon("active", ["Traceback (most recent call last):\n  File x"], 30000, 25000)
    assert len(tb) == 1 and "traceback" in tb[0]
    assert "RSS" in chaos.judge_daemon("active", [], 51000, 25000)[0]


def test_frozen_judge():
    assert chaos.judge_frozen({"/sys/fs/cgroup/system.slice/docker-x.scope": "0\n"}) == []
    assert len(chaos.judge_frozen({"/a": "1\n", "/b": "FROZEN\n", "/c": "THAWED"})) == 2


def test_worst_per_kind():
    records = [{"kind": "daemon-reload", "worst_s": 0.0}, {"kind": "uvm-reload", "worst_s": 0.4},
               {"kind": "uvm-reload", "worst_s": 0.7}]
    assert chaos.worst_per_kind(records) == {"daemon-reload": 0.0, "uvm-reload": 0.7}


# ---------------------------------------------------------------- the kernel judge itself

@pytest.mark.root
def test_kernel_judge_opens_in_the_containers_cgroup(runc_host, tmp_path):
    """chaosrun.cgroup_opens (what judges (b) in the VM): a child moved into a real runc
    container's device cgroup gets the kernel's verdict for that cgroup (granted: OK, not granted:
    EPERM), and nvsymlinkd's access engine reads the same cgroup the same way."""
    from tests.runcfixture import device_rule
    from tests.vm.guest import chaosrun

    nodes = {}
    for minor in (0, 1):       # no driver behind them: an allowed open gives ENXIO, a denied one EPERM
        nodes[minor] = str(tmp_path / f"nvidia{minor}")
        os.mknod(nodes[minor], 0o666 | stat.S_IFCHR, os.makedev(195, minor))
    c = runc_host.run("chaos-judge", rules=[device_rule(195, 0)])
    got = chaosrun.cgroup_opens(c.pid, [nodes[0], nodes[1]])
    assert got == {nodes[0]: "ENXIO", nodes[1]: "EPERM"}
    assert chaosrun.engine_verdicts(c.pid, [(195, 0), (195, 1)]) == {(195, 0): "allow", (195, 1): "deny"}
    c.allow("c 195:1 rw")      # behind the runtime's back, like a hook that was never asked
    assert chaosrun.cgroup_opens(c.pid, [nodes[1]]) == {nodes[1]: "ENXIO"}


def test_seed_and_steps_reach_the_guest_through_the_run_dir(monkeypatch, tmp_path):
    """NVSYMLINKD_CHAOS_SEEDS / _STEPS on the host re-run a seed or a printed sequence exactly: they
    go into the run dir's options.json (a guest restored from a base snapshot keeps the base's
    kernel command line), where chaosrun reads them."""
    from tests.vm import vmhost
    from tests.vm.guest import chaosrun

    monkeypatch.delenv("NVSYMLINKD_CHAOS_SEEDS", raising=False)
    monkeypatch.delenv("NVSYMLINKD_CHAOS_STEPS", raising=False)
    monkeypatch.setenv("VM_RUN", str(tmp_path))
    assert vmhost.guest_options() == {}
    (tmp_path / "options.json").write_text(json.dumps(vmhost.guest_options()))
    assert chaosrun.cmdline_option("chaos_seeds") is None
    steps = chaos.format_sequence(chaos.draw_sequence(7)[:3])
    monkeypatch.setenv("NVSYMLINKD_CHAOS_SEEDS", "7")
    monkeypatch.setenv("NVSYMLINKD_CHAOS_STEPS", steps)
    assert vmhost.guest_cmdline("s30_chaos_soak", "deb") == "nvsymlinkd.vm=deb"
    (tmp_path / "options.json").write_text(json.dumps(vmhost.guest_options()))
    assert chaosrun.cmdline_option("chaos_seeds") == "7"
    assert chaos.parse_sequence(chaosrun.cmdline_option("chaos_steps")) == chaos.draw_sequence(7)[:3]
    assert chaosrun.seeds_for("ci") == [7]


def test_a_lasting_window_fails_its_own_step_only():
    """One lost container must not turn every later step (and its kind's worst window) red."""
    assert chaos.judge_denials({}, {"gpu": 100.0}, since=99.0, now=150.0, budget_s=0.0).violations
    later = chaos.judge_denials({}, {"gpu": 100.0}, since=120.0, now=150.0, budget_s=0.0)
    assert later.violations == [] and later.worst_s == 0.0
