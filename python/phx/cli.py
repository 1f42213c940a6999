"""The ``phx`` command line: ``phx info``, ``phx stats``, ``phx tune``, ``phx bench <name>``.

Each benchmark lives in its own module under :mod:`phx.bench` and provides
``add_arguments(parser)`` and ``run(args) -> int``; :data:`BENCHMARKS` lists
them, so adding one is one line here.
"""
from __future__ import annotations

import argparse
import importlib
import sys

#: bench name -> (module, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "io": ("phx.bench.io", "file read/write GB/s and IOPS: phx vs fio vs os.preadv"),
    "kv": ("phx.bench.kv", "KV offload under memory caps: FlexLLMGen memmap vs fadvise vs direct vs phx dual-path"),
    "gpu": ("phx.bench.gpu", "file <-> GPU GB/s: phx Co-DMA vs raw O_DIRECT, naive staging, KvikIO"),
    "nvme": ("phx.bench.nvme", "NVMe namespace: io_uring passthrough vs O_DIRECT block device vs buffered"),
    "lmcache": ("phx.bench.lmcache", "LMCache KV tiers on a GPU: GDS L1 phx vs cufile vs host-staged disk, agentic replay"),
    "load": ("phx.bench.load", "safetensors checkpoint -> GPU: phx.loader vs safetensors vs fastsafetensors vs raw O_DIRECT"),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phx", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p_info = sub.add_parser("info", help="what this machine offers to phx, and why not")
    p_info.add_argument("path", nargs="?", default=".",
                        help="a file or directory whose O_DIRECT alignment to report")
    p_info.add_argument("--json", action="store_true", help="print JSON")

    sub.add_parser("stats", help="counters of this process's default engine (mostly for scripts)")

    p_tune = sub.add_parser("tune", help="measure and cache the GPU staging defaults for a filesystem")
    p_tune.add_argument("path", nargs="?", default=".", help="a directory on the filesystem to tune for")
    p_tune.add_argument("--size", default="1G", help="scratch file size (default 1G)")
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``phx`` console script and ``python -m phx``."""
    args = _build_parser().parse_args(argv)
    if args.command == "info":
        from phx.probe import main as info_main
        return info_main(args)
    if args.command == "tune":
        from phx.tune import main as tune_main
        return tune_main(args)
    if args.command == "stats":
        import json
        import phx
        print(json.dumps(phx.stats(), indent=2))
        return 0
    if args.command == "bench":
        if getattr(args, "_bench_error", None):
            print(f"phx bench {args.bench}: {args._bench_error}", file=sys.stderr)
            return 2
        return int(importlib.import_module(args._bench_module).run(args) or 0)
    return 2


if __name__ == "__main__":
    sys.exit(main())
