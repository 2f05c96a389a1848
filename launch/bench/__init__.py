"""The lab: what measures the engine, apart from the engine.

The `distengine bench` commands, one module each: `latency`, `throughput` (with `common`, what
they share), `serve`, `sweep` (with `sweep_report`, its table and plots), `kvcache` (with
`vllm_reference`, vLLM's manager behind ours) and `kernels`. Scripts run as
`python -m launch.bench.NAME`: `host` (any machine), `allreduce`, `profile_decode`,
`profile_prefill` and `decode_batched` (a GPU host); `gpu/` holds the shell drivers that run them
with the GPU tests. Kernel-only timings and sweeps, which need nothing of the engine, are in
`kernels.bench`. Every command module imports nothing heavy at import time, so `distengine --help`
stays fast. Run the scripts with `-m`, not by path: a path puts this folder first on sys.path,
where `kernels.py` (the `bench kernels` command) would hide the `kernels` package.
"""
