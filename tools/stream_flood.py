"""Many stream-ordered ops queued on one stream before the first runs (the
seed-scale LMCache replay queues ~1,600 stores at once): writes, then reads
of the same bytes, checked.

python3 tools/stream_flood.py FILE [--ops N] [--chunk BYTES] [--distinct K]
"""
import argparse
import os
import time

import numpy as np
import torch

import phx
import phx.gpu as pg


def main():
    p = argparse.ArgumentParser()
    p.add_argument("file")
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--chunk", type=int, default=4 << 20)
    p.add_argument("--distinct", type=int, default=64, help="source chunks in GPU memory")
    a = p.parse_args()
    n, ch, k = a.ops, a.chunk, a.distinct
    with open(a.file, "wb") as f:
        f.truncate(n * ch)
    src = torch.randint(0, 256, (k, ch), dtype=torch.uint8, device="cuda")
    dst = torch.zeros((n, ch), dtype=torch.uint8, device="cuda")
    eng = phx.Engine()
    ctx = pg.context(eng, 0, _new=True)
    s = torch.cuda.Stream()
    wargs = [np.array([ch, i * ch, (i % k) * ch, -1], dtype=np.int64) for i in range(n)]
    rargs = [np.array([ch, i * ch, i * ch, -1], dtype=np.int64) for i in range(n)]
    with phx.open(a.file, "r+", engine=eng) as f:
        t0 = time.perf_counter()
        for w in wargs:
            ctx.stream_deferred(f._c_file, src.data_ptr(), w.ctypes.data, True, s.cuda_stream)
        tq = time.perf_counter() - t0
        s.synchronize()
        tw = time.perf_counter() - t0
        print(f"writes: {n} x {ch} queued in {tq:.2f} s, done in {tw:.2f} s "
              f"({n * ch / tw / 1e9:.2f} GB/s); bad results {sum(int(w[3]) != ch for w in wargs)}",
              flush=True)
        t0 = time.perf_counter()
        for r in rargs:
            ctx.stream_deferred(f._c_file, dst.data_ptr(), r.ctypes.data, False, s.cuda_stream)
        s.synchronize()
        tr = time.perf_counter() - t0
        print(f"reads: done in {tr:.2f} s ({n * ch / tr / 1e9:.2f} GB/s); bad results "
              f"{sum(int(r[3]) != ch for r in rargs)}", flush=True)
    idx = torch.arange(n, device="cuda") % k
    wrong = int((dst != src[idx]).any(dim=1).sum())
    print(f"chunks differing from what was written: {wrong} of {n}", flush=True)
    ctx.close()
    os.unlink(a.file)


if __name__ == "__main__":
    main()
