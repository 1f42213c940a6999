"""One phx process feeding several GPUs (issue 15), against the fake libcuda.

Only single-GPU machines are lent to the project, so the several-device code
paths are tested on ``tests/gpu_fake/fake_cuda.c`` with FAKE_CUDA_DEVICES=N:
each fake device has its primary context, allocations know their device,
and work queued on a stream of another device's context fails there (see
the fake's header).  In one process: a ``phx.gpu`` context per device,
several threads per device reading random file bytes at unaligned sizes and
offsets into that device's buffers at once, every byte compared with the
file, each device's bytes counted by that device's context only, and each
context's staging bound to its device's NUMA node through a fake sysfs
(PHX_TEST_SYSFS_ROOT, a test hook of libphx).  What a real multi-GPU host
adds (peer traffic, PCIe placement, the bandwidth) is not tested here.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest





def _fake_sysfs(root, ndev: int) -> list[int]:
    """Two NUMA nodes; device 0 on node 0, device 1 says -1 (as firmware
    that does not know), the others have no numa_node file.  Returns the
    node each device's staging must be bound to on this machine."""
    node_dir = os.path.join(root, "devices", "system", "node")
    os.makedirs(node_dir)
    with open(os.path.join(node_dir, "online"), "w") as f:
        f.write("0-1\n")
    for dev, text in ((0, "0\n"), (1, "-1\n")):
        d = os.path.join(root, "bus", "pci", "devices", f"0000:{0x1b + 0x10 * dev:02x}:00.0")
        os.makedirs(d)
        with open(os.path.join(d, "numa_node"), "w") as f:
            f.write(text)
    return [0] + [-1] * (ndev - 1)


MULTI = textwrap.dedent(r"""
    import ctypes, errno, json, os, sys, threading
    import numpy as np
    import phx
    import phx.gpu
    from phx._lib import cuda

    lib = ctypes.CDLL("libcuda.so.1")
    assert lib.fake_ctx_retained, "not the fake"
    d, ndev, want_nodes = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    ok, why = phx.gpu.is_available()
    assert ok and why.endswith(f"{ndev} devices"), why

    class DevView:
        # what CuPy or Numba hand phx.gpu: an address, a size, no stream
        def __init__(self, ptr, n):
            self.ptr, self.n = ptr, n
            self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (n,),
                                             "typestr": "|u1", "version": 3,
                                             "stream": None}

        def head(self, n):
            return DevView(self.ptr, n)

        def host(self):
            return np.ctypeslib.as_array((ctypes.c_ubyte * self.n).from_address(self.ptr))

    def dev_alloc(dev, n):
        # cuMemAlloc with the device's primary context current, as an
        # application's allocator does after cudaSetDevice(dev)
        c, p = ctypes.c_void_p(), ctypes.c_uint64()
        assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(c), dev) == 0
        assert lib.cuCtxSetCurrent(c) == 0
        assert lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)) == 0
        assert lib.cuCtxSetCurrent(None) == 0
        assert cuda.pointer_device(p.value) == dev
        return DevView(p.value, n)

    rng = np.random.default_rng(int.from_bytes(os.urandom(8), "little"))
    data = rng.integers(1, 256, 12 << 20 | 4093, dtype=np.uint8)  # never zero
    path = os.path.join(d, "multi.bin")
    data.tofile(path)
    eng = phx.Engine()
    ctxs = [phx.gpu.context(eng, dev, lanes=2, bufs_per_lane=2, buf_size=256 << 10)
            for dev in range(ndev)]
    for dev, ctx in enumerate(ctxs):
        assert ctx.device == dev
        assert ctx.config["staging_node"] == want_nodes[dev], (dev, ctx.config)
        assert cuda.device_numa_node(dev) == want_nodes[dev], dev
    THREADS, ROUNDS, CHUNKS = 3, 6, 40
    bufs = {(dev, t): dev_alloc(dev, CHUNKS * 70000 + 4096)
            for dev in range(ndev) for t in range(THREADS)}
    for b in bufs.values():
        # marks every device byte not yet written by phx: read data is never 0
        b.host()[:] = 0
    moved = {dev: 0 for dev in range(ndev)}
    lock = threading.Lock()
    errors = []
    f = phx.open(path, "r", engine=eng)
    start = threading.Barrier(ndev * THREADS)

    def feed(dev, t, seed):
        r = np.random.default_rng(seed)
        b = bufs[(dev, t)]
        try:
            start.wait()
            for k in range(ROUNDS):
                h = b.host()
                h[:] = 0
                if k % 3 == 2:
                    # one synchronous read of an unaligned range
                    n = int(r.integers(1, 2 << 20))
                    fo = int(r.integers(0, len(data) - n))
                    got = phx.gpu.pread(b.head(n), f, fo)
                    assert got == n, (dev, t, k, got, n)
                    assert (h[:n] == data[fo:fo + n]).all(), (dev, t, k)
                    assert not h[n:].any(), (dev, t, k)
                    total = n
                else:
                    sizes = r.integers(1, 70000, CHUNKS)
                    foffs = r.integers(0, len(data) - 70000, CHUNKS)
                    boffs = np.cumsum(np.concatenate([[int(r.integers(0, 4096))],
                                                      sizes[:-1] + 1]))
                    res = phx.gpu.read_chunks(b, f, foffs, boffs, sizes)
                    assert res == [int(s) for s in sizes], (dev, t, k)
                    written = np.zeros(b.n, dtype=bool)
                    for o, s, fo in zip(boffs, sizes, foffs):
                        o, s, fo = int(o), int(s), int(fo)
                        assert (h[o:o + s] == data[fo:fo + s]).all(), (dev, t, k, o)
                        written[o:o + s] = True
                    assert not h[~written].any(), (dev, t, k)
                    total = int(sizes.sum())
                with lock:
                    moved[dev] += total
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append((dev, t, repr(e)))

    th = [threading.Thread(target=feed, args=(dev, t, int(rng.integers(1 << 62))))
          for dev in range(ndev) for t in range(THREADS)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    assert not errors, errors
    for dev in range(ndev):
        st = phx.gpu.stats(eng, device=dev)
        assert st["bytes_read"] == moved[dev], (dev, st["bytes_read"], moved)
        assert st["reads"] == THREADS * (ROUNDS // 3 * 2 * CHUNKS + ROUNDS // 3), (dev, st)
        assert st["h2d_bytes"] >= moved[dev], (dev, st)
    assert phx.gpu.stats(eng)["bytes_read"] == sum(moved.values())
    # device 1's memory handed to device 0's context is refused, not copied
    other = bufs[(ndev - 1, 0)]
    try:
        ctxs[0].pread(f._c_file, other.ptr, 4096, 0)
    except OSError as e:
        assert e.errno == errno.EXDEV, e
    else:
        raise AssertionError("device memory of another device accepted")
    f.close()
    for ctx in ctxs:
        ctx.close()
    print("multi ok", moved)
""")


@pytest.mark.parametrize("ndev", [2, 3])
def test_one_process_feeds_several_devices(fake_cuda, tmp_path, ndev):
    sysfs = tmp_path / "sysfs"
    want = _fake_sysfs(str(sysfs), ndev)
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_cuda), FAKE_CUDA_DEVICES=str(ndev),
               PHX_TEST_SYSFS_ROOT=str(sysfs))
    for k in ("PHX_CUDA_DEVICE", "FAKE_CUDA_NO_BATCH", "FAKE_CUDA_NO_MEMOPS"):
        env.pop(k, None)
    import json
    r = subprocess.run([sys.executable, "-c", MULTI, str(tmp_path), str(ndev), json.dumps(want)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "multi ok" in r.stdout


INFO = textwrap.dedent(r"""
    import json, phx
    print(json.dumps(phx.info()["cuda"]["devices"]))
""")


def test_info_lists_each_devices_numa_node(fake_cuda, tmp_path):
    """``phx info`` names each device's NUMA node (where its staging goes)."""
    sysfs = tmp_path / "sysfs"
    _fake_sysfs(str(sysfs), 3)
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_cuda), FAKE_CUDA_DEVICES="3",
               PHX_TEST_SYSFS_ROOT=str(sysfs))
    r = subprocess.run([sys.executable, "-c", INFO], env=env, capture_output=True, text=True,
                       timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    import json
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [
        {"device": 0, "numa_node": 0}, {"device": 1, "numa_node": -1},
        {"device": 2, "numa_node": -1}]
