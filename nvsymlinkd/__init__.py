"""nvsymlinkd: keep GPU containers from silently losing their NVIDIA devices."""

__version__ = "0.1.0"
