"""systemd over D-Bus: the manager signal watch the daemon listens to (bus), and the unit calls
repair/ makes: GetUnit, DeviceAllow read back and SetUnitProperties (units).
scopes: what systemd will re-apply on the next reload (the bus or the unit files) and systemd's unit-file
layout; deviceallow: one DeviceAllow= entry <-> Rule (pure).
render: nvsymlinkd's own udev rule and units for one Config (pure; `nvsymlinkd render` writes them)."""
