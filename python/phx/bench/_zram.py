"""A private zram block device with ext4 on it, for RAM-speed benchmark rows.

zram is a RAM-backed block device: with a real filesystem on it, reads and
writes go through the same kernel path as on a disk (filesystem, block layer,
driver), but the device answers at memory speed, so the software above it
decides.  :func:`zram_ext4` makes a new device (``/sys/class/zram-control/
hot_add``, so a device someone else uses is never touched), formats it,
mounts it on a fresh directory and, whatever happens, unmounts, resets and
removes it again.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

CONTROL = "/sys/class/zram-control"


@dataclass(frozen=True)
class ZramMount:
    """A mounted zram device."""
    index: int
    device: str      # /dev/zramN
    mountpoint: str
    disksize: int


def unavailable(disksize: int) -> str | None:
    """Why a zram device of ``disksize`` bytes cannot be made here, or None if it can."""
    if os.geteuid() != 0:
        return "not root (zram devices need root)"
    if not os.path.exists(os.path.join(CONTROL, "hot_add")):
        return f"no {CONTROL}/hot_add (kernel without zram, or zram not loaded)"
    for tool in ("mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} not found"
    avail = _mem_available()
    if avail is not None and avail < disksize:
        return (f"MemAvailable {avail / 2**30:.1f} GiB < {disksize / 2**30:.1f} GiB asked for "
                f"(random data does not compress: zram keeps all of it in RAM)")
    return None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _run(cmd: list[str]) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")


def _teardown(index: int, mountpoint: str | None) -> list[str]:
    """Unmount, reset and remove zram ``index``; return what could not be undone."""
    problems = []
    if mountpoint is not None:
        if os.path.ismount(mountpoint):
            # A process that just exited may still hold the mount for a moment, and
            # io_uring rings drop their registered files asynchronously after close.
            for _ in range(100):
                if subprocess.run(["umount", mountpoint], capture_output=True).returncode == 0:
                    break
                time.sleep(0.1)
            else:
                problems.append(f"umount {mountpoint} failed")
        if not os.path.ismount(mountpoint):
            with contextlib.suppress(OSError):
                os.rmdir(mountpoint)
    name = f"zram{index}"
    try:
        _write(f"/sys/block/{name}/reset", "1\n")
    except OSError as e:
        problems.append(f"reset {name}: {e}")
    try:
        _write(os.path.join(CONTROL, "hot_remove"), f"{index}\n")
    except OSError as e:
        problems.append(f"hot_remove {name}: {e}")
    return problems


@contextlib.contextmanager
def zram_ext4(disksize: int, fs: str = "ext4") -> Iterator[ZramMount]:
    """A new zram device of ``disksize`` bytes with ext4 (or ``fs="xfs"``:
    xfs, at least 300 MiB), mounted; removed on exit.

    ext4 is made with its inode tables and journal initialised up front
    (``lazy_itable_init=0,lazy_journal_init=0``), so no background
    initialisation writes to the device while it is measured.
    """
    if fs not in ("ext4", "xfs"):
        raise ValueError(f"zram filesystem {fs!r}: ext4 or xfs")
    why = unavailable(disksize)
    if why:
        raise RuntimeError(f"cannot make a zram device: {why}")
    with open(os.path.join(CONTROL, "hot_add")) as f:
        index = int(f.read().strip())
    device = f"/dev/zram{index}"
    mountpoint = None
    try:
        _write(f"/sys/block/zram{index}/disksize", f"{disksize}\n")
        for _ in range(50):  # devtmpfs makes the node; give it a moment
            if os.path.exists(device):
                break
            time.sleep(0.02)
        if fs == "xfs":
            _run(["mkfs.xfs", "-q", "-f", device])
        else:
            _run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0",
                  device])
        mountpoint = tempfile.mkdtemp(prefix=f"phx-bench-zram{index}-")
        # discard: a deleted file's blocks go back to RAM (zram frees them on
        # discard), so methods run one after another on one device do not
        # add up in memory
        _run(["mount", "-t", fs, "-o", "discard", device, mountpoint])
        yield ZramMount(index, device, mountpoint, disksize)
    finally:
        problems = _teardown(index, mountpoint)
        if problems:
            # Not raised: it would hide the exception that brought us here, if any.
            print(f"phx bench: zram cleanup incomplete: {'; '.join(problems)}", file=sys.stderr)
