"""Character majors from /proc/devices.

Several names can share one major (545+ drivers list `195 nvidia` and
`195 nvidiactl`; 550+ add `195 nvidia-modeset`), and dynamic majors differ
from host to host, so names are matched exactly, never by prefix
(`nvidia-caps` is a prefix of `nvidia-caps-imex-channels`). One name can also
own several majors (the kernel does not refuse a second register_chrdev of a
name): every line counts, a later one never re-maps an earlier one.
"""

from __future__ import annotations

from nvsymlinkd.errors import HostFileError
from nvsymlinkd.record import dataclass, field

PROC_DEVICES = "/proc/devices"
MAX_MAJOR = 4095  # MAJOR() is 12 bits in the kernel's dev_t

# Names the driver registers for major 195 across driver branches.
FRONTEND_NAMES = frozenset({"nvidia", "nvidia-frontend", "nvidiactl", "nvidia-modeset"})
UVM = "nvidia-uvm"
CAPS = "nvidia-caps"
IMEX_CHANNELS = "nvidia-caps-imex-channels"
NVSWITCH = "nvidia-nvswitch"
NVLINK = "nvidia-nvlink"


@dataclass(frozen=True)
class Majors:
    """NVIDIA character majors: every `nvidia*` name in the char section."""

    by_name: dict[str, int] = field(default_factory=dict)  # name -> major, for names listed with one major only
    lines: tuple[tuple[str, int], ...] = ()  # every (name, major) line, in order; () means by_name's items
    skipped: tuple[tuple[int, str], ...] = ()  # (line number, why) of other drivers' lines that could not be read

    @property
    def pairs(self) -> tuple[tuple[str, int], ...]:
        """Every (name, major): a name listed with several majors appears once per major."""
        return self.lines or tuple(self.by_name.items())

    @property
    def nvidia_majors(self) -> frozenset[int]:
        return frozenset(m for _, m in self.pairs)

    def majors_of(self, name: str) -> tuple[int, ...]:
        return tuple(sorted({m for n, m in self.pairs if n == name}))

    def major(self, name: str) -> int | None:
        """The one major of `name`; None when it is not listed, or listed with several (never guess)."""
        return self.by_name.get(name)

    def ambiguous(self) -> dict[str, tuple[int, ...]]:
        """name -> its majors, for names listed with more than one major."""
        out = {}
        for name, _ in self.pairs:
            majors = self.majors_of(name)
            if len(majors) > 1:
                out[name] = majors
        return out

    def frontend(self) -> int | None:
        """The major of /dev/nvidia0 and /dev/nvidiactl (195 on every driver)."""
        for name in ("nvidia", "nvidia-frontend", "nvidiactl"):
            if name in self.by_name:
                return self.by_name[name]
        return None

    def names_of(self, major: int) -> list[str]:
        return sorted({n for n, m in self.pairs if m == major})

    def __bool__(self) -> bool:
        return bool(self.by_name)


def parse_proc_devices(text: str, path: str = PROC_DEVICES) -> Majors:
    """Parse the text of /proc/devices; only the `Character devices:` section counts.

    Raises HostFileError (and nothing else) naming the line for malformed input that
    could matter: anything before a section, a line that is not `MAJOR NAME`, an
    NVIDIA name with an unusable major. Another driver's line with an unusable major
    (thousands of digits, above 4095) says nothing about NVIDIA's majors: it is
    skipped and reported in `skipped`, so the rest of the file still counts.
    """
    lines: list[tuple[str, int]] = []
    skipped: list[tuple[int, str]] = []
    section = None
    seen_char = False
    for lineno, raw in enumerate(text.split("\n"), 1):
        line = raw.strip()
        if not line:
            continue
        if line.endswith(":") and not line[0].isdigit():
            section = line[:-1].strip().lower()
            if section == "character devices":
                seen_char = True
            continue
        if section is None:
            raise HostFileError(path, f"unexpected line before a section header: {_show(line)}", lineno)
        parts = line.split(None, 1)
        if len(parts) != 2 or not parts[0].isdigit() or not parts[0].isascii():
            raise HostFileError(path, f"expected 'MAJOR NAME', got {_show(line)}", lineno)
        major = decimal(parts[0], MAX_MAJOR)
        name = parts[1].strip()
        if major is None:
            why = f"major {_show(parts[0])} out of range 0-{MAX_MAJOR}"
            if name.startswith("nvidia"):
                raise HostFileError(path, why, lineno)
            skipped.append((lineno, f"{why} for {_show(name)}"))
            continue
        if section == "character devices" and name.startswith("nvidia"):
            lines.append((name, major))
    if not seen_char:
        raise HostFileError(path, "no 'Character devices:' section (truncated or not /proc/devices?)")
    seen: dict[str, set[int]] = {}
    for name, major in lines:
        seen.setdefault(name, set()).add(major)
    by_name = {name: next(iter(majors)) for name, majors in seen.items() if len(majors) == 1}
    return Majors(by_name, tuple(lines), tuple(skipped))


def decimal(text: str, hi: int) -> int | None:
    """An ASCII decimal number 0..hi, or None (not a number, or too large).

    The digit count is checked before int(): a line of thousands of digits must not cost
    quadratic time (Python < 3.11) nor raise ValueError (Python >= 3.11's int-string limit).
    """
    if not text.isascii() or not text.isdigit():
        return None
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(hi)):
        return None
    value = int(digits)
    return value if value <= hi else None


def _show(line: str) -> str:
    return repr(line if len(line) <= 60 else line[:57] + "...")
