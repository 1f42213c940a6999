"""tools/udev_db_fill.py: the udev entries cuFile needs, on a host without udevd.

The tool is meant for the GPU box (no udevd, so cuFile registers no file);
here it runs on a made-up mountinfo and a folder standing in for
/run/udev/data, with ext4 and xfs images standing in for the devices.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "udev_db_fill.py"


def _tool():
    spec = importlib.util.spec_from_file_location("udev_db_fill", TOOL)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _image(tmp_path: Path, fstype: str) -> Path:
    mkfs = shutil.which(f"mkfs.{fstype}")
    if mkfs is None:
        pytest.skip(f"no mkfs.{fstype}")
    img = tmp_path / f"{fstype}.img"
    with open(img, "wb") as f:
        f.truncate(320 << 20)
    subprocess.run([mkfs, "-q", str(img)], check=True, capture_output=True)
    return img


def test_writes_missing_entries_and_keeps_existing(tmp_path: Path) -> None:
    u = _tool()
    mi = tmp_path / "mountinfo"
    mi.write_text(
        "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
        "40 27 252:1 / /mnt/x rw,relatime - xfs /dev/zram1 rw\n"
        "41 27 252:2 / /mnt/y rw,relatime - xfs /dev/zram2 rw\n"
        "43 27 7:0 / /mnt/l rw,relatime - ext4 /tmp/not-a-dev-node rw\n"
        "22 27 0:21 / /proc rw,relatime - proc proc rw\n"
        "30 27 0:27 / /dev/shm rw,relatime - tmpfs tmpfs rw\n"
        "42 27 0:40 / /mnt/o rw - overlay overlay rw\n")
    assert [m[:3] for m in u.block_mounts(str(mi))] == [
        (254, 0, "ext4"), (252, 1, "xfs"), (252, 2, "xfs")]
    db = tmp_path / "db"
    db.mkdir()
    (db / "b252:2").write_text("E:ID_FS_USAGE=filesystem\nE:KEEP=1\n")
    written = u.fill(str(db), str(mi))
    assert len(written) == 2
    vda = (db / "b254:0").read_text().splitlines()
    assert "E:ID_FS_USAGE=filesystem" in vda and "E:ID_FS_TYPE=ext4" in vda
    assert "E:DEVNAME=/dev/vda" in vda
    assert "E:ID_FS_TYPE=xfs" in (db / "b252:1").read_text().splitlines()
    # an entry udevd (or an earlier run) wrote is never touched
    assert (db / "b252:2").read_text() == "E:ID_FS_USAGE=filesystem\nE:KEEP=1\n"
    assert u.fill(str(db), str(mi)) == []
    assert not [p for p in os.listdir(db) if p.endswith(".phx-tmp")]


@pytest.mark.parametrize("fstype", ["ext4", "xfs"])
def test_uuid_matches_blkid(tmp_path: Path, fstype: str) -> None:
    blkid = shutil.which("blkid")
    if blkid is None:
        pytest.skip("no blkid")
    img = _image(tmp_path, fstype)
    want = subprocess.run([blkid, "-s", "UUID", "-o", "value", str(img)], check=True,
                          capture_output=True, text=True).stdout.strip()
    assert want and _tool().fs_uuid(str(img), fstype) == want
