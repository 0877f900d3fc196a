"""nvsymlinkd/messageids.py (pure): the one table of journal kinds and their MESSAGE_IDs. Every kind
the verifier and the repair journal has an ID, every ID is a distinct 128-bit id as sd-id128 writes it,
and the journal writer uses this table itself (the catalog's entries: tests/test_daemon_parts.py)."""

from __future__ import annotations

import re

from nvsymlinkd import journal
from nvsymlinkd.messageids import MESSAGE_IDS
from nvsymlinkd.repair.apply import JOURNAL_KINDS as REPAIR_KINDS
from nvsymlinkd.verify.kinds import JOURNAL_KINDS as VERIFY_KINDS


def test_every_id_is_32_lowercase_hex_digits_and_none_repeats():
    ids = list(MESSAGE_IDS.values())
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids), ids
    assert len(set(ids)) == len(ids)


def test_kinds_are_lowercase_words_with_dashes():
    assert all(re.fullmatch(r"[a-z]+(-[a-z]+)+", kind) for kind in MESSAGE_IDS), sorted(MESSAGE_IDS)


def test_every_verifier_and_repair_kind_has_an_id():
    for kind in [*VERIFY_KINDS.values(), *REPAIR_KINDS.values(), "repair-thawed"]:
        assert kind in MESSAGE_IDS, kind
    assert VERIFY_KINDS.keys() and len(set(VERIFY_KINDS.values())) == len(VERIFY_KINDS)


def test_the_journal_writes_this_table():
    assert journal.MESSAGE_IDS is MESSAGE_IDS


# IDs released in a package: never changed once out (journalctl's catalog and users' filters name them)
RELEASED = {
    "link-created": "c256b52640924401a1ad786fb804b8f4",
    "reload-seen": "4e6f02d91c174bf6a49a6b04db495c88",
    "container-lost": "483c260197bb4a5082cbaae3b26d085c",
    "container-at-risk-scope": "dc9a8c0480ee41a0a6a7ec454776bee3",
    "repair-done": "b8e8c1987b3d4de0ab6bb48f0e78cba5",
    "repair-failed": "02c9553b34b74c09b4a14ab6b6ce1107",
}


def test_released_ids_never_change():
    assert {k: MESSAGE_IDS.get(k) for k in RELEASED} == RELEASED
