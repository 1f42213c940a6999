"""The slab files of the phx L2 tier: locking, formatting, recovery, slot I/O.

One :class:`SlabFile` per path (a file on ext4/xfs or a block device).  Global
slot ``g`` lives in file ``g % nfiles`` at local slot ``g // nfiles``
(docs/lmcache-l2.md, "Slab layout").
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
import time
from typing import Any

import numpy as np

import phx

from . import format as fmt

log = logging.getLogger("phx_lmcache.l2")

_BLKGETSIZE64 = 0x80081272
SCAN_WINDOW = 8192


class SlabInUseError(OSError):
    """Another process (or another plugin in this one) holds the slab."""


def _lock_holder(fd: int) -> str:
    """Who holds a lock on the file of ``fd``, from /proc/locks (best effort)."""
    st = os.fstat(fd)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == dev:
                    return f"process {parts[4]}"
    except OSError:
        pass
    return "another process (or another open of it in this one)"


def _device_size(fd: int) -> int:
    buf = bytearray(8)
    fcntl.ioctl(fd, _BLKGETSIZE64, buf)
    return int(struct.unpack("<Q", buf)[0])


class SlabFile:
    """One slab file, locked for the life of this object."""

    def __init__(self, path: str, capacity: int, header_bytes: int, slot_bytes: int,
                 index: int, count: int, engine: Any, preallocate: bool = True) -> None:
        self.path = path
        self.header_bytes = header_bytes
        self.slot_bytes = slot_bytes
        self.index = index
        created = not os.path.exists(path)
        # No O_TRUNC, nothing read or written before the lock is ours.
        self._lock_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _lock_holder(self._lock_fd)
            os.close(self._lock_fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise SlabInUseError(errno.EBUSY, f"slab in use by {holder}: one phx L2 slab "
                                     "per LMCache server", path) from None
            raise
        try:
            self._open(capacity, count, engine, preallocate, created)
        except BaseException:
            f = getattr(self, "f", None)
            if f is not None:
                f.close()
            if created:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            os.close(self._lock_fd)
            raise

    def _open(self, capacity: int, count: int, engine: Any, preallocate: bool,
              created: bool) -> None:
        st = os.fstat(self._lock_fd)
        self.blockdev = stat.S_ISBLK(st.st_mode)
        if self.blockdev:
            dev = _device_size(self._lock_fd)
            capacity = min(capacity, dev) if capacity > 0 else dev
        if capacity <= 0:
            raise ValueError(f"{self.path}: phx_l2.capacity_gb must be > 0 for a file")
        self.slot_count = (capacity - fmt.SUPER_BYTES) // self.slot_bytes
        if self.slot_count < 1:
            raise ValueError(f"{self.path}: capacity {capacity} holds no slot of "
                             f"{self.slot_bytes} bytes")
        self.size = fmt.SUPER_BYTES + self.slot_count * self.slot_bytes
        self.f = phx.open(self.path, "r+", engine=engine)
        self.file_size = st.st_size if not self.blockdev else self.size
        buf = phx.empty_aligned(fmt.SUPER_BYTES)
        n = self.f.pread(buf, 0) if self.file_size else 0
        sb = fmt.decode_super(memoryview(buf)[:n])
        self.keys: list[str] = []
        self.metas: list[bytes] = []
        self.locals = self.seqs = self.plens = self.pcrcs = np.zeros(0, dtype=np.int64)
        self.dropped = 0
        self.dropped_slots: list[int] = []   # a header is there, not believed: tombstone first
        self.read_s = 0.0
        if isinstance(sb, str):
            if sb.startswith("not a phx"):
                raise ValueError(f"{self.path}: {sb}: refusing to format a file that is not "
                                 "a phx L2 slab (remove it, or name another path)")
            log.warning("phx L2: %s: %s: formatting it anew", self.path, sb)
            sb = None
        if sb is not None and (sb.header_bytes, sb.slot_bytes, sb.file_index, sb.file_count) != (
                self.header_bytes, self.slot_bytes, self.index, count):
            log.warning("phx L2: %s: slab geometry changed (header %d slot %d file %d/%d -> "
                        "%d %d %d/%d): formatting it anew", self.path, sb.header_bytes,
                        sb.slot_bytes, sb.file_index, sb.file_count, self.header_bytes,
                        self.slot_bytes, self.index, count)
            sb = None
        if sb is not None:
            self.uuid = sb.uuid
            self._scan(min(sb.slot_count, self.slot_count))
        else:
            self.uuid = fmt.new_uuid()
        # Extend (or preallocate) to full size only after the scan: a truncated
        # file must not look longer than what is on it.
        if not self.blockdev and self.file_size < self.size:
            try:
                if preallocate:
                    os.posix_fallocate(self._lock_fd, 0, self.size)
                else:
                    os.ftruncate(self._lock_fd, self.size)
            except OSError as e:
                raise OSError(e.errno, f"cannot allocate the slab ({self.size} bytes, "
                              f"{os.strerror(e.errno or 0)}); lower phx_l2.capacity_gb or free "
                              "space", self.path) from None
        if sb is None or sb.slot_count != self.slot_count:
            self.f.pwrite(fmt.encode_super(fmt.Super(self.uuid, self.header_bytes,
                                                     self.slot_bytes, self.slot_count,
                                                     self.index, count)), 0)

    def header_offset(self, local: int) -> int:
        return fmt.SUPER_BYTES + local * self.slot_bytes

    def _scan(self, nslots: int) -> None:
        """Read every slot header (batched, ``pread_many``) and keep the valid
        ones; the fixed fields of a whole window are checked with numpy."""
        hb = self.header_bytes
        win = min(SCAN_WINDOW, nslots)
        buf = phx.empty_aligned(max(win, 1) * hb)
        zero_magic = np.zeros(1, dtype="S8")[0]
        want_uuid = np.frombuffer(self.uuid, dtype="V16")[0]
        room = self.slot_bytes - hb
        locs, seqs, plens, pcrcs = [], [], [], []
        for start in range(0, nslots, SCAN_WINDOW):
            n = min(SCAN_WINDOW, nslots - start)
            local = start + np.arange(n, dtype=np.int64)
            offs = fmt.SUPER_BYTES + local * self.slot_bytes
            m = int((offs + hb <= self.file_size).sum())   # offsets grow: a prefix is inside
            if m == 0:
                break
            t = time.perf_counter()
            got = self.f.pread_many(buf, offs[:m], hb)
            self.read_s += time.perf_counter() - t
            h = np.ndarray((m,), dtype=fmt.SLOT_DTYPE, buffer=buf, strides=(hb,))
            written = (h["magic"] != zero_magic) & (got == hb)
            ok = (written & (h["magic"] == fmt.SLOT_MAGIC) & (h["version"] == fmt.VERSION)
                  & (h["used"] == fmt.SLOT_FIXED + h["klen"].astype(np.uint32) + h["mlen"])
                  & (h["used"] <= hb))
            mine = ok & (h["uuid"] == want_uuid)           # else: an earlier format's slot
            fits = mine & (h["slot"] == local[:m]) & (h["plen"] <= room) \
                & (offs[:m] + hb + h["plen"].astype(np.int64) <= self.file_size)
            for jj in np.flatnonzero(written & ~ok | mine & ~fits):
                i = int(jj)
                why = ("payload past the end of the file (truncated slab)"
                       if mine[i] and h["slot"][i] == start + i else "bad header")
                self._drop(start + i, why)
            used, crcs, klens = (h[f].tolist() for f in ("used", "crc", "klen"))
            good: list[int] = []
            crc, mv, fx, c0 = fmt.checksum, memoryview(buf), fmt.SLOT_FIXED, fmt.SLOT_CRC_FROM
            keys, metas = self.keys, self.metas
            for i in np.flatnonzero(fits).tolist():
                o = i * hb
                u = o + used[i]
                if crc(mv[o + c0:u]) != crcs[i]:
                    self._drop(start + i, "header checksum mismatch")
                    continue
                k = o + fx + klens[i]
                keys.append(bytes(mv[o + fx:k]).decode(errors="replace"))
                metas.append(bytes(mv[k:u]))
                good.append(i)
            idx = np.asarray(good, dtype=np.int64)
            locs.append(start + idx)
            seqs.append(h["seq"][idx].astype(np.int64))
            plens.append(h["plen"][idx].astype(np.int64))
            pcrcs.append(h["pcrc"][idx].astype(np.int64))
        self.locals, self.seqs, self.plens, self.pcrcs = (
            np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)
            for xs in (locs, seqs, plens, pcrcs))

    def _drop(self, local: int, why: str) -> None:
        self.dropped += 1
        self.dropped_slots.append(local)
        if self.dropped <= 16:
            log.warning("phx L2: %s slot %d: %s: dropped%s", self.path, local, why,
                        " (further drops counted, not logged)" if self.dropped == 16 else "")

    def close(self) -> None:
        try:
            self.f.close()
        finally:
            os.close(self._lock_fd)   # drops the flock


class SlabSet:
    """All files of one tier; global slot numbers over them."""

    def __init__(self, paths: list[str], capacity: int, header_bytes: int, slot_bytes: int,
                 engine: Any, preallocate: bool = True) -> None:
        t0 = time.perf_counter()
        self.files: list[SlabFile] = []
        per = capacity // len(paths) if capacity > 0 else 0
        try:
            for i, p in enumerate(paths):
                self.files.append(SlabFile(p, per, header_bytes, slot_bytes, i, len(paths),
                                           engine, preallocate))
        except BaseException:
            for f in self.files:
                f.close()
            raise
        self.nfiles = len(self.files)
        self.header_bytes = header_bytes
        self.slot_bytes = slot_bytes
        per_file = min(f.slot_count for f in self.files)
        self.slot_count = per_file * self.nfiles
        # what the scan found, over all files: global slot, sequence, payload
        # length and crc (arrays), key and meta (lists), in one order
        self.dropped = sum(f.dropped for f in self.files)
        slots, seqs, plens, pcrcs = [], [], [], []
        self.keys: list[str] = []
        self.metas: list[bytes] = []
        for f in self.files:
            inside = f.locals < per_file
            slots.append(f.locals[inside] * self.nfiles + f.index)
            seqs.append(f.seqs[inside])
            plens.append(f.plens[inside])
            pcrcs.append(f.pcrcs[inside])
            self.keys += [k for k, ok in zip(f.keys, inside) if ok]
            self.metas += [m for m, ok in zip(f.metas, inside) if ok]
            f.keys, f.metas = [], []
        self.slots, self.seqs, self.plens, self.pcrcs = (
            np.concatenate(xs) for xs in (slots, seqs, plens, pcrcs))
        self.dropped_slots = [loc * self.nfiles + f.index for f in self.files
                              for loc in f.dropped_slots if loc < per_file]
        self.recovery_s = time.perf_counter() - t0

    def locate(self, slot: int) -> tuple[SlabFile, int]:
        """(file, offset of the slot's header)."""
        f = self.files[slot % self.nfiles]
        return f, f.header_offset(slot // self.nfiles)

    def uuid_of(self, slot: int) -> bytes:
        return self.files[slot % self.nfiles].uuid

    def local(self, slot: int) -> int:
        return slot // self.nfiles

    def fdatasync(self) -> None:
        for f in self.files:
            os.fdatasync(f.f.fileno())

    def close(self) -> None:
        for f in self.files:
            f.close()
