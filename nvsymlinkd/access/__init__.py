"""Effective device access of a cgroup: the device rule vocabulary and decider, the cgroup v1
devices.list and v2 BPF readers, and the BPF interpreter that runs a program on a request.
Observe only; verify/ asks it what a container can open, repair/ changes it."""
