"""The host, seen through one confined root: HostRoot (every path under --root), bounded reads,
/proc/devices, the NVIDIA device nodes, the driver version, atomic file replace and the one ctypes libc
seam. Everything else observes and changes the host through this package; it imports no other subpackage."""
