"""``phx info``: what this machine offers phx, and why a path is unavailable.

Every entry carries ``available`` and a ``reason`` a person can act on.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import resource
import tempfile
from typing import Any

import phx
from phx.cgroup import read_text


def _io_uring() -> dict[str, Any]:
    try:
        eng = phx.Engine(queue_depth=4, backend="uring")
    except OSError as e:
        disabled = read_text("/proc/sys/kernel/io_uring_disabled")
        why = str(e)
        if disabled and disabled != "0":
            why += f" (sysctl kernel.io_uring_disabled = {disabled})"
        return {"available": False, "reason": why}
    feats = eng.features
    eng.close()
    return {"available": True, "reason": "io_uring_setup succeeded", **feats}


def _engine() -> dict[str, Any]:
    """The backend an engine gets here (PHX_ENGINE honoured), why, and each
    backend's availability (libphx's table, phx_backend_check)."""
    from phx._lib.engine import backends
    out: dict[str, Any] = {"backends": backends()}
    try:
        eng = phx.Engine(queue_depth=4)
    except (OSError, ValueError) as e:
        return {"available": False, "reason": str(e), **out}
    out = {"available": True, "backend": eng.backend, "reason": eng.backend_reason, **out}
    out["live_counters"] = _live_counters()
    eng.close()
    return out


def _live_counters() -> str:
    """Where this process's engines publish their counters (phx stats / top),
    or why they do not (asked while an engine is open)."""
    from phx._lib.engine import stats_path, stats_path_reason
    path = stats_path()
    return f"published in {os.path.dirname(path)} (phx stats, phx top)" if path else \
        stats_path_reason()


def _fs_type(path: str) -> str:
    best, fstype = "", "?"
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype


def _direct(path: str) -> dict[str, Any]:
    """Open a file at (or in) ``path`` with O_DIRECT and report its alignment."""
    out: dict[str, Any] = {"path": os.path.abspath(path), "filesystem": _fs_type(path)}
    tmp = None
    try:
        if os.path.isdir(path):
            fd, tmp = tempfile.mkstemp(prefix=".phx-info-", dir=path)
            os.close(fd)
            target = tmp
        else:
            target = path
        with phx.open(target, "r") as f:
            out.update(available=True, mem_align=f.mem_align, offset_align=f.offset_align,
                       alignment_source="statx(STATX_DIOALIGN)" if f.align_from_statx
                       else "default 4096 (kernel did not report STATX_DIOALIGN)",
                       reason="O_DIRECT open succeeded")
    except OSError as e:
        out.update(available=False, reason=f"O_DIRECT open failed: {e.strerror}"
                   + (" (filesystem does not support O_DIRECT; phx would need direct=False)"
                      if e.errno == 22 else ""))
    finally:
        if tmp:
            os.unlink(tmp)
    return out


def _cuda_devices() -> list[dict[str, Any]]:
    """Each CUDA device's NUMA node: where a context's staging is bound on a
    machine of several nodes (-1: the firmware does not say; not bound)."""
    try:
        from phx._lib import cuda
    except ImportError:
        return []
    out = []
    for dev in range(64):
        try:
            node = cuda.device_numa_node(dev)
        except OSError:
            break
        out.append({"device": dev, "numa_node": node})
    return out


def _cuda() -> dict[str, Any]:
    try:
        from phx import gpu
    except ImportError:
        return _no_gpu_path()
    if hasattr(gpu, "is_available"):
        ok, why = gpu.is_available()
        out: dict[str, Any] = {"available": bool(ok), "reason": why}
        if ok:
            try:
                from phx import tune
                out["staging"] = tune.explain(0)
            except Exception as e:  # noqa: BLE001 - info must not fail on it
                out["staging"] = {"error": str(e)}
            out["devices"] = _cuda_devices()
            try:
                sok, swhy = gpu.stream_ops_status(0)
                out["stream_ops"] = {"available": sok, "reason": swhy}
            except Exception as e:  # noqa: BLE001 - info must not fail on it
                out["stream_ops"] = {"available": False, "reason": str(e)}
        return out
    return _no_gpu_path()


def _no_gpu_path() -> dict[str, Any]:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return {"available": False, "reason": f"no CUDA driver: {e}"}
    return {"available": False, "reason": "libcuda.so.1 loads, but this build has no GPU path"}


def _module() -> dict[str, Any]:
    from phx import devmem
    ok, why = devmem.available()
    if ok:
        return {"loaded": True, "reason": why + ": device memory can take the direct path"}
    if read_text("/proc/sys/kernel/modules_disabled") == "1":
        why += "; kernel.modules_disabled = 1 here, so no module can be loaded"
    elif "nomodule" in (read_text("/proc/cmdline") or "").split():
        why += "; this kernel was booted with 'nomodule'"
    return {"loaded": False, "reason": why + "; GPU data goes through pinned bounce buffers"}


def _cgroup() -> dict[str, Any]:
    """The process's own memory cgroup, v1 or v2, with the tightest limit and
    memory.high up to the root (phx.cgroup: the reader phx.kv uses too)."""
    from phx import cgroup
    return cgroup.info()


def _nvme() -> list[dict[str, Any]]:
    import phx.nvme
    return phx.nvme.probe()


def gather(path: str | os.PathLike[str] = ".") -> dict[str, Any]:
    """Everything ``phx info`` reports, as a dict."""
    ml = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    info: dict[str, Any] = {
        "phx": phx.__version__,
        "kernel": platform.release(),
        "io_uring": _io_uring(),
        "engine": _engine(),
        "o_direct": _direct(os.fspath(path)),
        "cuda": _cuda(),
        "kernel_module": _module(),
        "memlock_limit": "unlimited" if ml[0] == resource.RLIM_INFINITY else ml[0],
        "cgroup": _cgroup(),
        "nvme_namespaces": _nvme(),
    }
    eng = {"uring": "io_uring", "threads": "thread pool (preadv2/pwritev2)"}.get(
        info["engine"].get("backend"))
    if eng is None:
        info["host_path"] = "none: " + info["engine"]["reason"]
    elif info["o_direct"]["available"]:
        info["host_path"] = f"{eng} + O_DIRECT (page cache bypassed)"
    else:
        info["host_path"] = f"{eng}, buffered (this filesystem refuses O_DIRECT)"
    if info["kernel_module"]["loaded"]:
        info["gpu_path"] = "direct via /dev/phx"
    elif info["cuda"]["available"]:
        info["gpu_path"] = "pinned bounce buffers (Co-DMA pipeline)"
    else:
        info["gpu_path"] = "none: " + info["cuda"]["reason"]
    return info


def _print(d: dict[str, Any], indent: int = 0) -> None:
    for k, v in d.items():
        if isinstance(v, dict):
            print(" " * indent + f"{k}:")
            _print(v, indent + 2)
        else:
            print(" " * indent + f"{k}: {v}")


def main(args: argparse.Namespace) -> int:
    """The ``phx info`` command."""
    d = gather(args.path)
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        _print(d)
    return 0
