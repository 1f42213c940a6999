"""Adaptive pipeline parallelism between storage reads and the copy ("GPU DMA").

Copy threads each own one relay (:mod:`phx.kv.codma`: the paper's pinned
per-thread buffer, shared by the storage read and the GPU DMA: Co-DMA).  A job is
"read a range from storage into my relay, then copy it to its destination" (for a
CUDA destination an H2D copy on the relay's stream, waited for, so the probe times
real copy work).  Two ways to overlap two threads:

- Overlap-Intra: the threads' storage reads run in parallel; copies are serialised.
- Overlap-Cross: storage reads are taken in turn (thread 2's read starts when thread
  1's read ends, i.e. while thread 1 copies), so each read overlaps the other
  thread's copy instead of competing for the device.

Strategy selection over decode iterations (:meth:`AdaptivePipeline.begin_step`):
iteration 1 runs Overlap-Intra unmeasured (cold cache), iteration 2 runs
Overlap-Intra and iteration 3 Overlap-Cross, each timed; the one with the higher
throughput (bytes / busy time) is locked for every later iteration.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from phx.kv.codma import RelayPool

INTRA = "overlap-intra"
CROSS = "overlap-cross"
STRATEGIES = (INTRA, CROSS)


@dataclass
class CopyJob:
    """``read(relay) -> bytes`` fills the relay buffer; ``dma(relay, nbytes)`` consumes it."""
    read: Callable[[np.ndarray], int]
    dma: Callable[[np.ndarray, int], None]


class AdaptivePipeline:
    """Runs batches of :class:`CopyJob` on ``threads`` copy threads.

    Args:
        relay_bytes: size of each thread's relay buffer (>= the largest read);
            ignored when ``relays`` is given.
        threads: copy threads (2 in the paper's probe).
        relays: a :class:`~phx.kv.codma.RelayPool` (e.g. ``store.relays(device)``)
            whose first ``threads`` relays the threads use; each thread's relay is
            bound to it while it runs jobs (``pool.current()``).  Default: host
            relays of ``relay_bytes`` made here.
        strategy: force one strategy (no probing) when given.
        delay_hook: ``hook(strategy, thread, job_index)`` called just before every
            storage read (tests use it to slow one strategy down).
    """

    def __init__(self, relay_bytes: int = 0, threads: int = 2, strategy: str | None = None,
                 delay_hook: Callable[[str, int, int], None] | None = None,
                 relays: "RelayPool | None" = None):
        if threads < 1:
            raise ValueError("threads must be >= 1")
        if strategy is not None and strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}")
        self._own_pool = relays is None
        if relays is None:
            relays = RelayPool(threads, relay_bytes)
        elif len(relays.relays) < threads:
            raise ValueError(f"{threads} copy threads need {threads} relays, the pool "
                             f"has {len(relays.relays)}")
        self.pool = relays
        self.threads = threads
        self.relays = [r.buf for r in relays.relays[:threads]]
        self.relay_bytes = relays.nbytes
        self.forced = strategy
        self.locked: str | None = strategy
        self.delay_hook = delay_hook
        self.step = 0                      # decode iterations begun
        self.measured: dict[str, dict[str, float]] = {}
        self._strategy = strategy or INTRA
        self._busy = 0.0
        self._bytes = 0
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="phx-kv-copy")

    @property
    def pinned_bytes(self) -> int:
        return self.threads * self.relay_bytes

    @property
    def strategy(self) -> str:
        """The strategy the current iteration runs."""
        return self._strategy

    def begin_step(self) -> str:
        """Start a decode iteration; returns the strategy it will run."""
        self.step += 1
        self._busy, self._bytes = 0.0, 0
        if self.locked is not None:
            self._strategy = self.locked
        elif self.step == 3:
            self._strategy = CROSS
        else:
            self._strategy = INTRA
        return self._strategy

    def end_step(self) -> None:
        """Finish an iteration; after iteration 3 the faster strategy is locked."""
        if self.locked is not None or self.step not in (2, 3):
            return
        self.measured[self._strategy] = {
            "seconds": self._busy, "bytes": self._bytes,
            "gbps": self._bytes / self._busy / 1e9 if self._busy > 0 else 0.0,
        }
        if self.step == 3:
            intra = self.measured[INTRA]["gbps"]
            cross = self.measured[CROSS]["gbps"]
            self.locked = CROSS if cross > intra else INTRA

    def run(self, jobs: Sequence[CopyJob]) -> int:
        """Run ``jobs`` (e.g. one layer's K and V) with this iteration's strategy."""
        t0 = time.perf_counter()
        n = self.threads
        state = _RunState(self._strategy)
        futs = [self._pool.submit(self._worker, i, list(range(i, len(jobs), n)), jobs, state)
                for i in range(min(n, len(jobs)))]
        total = 0
        err = None
        for f in futs:
            try:
                total += f.result()
            except BaseException as e:      # keep waiting for the others
                # the first real failure wins over the peers it released
                if err is None or (isinstance(err, _PeerFailed)
                                   and not isinstance(e, _PeerFailed)):
                    err = e
        if err is not None:
            raise err
        self._busy += time.perf_counter() - t0
        self._bytes += total
        return total

    def _worker(self, tidx: int, idxs: list[int], jobs: Sequence[CopyJob], st: "_RunState") -> int:
        try:
            return self._jobs(tidx, idxs, jobs, st)
        except BaseException:
            # any failure (storage read or DMA) releases the other threads: under
            # Overlap-Cross they may be waiting for a read turn this thread owns
            with st.cond:
                st.failed = True
                st.cond.notify_all()
            raise

    def _jobs(self, tidx: int, idxs: list[int], jobs: Sequence[CopyJob], st: "_RunState") -> int:
        with self.pool.bind(self.pool.relays[tidx]):
            return self._jobs_bound(tidx, idxs, jobs, st)

    def _jobs_bound(self, tidx: int, idxs: list[int], jobs: Sequence[CopyJob],
                    st: "_RunState") -> int:
        relay = self.relays[tidx]
        total = 0
        for k in idxs:
            if st.strategy == CROSS:
                with st.cond:
                    while st.next_read != k and not st.failed:
                        st.cond.wait()
                    if st.failed:
                        raise _PeerFailed("another copy job of this batch failed")
                if self.delay_hook:
                    self.delay_hook(st.strategy, tidx, k)
                nb = jobs[k].read(relay)
                with st.cond:
                    st.next_read = k + 1
                    st.cond.notify_all()
            else:
                if self.delay_hook:
                    self.delay_hook(st.strategy, tidx, k)
                nb = jobs[k].read(relay)
            with st.dma_lock:
                jobs[k].dma(relay, nb)
            total += nb
        return total

    def report(self) -> dict[str, Any]:
        return {"choice": self.locked, "forced": self.forced is not None,
                "probe": self.measured, "threads": self.threads,
                "relays": self.pool.stats()}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._own_pool:
            self.pool.close()

    def __enter__(self) -> "AdaptivePipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _PeerFailed(RuntimeError):
    """A copy thread gave up because another thread of its batch failed."""


class _RunState:
    def __init__(self, strategy: str):
        self.strategy = strategy
        self.dma_lock = threading.Lock()
        self.cond = threading.Condition()
        self.next_read = 0
        self.failed = False
