"""GPU containers and what they should have: discovery (runtime state, cgroups, PIDs), the OCI spec
reader (bounded, never trusted), the expected device set, the baselines kept across restarts (a
scope's DeviceAllow: systemd/scopes). The observe side of check and repair; verify/ decides over it."""
