"""The ``phx`` command line: ``phx info``, ``phx stats``, ``phx top``, ``phx tune``, ``phx bench <name>``.

Each benchmark lives in its own module under :mod:`phx.bench` and provides
``add_arguments(parser)`` and ``run(args) -> int``; :data:`BENCHMARKS` lists
them, so adding one is one line here.  The options every bench shares, the
exit status and the JSON envelope live in :mod:`phx.bench._common`.

Errors a user can act on are one line on stderr, never a traceback: a bad
option value (``PROG: argument --flag: why``, exit 2), a ``PHX_*`` setting
libphx cannot read (naming the variable, exit 2), a bench's
:class:`~phx.bench._common.BenchError` (its status) and the operating
system's refusals a user causes (no space, no such device, permission:
exit 2).  Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys

from phx.bench import _common
from phx.bench._common import BenchError, Parser

#: bench name -> (module, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "io": ("phx.bench.io", "file read/write GB/s and IOPS: phx vs fio vs os.preadv"),
    "kv": ("phx.bench.kv", "KV offload under memory caps: FlexLLMGen memmap vs fadvise vs direct vs phx dual-path"),
    "gpu": ("phx.bench.gpu", "file <-> GPU GB/s: phx Co-DMA vs raw O_DIRECT, naive staging, KvikIO"),
    "nvme": ("phx.bench.nvme", "NVMe namespace: io_uring passthrough vs O_DIRECT block device vs buffered"),
    "lmcache": ("phx.bench.lmcache", "LMCache KV tiers on a GPU: GDS L1 phx vs cufile vs host-staged disk, agentic replay"),
    "load": ("phx.bench.load", "safetensors checkpoint -> GPU: phx.loader vs safetensors vs fastsafetensors vs raw O_DIRECT"),
}

#: errnos of refusals a user causes and can fix (one line, exit 2)
USER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.ENOENT,
                         errno.ENOTDIR, errno.EISDIR, errno.EROFS, errno.ENODEV, errno.ENXIO,
                         errno.ENOTBLK, errno.EBUSY, errno.EEXIST})


def _existing_dir(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return text


def _build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="phx", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p_info = sub.add_parser("info", help="what this machine offers to phx, and why not")
    p_info.add_argument("path", nargs="?", default=".",
                        help="a file or directory whose O_DIRECT alignment to report")
    p_info.add_argument("--json", action="store_true", help="print JSON")

    from phx import top
    top.add_stats_arguments(sub.add_parser(
        "stats", help="counters of the running processes that use phx (--json for scripts)"))
    top.add_top_arguments(sub.add_parser(
        "top", help="what running phx processes do, refreshed: GB/s, IOPS, paths, errors"))

    p_tune = sub.add_parser("tune", help="measure and cache the GPU staging defaults for a filesystem")
    p_tune.add_argument("path", nargs="?", default=".", type=_existing_dir,
                        help="a directory on the filesystem to tune for")
    p_tune.add_argument("--size", default="1G", type=_common.positive_size,
                        help="scratch file size (default 1G)")
    p_tune.add_argument("--quiet", action="store_true", help="no per-configuration lines")

    p_bench = sub.add_parser("bench", help="benchmarks")
    bsub = p_bench.add_subparsers(dest="bench", required=True)
    for name, (modname, help_text) in BENCHMARKS.items():
        bp = bsub.add_parser(name, help=help_text, description=help_text)
        bp.set_defaults(_bench_module=modname)
        try:
            importlib.import_module(modname).add_arguments(bp)
        except ImportError as e:
            # One broken benchmark must not take the other commands down.
            bp.set_defaults(_bench_error=f"{modname} cannot be imported: {e}")
    return parser


def settings_error() -> str | None:
    """Why libphx refuses this process's ``PHX_*`` settings (one line naming
    the variable), or None.  libphx reads them (``libphx/src/env.c``) and its
    engine create fails with EINVAL on one it cannot read; a default engine is
    made and dropped here so that every command says so before it starts."""
    try:
        import phx
        phx.Engine().close()
    except ImportError:
        return None
    except (OSError, ValueError) as e:   # the binding raises ValueError for EINVAL
        if isinstance(e, OSError) and e.errno != errno.EINVAL:
            return None              # no io_uring etc.: `phx info` says why
        msg = (e.strerror if isinstance(e, OSError) else None) or str(e)
        msg = msg.removesuffix(": Invalid argument")
        if "PHX_" in msg:
            return msg
        set_ = [f"{k}={v}" for k, v in sorted(os.environ.items())
                if k.startswith("PHX_") and v]
        if set_:
            return f"libphx refuses the engine settings: {msg} (set: {', '.join(set_)})"
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``phx`` console script and ``python -m phx``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _build_parser().parse_args(argv)
    _common.set_command(["phx", *argv])
    what = "phx " + (f"bench {args.bench}" if args.command == "bench" else args.command)
    if args.command == "bench" and getattr(args, "_bench_error", None):
        print(f"{what}: {args._bench_error}", file=sys.stderr)
        return 2
    why = settings_error()
    if why:
        print(f"{what}: {why}", file=sys.stderr)
        return 2
    try:
        return _dispatch(args)
    except BenchError as e:
        print(f"{what}: {e}", file=sys.stderr)
        return e.status
    except OSError as e:
        if e.errno not in USER_ERRNOS:
            raise
        where = f": {e.filename}" if e.filename else ""
        print(f"{what}: {e.strerror or e}{where}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "info":
        from phx.probe import main as info_main
        return info_main(args)
    if args.command == "tune":
        from phx.tune import main as tune_main
        return tune_main(args)
    if args.command == "stats":
        from phx.top import stats_main
        return stats_main(args)
    if args.command == "top":
        from phx.top import top_main
        return top_main(args)
    if args.command == "bench":
        return int(importlib.import_module(args._bench_module).run(args) or 0)
    return 2


if __name__ == "__main__":
    sys.exit(main())
