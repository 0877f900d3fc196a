"""The /dev/char links: observe (snapshot), plan (pure: which links to create, replace or remove),
apply (the syscalls, confined under HostRoot), and reconcile, the one pass that runs the three.
Sits on host/; used by `nvsymlinkd sync` and the daemon loop."""
