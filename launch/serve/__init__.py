"""`distengine serve`: an OpenAI-compatible server (FastAPI + uvicorn, pydantic request bodies, as
vLLM's) over `AsyncLLM`.

Endpoints: POST /v1/completions and /v1/chat/completions (server-sent events with `stream: true`,
ending with `data: [DONE]`), GET /v1/models, /health (200 while the engine lives, 503 after),
/version, /metrics (Prometheus), POST /tokenize and /detokenize. Errors have OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: 400 for bad input (naming the field), 401 for a
missing or wrong API key, 404 for an unknown model, 503 once the engine is dead. A client that
disconnects has its request aborted at once. SIGTERM or Ctrl-C: the server stops accepting, lets
requests in flight finish (up to --shutdown-timeout seconds; those still running then end with an
error event and `[DONE]`), shuts the workers down and frees their placement group, and exits 0.
When the engine dies, every request in flight ends with an error and the server exits with
status 1, so that a supervisor restarts it.

Every flag is checked before the engine starts, and the address taken: a chat template that does
not compile, a generation config or TLS file that cannot be read, a port in use, end the command
at once with status 2 and one line naming it.

This module is the command (arguments, engine, uvicorn, signals); it imports nothing heavy, so
that `distengine --help` stays fast. The application is `launch.serve.app.build_app` (its options
`launch.serve.options`); the wire format `launch.serve.protocol`; the endpoints
`launch.serve.routes`; errors `launch.serve.errors`; the address and TLS files
`launch.serve.listen`; the request log `launch.serve.request_log`; a chat's tools
`launch.serve.tool_calls`, the formats of the models' calls `launch.serve.tool_parsers`.
"""

import contextlib
import os
import signal
import sys
import threading

from distengine.model_config import KV_CACHE_DTYPES
from distengine.quantization import QUANTIZATION_CHOICES


def add_arguments(p) -> None:
    p.add_argument("model", help="a model folder or a Hugging Face hub id")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, help="tensor-parallel workers")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize "
                        "(default: $DISTENGINE_API_KEY, else none)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model's name(s) in the API (default: the model argument)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder or hub id (default: the model's)")
    p.add_argument("--max-model-len", type=int, default=None, help="the longest prompt plus output")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of each GPU to use")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV cache per rank, in bytes")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests in the running batch at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step at most (default: 8192 on GPUs of 70 GiB or more, else 2048)")
    p.add_argument("--no-enable-prefix-caching", action="store_true", help="no prefix caching")
    p.add_argument("--mamba-checkpoint-interval", type=int, default=None,
                   help="Mamba hybrids: also keep the state every N tokens for prefix hits (default: only "
                        "at each step's last block end and where prompts diverge; 1: every block)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the attention K/V's dtype: auto (the model's) or fp8 / fp8_e4m3 (e4m3 with per-layer "
                        "scales, twice the tokens)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"], help="model dtype")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="where the workers run")
    p.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: $RAY_ADDRESS, else local)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights, no checkpoint read (benchmarks)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                   help="fp8: FP8 linear weights (an FP8 checkpoint's; with --load-format dummy random ones); "
                        "modelopt: a ModelOpt FP8 checkpoint's (dummy: per-tensor scales) "
                        "(default: the checkpoint's quantization_config)")
    p.add_argument("--structured-outputs-backend", "--guided-decoding-backend", dest="structured_outputs_backend",
                   default="auto", choices=["auto", "xgrammar", "guidance"],
                   help="the library of structured outputs: auto (llguidance for JSON schemas, JSON objects, "
                        "regexes and choices; xgrammar for EBNF grammars), xgrammar, or guidance (llguidance; "
                        "grammars are then Lark); a request may name its own")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds requests in flight may take to finish after SIGTERM or Ctrl-C")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no stats line (throughputs, requests, KV cache usage, prefix hit rate) every "
                        "$DISTENGINE_LOG_STATS_INTERVAL seconds (default 10) while there is work")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, for chat completions and /tokenize "
                        "(default: the tokenizer's)")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults for the fields a request leaves out (temperature, top_p, top_k, "
                        "min_p, repetition_penalty, max_new_tokens): 'auto' from the model's "
                        "generation_config.json, 'vllm' none, or a folder holding a generation_config.json")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log each request (its id, prompt and sampling params) at INFO on stdout")
    p.add_argument("--max-log-len", type=int, default=None,
                   help="characters of the prompt, and prompt token ids, in a request's log line (default: all)")
    p.add_argument("--allowed-origins", type=_json_list, default=["*"], help="CORS: allowed origins, a JSON list")
    p.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS: allowed methods, a JSON list")
    p.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS: allowed headers, a JSON list")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this PEM certificate (chain)")
    p.add_argument("--ssl-keyfile", default=None, help="the certificate's key, when --ssl-certfile does not hold it")
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates a client's certificate must come from")
    p.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                   help="a client certificate: 0 not asked for, 1 optional, 2 required (Python's ssl.CERT_*)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice 'auto' (the default when a request gives tools): calls read out of the "
                        "generated text by --tool-call-parser")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the format of the model's tool calls: hermes (Qwen), llama3_json, llama4_json, pythonic, "
                        "llama4_pythonic, openai (gpt-oss), functiongemma")
    p.add_argument("--root-path", default="",
                   help="the path prefix of a proxy in front of the server that strips it (the ASGI root_path, "
                        "for /docs and the OpenAPI schema), like /api")


def _json_list(text: str) -> list[str]:
    import argparse
    import json
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, like '[\"*\"]', got {text!r}")
    return value


def run(args) -> int:
    try:
        import uvicorn
    except ImportError as e:
        raise ImportError(f"distengine serve needs the server's packages: pip install 'distengine[serve]' ({e})") from e
    from distengine.async_llm import AsyncLLM
    from launch.serve.app import build_app
    from launch.serve.listen import bind
    names = args.served_model_name or [args.model]
    interval = None if args.disable_log_stats else _stats_interval()
    options, tls = _checked_options(args)
    sock = bind(args.host, args.port)
    try:
        engine = AsyncLLM(args.model, metrics_name=names[0], log_stats_interval=interval,
                          tensor_parallel_size=args.tensor_parallel_size,
                          tokenizer=args.tokenizer, max_model_len=args.max_model_len,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          enable_prefix_caching=not args.no_enable_prefix_caching, enforce_eager=args.enforce_eager,
                          mamba_checkpoint_interval=args.mamba_checkpoint_interval,
                          dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, device=args.device,
                          ray_address=args.ray_address, load_format=args.load_format,
                          quantization=args.quantization, structured_outputs_backend=args.structured_outputs_backend)
    except BaseException:
        sock.close()
        raise
    try:
        app = build_app(engine, names, options)
        verbose = bool(os.environ.get("DISTENGINE_VERBOSE"))
        server = _uvicorn_server(uvicorn.Config(app, host=args.host, port=args.port,
                                                log_level="info" if verbose else "warning", access_log=verbose,
                                                timeout_graceful_shutdown=args.shutdown_timeout + CUT_GRACE_S,
                                                ssl_certfile=tls.certfile, ssl_keyfile=tls.keyfile,
                                                ssl_ca_certs=tls.ca_certs, ssl_cert_reqs=tls.cert_reqs,
                                                root_path=args.root_path),
                                 engine, args.shutdown_timeout)
        # A dead engine cannot come back: the server ends (status 1) so that a supervisor restarts it.
        threading.Thread(target=_stop_when_dead, args=(engine, server), name="distengine-watch", daemon=True).start()
        scheme = "https" if tls.enabled else "http"
        print(f"distengine serve: {names[0]} on {scheme}://{args.host}:{args.port}/v1 "
              f"(max_model_len {engine.max_model_len}, TP={args.tensor_parallel_size})", flush=True)
        server.run(sockets=[sock])
    finally:
        sock.close()
        engine.shutdown()
    if engine.dead is not None:
        print(f"distengine serve: the engine died ({engine.dead}); exiting", file=sys.stderr, flush=True)
        return 1
    return 0


def _checked_options(args):
    """The server's options and TLS files from the flags, each checked (ValueError naming the
    flag), before anything is loaded; the sampling defaults taken are logged, as vLLM logs them."""
    from distengine.generation_config import sampling_defaults
    from launch.serve.listen import TLSFiles
    from launch.serve.options import ServerOptions, load_chat_template
    from launch.serve.request_log import LOGGER
    tls = TLSFiles(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)
    tls.check()
    defaults = sampling_defaults(args.generation_config, args.model)
    options = ServerOptions(api_key=args.api_key or os.environ.get("DISTENGINE_API_KEY") or None,
                            chat_template=load_chat_template(args.chat_template) if args.chat_template else None,
                            sampling_defaults=defaults, log_requests=args.enable_log_requests,
                            max_log_len=args.max_log_len, allowed_origins=tuple(args.allowed_origins),
                            allowed_methods=tuple(args.allowed_methods), allowed_headers=tuple(args.allowed_headers),
                            allow_credentials=args.allow_credentials,
                            enable_auto_tool_choice=args.enable_auto_tool_choice,
                            tool_call_parser=args.tool_call_parser)
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise ValueError(f"--root-path must start with '/' and not end with one, like '/api', got {args.root_path!r}")
    _log_to_stdout(LOGGER)
    if defaults.given():
        source = "the model's " if args.generation_config == "auto" else f"{args.generation_config}/"
        LOGGER.info("Using default sampling params from %sgeneration_config.json (--generation-config vllm: none): "
                    "%s", source, defaults.given())
    return options, tls


# Seconds past --shutdown-timeout for the requests cut then to send their error event and [DONE].
CUT_GRACE_S = 5.0


def _stop_when_dead(engine, server) -> None:
    engine.died.wait()
    server.should_exit = True


def _stats_interval() -> float:
    """The stats line's period: $DISTENGINE_LOG_STATS_INTERVAL seconds (vLLM's is
    VLLM_LOG_STATS_INTERVAL), 10 by default; its lines go to stdout."""
    import logging
    text = os.environ.get("DISTENGINE_LOG_STATS_INTERVAL", "10")
    try:
        interval = float(text)
    except ValueError:
        interval = float("nan")
    if not interval > 0:
        raise ValueError(f"DISTENGINE_LOG_STATS_INTERVAL must be a number of seconds > 0, got {text!r}")
    _log_to_stdout(logging.getLogger("distengine.stats"))
    return interval


def _log_to_stdout(logger) -> None:
    """A logger of the server's own lines (INFO and up) on stdout, where its banner goes."""
    import logging
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s distengine: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _uvicorn_server(config, engine, shutdown_timeout: float):
    """uvicorn's server, except that a SIGTERM or Ctrl-C, once the graceful shutdown is done, ends
    the process normally (status 0): uvicorn would raise the signal again; and that the requests
    still running `shutdown_timeout` seconds into the shutdown end with an error event and
    `[DONE]` (uvicorn would cancel their tasks mid-stream, with a traceback each)."""
    import asyncio

    import uvicorn

    from launch.serve.errors import ServerShutdown

    def cut() -> None:
        engine.abort_all(ServerShutdown(f"the server shut down before this request finished "
                                        f"(--shutdown-timeout {shutdown_timeout:g} s)"))

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            timer = asyncio.get_running_loop().call_later(shutdown_timeout, cut)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:  # a second signal: no more waiting
                cut()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server(config)


def __getattr__(name: str):
    # `from launch.serve import build_app` (a server inside another program) without the CLI's
    # import of this package loading FastAPI.
    if name == "build_app":
        from launch.serve.app import build_app
        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
