#!/bin/sh
# mmdebstrap --customize-hook for the guest image: $1 is the finished root tree.
# Everything that changes the image lives in tests/vm/image/ and is part of the cache key.
set -eu
root="$1"
here="$(dirname "$0")"

cp -a "$here/files/." "$root/"

# Fixed identity: no first-boot prompts on the serial console.
echo nvsymlinkd-vm > "$root/etc/hostname"
echo 5a1f0c2e9b7d4e3f8a6b1c0d2e3f4a5b > "$root/etc/machine-id"
chroot "$root" passwd -d root >/dev/null

# The scenario runner and its 9p mounts start at boot.
mkdir -p "$root/mnt/src" "$root/mnt/run" "$root/etc/systemd/system/multi-user.target.wants"
ln -sf /etc/systemd/system/vm-scenario.service "$root/etc/systemd/system/multi-user.target.wants/vm-scenario.service"

# Nothing periodic or interactive may run during a scenario.
for unit in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer \
            systemd-firstboot.service getty@tty1.service systemd-timesyncd.service; do
    ln -sf /dev/null "$root/etc/systemd/system/$unit"
done

# Container daemons start only in the scenarios that test them (boot stays fast for the rest).
for link in "$root"/etc/systemd/system/*.wants/*; do
    case "$(basename "$link")" in
        docker.*|containerd.*|podman*) rm -f "$link" ;;
    esac
done

# Drop kernel modules a headless virtio guest never loads: halves the image.
for kdir in "$root"/usr/lib/modules/*; do
    for sub in sound drivers/gpu drivers/media drivers/net/wireless drivers/net/ethernet \
               drivers/infiniband drivers/staging drivers/bluetooth drivers/iio drivers/isdn; do
        rm -rf "$kdir/kernel/$sub"
    done
    chroot "$root" depmod -a "$(basename "$kdir")"
done

# Small initrd: only what finds and mounts a virtio ext4 root.
printf '%s\n' virtio_pci virtio_blk ext4 >> "$root/etc/initramfs-tools/modules"
chroot "$root" update-initramfs -u -k all >/dev/null
