"""Every kind of journal entry and its MESSAGE_ID (pure, standard library only).

The one table: a module with a new kind of event adds it here and to catalog/nvsymlinkd.catalog, never a
table of its own. journal.py writes the IDs (journal.MESSAGE_IDS is this table); pure modules (the
verifier's evaluation) name them without importing the writer.
"""

from __future__ import annotations

# kind -> MESSAGE_ID (32 hex digits, never change one once released)
MESSAGE_IDS = {
    "link-created": "c256b52640924401a1ad786fb804b8f4",
    "link-replaced": "d83455dfb6ef4fddbd7ada1052a5466c",
    "link-removed": "2aefb048db9248f08bb5b700948ecf4a",
    "node-created": "2e823c12dbc745db8704a1bb2491eafd",
    "link-conflict": "8abe9644993e4d748e0d26afde513558",
    "link-foreign": "209995f754174c899a02cf97ef0b9d5e",
    "link-failed": "dd9d5168c48d407aadc2896f70f90d63",
    "sync-failed": "3d23c8f20d6a4d66a5b4cca497878af4",
    "reload-seen": "4e6f02d91c174bf6a49a6b04db495c88",
    "systemd-restarted": "6e878b68b9fa48da8a086a147ccd1e29",
    "bus-lost": "c0b3e94e83554d04bf617f88aca4e5be",
    "bus-regained": "b4f3e9092081455289734525650eed39",
    "config-error": "3b690b49ad734a7e878aed60c1e3d0ef",
    "config-reloaded": "adac97ee55e94aef8680757634e545f0",
    "daemon-started": "4292addf44884482baae0673fe1007c1",
    "daemon-stopped": "e41cd2e590d6418eaa51110fdc36eaf8",
    "event-overflow": "686126523c744885bf7219ece7b7287a",
    # container verifier: "container-" + each finding kind, and "container-ok" (verify.kinds.JOURNAL_KINDS)
    "container-ok": "b0c3e0dd255749f89757d1b6405543cf",
    "container-lost": "483c260197bb4a5082cbaae3b26d085c",
    "container-denied": "6319b0c3b41544b2abc25c1ebf2c08b0",
    "container-at-risk-scope": "dc9a8c0480ee41a0a6a7ec454776bee3",
    "container-at-risk-not-in-spec": "e22f202c38134d758577be98caa78c07",
    "container-at-risk-uvm-missing": "3b40d429af264d4d893899337d991187",
    "container-unknown": "cc6369fb247c43c6a79a190b6d432b93",
    # repair: one per status that changed or would change something (repair.apply.JOURNAL_KINDS), and the
    # thaw of a freeze a killed repair left behind
    "repair-done": "b8e8c1987b3d4de0ab6bb48f0e78cba5",
    "repair-prevented": "5966faec75834084bc2e3bbac11d0823",
    "repair-failed": "02c9553b34b74c09b4a14ab6b6ce1107",
    "repair-refused": "3d820b575ee74530a718c2a5d339903b",
    "repair-reported": "07a882cdd951467dbdf7dcd3e530598f",
    "repair-thawed": "a34478dd88164b7ca7a9ec41173f126b",
}
