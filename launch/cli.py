"""`distengine`: the command line.

Every command's arguments are defined by a module that imports nothing heavy at import time, so
`--help` answers without loading torch. A user error (a bad argument, a model folder that is not
there, a cluster too small) ends with one line on stderr and exit status 2; any other failure with
one line and status 1; `--debug` shows the traceback instead. Ray's start-up and shutdown messages
are hidden unless `--verbose`.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

# (command words, module with add_arguments(parser) and run(args), one line of help)
COMMANDS = (
    (("kv-plan",), "launch.kv_plan", "print the hybrid KV cache plan of a model (its config.json only)"),
    (("demo",), "launch.demo", "the engine end to end on a tiny hybrid model built locally"),
    (("generate",), "launch.generate", "print completions of a model for prompts or token ids"),
    (("serve",), "launch.serve", "an OpenAI-compatible server (completions, chat, streaming, metrics)"),
    (("bench", "kvcache"), "launch.bench.kvcache", "drive the KV cache manager like the scheduler does"),
    (("bench", "kernels"), "launch.bench.kernels", "paged attention on a GPU against torch SDPA and the copy bandwidth"),
    (("bench", "latency"), "launch.bench.latency", "the time to generate one batch, against the roofline"),
    (("bench", "throughput"), "launch.bench.throughput", "offline throughput over many prompts, against the roofline"),
    (("bench", "serve"), "launch.bench.serve", "load on an OpenAI-compatible server: throughput, TTFT, TPOT, ITL"),
    (("bench", "soak"), "launch.bench.soak", "many requests on a server: RSS, latency and KV blocks over time"),
    (("bench", "sweep"), "launch.bench.sweep", "a grid of benchmark points scheduled by Ray, with a table and plots"),
)
# Errors that mean "what you asked for cannot be done", not "the program broke".
USER_ERROR_NAMES = {"ConfigError", "PlacementGroupError", "KVCacheTooSmallError", "UnsupportedArchitectureError",
                    "MissingWeightsError", "WeightShapeError"}


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown after every option's help; descriptions kept as written."""


def build_parser() -> argparse.ArgumentParser:
    from distengine import __version__
    parser = argparse.ArgumentParser(prog="distengine", formatter_class=Formatter,
                                     description="A tensor-parallel inference engine for hybrid LLMs.")
    parser.add_argument("--version", action="version", version=f"distengine {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--verbose", action="store_true", help="show Ray's own start-up and shutdown messages")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for words, module, text in COMMANDS:
        where = sub
        if len(words) == 2:
            if words[0] not in groups:
                g = sub.add_parser(words[0], help="benchmarks", formatter_class=Formatter)
                groups[words[0]] = g.add_subparsers(dest="what", required=True, metavar="BENCHMARK")
            where = groups[words[0]]
        p = where.add_parser(words[-1], help=text, description=text, formatter_class=Formatter)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        os.environ["DISTENGINE_VERBOSE"] = "1"
    name = " ".join(w for w in (args.command, getattr(args, "what", None)) if w)
    try:
        return importlib.import_module(args.module).run(args) or 0
    except KeyboardInterrupt:
        print(f"distengine {name}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except Exception as e:  # noqa: BLE001 - the one place that turns errors into exit statuses
        if args.debug:
            raise
        user = isinstance(e, (ValueError, TypeError, FileNotFoundError, NotADirectoryError, PermissionError,
                              ImportError)) or type(e).__name__ in USER_ERROR_NAMES
        text = " ".join(str(e).split()) or type(e).__name__
        hint = "" if user else f" ({type(e).__name__}; --debug shows the traceback)"
        print(f"distengine {name}: error: {text}{hint}", file=sys.stderr)
        return 2 if user else 1


if __name__ == "__main__":
    sys.exit(main())
