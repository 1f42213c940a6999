"""libphxfile.so under LMCache's own GDS code on a real GPU (the H200 box).

LMCache's ``GDSContext`` with its ``phx`` backend (initialize,
register_gpu_buffer, transfer_async both ways, close) moving random Llama-
shaped KV chunks through the slab byte-exact; a kernel queued after a read
sees the data; several threads on their own streams at once; a slab on a
small filesystem (ENOSPC), a closed fd and an unregistered buffer, each a
clear -errno with nothing corrupted; close with I/O in flight.  Skipped
without torch+CUDA or lmcache (see adapters/lmcache/tools/lmcache-deps.sh).
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "adapters", "lmcache", "tests"))
import support  # noqa: E402

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no usable GPU: torch sees no CUDA device", allow_module_level=True)
if support.lmcache_site() is None:
    pytest.skip(f"lmcache not installed: {support.INSTALL_HINT}", allow_module_level=True)
if support.lmcache_site():
    sys.path.insert(0, support.lmcache_site())
try:
    from lmcache.v1.distributed.config import GdsL1Config
    from lmcache.v1.gpu_connector.gds_backends import phx as lmphx
    from lmcache.v1.gpu_connector.gds_context import GDSContext, SlabDirection
except Exception as e:  # noqa: BLE001
    pytest.skip(f"lmcache's GDS modules do not import: {e}", allow_module_level=True)

import phx_lmcache  # noqa: E402
from phx.bench._lmcache_methods import _memory_obj  # noqa: E402

MiB = 1 << 20
SHAPE = (2, 32, 64, 1024)             # Llama-3-8B KV, 64 tokens: 8 MiB (bf16)
CHUNK = 2 * 32 * 64 * 1024 * 2


def _dir(tmp_path) -> str:
    base = os.environ.get("PHX_TEST_DIR")
    if base:
        d = os.path.join(base, tmp_path.name)
        os.makedirs(d, exist_ok=True)
        return d
    return str(tmp_path)


def _ctx(where: str, size: int) -> GDSContext:
    ctx = GDSContext()
    ctx.initialize(GdsL1Config(file_location=where, size_in_bytes=size, use_direct_io=True,
                               backend="phx"))
    return ctx


def _random(nbytes: int, seed: int):
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)


def _last_sub(ctx, stream=None):
    raw = (stream or torch.cuda.current_stream()).cuda_stream
    st = ctx._submissions[raw]
    return st.uncommitted[-1] if st.uncommitted else st.inflight[-1][1][-1]


def test_gdscontext_roundtrip_byte_exact(tmp_path):
    before = phx_lmcache.stats()
    n = 12
    ctx = _ctx(_dir(tmp_path), n * CHUNK + 64 * MiB)
    src = _random(n * CHUNK, 1)
    dst = torch.zeros(n * CHUNK, dtype=torch.uint8, device="cuda")
    ctx.register_gpu_buffer(src)      # regions of at most 16 MiB
    ctx.register_gpu_buffer(dst)
    order = torch.randperm(n).tolist()
    for i in range(n):                # chunk i to slab slot order[i]
        ctx.transfer_async(_memory_obj(order[i] * CHUNK + 4096, CHUNK, SHAPE),
                           src[i * CHUNK:(i + 1) * CHUNK], SlabDirection.WRITE)
    for i in range(n):
        ctx.transfer_async(_memory_obj(order[i] * CHUNK + 4096, CHUNK, SHAPE),
                           dst[i * CHUNK:(i + 1) * CHUNK], SlabDirection.READ)
    torch.cuda.synchronize()
    assert torch.equal(src, dst)
    st = phx_lmcache.stats()
    assert st["path"] in ("staging", "direct")
    assert st["failures"] == before["failures"]
    ctx.deregister_gpu_buffer(src)
    ctx.deregister_gpu_buffer(dst)
    ctx.close()
    assert phx_lmcache.stats()["handles"] == 0


def test_kernel_after_read_sees_data(tmp_path):
    ctx = _ctx(_dir(tmp_path), 64 * MiB)
    src = _random(CHUNK, 2)
    ctx.register_gpu_buffer(src)
    ctx.transfer_async(_memory_obj(0, CHUNK, SHAPE), src, SlabDirection.WRITE)
    torch.cuda.synchronize()
    want = int(src.view(torch.int64).sum())
    dst = torch.zeros(CHUNK, dtype=torch.uint8, device="cuda")
    ctx.register_gpu_buffer(dst)
    for _ in range(5):
        dst.zero_()
        torch.cuda._sleep(50_000_000)     # the stream is busy when the read is queued
        ctx.transfer_async(_memory_obj(0, CHUNK, SHAPE), dst, SlabDirection.READ)
        got = dst.view(torch.int64).sum()  # queued after it, no synchronisation
        assert int(got) == want
    ctx.deregister_gpu_buffer(src)
    ctx.deregister_gpu_buffer(dst)
    ctx.close()


def test_threads_and_streams(tmp_path):
    ctx = _ctx(_dir(tmp_path), 8 * 4 * CHUNK)
    errors: list[str] = []
    bufs = []

    def worker(k: int) -> None:
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                src = _random(4 * CHUNK, 10 + k)
                dst = torch.zeros_like(src)
                ctx.register_gpu_buffer(src)
                ctx.register_gpu_buffer(dst)
                bufs.append((src, dst))
                for rep in range(3):
                    for i in range(4):
                        off = (k * 4 + i) * CHUNK
                        ctx.transfer_async(_memory_obj(off, CHUNK, SHAPE),
                                           src[i * CHUNK:(i + 1) * CHUNK], SlabDirection.WRITE)
                        ctx.transfer_async(_memory_obj(off, CHUNK, SHAPE),
                                           dst[i * CHUNK:(i + 1) * CHUNK], SlabDirection.READ)
                    s.synchronize()
                    if not torch.equal(src, dst):
                        errors.append(f"thread {k} repeat {rep}: bytes differ")
                    dst.zero_()
                ctx.deregister_gpu_buffer(src)
                ctx.deregister_gpu_buffer(dst)
        except Exception as e:  # noqa: BLE001
            errors.append(f"thread {k}: {e!r}")

    th = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    ctx.close()
    assert not errors, errors


@pytest.fixture
def small_fs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    d = tmp_path / "small"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64M", "tmpfs", str(d)]).returncode:
        pytest.skip("cannot mount tmpfs")
    yield str(d)
    subprocess.run(["umount", str(d)])


def test_slab_on_small_filesystem(small_fs):
    """A slab that does not fit fails at initialize with ENOSPC; a write past
    a fitting slab on a full filesystem is -ENOSPC in bytes_done, counted,
    and the slab's data stays intact."""
    with pytest.raises(OSError) as ei:
        _ctx(os.path.join(small_fs, "big"), 256 * MiB)
    assert ei.value.errno == errno.ENOSPC
    ctx = _ctx(os.path.join(small_fs, "ok"), 2 * CHUNK)
    src = _random(CHUNK, 3)
    ctx.register_gpu_buffer(src)
    ctx.transfer_async(_memory_obj(0, CHUNK, SHAPE), src, SlabDirection.WRITE)
    torch.cuda.synchronize()
    with open(os.path.join(small_fs, "filler"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * MiB)
                f.flush()
        except OSError:
            pass
    before = phx_lmcache.stats()["failures"]
    ctx.transfer_async(_memory_obj(16 * CHUNK, CHUNK, SHAPE), src, SlabDirection.WRITE)
    torch.cuda.synchronize()
    assert _last_sub(ctx).bytes_done == -errno.ENOSPC
    assert phx_lmcache.stats()["failures"] == before + 1
    dst = torch.zeros_like(src)
    ctx.register_gpu_buffer(dst)
    ctx.transfer_async(_memory_obj(0, CHUNK, SHAPE), dst, SlabDirection.READ)
    torch.cuda.synchronize()
    assert torch.equal(src, dst)
    ctx.deregister_gpu_buffer(src)
    ctx.deregister_gpu_buffer(dst)
    ctx.close()


def test_closed_fd_and_unregistered_buffer(tmp_path):
    be = lmphx.Backend()
    path = os.path.join(_dir(tmp_path), "f.bin")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    os.posix_fallocate(fd, 0, 4 * CHUNK)
    os.close(fd)
    with pytest.raises(RuntimeError, match=f"rc={-errno.EBADF}"):
        be.register_handle(fd)
    h = be.open_handle(os.open(path, os.O_RDWR | os.O_DIRECT), path)
    src = _random(CHUNK, 4)                      # never registered
    dst = torch.zeros_like(src)
    u0 = phx_lmcache.stats()["unregistered_ops"]
    s = torch.cuda.current_stream().cuda_stream
    w = h.write_async(src.data_ptr(), CHUNK, 0, 0, s)
    r = h.read_async(dst.data_ptr(), CHUNK, 0, 0, s)
    torch.cuda.synchronize()
    assert (w.bytes_done, r.bytes_done) == (CHUNK, CHUNK)
    assert torch.equal(src, dst)
    assert phx_lmcache.stats()["unregistered_ops"] == u0 + 2
    host = torch.zeros(CHUNK, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=f"rc={-errno.EINVAL}"):
        h.read_async(host.data_ptr(), CHUNK, 0, 0, s)
    h.close()
    be.close_driver()


def test_close_with_io_in_flight(tmp_path):
    """Closing the slab handle with transfers still queued waits for them."""
    be = lmphx.Backend()
    path = os.path.join(_dir(tmp_path), "g.bin")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    os.posix_fallocate(fd, 0, 8 * CHUNK)
    os.close(fd)
    h = be.open_handle(os.open(path, os.O_RDWR | os.O_DIRECT), path)
    src = _random(8 * CHUNK, 5)
    s = torch.cuda.current_stream().cuda_stream
    torch.cuda._sleep(200_000_000)
    subs = [h.write_async(src.data_ptr(), CHUNK, i * CHUNK, i * CHUNK, s) for i in range(8)]
    h.close()                                    # phxFileHandleDeregister: waits
    assert [x.bytes_done for x in subs] == [CHUNK] * 8
    assert phx_lmcache.stats()["inflight"] == 0
    torch.cuda.synchronize()
    import numpy as np
    got = np.fromfile(path, dtype=np.uint8, count=8 * CHUNK)
    assert (got == src.cpu().numpy()).all()
    be.close_driver()
