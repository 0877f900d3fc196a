"""IMEX channels: /dev/nvidia-caps-imex-channels/channelN, and the channel list nvidia-container-cli reads.
Pure: no I/O.

- The node of channel N is `c M:N` with M the `nvidia-caps-imex-channels` major of /proc/devices (an exact
  name: `nvidia-caps` is its prefix; a channel0 made with the `nvidia-caps` major is another device, the
  mistake public incident write-ups show). The driver makes no node itself unless NVreg_CreateImexChannel0=1
  asks for channel 0 (open-gpu-kernel-modules kernel-open/nvidia/nv-reg.h, NVreg_ImexChannelCount and
  NVreg_CreateImexChannel0: default 0); nvidia-modprobe makes `channel%d` with that major and minor N,
  replacing a node of another number (NVIDIA/nvidia-modprobe 550.54.14 modprobe-utils/nvidia-modprobe-utils.c:1072-1099
  nvidia_cap_imex_channel_mknod, :581 mknod_helper; nvidia-modprobe-utils.h:49-51 the names).
- nvidia-container-cli `--imex-channel=LIST` (libnvidia-container @63d366e, NVIDIA's merge of PR #286, in
  1.17.0; the same since the option came, @edd0c7a in 1.15.0): src/cli/common.c:446-496 parse_imex_info
  splits LIST on `,` (strsep), skips empty items, and takes each as strtoumax(item, &end, 10) that must end
  the item and be below 2^20; any other item fails the cli ("unsupported IMEX channel value"), so the hook
  fails and runc fails the container's creation.
- Each channel is then mounted and granted (src/nvc_mount.c:1101-1147 nvc_imex_channel_mount): the node
  `channel%d` found under the cli's --root (src/nvc_info.c:313-329 find_device_node: its st_rdev), whatever
  the capabilities or the GPUs selected, and `c M:m rw` written by setup_device_cgroup unless --no-cgroups.
  With --load-kmods (the toolkit's default) and without --no-create-imex-channels (toolkit 1.17+
  `features.disable-imex-channel-creation`), the cli's nvc_init first runs nvidia_cap_imex_channel_mknod for
  each channel, chrooted to --root (src/nvc.c:294-299 load_kernel_modules).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Tuple, Union

from nvsymlinkd.host.devices import Device

CHANNELS_DIR = "/dev/nvidia-caps-imex-channels"  # NV_CAPS_IMEX_DEVICE_DIR (src/nvc_internal.h:40)
MAX_CHANNELS = 1 << 20  # parse_imex_info: "Channel IDs must fit in the minor number of a dev_t"
_C_SPACE = " \t\n\v\f\r"  # isspace() in the C locale: what strtoumax skips first
_DIGITS = re.compile(r"([+-]?)([0-9]+)")
_UINTMAX = (1 << 64) - 1
_NAME = re.compile(r"channel(0|[1-9][0-9]{0,6})")  # NV_CAPS_IMEX_DEVICE_PATH "/channel%d": no leading zero


def channel_path(channel: int) -> str:
    """The node the cli looks for (NV_CAPS_IMEX_DEVICE_PATH, src/nvc_internal.h:41), relative to its root."""
    return f"{CHANNELS_DIR}/channel{channel}"


def channel_of(path: str) -> int | None:
    """N for a path ending in `channelN` as `%d` writes it; None otherwise (`channel03` is not a name the cli
    or nvidia-modprobe ever writes)."""
    m = _NAME.fullmatch(path.rsplit("/", 1)[-1])
    return int(m.group(1)) if m is not None else None


def _strtoumax_whole(item: str) -> int | None:
    """strtoumax(item, &end, 10) when *end == '\\0', else None: leading C blanks, a sign (`-N` negates in the
    unsigned type), ERANGE saturating at UINTMAX_MAX."""
    m = _DIGITS.fullmatch(item.lstrip(_C_SPACE))
    if m is None:
        return None
    digits = m.group(2).lstrip("0") or "0"
    n = _UINTMAX if len(digits) > 20 else min(int(digits), _UINTMAX)
    if m.group(1) == "-" and n not in (0, _UINTMAX):
        n = (-n) & _UINTMAX
    return n


def parse_channel_list(value: str) -> Union[Tuple[int, ...], str]:
    """parse_imex_info: the channels of one --imex-channel value, in order and without repeats; or the item
    that makes the cli fail."""
    out: list[int] = []
    for item in value.split(","):
        if item == "":
            continue  # "Allow extra commas between device strings"
        n = _strtoumax_whole(item)
        if n is None or n >= MAX_CHANNELS:
            shown = item if len(item) <= 40 else item[:37] + "..."
            return f"unsupported IMEX channel value: {shown!r}"
        if n not in out:
            out.append(n)
    return tuple(out)


@dataclass(frozen=True)
class ImexNodes:
    """The host's IMEX channel nodes as the cli would stat them: `major` is the one `nvidia-caps-imex-channels`
    major of /proc/devices (None: not listed, or listed with several); `exact` the channels whose node is
    `c major:N`; `odd` those whose `channelN` node is another device."""

    major: int | None = None
    exact: Tuple[int, ...] = ()
    odd: Tuple[int, ...] = ()

    def device(self, channel: int) -> Device | None:
        """The device the cli grants for this channel when its node is exact, else None."""
        if self.major is None or channel not in self.exact:
            return None
        return Device.char(self.major, channel)


def imex_nodes(major: int | None, nodes: Iterable[Tuple[str, int, int]]) -> ImexNodes:
    """From (path, major, minor) of the nodes scanned under the driver root's dev/nvidia-caps-imex-channels/."""
    exact: set[int] = set()
    odd: set[int] = set()
    for path, node_major, minor in nodes:
        channel = channel_of(path)
        if channel is None:
            continue
        if major is not None and (node_major, minor) == (major, channel):
            exact.add(channel)
        else:
            odd.add(channel)
    return ImexNodes(major, tuple(sorted(exact)), tuple(sorted(odd - exact)))
