"""The long-running daemon: the loop that wires the watchers (inotify, udev, systemd signals) to
devchar/ reconcile and to the container watch (verify/, then repair/), sd_notify, and the journal
writer that check and repair also log through. The apply side of `nvsymlinkd run`."""
