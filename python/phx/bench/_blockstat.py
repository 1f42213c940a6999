"""Block-layer request counts for the device under a file (``/sys/block/<dev>/stat``).

The kernel counts, per block device, the requests it completed, how many bios
it merged into requests already queued, the sectors moved and the time spent
(Documentation/block/stat.rst).  Reading the file before and after a run and
taking the difference tells how an engine's I/O reached the device: the
average request size and the share of bios that were merged.  The counts are
device-wide: whatever else uses the device during the run (other processes,
the filesystem's journal) is in them too.

Which device: the file's ``st_dev`` names it (``/sys/dev/block/MAJ:MIN``); a
partition has its own ``stat`` file, and so do device-mapper, loop and zram
devices (bio-based ones such as device-mapper and zram count bios and never
merge).  A filesystem with no block device of its own (tmpfs, overlay, a
btrfs subvolume's anonymous device) falls back to the block device its mount
names, and else has none: its counts are "n/a".
"""
from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass, fields

SECTOR = 512  # the stat file counts 512-byte sectors whatever the device's block size

#: The stat file's fields, in order (kernel 4.18 added discards, 5.5 flushes).
FIELDS = ("read_ios", "read_merges", "read_sectors", "read_ticks_ms",
          "write_ios", "write_merges", "write_sectors", "write_ticks_ms",
          "in_flight", "io_ticks_ms", "time_in_queue_ms",
          "discard_ios", "discard_merges", "discard_sectors", "discard_ticks_ms",
          "flush_ios", "flush_ticks_ms")


@dataclass(frozen=True)
class BlockStat:
    """One reading of a ``stat`` file (fields the kernel lacks read as 0)."""
    read_ios: int = 0
    read_merges: int = 0
    read_sectors: int = 0
    read_ticks_ms: int = 0
    write_ios: int = 0
    write_merges: int = 0
    write_sectors: int = 0
    write_ticks_ms: int = 0
    in_flight: int = 0
    io_ticks_ms: int = 0
    time_in_queue_ms: int = 0
    discard_ios: int = 0
    discard_merges: int = 0
    discard_sectors: int = 0
    discard_ticks_ms: int = 0
    flush_ios: int = 0
    flush_ticks_ms: int = 0

    def __sub__(self, before: "BlockStat") -> "BlockStat":
        """What happened between ``before`` and this reading (in_flight: this reading's)."""
        vals = {f.name: getattr(self, f.name) - getattr(before, f.name) for f in fields(self)}
        vals["in_flight"] = self.in_flight
        return BlockStat(**vals)

    def __add__(self, other: "BlockStat") -> "BlockStat":
        vals = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        vals["in_flight"] = max(self.in_flight, other.in_flight)
        return BlockStat(**vals)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def parse_stat(text: str) -> BlockStat:
    """A ``stat`` file's text (11, 15 or 17 numbers) as a :class:`BlockStat`."""
    nums = [int(t) for t in text.split()]
    if len(nums) < 11:
        raise ValueError(f"not a block stat line (need >= 11 fields): {text!r}")
    return BlockStat(**dict(zip(FIELDS, nums)))


@dataclass(frozen=True)
class BlockDevice:
    """The block device whose ``stat`` file counts a file's I/O."""
    name: str           # e.g. vda, vda1, dm-0, zram1, loop3
    sysfs: str          # its /sys/devices/... directory
    kind: str           # disk, partition, device-mapper, loop, zram, md, ...
    parent: str | None  # the whole disk of a partition
    members: tuple[str, ...] = ()  # what a device-mapper/md device sits on

    @property
    def stat_path(self) -> str:
        return os.path.join(self.sysfs, "stat")

    def read(self) -> BlockStat:
        with open(self.stat_path) as f:
            return parse_stat(f.read())

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "kind": self.kind, "parent": self.parent,
                "members": list(self.members), "stat": self.stat_path}


def _kind(name: str, sysfs: str) -> str:
    if os.path.exists(os.path.join(sysfs, "partition")):
        return "partition"
    for prefix, kind in (("dm-", "device-mapper"), ("loop", "loop"), ("zram", "zram"),
                         ("md", "md"), ("nbd", "nbd")):
        if name.startswith(prefix):
            return kind
    return "disk"


def device_by_number(major: int, minor: int, sys_root: str = "/sys") -> BlockDevice | None:
    """The block device MAJ:MIN, or None when the kernel has no such block device."""
    link = os.path.join(sys_root, "dev", "block", f"{major}:{minor}")
    if not os.path.exists(os.path.join(link, "stat")):
        return None
    sysfs = os.path.realpath(link)
    name = os.path.basename(sysfs)
    kind = _kind(name, sysfs)
    parent = os.path.basename(os.path.dirname(sysfs)) if kind == "partition" else None
    try:
        members = tuple(sorted(os.listdir(os.path.join(sysfs, "slaves"))))
    except OSError:
        members = ()
    return BlockDevice(name, sysfs, kind, parent, members)


def _mount_source(path: str) -> str | None:
    """The device named by the mount that holds ``path`` (longest mount point wins)."""
    real = os.path.realpath(path)
    best, src = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 2:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, src = mnt, parts[0]
    except OSError:
        return None
    return src


def device_for_path(path: str) -> tuple[BlockDevice | None, str]:
    """The block device that serves ``path``'s I/O, and how it was found (or why none)."""
    st = os.stat(path)
    maj, mnr = os.major(st.st_dev), os.minor(st.st_dev)
    dev = device_by_number(maj, mnr)
    if dev is not None:
        return dev, f"st_dev {maj}:{mnr}"
    src = _mount_source(path)
    if src and src.startswith("/"):
        try:
            sst = os.stat(src)
        except OSError:
            sst = None
        if sst is not None and stat.S_ISBLK(sst.st_mode):
            dev = device_by_number(os.major(sst.st_rdev), os.minor(sst.st_rdev))
            if dev is not None:
                return dev, f"mount source {src} (st_dev {maj}:{mnr} is not a block device)"
    return None, (f"no block device: st_dev {maj}:{mnr} is not one"
                  f"{f' and the mount source is {src!r}' if src else ''}")


def summarise(diff: BlockStat, write: bool, engine_ios: int) -> dict[str, float | int | None]:
    """How ``engine_ios`` requests of one direction reached the device.

    ``requests`` are the device requests completed in that direction,
    ``merged`` the bios merged into others, ``avg_request_bytes`` bytes per
    device request, ``merge_ratio`` merged / (requests + merged), i.e. the
    share of bios that did not become a request of their own, and
    ``requests_per_io`` device requests per engine request.
    """
    ios = diff.write_ios if write else diff.read_ios
    merges = diff.write_merges if write else diff.read_merges
    sectors = diff.write_sectors if write else diff.read_sectors
    bios = ios + merges
    return {
        "requests": ios, "merged": merges, "bytes": sectors * SECTOR,
        "avg_request_bytes": sectors * SECTOR / ios if ios else None,
        "merge_ratio": merges / bios if bios else None,
        "requests_per_io": ios / engine_ios if engine_ios else None,
        "flushes": diff.flush_ios,
        "other_direction_requests": diff.read_ios if write else diff.write_ios,
    }
