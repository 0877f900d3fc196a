"""A container's expected access (containers/expected.py) decided per class of devices its rules cannot
tell apart, against asking the rules about every device (the way it was computed before).

On a MIG host every one of ~2,000 capability nodes is a candidate device of every container:
expected_access asks the spec's and the runtime state's rules once per (type, major, minor no rule
names) and looks the baseline up per device. Random rule lists (allow and deny, wildcards, every
type), random candidates and baselines: the Expected must be the one checking each device gives.
"""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from nvsymlinkd.containers.expected import (
    BASELINE,
    RUNTIME_STATE,
    SPEC,
    Expected,
    expected_access,
    relevant,
    rules_access,
    usable,
)
from nvsymlinkd.host.devices import Access, Device, Rule

MAJORS = (195, 509, 510)
access = st.sets(st.sampled_from("rwm"), min_size=1).map(lambda s: Access("".join(s)))
rule = st.builds(lambda allow, t, ma, mi, a: Rule(allow, t, None if t == "a" else ma, None if t == "a" else mi, a),
                 st.booleans(), st.sampled_from("abc"), st.one_of(st.none(), st.sampled_from(MAJORS + (7,))),
                 st.one_of(st.none(), st.integers(0, 6)), access)
rules = st.lists(rule, max_size=8)
device = st.builds(Device, st.just("c"), st.sampled_from(MAJORS), st.integers(0, 12))


def per_device(candidates, spec, state, baseline) -> Expected:
    """expected_access as it was: every rule list asked about every device."""
    majors = {k.major for k in candidates}
    spec_rules = relevant(spec.rules, majors) if spec is not None else None
    state_rules = relevant(state.rules, majors) if state is not None and state.rules is not None else None
    devices, declared, sources = {}, set(), {}
    for key in sorted(candidates):
        key = Device(*key)
        got, acc = [], Access()
        for source, rs in ((SPEC, spec_rules), (RUNTIME_STATE, state_rules)):
            if rs is not None:
                a = usable(rules_access(rs, key))
                if a:
                    got.append(source)
                    acc = acc.union(a)
        if got:
            declared.add(key)
        if baseline is not None and key in baseline.devices:
            a = usable(baseline.devices[key])
            if a:
                got.append(BASELINE)
                acc = acc.union(a)
        if got:
            devices[key] = acc
            sources[key] = tuple(got)
    return Expected(devices, frozenset(declared), sources)


@settings(max_examples=400, deadline=None)
@given(spec_rules=st.one_of(st.none(), rules), state_rules=st.one_of(st.none(), rules),
       candidates=st.sets(device, max_size=25), baseline=st.one_of(st.none(), st.dictionaries(device, access)))
def test_expected_by_classes_is_expected_by_device(spec_rules, state_rules, candidates, baseline):
    spec = SimpleNamespace(rules=spec_rules) if spec_rules is not None else None
    state = SimpleNamespace(rules=state_rules) if state_rules is not None else None
    base = SimpleNamespace(devices=baseline) if baseline is not None else None
    got = expected_access(candidates, spec, state, base)
    want = per_device(candidates, spec, state, base)
    assert got == want
    assert list(got.devices) == list(want.devices)  # the same order (sorted): the JSON's


def test_a_mig_host_asks_the_rules_once_per_class(monkeypatch):
    """2,000 capability nodes, none named by a rule: the rules are asked about 4 classes, not 2,002 devices
    (195:0, 195:1, 509:*, and 509:0, whose minor a rule names for another major: its own class)."""
    from nvsymlinkd.containers import expected as mod

    asked = []
    real = mod.rules_access
    monkeypatch.setattr(mod, "rules_access", lambda rs, d: asked.append(d) or real(rs, d))
    spec = SimpleNamespace(rules=(Rule(False, "a", None, None, Access("rwm")), Rule(True, "c", 195, 0, Access("rw")),
                                  Rule(True, "c", 509, None, Access("r"))))
    candidates = {Device.char(509, m) for m in range(2000)} | {Device.char(195, 0), Device.char(195, 1)}
    got = expected_access(candidates, spec, None, None)
    assert len(got.devices) == 2001 and Device.char(195, 1) not in got.devices
    assert len(asked) == 4
