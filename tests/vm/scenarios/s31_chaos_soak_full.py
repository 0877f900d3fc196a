"""Scenario 31: the chaos soak's other 40 seeds (chaos.FULL_SEEDS less chaos.CI_SEEDS), in one
guest, only with NVSYMLINKD_VM_MATRIX=full: with s30, all 50 sequences. See s30 and docs/vm.md.
"""
# vm: nvsymlinkd=deb timeout=7200 matrix=full
from chaosrun import run_soak

run_soak("full")
