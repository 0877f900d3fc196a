"""What of a link pass is news for the journal (pure): a pass's outcomes, conflicts and notes, a failed
pass, the driver missing -> entries.

The daemon runs a pass at every event, but an operator reading `journalctl -u nvsymlinkd` should see each
change, each conflict and each note once: a conflict or a note again only when it is new, and a link that
another writer keeps changing (a flapping tool) once per FLAP_WINDOW seconds, then as a count (1,144 lines in
3 s before: a journal flood that buries everything else). The change itself is always made.

`LinkNews` keeps what was said between passes; it does no I/O and reads no clock (the caller passes `now`):
daemon/loop.py writes the entries it returns, as daemon/containerwatch.py does verify/journaldiff's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from nvsymlinkd.host.devices import Device
from nvsymlinkd.text import plural
from nvsymlinkd.verify.journaldiff import Entry

if TYPE_CHECKING:
    from nvsymlinkd.devchar.apply import Outcome
    from nvsymlinkd.devchar.model import DevCharEntry
    from nvsymlinkd.devchar.plan import Action

# syslog priorities (journal.py is the writer, not imported by pure modules)
ERR, WARNING, NOTICE, INFO = 3, 4, 5, 6

# A link another writer keeps changing: said once per FLAP_WINDOW seconds per link, then how many more
# corrections were made meanwhile.
FLAP_WINDOW = 10.0

# applied plan action -> (journal kind, priority, what the line says)
CHANGE_EVENTS = {
    "create": ("link-created", INFO, "created link"),
    "replace": ("link-replaced", NOTICE, "replaced link"),
    "remove": ("link-removed", INFO, "removed link"),
    "create-node": ("node-created", NOTICE, "created node"),
}

FlapKey = Tuple[str, str]  # (link, action)


class LinkNews:
    """What the journal was told of the links: the conflicts and notes said, and the changes said per link
    with the corrections made since and not said."""

    def __init__(self) -> None:
        self.conflicts: Set[Tuple[str, Device, str]] = set()  # (where, device, reason) said, still there
        self.notes: Set[str] = set()
        self.changes: Dict[FlapKey, List[float]] = {}  # key -> [when last said (monotonic), corrections since]
        self.failure: Optional[str] = None  # the failure said last, until a pass succeeds
        self.no_driver = False  # "NVIDIA driver not loaded" was said, and it has not been loaded since

    def failed(self, message: str) -> List[Entry]:
        """A pass failed: said once, not at every event (until a pass succeeds or the message changes)."""
        if message == self.failure:
            return []
        self.failure = message
        return [Entry("sync-failed", ERR, f"sync failed: {message}", {})]

    def driver(self, loaded: bool) -> List[Entry]:
        """After a pass, whether the NVIDIA driver is loaded: once, not at every pass, a daemon that links
        nothing says why, and says when that ends."""
        if not loaded and not self.no_driver:
            self.no_driver = True
            return [Entry(None, WARNING, "NVIDIA driver not loaded (no nvidia entry in /proc/devices): no nodes to "
                          "link yet; linking as soon as the module loads (udev event or the next resync)", {})]
        if loaded and self.no_driver:
            self.no_driver = False
            return [Entry(None, INFO, "NVIDIA driver loaded: linking its nodes", {})]
        return []

    def after_pass(self, outcomes: Iterable[Outcome], conflicts: Iterable[Action],
                   foreign: Mapping[str, DevCharEntry], notes: Iterable[str], now: float) -> List[Entry]:
        """The entries for one pass, in the order they are written: per outcome (a raced or failed action, a
        change), the flapping links' counts, the new conflicts, the new notes."""
        self.failure = None
        out: List[Entry] = []
        for outcome in outcomes:
            a = outcome.action
            where = a.link or a.target
            if outcome.raced:
                # another writer got there between planning and applying: its change raised
                # an event of its own, and the next pass plans from what it left
                out.append(Entry(None, INFO, f"{a.action} {where} ({a.device}) not done: {outcome.error}", {}))
            elif outcome.error is not None:
                out.append(Entry("link-failed", ERR, f"failed to {a.action} {where} ({a.device}): {outcome.error}",
                                 {"link": where, "device": a.device, "action": a.action}))
            elif a.action in CHANGE_EVENTS and self._say_change((str(where), a.action), now, out):
                kind, priority, text = CHANGE_EVENTS[a.action]
                why = f": {a.reason}" if a.action != "create" else ""
                arrow = f" -> {a.target}" if a.action in ("create", "replace") else ""
                out.append(Entry(kind, priority, f"{text} {where}{arrow} ({a.device}){why}",
                                 {"link": where, "device": a.device, "action": a.action}))
        out += self.flush(now)
        # once per (path, device, reason): a foreign link's reason names its target, so a new target is news
        said = {(str(a.link or a.target), a.device, a.reason) for a in conflicts}
        for where, device, reason in sorted(said - self.conflicts):
            entry = foreign.get(where)
            if entry is not None:
                out.append(Entry("link-foreign", WARNING, f"conflict at {where} ({device}): {reason}; "
                                 f"{resolves_to(entry)}, so {systemd_gets(entry, where, device)}",
                                 {"link": where, "device": device, "action": "conflict", "target": entry.link_text}))
            else:
                out.append(Entry("link-conflict", WARNING, f"conflict at {where} ({device}): {reason}",
                                 {"link": where, "device": device, "action": "conflict"}))
        self.conflicts = said
        new_notes = set(notes)
        out += [Entry(None, INFO, f"note: {note}", {}) for note in sorted(new_notes - self.notes)]
        self.notes = new_notes
        return out

    def _say_change(self, key: FlapKey, now: float, out: List[Entry]) -> bool:
        """Whether to say this change: the first in FLAP_WINDOW seconds is said, the rest counted (a count
        due is added to `out` first)."""
        said = self.changes.get(key)
        if said is not None and now - said[0] < FLAP_WINDOW:
            said[1] += 1
            return False
        if said is not None and said[1]:
            out.append(_flap_entry(key, said, now))
        self.changes[key] = [now, 0]
        return True

    def flush(self, now: float, final: bool = False) -> List[Entry]:
        """The counts of corrections not said whose window has passed (all of them when stopping)."""
        out = []
        for key, said in list(self.changes.items()):
            if final or now - said[0] >= FLAP_WINDOW:
                if said[1]:
                    out.append(_flap_entry(key, said, now))
                del self.changes[key]
        return out


def _flap_entry(key: FlapKey, said: List[float], now: float) -> Entry:
    where, action = key
    kind, priority, text = CHANGE_EVENTS[action]
    count = int(said[1])
    said[1] = 0
    return Entry(kind, min(priority, NOTICE),
                 f"{text.split()[0]} {where} {plural(count, 'more time')} in the last "
                 f"{now - said[0]:.0f} s: another writer keeps changing it (find it: auditctl -w on the "
                 "link); each change is made, only this count is said", {"link": where, "action": action,
                                                                         "count": count})


def resolves_to(entry: DevCharEntry) -> str:
    if entry.resolved is not None:
        return f"it resolves to c {entry.resolved[0]}:{entry.resolved[1]}"
    if entry.resolved_kind == "missing":
        return "it resolves to nothing"
    return "it resolves to no character device"


def systemd_gets(entry: DevCharEntry, where: str, device: Device) -> str:
    # runc stat()s /dev/char/M:m before passing DeviceAllow= to systemd; systemd >= 240 parses
    # the name, older ones stat() it too (REFERENCE: runc with the systemd cgroup driver)
    if entry.resolved is not None:
        return f"whatever stat()s {where} gets that device instead (systemd < 240 for DeviceAllow=)"
    return (f"runc 1.1.3-1.1.6 (any runc with systemd < 240) leaves {device} out of containers created "
            "meanwhile, and the next daemon-reload takes it from them")
