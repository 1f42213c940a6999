"""On-disk format of the phx L2 slab: superblock, slot headers, the checksum.

No LMCache import here: the format is plain bytes (docs/lmcache-l2.md, "Slab
layout").  Every function is pure.
"""
from __future__ import annotations

import json
import struct
import uuid as _uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    from crc32c import crc32c as _crc32c
except ImportError as e:  # pragma: no cover - the package is a dependency
    raise ImportError("phx_lmcache.l2 needs the 'crc32c' package: "
                      "pip install 'phx[lmcache]' (or pip install crc32c)") from e

SUPER_MAGIC = b"PHXL2SB1"
SLOT_MAGIC = b"PHXL2SL1"
VERSION = 1
SUPER_BYTES = 4096
ALIGN = 4096

# superblock: magic, version, crc, uuid, header_bytes, slot_bytes, slot_count,
# file_index, file_count
_SUPER = struct.Struct("<8sII16sQQQII")
# slot header: magic, version, crc, used, uuid, slot, seq, payload_len,
# payload_crc, key_len, meta_len
_SLOT = struct.Struct("<8sIII16sIQQIHH")
SLOT_FIXED = _SLOT.size
_CRC_OFF = 12  # offset of the crc field in both structs


def checksum(data: Any, value: int = 0) -> int:
    """crc32c of a buffer (bytes, memoryview, numpy array, CPU tensor's buffer)."""
    return int(_crc32c(data, value))


def _crc_with_zeroed_field(buf: bytes | bytearray | memoryview, used: int) -> int:
    mv = memoryview(buf)[:used]
    c = _crc32c(mv[:_CRC_OFF])
    c = _crc32c(b"\0\0\0\0", c)
    return int(_crc32c(mv[_CRC_OFF + 4:], c))


def new_uuid() -> bytes:
    return _uuid.uuid4().bytes


@dataclass(frozen=True)
class Super:
    uuid: bytes
    header_bytes: int
    slot_bytes: int
    slot_count: int
    file_index: int
    file_count: int


def encode_super(s: Super) -> bytes:
    b = bytearray(SUPER_BYTES)
    _SUPER.pack_into(b, 0, SUPER_MAGIC, VERSION, 0, s.uuid, s.header_bytes, s.slot_bytes,
                     s.slot_count, s.file_index, s.file_count)
    struct.pack_into("<I", b, _CRC_OFF, _crc_with_zeroed_field(b, _SUPER.size))
    return bytes(b)


def decode_super(b: bytes | memoryview) -> Super | None | str:
    """The superblock; None for an all-zero (unformatted) block; a reason
    string for anything else (not ours, or damaged)."""
    if len(b) < _SUPER.size:
        return None if not any(bytes(b)) else "short superblock"
    magic, ver, crc, uid, hb, sb, n, fi, fc = _SUPER.unpack_from(b, 0)
    if magic != SUPER_MAGIC:
        return None if not any(bytes(b[:SUPER_BYTES])) else "not a phx L2 slab (magic)"
    if ver != VERSION:
        return f"superblock version {ver} (this code reads {VERSION})"
    if crc != _crc_with_zeroed_field(b, _SUPER.size):
        return "superblock checksum mismatch"
    return Super(uid, hb, sb, n, fi, fc)


@dataclass(frozen=True)
class SlotHeader:
    slot: int
    seq: int
    payload_len: int
    payload_crc: int
    key: str
    meta: bytes   # JSON, decoded lazily (recovery reads 100k of these)


#: the fixed part of a slot header as a numpy record (recovery parses all at once)
SLOT_DTYPE = np.dtype([("magic", "S8"), ("version", "<u4"), ("crc", "<u4"), ("used", "<u4"),
                       ("uuid", "V16"), ("slot", "<u4"), ("seq", "<u8"), ("plen", "<u8"),
                       ("pcrc", "<u4"), ("klen", "<u2"), ("mlen", "<u2")])
assert SLOT_DTYPE.itemsize == _SLOT.size
SLOT_CRC_FROM = 16    # a slot header's crc covers bytes 16..used (magic and version
                      # before the crc are compared as they are)


def slot_crc(b: bytes | bytearray | memoryview, used: int) -> int:
    return int(_crc32c(memoryview(b)[SLOT_CRC_FROM:used]))


def encode_slot(uuid: bytes, h: SlotHeader, header_bytes: int) -> bytes:
    """One slot header, padded to ``header_bytes``; ValueError if it does not fit."""
    kb = h.key.encode()
    used = SLOT_FIXED + len(kb) + len(h.meta)
    if used > header_bytes or len(kb) > 0xFFFF or len(h.meta) > 0xFFFF:
        raise ValueError(f"slot header of {used} bytes does not fit {header_bytes}")
    b = bytearray(header_bytes)
    _SLOT.pack_into(b, 0, SLOT_MAGIC, VERSION, 0, used, uuid, h.slot, h.seq, h.payload_len,
                    h.payload_crc, len(kb), len(h.meta))
    b[SLOT_FIXED:SLOT_FIXED + len(kb)] = kb
    b[SLOT_FIXED + len(kb):used] = h.meta
    struct.pack_into("<I", b, _CRC_OFF, slot_crc(b, used))
    return bytes(b)


def decode_slot(b: bytes | memoryview, uuid: bytes, slot: int) -> SlotHeader | None | str:
    """The header; None for a tombstone / never-written slot; a reason string
    for a header that is damaged or does not belong here."""
    if len(b) < SLOT_FIXED:
        return "short header"
    magic, ver, crc, used, uid, s, seq, plen, pcrc, klen, mlen = _SLOT.unpack_from(b, 0)
    if magic != SLOT_MAGIC:
        return None if magic == b"\0" * 8 else "bad magic"
    if ver != VERSION or used != SLOT_FIXED + klen + mlen or used > len(b):
        return "bad header geometry"
    if crc != slot_crc(b, used):
        return "header checksum mismatch"
    if uid != uuid:
        return None          # from an earlier format of this file: not a slot of ours
    if s != slot:
        return f"header names slot {s}"
    key = bytes(b[SLOT_FIXED:SLOT_FIXED + klen]).decode(errors="replace")
    return SlotHeader(s, seq, plen, pcrc, key, bytes(b[SLOT_FIXED + klen:used]))


TOMBSTONE_CACHE: dict[int, bytes] = {}


def tombstone(header_bytes: int) -> bytes:
    t = TOMBSTONE_CACHE.get(header_bytes)
    if t is None:
        t = TOMBSTONE_CACHE[header_bytes] = bytes(header_bytes)
    return t


def encode_meta(shapes: list[list[int]], dtypes: list[str], fmt: int,
                cached_positions: list[int] | None) -> bytes:
    d: dict[str, Any] = {"s": shapes, "d": dtypes, "f": fmt}
    if cached_positions is not None:
        d["p"] = cached_positions
    return json.dumps(d, separators=(",", ":")).encode()


def decode_meta(b: bytes) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(b)
    return out


def round_up(x: int, a: int = ALIGN) -> int:
    return (x + a - 1) // a * a
