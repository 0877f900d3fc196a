"""udev events that mean NVIDIA's device set may have changed.

- `module` add/remove of an nvidia* module (nvidia, nvidia_uvm,
  nvidia_modeset, nvidia_drm, nvidia_peermem, ...): a major was registered or
  dropped in /proc/devices.
- PCI `bind`/`unbind` of the nvidia driver: a GPU came or went. An unbind
  uevent no longer carries DRIVER=, so an unbind of any NVIDIA PCI function
  (PCI_ID 10DE:...) counts.

Matched on subsystem and sys_name/properties, never on a full DEVPATH (it
differs per host and in containers). The monitor's fd is read by the event
loop; the kernel's netlink buffer overflowing (ENOBUFS) means events were
lost, and the caller does a full resync.
"""

from __future__ import annotations

import errno

NVIDIA_PCI_VENDOR = "10DE"


def is_nvidia_event(action: str, subsystem: str, sys_name: str, properties) -> bool:
    """Pure filter over what a uevent carries."""
    if subsystem == "module":
        return action in ("add", "remove") and sys_name.startswith("nvidia")
    if subsystem == "pci":
        if action == "bind":
            return properties.get("DRIVER") == "nvidia"
        if action == "unbind":
            return properties.get("DRIVER") == "nvidia" or \
                properties.get("PCI_ID", "").upper().startswith(NVIDIA_PCI_VENDOR + ":")
    return False


class UdevWatch:
    def __init__(self):
        import pyudev

        self.context = pyudev.Context()
        self.monitor = pyudev.Monitor.from_netlink(self.context)
        self.monitor.filter_by("module")
        self.monitor.filter_by("pci")
        # bigger than the default: a driver load is a burst of PCI and module events
        try:
            self.monitor.set_receive_buffer_size(4 * 1024 * 1024)
        except Exception:  # noqa: BLE001 - needs CAP_NET_ADMIN above rmem_max; the default works too
            pass
        self.monitor.start()

    def fileno(self) -> int:
        return self.monitor.fileno()

    def poll(self):
        """Drain queued uevents -> (descriptions of matching events, overflowed)."""
        seen = []
        while True:
            try:
                device = self.monitor.poll(timeout=0)
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    return seen, True
                if exc.errno in (errno.EAGAIN, errno.EINTR):
                    break
                raise
            if device is None:
                break
            action = device.action or ""
            props = device.properties
            if is_nvidia_event(action, device.subsystem or "", device.sys_name or "", props):
                seen.append(f"{device.subsystem} {device.sys_name} {action}")
        return seen, False

    def close(self) -> None:
        # pyudev has no explicit close; dropping the monitor closes its socket
        self.monitor = None
        self.context = None
