#!/usr/bin/env python3
"""The bpf-program repair's proof and the repair's "never narrows" check, beside floors from the same run.

A GPU container on a MIG host: runc's device program (runc's defaults, systemd's static list, 8 GPUs,
nvidiactl, nvidia-uvm and the MIG capability nodes of one major, up to N rules) without c 195:0, which
the repair gives back. Pure Python, no root:

  - bpfproof at 100, 323 and 1,000 rules: what repair/bpfrepair.prepare does with the cgroup's programs
    (bpfproof.policy_rules, bpfgen.program, bpfproof.prove), every program new to the process (issue 38
    item 1's target: 1,000 rules < 100 ms);
  - keep at 5, 25 and 325 rules: repair/keep.narrowed, the before/after judgment of every device class,
    on cgroup v2 (the runtime's program; after: ANDed with systemd's allow-list of the same rules and the
    grant) and on v1 (devices.list before and after the grant).

Floors: the interpreter (bpfeval.evaluate) answering one request that runs the whole program (a device no
rule names), and a bare Python loop over the rules (Rule.matches for that device). Medians of --runs runs,
wall time and the thread's CPU time, and the ratio to each floor.

    .venv/bin/python benchmarks/proof_bench.py [--runs 5] [--sizes 100,323,1000] [--keep-sizes 5,25,325]
    .venv/bin/python benchmarks/proof_bench.py --tree /path/to/other/checkout   # the same on that code
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--runs", type=int, default=5)
ap.add_argument("--sizes", default="100,323,1000")
ap.add_argument("--keep-sizes", default="5,25,325")
ap.add_argument("--tree", help="import nvsymlinkd from this checkout instead (figures for other code)")
ARGS = ap.parse_args()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a script: the repository root, for tests.*
if ARGS.tree:
    sys.path.insert(0, ARGS.tree)

from figures import emit, use_tree  # noqa: E402

if not ARGS.tree:
    use_tree()  # benchmarks/run --tree: NVSYMLINKD_BENCH_TREE

from nvsymlinkd.access import bpfeval, bpfgen, bpfproof  # noqa: E402
from nvsymlinkd.access.cgroup import policy_of  # noqa: E402
from nvsymlinkd.host.devices import Access, Device, Rule  # noqa: E402
from nvsymlinkd.repair import keep  # noqa: E402

LOST = Device("c", 195, 0)
GRANT = [(LOST, Access("rw"))]
STATIC = [Rule(True, "c", 1, n, "rwm") for n in (3, 5, 7, 8, 9)] + [Rule(True, "c", 5, 0, "rwm"),
                                                                    Rule(True, "c", 5, 2, "rwm"),
                                                                    Rule(True, "c", 136, None, "rw")]
NOWHERE = Device("c", 4000, 4000)   # named by no rule: the interpreter runs the whole program


def rules(n: int) -> list:
    """n rules of a MIG container's program (runc's and systemd's defaults, GPUs, control nodes, caps)."""
    out = [Rule(True, "c", None, None, "m"), Rule(True, "b", None, None, "m")] + STATIC
    out += [Rule(True, "c", 10, 200, "rwm"), Rule(True, "c", 195, 255, "rw")]
    out += [Rule(True, "c", 195, i, "rw") for i in range(1, 8)]
    out += [Rule(True, "c", 508, 0, "rw"), Rule(True, "c", 508, 1, "rw")]
    out += [Rule(True, "c", 509, i, "r") for i in range(max(0, n - len(out)))]
    return out[:n]


def fresh() -> None:
    """Forget the programs' decoded verdicts: every program is new to the process, as in a repair."""
    cached = getattr(bpfeval, "_decisions", None)
    if cached is not None:
        cached.cache_clear()


def timed(fn, runs: int) -> tuple:
    wall, cpu = [], []
    for _ in range(runs):
        fresh()
        t, c = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - t)
    return statistics.median(wall), statistics.median(cpu)


def floors(prog: list, rule_list: list) -> tuple:
    ctx = bpfeval.make_ctx(NOWHERE, Access("rw"))
    n = 200
    t = time.thread_time()
    for _ in range(n):
        bpfeval.evaluate(prog, ctx)
    one = (time.thread_time() - t) / n
    t = time.thread_time()
    for _ in range(n):
        for r in rule_list:
            r.matches(NOWHERE)
    loop = (time.thread_time() - t) / n
    return one, loop


def row(what: str, n: int, wall: float, cpu: float, one: float, loop: float) -> None:
    print(f"{what:<22} {n:>5}  {wall * 1e3:>9.1f}  {cpu * 1e3:>9.1f}  {one * 1e3:>9.3f}  {cpu / one:>9.0f}x  "
          f"{loop * 1e3:>9.3f}  {cpu / loop:>9.0f}x")


def main() -> int:
    print(f"nvsymlinkd from {Path(bpfproof.__file__).resolve().parent.parent}; medians of {ARGS.runs} runs")
    print(f"{'figure':<22} {'rules':>5}  {'wall ms':>9}  {'CPU ms':>9}  {'interp 1':>9}  {'CPU/it':>10}  "
          f"{'rule loop':>9}  {'CPU/loop':>10}")
    for n in (int(s) for s in ARGS.sizes.split(",")):
        rule_list = rules(n)
        old = bpfgen.program([r for r in rule_list if not r.matches(LOST)])

        def repair(old: list = old) -> None:
            derived = bpfgen.program(bpfproof.policy_rules([old], GRANT))
            proof = bpfproof.prove([old], [derived], GRANT)
            assert proof.ok and proof.granted, proof.problems

        wall, cpu = timed(repair, ARGS.runs if n < 1000 else max(1, ARGS.runs // 2))
        one, loop = floors(old, rule_list)
        row("bpfproof derive+prove", n, wall, cpu, one, loop)
        emit(f"bpfproof, {n} rules (CPU; floor: interpreter, 1 request)", cpu * 1e3, one * 1e3,
             goal="< 100 ms" if n == 1000 else "", met=cpu < 0.1 if n == 1000 else None)
    for n in (int(s) for s in ARGS.keep_sizes.split(",") if s):
        rule_list = rules(n)
        runtime = bpfgen.program(rule_list)
        scope = bpfgen.program(STATIC + rule_list + [Rule(True, "c", 195, 0, "rw")])
        v2 = (policy_of(programs=[runtime]), policy_of(programs=[runtime, scope]))
        text = "".join(f"{r}\n" for r in rule_list)
        v1 = (policy_of(text), policy_of(text + "c 195:0 rw\n"))
        for label, (before, after) in (("keep v2 (programs)", v2), ("keep v1 (devices.list)", v1)):
            def judged(before=before, after=after) -> None:
                lost = keep.narrowed(before, after, [LOST])
                assert lost == [], lost
            wall, cpu = timed(judged, ARGS.runs)
            row(label, n, wall, cpu, *floors(runtime, rule_list))
    print("interp 1: bpfeval.evaluate answering one request through the whole program; rule loop: Rule.matches "
          "over every rule for one device (thread CPU time, both); CPU/it, CPU/loop: the figure's CPU over each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
