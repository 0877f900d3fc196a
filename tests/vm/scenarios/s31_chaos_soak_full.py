"""Scenario 31: the chaos soak's other 48 seeds (chaos.FULL_SEEDS less chaos.CI_SEEDS: 2, 3 and
5-50), in one guest, only with NVSYMLINKD_VM_MATRIX=full: with s30, all 50 sequences. See s30 and docs/vm.md.
"""
# vm: nvsymlinkd=deb timeout=9000 matrix=full
from tests.vm.guest.chaosrun import run_soak

run_soak("full")
