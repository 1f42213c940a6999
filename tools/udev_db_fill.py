#!/usr/bin/env python3
"""Give cuFile the filesystem facts udevd would have recorded, on a host without udevd.

cuFile asks libudev for a file's block device's ``ID_FS_USAGE`` before it will
register a handle.  libudev answers from udevd's database, ``/run/udev/data/
b<major>:<minor>``.  The GPU box (a Firecracker VM) runs no udevd, so that
database is empty.  There cuFile logs "udev property not found: ID_FS_USAGE"
and ``cuFileHandleRegister`` fails with 5027 for every file
(docs/cufile-diag-h100/).  Then LMCache's cufile backend cannot start.

This tool writes, for every mounted ext4 or xfs filesystem on a block device
that has no entry, the few properties that udevd's blkid builtin would have
recorded: ``ID_FS_USAGE=filesystem``, ``ID_FS_TYPE``, ``ID_FS_UUID`` (read from
the superblock) and ``DEVNAME``.  It
never touches an entry that is already there.  With ``--watch S`` it checks
again every S seconds until it is killed, so that it also covers the zram
filesystems a benchmark mounts later.

It is a tool for such a box only.  A host that runs udevd (any normal
installation) has these entries already, and there this tool writes nothing.

    python3 tools/udev_db_fill.py [--watch 0.2] [--db /run/udev/data]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

FILESYSTEMS = ("ext4", "xfs")


def block_mounts(mountinfo: str = "/proc/self/mountinfo") -> list[tuple[int, int, str, str]]:
    """(major, minor, fstype, source) of every ext4/xfs mount on a block device."""
    out = []
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) < 3 or len(rest) < 2 or rest[0] not in FILESYSTEMS:
                continue
            major, minor = (int(x) for x in fields[2].split(":"))
            if major and rest[1].startswith("/dev/"):
                out.append((major, minor, rest[0], rest[1]))
    return out


def fs_uuid(source: str, fstype: str) -> str | None:
    """The filesystem's UUID from its superblock, as udev's blkid builtin
    records it (ext4: 16 bytes at 1024 + 0x68; xfs: at 32), or None."""
    at = 1024 + 0x68 if fstype == "ext4" else 32
    try:
        with open(source, "rb") as f:
            f.seek(at)
            u = f.read(16).hex()
    except OSError:
        return None
    if len(u) != 32:
        return None
    return f"{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:]}"


def fill(db: str, mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """Write the missing entries; the paths written."""
    os.makedirs(db, exist_ok=True)
    written = []
    for major, minor, fstype, source in block_mounts(mountinfo):
        path = os.path.join(db, f"b{major}:{minor}")
        if os.path.exists(path):
            continue
        tmp = f"{path}.phx-tmp"
        uuid = fs_uuid(source, fstype)
        with open(tmp, "w") as f:
            f.write(f"E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE={fstype}\nE:DEVNAME={source}\n")
            if uuid:
                f.write(f"E:ID_FS_UUID={uuid}\nE:ID_FS_UUID_ENC={uuid}\n")
        os.replace(tmp, path)      # a reader never sees half an entry
        written.append(f"{path} ({source}, {fstype})")
    return written


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--db", default="/run/udev/data", help="udevd's database folder")
    p.add_argument("--watch", type=float, default=0.0, metavar="S",
                   help="check again every S seconds until killed")
    args = p.parse_args()
    while True:
        for w in fill(args.db):
            print(f"udev_db_fill: wrote {w}", flush=True)
        if args.watch <= 0:
            return 0
        time.sleep(args.watch)


if __name__ == "__main__":
    sys.exit(main())
