"""`distengine` command line."""
from __future__ import annotations

import argparse
import sys

from distengine.kv_cache.model_config import ConfigError


def main(argv: list[str] | None = None) -> int:
    from launch import bench_kernels, bench_kvcache, demo, generate, kv_plan

    parser = argparse.ArgumentParser(prog="distengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("kv-plan", help="print the hybrid KV cache plan of a model")
    kv_plan.add_arguments(p)
    p.set_defaults(func=kv_plan.run)
    p = sub.add_parser("demo", help="the engine end to end on a tiny hybrid model built locally")
    demo.add_arguments(p)
    p.set_defaults(func=demo.run)
    p = sub.add_parser("generate", help="print completions of a model")
    generate.add_arguments(p)
    p.set_defaults(func=generate.run)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    p = bench_sub.add_parser("kvcache", help="drive the KV cache manager like the scheduler does")
    bench_kvcache.add_arguments(p)
    p.set_defaults(func=bench_kvcache.run)
    p = bench_sub.add_parser("kernels", help="paged attention on a GPU against torch SDPA and the copy bandwidth")
    bench_kernels.add_arguments(p)
    p.set_defaults(func=bench_kernels.run)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"distengine: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
