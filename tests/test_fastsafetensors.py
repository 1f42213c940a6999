"""phx's fastsafetensors copier (adapters/fastsafetensors) with the real
fastsafetensors 0.5.0 in its CPU mode: copier type ``"phx"``; and after
``replace()`` fastsafetensors' own ``nogds`` users (``SafeTensorsFileLoader``,
``ParallelLoader`` with sub-file chunks) reading through phx - every tensor
byte-for-byte against ``safetensors.torch.load_file``, phx's counters showing
the bytes were its reads, a truncated file failing the load.  ``replace()``
changes fastsafetensors' registry for the whole process, so those tests run
in a fresh interpreter.  On a GPU: tools/loader_gpu_run.sh (bench rows).
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")
fst = pytest.importorskip("fastsafetensors")

import phx  # noqa: E402
import phx_fastsafetensors  # noqa: E402
from fastsafetensors.frameworks import get_framework_op  # noqa: E402
from fastsafetensors.loader import BaseSafeTensorsFileLoader  # noqa: E402

from phx.loader import CheckpointError  # noqa: E402
from test_loader import raw, random_state, rand_tensor  # noqa: E402

MiB = 1 << 20


def _state(rng):
    sd = random_state(rng, big=3 * MiB + 1)
    return {k: v for k, v in sd.items() if v.numel()}   # fastsafetensors: no empty tensors


def _copy(files, device="cpu"):
    fw = get_framework_op("pytorch")
    dev = fw.get_device(device, fw.get_process_group(None))
    ld = BaseSafeTensorsFileLoader(None, dev, "phx")
    try:
        ld.add_filenames({0: list(files)})
        fb = ld.copy_files_to_device()
        try:
            return {k: fb.get_tensor(k).clone() for k in ld.get_keys()}
        finally:
            fb.close()
    finally:
        ld.close()


def test_phx_copier_type_matches_safetensors(fs_dir, rng):
    phx_fastsafetensors.register()
    phx_fastsafetensors.register()              # idempotent
    sd = _state(rng)
    path = os.path.join(fs_dir, "m.safetensors")
    st.save_file(sd, path)
    ref = st.load_file(path)
    before = phx.stats()["bytes_read"]
    got = _copy([path])
    moved = phx.stats()["bytes_read"] - before
    assert sorted(got) == sorted(ref)
    for k, r in ref.items():
        assert got[k].dtype == r.dtype and tuple(got[k].shape) == tuple(r.shape), k
        assert raw(got[k]) == raw(r), k
    data = os.path.getsize(path) - loader_header_end(path)
    assert moved >= data, (moved, data)


def test_note_identities_wraps_once():
    from fastsafetensors.common import SafeTensorsMetadata

    from phx_fastsafetensors.copier import note_identities
    note_identities()
    first = SafeTensorsMetadata.__dict__["from_fd"]
    note_identities()
    assert SafeTensorsMetadata.__dict__["from_fd"] is first


def loader_header_end(path: str) -> int:
    from phx.loader import open_checkpoint
    return open_checkpoint(path).files[0].data_start


def _loader_for(path):
    fw = get_framework_op("pytorch")
    ld = BaseSafeTensorsFileLoader(None, fw.get_device("cpu", fw.get_process_group(None)), "phx")
    ld.add_filenames({0: [path]})            # fastsafetensors reads the header here
    return ld


def _two(rng, path):
    sd = {"a": rand_tensor(rng, (2 * MiB,), torch.int8), "b": rand_tensor(rng, (1 * MiB,), torch.int8)}
    st.save_file(sd, path)
    return sd


def test_phx_copier_truncated_file_fails(data_dir, rng):
    phx_fastsafetensors.register()
    path = os.path.join(data_dir, "m.safetensors")
    _two(rng, path)
    ld = _loader_for(path)
    os.truncate(path, os.path.getsize(path) - 4096)
    with pytest.raises(CheckpointError, match="changed since its header was read") as e:
        ld.copy_files_to_device()
    assert e.value.path == path and "size" in str(e.value)
    ld.close()


def test_phx_copier_file_replaced_by_rename_fails(data_dir, rng):
    """The header fastsafetensors read is of the old file; a new file of the
    same layout renamed over it must not be copied under that header."""
    phx_fastsafetensors.register()
    path = os.path.join(data_dir, "m.safetensors")
    _two(rng, path)
    ld = _loader_for(path)
    _two(rng, path + ".new")
    os.rename(path + ".new", path)
    with pytest.raises(CheckpointError, match="another file") as e:
        ld.copy_files_to_device()
    assert e.value.path == path
    ld.close()


def test_phx_copier_file_written_in_place_fails(data_dir, rng):
    phx_fastsafetensors.register()
    path = os.path.join(data_dir, "m.safetensors")
    _two(rng, path)
    ld = _loader_for(path)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\x11" * 4096, 1 << 20)
    finally:
        os.close(fd)
    with pytest.raises(CheckpointError, match="mtime changed") as e:
        ld.copy_files_to_device()
    assert e.value.path == path
    ld.close()


def test_phx_copier_file_written_during_the_read_fails(data_dir, rng):
    """Written between submit_io and wait_io (the reads may already have
    taken the new bytes): wait_io's check after the reads refuses them."""
    phx_fastsafetensors.register()
    from fastsafetensors.common import SafeTensorsMetadata
    from phx_fastsafetensors.copier import PhxCopier
    path = os.path.join(data_dir, "m.safetensors")
    _two(rng, path)
    fw = get_framework_op("pytorch")
    dev = fw.get_device("cpu", fw.get_process_group(None))
    md = SafeTensorsMetadata.from_file(path, fw)
    cp = PhxCopier(md, dev, fw)
    gbuf = cp.submit_io(False, 16 * MiB)
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\x22" * 4096, 2 << 20)
    finally:
        os.close(fd)
    try:
        with pytest.raises(CheckpointError, match="after reading it") as e:
            cp.wait_io(gbuf)
        assert e.value.path == path
    finally:
        fw.free_tensor_memory(gbuf, dev)


def test_phx_copier_unchanged_file_still_loads_after_the_checks(data_dir, rng):
    phx_fastsafetensors.register()
    path = os.path.join(data_dir, "m.safetensors")
    sd = _two(rng, path)
    ld = _loader_for(path)
    fb = ld.copy_files_to_device()
    try:
        for k in sd:
            assert raw(fb.get_tensor(k)) == raw(sd[k])
    finally:
        fb.close()
        ld.close()


REPLACED = textwrap.dedent(r"""
    import pickle, sys
    import phx, phx_fastsafetensors
    phx_fastsafetensors.replace()
    from phx_fastsafetensors.copier import PhxCopier
    chunks = []
    real_set_chunk = PhxCopier.set_chunk
    def counting(self, *a, **k):
        chunks.append(1)
        return real_set_chunk(self, *a, **k)
    PhxCopier.set_chunk = counting
    from fastsafetensors import ParallelLoader, SafeTensorsFileLoader
    files, out = sys.argv[1].split(","), sys.argv[2]
    res = {}
    b0 = phx.stats()["bytes_read"]
    ld = SafeTensorsFileLoader(None, "cpu", nogds=True)
    res["copier"] = ld.copier_class.__name__
    ld.add_filenames({0: files})
    fb = ld.copy_files_to_device()
    res["plain"] = {k: fb.get_tensor(k).contiguous().view(-1).view(__import__("torch").uint8)
                    .numpy().tobytes() for k in ld.get_keys()}
    fb.close(); ld.close()
    res["plain_bytes"] = phx.stats()["bytes_read"] - b0
    b0 = phx.stats()["bytes_read"]
    pl = ParallelLoader(None, files, device="cpu", nogds=True, use_tqdm_on_load=False,
                        max_batch_bytes=int(sys.argv[3]))
    res["chunked"] = {k: t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
                      for k, t in pl.iterate_weights()}
    pl.close()
    res["chunked_bytes"] = phx.stats()["bytes_read"] - b0
    res["chunks"] = len(chunks)
    pickle.dump(res, open(out, "wb"))
""")


def test_replace_routes_fastsafetensors_nogds_through_phx(data_dir, tmp_path, rng):
    sd = _state(rng)
    names = sorted(sd)
    files = []
    for s in range(2):
        p = os.path.join(data_dir, f"m{s}.safetensors")
        st.save_file({k: sd[k] for k in names[s::2]}, p)
        files.append(p)
    out = tmp_path / "r.pkl"
    r = subprocess.run([sys.executable, "-c", REPLACED, ",".join(files), str(out),
                        str(3 * MiB + 64 * 1024)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    res = pickle.load(open(out, "rb"))
    assert res["copier"] == "PhxCopier"
    assert res["chunks"] > 2, res["chunks"]        # sub-file chunks were planned
    total = sum(os.path.getsize(f) for f in files)
    for form in ("plain", "chunked"):
        assert sorted(res[form]) == names, form
        for k in names:
            assert res[form][k] == raw(sd[k]), (form, k)
        assert res[f"{form}_bytes"] >= total - 2 * 8192, (form, res[f"{form}_bytes"], total)


def test_without_fastsafetensors_import_works_register_says_why():
    """Importing the adapter never needs fastsafetensors; using it without
    says what is missing (fastsafetensors hidden from a fresh interpreter)."""
    code = textwrap.dedent(r"""
        import sys
        sys.modules["fastsafetensors"] = None        # as if not installed
        import phx_fastsafetensors
        try:
            phx_fastsafetensors.register()
        except ImportError as e:
            print("ERR", e)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ERR phx_fastsafetensors: fastsafetensors is not installed" in r.stdout, r.stdout
    assert "pip install" in r.stdout
