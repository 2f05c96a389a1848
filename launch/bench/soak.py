"""`distengine bench soak` (also `python -m launch.bench.soak`): does a server leak or slow down
over many requests? It sends --num-requests streamed completions of mixed lengths, at most
--max-concurrency at a time, a --disconnect-fraction of them closed by the client after a random
number of chunks (before the end), in ten equal parts. Between parts it waits until the server is
idle and reads, per part: the RSS of the server's processes at the part's start and end, the
p50 / p99 latency of the part's completed requests, and the KV blocks still in use (leaked:
nothing runs), from /metrics: round(kv_cache_usage_perc x (num_gpu_blocks - 1)).

It starts `distengine serve` itself on a model folder (the demo's tiny hybrid model by default:
it has a tokenizer, so the server's detokenizer runs too) on a free loopback port and shuts it
down at the end, or it measures a running server (--base-url; its RSS only with --server-pid).
A server started here gets a small KV pool (--kv-cache-memory-bytes) so that the first part
uses every block: the RSS after it is the baseline of the growth figure. The RSS is the sum over
the server's process and all its descendants (the engine process, and at TP>1 the Ray
processes its engine started: workers, raylet, GCS and the rest; shared pages count in each).

Criteria (printed, and the exit status 1 when one fails): RSS growth after the first part and
p50 / p99 drift from the first part to the last within +5% (a drop passes), no leaked block at
any reading, no errors (a non-200 answer, an error event, a stream ending without [DONE] or
timing out; the client's own disconnects are not errors). Each tenth also shows the CPU time the
server's processes used and the machine's load: on shared cores latency moves with other work,
the server's own CPU time much less.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field

from launch.bench.serve import (
    StreamRecord,
    first_model,
    open_client,
    random_prompts,
    stream_completion,
    summary,
)

PARTS = 10
FLAT_PCT = 5.0
KIB = 1024


def add_arguments(p) -> None:
    p.add_argument("--model-dir", default=None,
                   help="serve this model folder (built there as the demo's tiny hybrid model when it has no "
                        "config.json; default: the demo's folder, ~/.cache/distengine/demo-model-HASH)")
    p.add_argument("--tp", type=int, default=1, choices=[1, 2], help="tensor-parallel workers of the server started")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="the started server's KV pool per rank (default: 32 MiB / TP, 4,096 blocks of the demo "
                        "model): small, so that the first tenth uses every block")
    p.add_argument("--base-url", default=None, help="measure a running server instead, e.g. http://127.0.0.1:8000")
    p.add_argument("--server-pid", type=int, default=None, help="with --base-url: its process, for the RSS")
    p.add_argument("--api-key", default=None, help="with --base-url (default: $OPENAI_API_KEY or $DISTENGINE_API_KEY)")
    p.add_argument("--num-requests", type=int, default=10000, help="requests in all, in ten equal parts")
    p.add_argument("--disconnect-fraction", type=float, default=0.3,
                   help="requests whose client closes the stream after a random number of chunks")
    p.add_argument("--max-concurrency", type=int, default=32, help="requests in flight at most")
    p.add_argument("--input-len", type=int, nargs=2, default=[8, 256], metavar=("MIN", "MAX"),
                   help="prompt tokens, uniform in this range")
    p.add_argument("--output-len", type=int, nargs=2, default=[4, 128], metavar=("MIN", "MAX"),
                   help="tokens asked for (ignore_eos), uniform in this range")
    p.add_argument("--shared-prefix-len", type=int, default=64,
                   help="tokens of a prefix that --shared-prefix-fraction of the prompts start with")
    p.add_argument("--shared-prefix-fraction", type=float, default=0.25,
                   help="prompts that start with the shared prefix (prefix-cache hits, blocks shared)")
    p.add_argument("--random-vocab-size", type=int, default=100, help="prompt token ids lie below this")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds; a request past it is an error")
    p.add_argument("--idle-timeout", type=float, default=120.0,
                   help="seconds to wait for the server to become idle between tenths")
    p.add_argument("--seed", type=int, default=0, help="seeds the lengths, prompts, sampling and disconnects")
    p.add_argument("--output-json", default=None, help="write the results here")


# ---- the requests --------------------------------------------------------------------------------
@dataclass
class RequestPlan:
    prompt: list[int]
    max_tokens: int
    shared_prefix: bool
    disconnect_after: int | None  # chunks of tokens after which the client closes the stream
    sampled: bool                 # temperature 0.8, top-p 0.95; else greedy


def plan_requests(args) -> list[RequestPlan]:
    rng = random.Random(args.seed)
    n = args.num_requests
    lengths = [rng.randint(*args.input_len) for _ in range(n)]
    prompts = random_prompts(args.seed + 1, args.random_vocab_size, lengths)
    prefix = random_prompts(args.seed + 2, args.random_vocab_size, [args.shared_prefix_len])[0]
    plans = []
    for prompt in prompts:
        shared = rng.random() < args.shared_prefix_fraction
        if shared:
            k = min(len(prompt), len(prefix))
            prompt[:k] = prefix[:k]
        max_tokens = rng.randint(*args.output_len)
        # Before the end: a request of one token has no chunk to close after.
        cut = rng.random() < args.disconnect_fraction and max_tokens > 1
        plans.append(RequestPlan(prompt, max_tokens, shared, rng.randint(1, max_tokens - 1) if cut else None,
                                 rng.random() < 0.5))
    return plans


def request_body(model: str, plan: RequestPlan) -> dict:
    # ignore_eos: random weights may end a request at any token; the lengths stay the planned ones.
    body = {"model": model, "prompt": plan.prompt, "max_tokens": plan.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}
    if plan.sampled:
        body.update(temperature=0.8, top_p=0.95)
    return body


# ---- the server's processes ------------------------------------------------------------------------
@dataclass
class Proc:
    pid: int
    role: str      # server, engine, Ray worker, Ray
    name: str
    rss_kib: int
    start: int     # start time in clock ticks since boot: a pid reused later is another process
    cpu_ticks: int  # user + system time so far


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces


def process_tree(root: int) -> list[Proc]:
    """`root` and every process below it, from /proc (Linux), with their RSS."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                children.setdefault(int(_stat_fields(int(d))[1]), []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass  # gone meanwhile
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/status") as f:
                rss = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            fields = _stat_fields(pid)
        except (OSError, IndexError, ValueError):
            continue
        out.append(Proc(pid, _role(pid == root, cmd), _short_name(cmd), rss, int(fields[19]),
                        int(fields[11]) + int(fields[12])))
    return out


def _role(is_root: bool, cmd: str) -> str:
    if is_root:
        return "server"
    if "distengine.core_client" in cmd:
        return "engine"
    if cmd.startswith("ray::Worker"):
        return "Ray worker"
    return "Ray" if "ray" in cmd.lower() else "other"


def _short_name(cmd: str) -> str:
    words = cmd.split()
    if not words:
        return "?"
    if os.path.basename(words[0]).startswith("python"):
        # `python [-u] -m module` or `python [-u] path/script.py`: the module or the script names it
        for i, w in enumerate(words[1:], 1):
            if w == "-m" and i + 1 < len(words):
                return words[i + 1]
            if not w.startswith("-"):
                return os.path.basename(w)
    return os.path.basename(words[0])


def cpu_seconds(before: list[Proc], after: list[Proc]) -> float:
    """CPU time the processes of `after` used since `before` (one that started meanwhile: all of it)."""
    then = {(p.pid, p.start): p.cpu_ticks for p in before}
    return sum(p.cpu_ticks - then.get((p.pid, p.start), 0) for p in after) / os.sysconf("SC_CLK_TCK")


def load_average() -> float:
    """The machine's 1-minute load: other work on the same cores shows in the latency."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def rss_by_role(procs: list[Proc]) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in procs:
        out[p.role] = out.get(p.role, 0.0) + p.rss_kib / KIB
    return out


def describe(procs: list[Proc]) -> str:
    parts = []
    for role in ("server", "engine", "Ray worker", "Ray", "other"):
        mine = [p for p in procs if p.role == role]
        if mine:
            names = ", ".join(sorted({p.name for p in mine}))
            parts.append(f"{role} x{len(mine)} ({names}; pid {', '.join(str(p.pid) for p in mine[:4])}"
                         f"{', ...' if len(mine) > 4 else ''})")
    return " + ".join(parts)


# ---- the server, when started here --------------------------------------------------------------------
@dataclass
class StartedServer:
    proc: object  # subprocess.Popen
    url: str
    log_path: str


def start_server(folder: str, tp: int, kv_bytes: int, log_path: str, timeout: float = 600.0) -> StartedServer:
    import socket
    import subprocess
    import sys

    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "launch.cli", "serve", folder, "--device", "cpu", "--dtype", "float32",
           "--host", "127.0.0.1", "--port", str(port), "--tensor-parallel-size", str(tp),
           "--kv-cache-memory-bytes", str(kv_bytes)]
    # Its output to a file: a pipe nobody reads would stall the server once full (stats lines).
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} at start: {_tail(log_path)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return StartedServer(proc, url, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(StartedServer(proc, url, log_path))
    raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s: {_tail(log_path)}")


def stop_server(server: StartedServer, wait_s: float = 90.0) -> int:
    """SIGTERM, then SIGKILL if it has not exited within `wait_s`; its exit status."""
    import signal
    import subprocess
    proc = server.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def reap_left_behind(procs: list[Proc], wait_s: float = 15.0) -> list[str]:
    """The server's descendants still alive `wait_s` after it exited: named, then killed (they are
    this run's, as their start times show)."""
    import signal
    deadline = time.monotonic() + wait_s
    alive = procs
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [p for p in alive if _same_process(p)]
    for p in alive:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except OSError:
            pass
    return [f"{p.name} (pid {p.pid})" for p in alive]


def _same_process(p: Proc) -> bool:
    try:
        fields = _stat_fields(p.pid)
    except (OSError, IndexError):
        return False
    return fields[0] != "Z" and int(fields[19]) == p.start


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(f.read().splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---- the pool, from /metrics --------------------------------------------------------------------------
@dataclass
class PoolReading:
    running: int
    waiting: int
    usage: float       # kv_cache_usage_perc
    num_blocks: int    # the null block included
    block_size: int
    leaked: int | None  # blocks in use while idle; None when the server never became idle


def parse_metrics(text: str) -> dict[str, tuple[dict[str, str], float]]:
    """Prometheus text: name -> (labels, value) of its first sample."""
    import re
    out: dict[str, tuple[dict[str, str], float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        if name not in out:
            out[name] = (dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value))
    return out


async def read_pool(client, base_url: str) -> PoolReading:
    resp = await client.get(base_url.rstrip("/") + "/metrics")
    resp.raise_for_status()
    m = parse_metrics(resp.text)
    labels = m["distengine:cache_config_info"][0]
    return PoolReading(int(m["distengine:num_requests_running"][1]), int(m["distengine:num_requests_waiting"][1]),
                       m["distengine:kv_cache_usage_perc"][1], int(labels["num_gpu_blocks"]),
                       int(labels["block_size"]), None)


async def wait_idle(client, base_url: str, timeout: float, settle_s: float = 3.0) -> PoolReading:
    """The pool once nothing runs or waits. The gauges come with the engine's steps and idle
    reports, so a usage above 0 is read again for `settle_s` before it counts as leaked blocks."""
    import asyncio
    deadline = time.monotonic() + timeout
    settled = None
    while True:
        r = await read_pool(client, base_url)
        if r.running == 0 and r.waiting == 0:
            settled = settled or time.monotonic() + settle_s
            if r.usage == 0 or time.monotonic() >= settled:
                r.leaked = round(r.usage * (r.num_blocks - 1))
                return r
        else:
            settled = None
        if time.monotonic() >= deadline:
            return r  # leaked stays None: not idle
        await asyncio.sleep(0.25)


# ---- the run ---------------------------------------------------------------------------------------------
@dataclass
class Tenth:
    index: int
    requests_done: int        # since the start of the run
    completed: int            # streams read to [DONE]
    disconnected: int         # closed by the client
    errors: int
    rss_start_mib: float | None
    rss_end_mib: float | None
    p50_ms: float
    p99_ms: float
    leaked_blocks: int | None
    running_after: int        # requests the server still counted at the idle reading
    waiting_after: int
    wall_s: float
    cpu_s: float | None       # CPU time of the server's processes in this tenth
    load_avg: float           # the machine's 1-minute load at the tenth's end
    output_tokens: int        # of the completed requests
    wrong_lengths: int        # completed with another count of tokens than asked for (ignore_eos)
    blocks_allocated: int     # at least: one KV group's new blocks of this tenth's requests
    rss_end_by_role_mib: dict[str, float] = field(default_factory=dict)


@dataclass
class SoakResult:
    base_url: str
    tp: int | None
    model_dir: str | None
    num_requests: int
    disconnect_fraction: float
    max_concurrency: int
    input_len: list[int]
    output_len: list[int]
    seed: int
    num_gpu_blocks: int
    block_size: int
    rss_processes: str        # what the RSS counts
    tenths: list[Tenth]
    rss_baseline_mib: float | None  # after the first tenth
    rss_growth_pct: float | None    # the last tenth's end against the baseline
    rss_peak_growth_pct: float | None
    p50_drift_pct: float
    p99_drift_pct: float
    cpu_drift_pct: float | None     # the server's CPU time, last tenth against the first
    leaked_blocks_at_start: int | None  # before the first request
    leaked_blocks: int | None       # at the last reading
    max_leaked_blocks: int | None   # over all readings, the one at the start included
    errors: int
    error_samples: list[str]
    disconnects: int
    completed: int
    wall_s: float
    pool_turned_over: bool          # the first tenth allocated at least as many blocks as the pool has
    criteria: dict[str, bool]
    server_exit_status: int | None = None
    left_behind: list[str] = field(default_factory=list)


def _pct(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or not old > 0 or math.isnan(new) or math.isnan(old):
        return None
    return 100.0 * (new - old) / old


def _new_blocks(plan: RequestPlan, rec, block_size: int, prefix_len: int) -> int:
    """New blocks of one KV group a request took at least: its tokens' blocks, less the shared
    prefix's full blocks (found in the cache)."""
    tokens = len(plan.prompt) + (rec.chunks if rec.disconnected else rec.output_tokens)
    cached = min(len(plan.prompt), prefix_len) // block_size if plan.shared_prefix else 0
    return max(0, -(-tokens // block_size) - cached)


async def soak(args, base_url: str, rss_root: int | None) -> SoakResult:
    import asyncio

    import httpx
    client = open_client(base_url, args.api_key)
    metrics = httpx.AsyncClient(timeout=30.0)
    model = await first_model(client)
    plans = plan_requests(args)
    limit = asyncio.Semaphore(args.max_concurrency)
    first = await wait_idle(metrics, base_url, args.idle_timeout)
    pool_n, bs = first.num_blocks, first.block_size
    procs = process_tree(rss_root) if rss_root else []
    what = describe(procs) if procs else "not measured (no --server-pid)"
    print(f"soak: {len(plans)} requests to {base_url} ({model}), {PARTS} tenths, at most {args.max_concurrency} "
          f"at a time, {args.disconnect_fraction:.0%} disconnects; pool {pool_n - 1} blocks of {bs} tokens",
          flush=True)
    print(f"RSS: the sum over {what}", flush=True)
    header = (f"{'tenth':>5} {'requests':>8} {'done':>5} {'disc':>5} {'err':>4} {'RSS start MiB':>13} "
              f"{'RSS end MiB':>11} {'p50 ms':>8} {'p99 ms':>8} {'leaked':>6} {'wall s':>7} {'CPU s':>7} {'load':>5}")
    print(header + "\n" + "-" * len(header), flush=True)

    async def one(plan: RequestPlan):
        async with limit:
            try:
                return await asyncio.wait_for(
                    stream_completion(client, request_body(model, plan), plan.disconnect_after), args.request_timeout)
            except asyncio.TimeoutError:
                return StreamRecord(error=f"no end within --request-timeout {args.request_timeout:g} s")

    tenths: list[Tenth] = []
    samples: list[str] = []
    start = time.perf_counter()
    size = math.ceil(len(plans) / PARTS)
    rss = sum(p.rss_kib for p in procs) / KIB if procs else None
    for i in range(PARTS):
        part = plans[i * size:(i + 1) * size]
        rss_start = rss
        t0 = time.perf_counter()
        records = await asyncio.gather(*(one(p) for p in part))
        wall = time.perf_counter() - t0
        pool = await wait_idle(metrics, base_url, args.idle_timeout)
        before, procs = procs, process_tree(rss_root) if rss_root else []
        rss = sum(p.rss_kib for p in procs) / KIB if procs else None
        ended = [r.done and not r.disconnected and r.error is None for r in records]
        done = [r for r, e in zip(records, ended) if e]
        failed = [r for r in records if r.error is not None or not (r.done or r.disconnected)]
        samples.extend(r.error or "the stream ended without [DONE]" for r in failed)
        lat = summary([r.latency for r in done])
        t = Tenth(i + 1, i * size + len(part), len(done), sum(r.disconnected and r.error is None for r in records),
                  len(failed), rss_start, rss, lat["median"] * 1e3, lat["p99"] * 1e3, pool.leaked, pool.running,
                  pool.waiting, wall, cpu_seconds(before, procs) if procs else None, load_average(),
                  sum(r.output_tokens for r in done),
                  sum(r.output_tokens != p.max_tokens for r, p, e in zip(records, part, ended) if e),
                  sum(_new_blocks(p, r, bs, args.shared_prefix_len) for p, r in zip(part, records) if r.error is None),
                  {k: round(v, 1) for k, v in rss_by_role(procs).items()})
        tenths.append(t)
        print(f"{t.index:>5} {t.requests_done:>8} {t.completed:>5} {t.disconnected:>5} {t.errors:>4} "
              f"{_mib(t.rss_start_mib):>13} {_mib(t.rss_end_mib):>11} {t.p50_ms:>8.1f} {t.p99_ms:>8.1f} "
              f"{'busy' if t.leaked_blocks is None else t.leaked_blocks:>6} {t.wall_s:>7.1f} "
              f"{'-' if t.cpu_s is None else f'{t.cpu_s:.1f}':>7} {t.load_avg:>5.1f}", flush=True)
    wall = time.perf_counter() - start
    await client.aclose()
    await metrics.aclose()
    base = tenths[0].rss_end_mib
    ends = [t.rss_end_mib for t in tenths[1:] if t.rss_end_mib is not None]
    leaks = [first.leaked] + [t.leaked_blocks for t in tenths]
    res = SoakResult(
        base_url, args.tp, args.model_dir, len(plans), args.disconnect_fraction,
        args.max_concurrency, list(args.input_len), list(args.output_len), args.seed, pool_n, bs, what, tenths,
        base, _pct(tenths[-1].rss_end_mib, base), _pct(max(ends), base) if ends else None,
        _pct(tenths[-1].p50_ms, tenths[0].p50_ms), _pct(tenths[-1].p99_ms, tenths[0].p99_ms),
        _pct(tenths[-1].cpu_s, tenths[0].cpu_s),
        first.leaked, leaks[-1], None if None in leaks else max(leaks), sum(t.errors for t in tenths), samples[:10],
        sum(t.disconnected for t in tenths), sum(t.completed for t in tenths), wall,
        tenths[0].blocks_allocated >= pool_n - 1, {})
    res.criteria = {
        "rss_flat": res.rss_growth_pct is not None and res.rss_growth_pct <= FLAT_PCT,
        "latency_flat": all(d is not None and d <= FLAT_PCT for d in (res.p50_drift_pct, res.p99_drift_pct)),
        "no_leaked_blocks": res.max_leaked_blocks == 0,
        "no_errors": res.errors == 0,
    }
    return res


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _signed(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1f}%"


def report(res: SoakResult) -> None:
    turned = ("the first tenth allocated at least "
              f"{res.tenths[0].blocks_allocated:,} blocks of one KV group against a pool of {res.num_gpu_blocks - 1:,}: "
              + ("every block had been used" if res.pool_turned_over else
                 "perhaps not every block had been used yet (a larger pool)"))
    print(f"\nRSS growth after the first tenth: {_signed(res.rss_growth_pct)} (baseline: RSS at the end of the first "
          f"tenth, {_mib(res.rss_baseline_mib)} MiB; {turned}); peak {_signed(res.rss_peak_growth_pct)}")
    print(f"latency drift, first to last tenth: p50 {_signed(res.p50_drift_pct)}, p99 {_signed(res.p99_drift_pct)}; "
          f"the server's CPU time {_signed(res.cpu_drift_pct)} (not a criterion: less moved by other work on the "
          f"machine's cores)")
    leaked = "the server never became idle" if res.max_leaked_blocks is None else \
        f"{res.leaked_blocks} at the end, at most {res.max_leaked_blocks} over the tenths (before them: {res.leaked_blocks_at_start})"
    print(f"leaked KV blocks: {leaked}; errors: {res.errors} ({res.disconnects:,} disconnects excluded); "
          f"completed {res.completed:,}; wall {res.wall_s:,.0f} s")
    wrong = sum(t.wrong_lengths for t in res.tenths)
    if wrong:
        print(f"note: {wrong} completed requests got another number of tokens than they asked for")
    for e in res.error_samples[:5]:
        print(f"error: {e}")
    if res.tenths[-1].rss_end_by_role_mib:
        first, last = res.tenths[0].rss_end_by_role_mib, res.tenths[-1].rss_end_by_role_mib
        print("RSS by role, end of first -> last tenth (MiB): "
              + "; ".join(f"{k} {first.get(k, 0):,.1f} -> {v:,.1f}" for k, v in last.items()))
    names = {"rss_flat": f"RSS flat within {FLAT_PCT:g}%", "latency_flat": f"p50 / p99 flat within {FLAT_PCT:g}%",
             "no_leaked_blocks": "0 leaked blocks", "no_errors": "no errors"}
    print("criteria: " + "; ".join(f"{names[k]}: {'PASS' if ok else 'FAIL'}" for k, ok in res.criteria.items()))
    if res.left_behind:
        print(f"processes left behind by the server (killed): {', '.join(res.left_behind)}")


def run(args) -> int:
    import asyncio
    import tempfile
    lo_in, hi_in = args.input_len
    lo_out, hi_out = args.output_len
    if args.num_requests < PARTS:
        raise ValueError(f"--num-requests must be >= {PARTS} (ten parts), got {args.num_requests}")
    if not (1 <= lo_in <= hi_in and 1 <= lo_out <= hi_out):
        raise ValueError("--input-len and --output-len: MIN >= 1 and MIN <= MAX")
    if not 0 <= args.disconnect_fraction <= 1 or not 0 <= args.shared_prefix_fraction <= 1:
        raise ValueError("--disconnect-fraction and --shared-prefix-fraction lie in [0, 1]")
    if args.max_concurrency < 1 or args.random_vocab_size < 1 or args.shared_prefix_len < 0:
        raise ValueError("--max-concurrency and --random-vocab-size must be >= 1, --shared-prefix-len >= 0")
    if args.base_url:
        args.tp = args.model_dir = None  # the server's own
        res = asyncio.run(soak(args, args.base_url, args.server_pid))
    else:
        from launch.demo import build_model, default_model_dir
        folder = args.model_dir or default_model_dir()
        if not os.path.exists(os.path.join(folder, "config.json")):
            print(f"building the demo's tiny model in {folder}", flush=True)
            build_model(folder)
        args.model_dir = folder
        args.kv_cache_memory_bytes = args.kv_cache_memory_bytes or 32 * KIB * KIB // args.tp
        fd, log = tempfile.mkstemp(prefix="soak-server-", suffix=".log")
        os.close(fd)
        print(f"starting distengine serve {folder} (TP={args.tp}, CPU, KV pool {args.kv_cache_memory_bytes:,} bytes "
              f"per rank); its log: {log}", flush=True)
        t = time.perf_counter()
        server = start_server(folder, args.tp, args.kv_cache_memory_bytes, log)
        print(f"serving on {server.url} after {time.perf_counter() - t:.0f} s", flush=True)
        procs: list[Proc] = []
        try:
            res = asyncio.run(soak(args, server.url, server.proc.pid))
        finally:
            procs = [p for p in process_tree(server.proc.pid) if p.pid != server.proc.pid]
            status = stop_server(server)
            left = reap_left_behind(procs)
        res.server_exit_status, res.left_behind = status, left
        print(f"server stopped: exit status {status}", flush=True)
    report(res)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(asdict(res), f, indent=1)
    return 0 if all(res.criteria.values()) else 1


if __name__ == "__main__":
    import argparse
    import sys
    parser = argparse.ArgumentParser(prog="python -m launch.bench.soak", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
