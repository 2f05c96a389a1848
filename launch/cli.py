"""`distengine` command line."""
from __future__ import annotations

import argparse
import sys

from distengine.kv_cache.model_config import ConfigError


def main(argv: list[str] | None = None) -> int:
    from launch import bench_kernels, bench_kvcache, bench_latency, bench_throughput, demo, generate, kv_plan

    parser = argparse.ArgumentParser(prog="distengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    # (subcommands, name, module with add_arguments and run, help)
    for where, name, module, text in (
            (sub, "kv-plan", kv_plan, "print the hybrid KV cache plan of a model"),
            (sub, "demo", demo, "the engine end to end on a tiny hybrid model built locally"),
            (sub, "generate", generate, "print completions of a model"),
            (bench, "kvcache", bench_kvcache, "drive the KV cache manager like the scheduler does"),
            (bench, "kernels", bench_kernels, "paged attention on a GPU against torch SDPA and the copy bandwidth"),
            (bench, "latency", bench_latency, "the time to generate one batch, against the roofline"),
            (bench, "throughput", bench_throughput, "offline throughput over many prompts, against the roofline")):
        p = where.add_parser(name, help=text)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
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
