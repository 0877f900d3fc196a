"""The long-running daemon: the loop that wires the watchers (inotify, udev, systemd signals) to
devchar/ reconcile and to the container watch (verify/, then repair/), and sd_notify. It decides
nothing itself: every event only asks for a pass."""
