#!/usr/bin/env python3
"""Why LMCache's cufile backend does not start on the GPU box (issue 23).

On the H200 box LMCache 0.5.6's ``cufile`` GDS backend failed at its first
step, ``cuFileHandleRegister failed (cuFile err=5027, cuda_err=0)``: 5027 is
``CU_FILE_HANDLE_NOT_REGISTERED`` in cufile.h's ``CUfileOpError``, an odd
answer from the call that registers a handle.  This tool answers, in one
device call, what that box's cuFile does and why:

* which libcufile a process loads (``cufile-python`` opens the unversioned
  ``libcufile.so``; torch's CUDA wheels bring ``libcufile.so.0``), its
  version, and every libcufile mapped into the process;
* for each configuration - cuFile's defaults, a ``cufile.json`` that allows
  compatibility mode, and ``CUFILE_FORCE_COMPAT_MODE`` - and each directory
  (zram, disk), with and without ``O_DIRECT``: ``cuFileDriverOpen``,
  ``cuFileHandleRegister``, ``cuFileBufRegister`` and a 1 MiB read and write
  through cuFile, both checked byte for byte against the file on fresh random
  data;
* LMCache's own backend (``Backend().open_slab``) under the same settings.

Each trial runs in a process of its own (cuFile reads its configuration
once per process) with cuFile's log at TRACE level; every log is kept in
OUTDIR with ``cufile-diag.json`` and a table on stdout.

    python3 tools/cufile_diag.py OUTDIR --dir zram=/mnt/zram --dir disk=/var/tmp/x

Written on a machine without a GPU or libcufile: there it only reports that
libcufile cannot be loaded.  Not yet run on the GPU box.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import subprocess
import sys
from typing import Any

MiB = 1 << 20
FILE_BYTES = 8 * MiB
#: configuration name -> (cufile.json properties, extra environment)
CONFIGS: dict[str, tuple[dict | None, dict[str, str]]] = {
    "default": (None, {}),
    "compat-json": ({"allow_compat_mode": True}, {}),
    "force-compat": ({"allow_compat_mode": True}, {"CUFILE_FORCE_COMPAT_MODE": "true"}),
}


class CUfileError(ctypes.Structure):
    _fields_ = [("err", ctypes.c_int), ("cu_err", ctypes.c_int)]


class _Handle(ctypes.Union):
    _fields_ = [("fd", ctypes.c_int), ("handle", ctypes.c_void_p)]


class CUfileDescr(ctypes.Structure):
    # cufile.h: CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1
    _fields_ = [("type", ctypes.c_int), ("handle", _Handle), ("fs_ops", ctypes.c_void_p)]


def load_libcufile() -> tuple[Any, str]:
    """libcufile as cufile-python loads it (``libcufile.so``), else the
    versioned name, else torch's wheel copy; (library, how it was found)."""
    tried = []
    names = ["libcufile.so", "libcufile.so.0"]
    try:
        import nvidia.cufile  # type: ignore[import-not-found]  # torch's CUDA wheels
        for d in nvidia.cufile.__path__:
            names.append(os.path.join(d, "lib", "libcufile.so.0"))
    except ImportError:
        pass
    for n in names:
        try:
            return ctypes.CDLL(n), n
        except OSError as e:
            tried.append(f"{n}: {e}")
    raise OSError("libcufile not loadable: " + "; ".join(tried))


def mapped_libcufile() -> list[str]:
    """Every libcufile file mapped into this process (two copies is a finding)."""
    out = set()
    with open("/proc/self/maps") as f:
        for line in f:
            p = line.split()[-1]
            if "libcufile" in p:
                out.add(os.path.realpath(p))
    return sorted(out)


def _err(e: CUfileError) -> dict[str, int]:
    return {"err": e.err, "cu_err": e.cu_err}


def raw_trial(lib: Any, path: str, direct: bool) -> dict[str, Any]:
    """cuFile's own calls on ``path``: open, register, read and write 1 MiB,
    each checked against the file."""
    import torch
    lib.cuFileDriverOpen.restype = CUfileError
    lib.cuFileHandleRegister.restype = CUfileError
    lib.cuFileHandleRegister.argtypes = [ctypes.POINTER(ctypes.c_void_p),
                                         ctypes.POINTER(CUfileDescr)]
    lib.cuFileHandleDeregister.argtypes = [ctypes.c_void_p]
    lib.cuFileBufRegister.restype = CUfileError
    lib.cuFileBufRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.cuFileBufDeregister.restype = CUfileError
    lib.cuFileBufDeregister.argtypes = [ctypes.c_void_p]
    for fn in (lib.cuFileRead, lib.cuFileWrite):
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64,
                       ctypes.c_int64]
    res: dict[str, Any] = {}
    torch.cuda.init()
    buf = torch.empty(MiB, dtype=torch.uint8, device="cuda")
    res["driver_open"] = _err(lib.cuFileDriverOpen())
    fd = os.open(path, os.O_RDWR | (os.O_DIRECT if direct else 0))
    try:
        descr = CUfileDescr(type=1, handle=_Handle(fd=fd))
        h = ctypes.c_void_p()
        res["handle_register"] = _err(lib.cuFileHandleRegister(ctypes.byref(h),
                                                               ctypes.byref(descr)))
        if res["handle_register"]["err"]:
            return res
        try:
            res["buf_register"] = _err(lib.cuFileBufRegister(buf.data_ptr(), MiB, 0))
            n = lib.cuFileRead(h, buf.data_ptr(), MiB, 4096, 0)
            with open(path, "rb") as f:
                f.seek(4096)
                want = f.read(MiB)
            res["read"] = {"ret": n, "exact": n == MiB and bytes(buf.cpu().numpy()) == want}
            new = os.urandom(MiB)
            buf.copy_(torch.frombuffer(bytearray(new), dtype=torch.uint8))
            torch.cuda.synchronize()
            n = lib.cuFileWrite(h, buf.data_ptr(), MiB, 2 * MiB, 0)
            with open(path, "rb") as f:
                f.seek(2 * MiB)
                res["write"] = {"ret": n, "exact": n == MiB and f.read(MiB) == new}
            if not res["buf_register"]["err"]:
                lib.cuFileBufDeregister(buf.data_ptr())
        finally:
            lib.cuFileHandleDeregister(h)
    finally:
        os.close(fd)
    return res


def lmcache_trial(directory: str, direct: bool) -> dict[str, Any]:
    """LMCache 0.5.6's own cufile backend making its slab, as GDSContext does."""
    try:
        from lmcache.v1.gpu_connector.gds_backends.cufile import Backend
    except Exception as e:  # noqa: BLE001 - reported
        return {"error": f"import: {type(e).__name__}: {e}"}
    try:
        h = Backend().open_slab(os.path.join(directory, "lmcache-cufile"), 64 * MiB, direct)
    except Exception as e:  # noqa: BLE001 - this is what the bench saw
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        h.close()
    except Exception as e:  # noqa: BLE001
        return {"opened": True, "close_error": str(e)}
    return {"opened": True}


def child(args: argparse.Namespace) -> None:
    out: dict[str, Any] = {}
    try:
        lib, how = load_libcufile()
    except OSError as e:
        print(json.dumps({"libcufile": None, "error": str(e)}))
        return
    out["libcufile"] = how
    try:
        v = ctypes.c_int()
        lib.cuFileGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cuFileGetVersion.restype = CUfileError
        out["version"] = v.value if not lib.cuFileGetVersion(ctypes.byref(v)).err else None
    except AttributeError:
        out["version"] = "no cuFileGetVersion"
    if args.child == "raw":
        try:
            out.update(raw_trial(lib, args.path, args.direct))
        except Exception as e:  # noqa: BLE001 - reported
            out["error"] = f"{type(e).__name__}: {e}"
    else:
        out.update(lmcache_trial(os.path.dirname(args.path), args.direct))
    out["mapped"] = mapped_libcufile()
    print(json.dumps(out))


def _config_env(outdir: str, name: str, tag: str) -> dict[str, str]:
    props, extra = CONFIGS[name]
    env = dict(os.environ, **extra)
    log = os.path.join(outdir, f"cufile-{tag}.log")
    env["CUFILE_LOGFILE_PATH"] = log
    env["CUFILE_LOGGING_LEVEL"] = "TRACE"
    if props is not None:
        cfg = os.path.join(outdir, f"cufile-{name}.json")
        with open(cfg, "w") as f:
            json.dump({"logging": {"dir": outdir, "level": "TRACE"}, "properties": props}, f)
        env["CUFILE_ENV_PATH_JSON"] = cfg
    return env


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir")
    p.add_argument("--dir", action="append", default=[], metavar="NAME=PATH",
                   help="a directory to try (repeatable; default: disk=OUTDIR)")
    p.add_argument("--child", choices=("raw", "lmcache"), help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    os.makedirs(args.outdir, exist_ok=True)
    dirs = dict(d.split("=", 1) for d in args.dir) or {"disk": args.outdir}
    results = []
    for dname, d in dirs.items():
        path = os.path.join(d, "cufile-diag.bin")
        with open(path, "wb") as f:      # fresh random data, never zeros
            f.write(os.urandom(FILE_BYTES))
        for cname in CONFIGS:
            for kind in ("raw", "lmcache"):
                for direct in (True, False):
                    tag = f"{cname}-{dname}-{kind}-{'odirect' if direct else 'buffered'}"
                    cmd = [sys.executable, os.path.abspath(__file__), args.outdir, "--child",
                           kind, "--path", path] + (["--direct"] if direct else [])
                    r = subprocess.run(cmd, env=_config_env(args.outdir, cname, tag),
                                       capture_output=True, text=True, timeout=120)
                    try:
                        res = json.loads(r.stdout.strip().splitlines()[-1])
                    except (IndexError, ValueError):
                        res = {"error": f"child rc {r.returncode}: {r.stderr[-1500:]}"}
                    res.update(config=cname, dir=dname, kind=kind, direct=direct)
                    results.append(res)
                    print(f"{tag:44s} {summary(res)}", flush=True)
                    if res.get("libcufile") is None and "error" in res:
                        os.unlink(path)
                        return _finish(args.outdir, results, 1)   # nothing else can run
        os.unlink(path)
    return _finish(args.outdir, results, 0)


def _finish(outdir: str, results: list, rc: int) -> int:
    with open(os.path.join(outdir, "cufile-diag.json"), "w") as f:
        json.dump(results, f, indent=1)
    return rc


def summary(r: dict[str, Any]) -> str:
    """One line: where it stopped, and with what."""
    if r.get("libcufile") is None and "error" in r:
        return r["error"]
    if r["kind"] == "lmcache":
        return "opened" if r.get("opened") else r.get("error", "?")
    parts = []
    for k in ("driver_open", "handle_register", "buf_register"):
        if k in r:
            parts.append(f"{k} {r[k]['err']}/{r[k]['cu_err']}")
    for k in ("read", "write"):
        if k in r:
            parts.append(f"{k} {r[k]['ret']} {'exact' if r[k]['exact'] else 'WRONG'}")
    if "error" in r:
        parts.append(r["error"])
    return ", ".join(parts) + f"  [{r.get('libcufile')} v{r.get('version')}]"


if __name__ == "__main__":
    sys.exit(main())
