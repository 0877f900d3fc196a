"""systemd over D-Bus: the manager signal watch the daemon listens to (bus), and the unit calls
repair/ makes: GetUnit, DeviceAllow read back and SetUnitProperties (units).
(containers/scopes reads scope properties over the bus on its own.)
render: nvsymlinkd's own udev rule and units for one Config (pure; `nvsymlinkd render` writes them)."""
