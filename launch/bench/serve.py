"""`distengine bench serve`: a load generator for any OpenAI-compatible server, with vLLM's `bench
serve` names. Random prompts of --random-input-len tokens (a --random-prefix-len prefix shared by
all of them, for prefix-cache workloads), --random-output-len tokens each, sent to
/v1/completions with `stream: true` at --request-rate (a Poisson process; inf: all at once),
at most --max-concurrency at a time. Every request is streamed; it prints request throughput,
output tokens/s, and TTFT, TPOT and ITL (mean, median, p99).

Prompts are token ids (exact lengths, ids below --random-vocab-size) unless --tokenizer is given:
then random ids decoded to text, as vLLM does.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass, field


def add_arguments(p) -> None:
    p.add_argument("--base-url", default=None, help="the server, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    p.add_argument("--host", default="127.0.0.1", help="the server's host, without --base-url")
    p.add_argument("--port", type=int, default=8000, help="the server's port, without --base-url")
    p.add_argument("--model", default=None, help="the model name to ask for (default: the server's first)")
    p.add_argument("--api-key", default=None, help="(default: $OPENAI_API_KEY or $DISTENGINE_API_KEY)")
    p.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, a Poisson process; inf sends them all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no bound)")
    p.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens after the shared prefix")
    p.add_argument("--random-output-len", type=int, default=128, help="tokens asked for per request")
    p.add_argument("--random-prefix-len", type=int, default=0, help="tokens of a prefix every prompt shares")
    p.add_argument("--random-vocab-size", type=int, default=1000, help="token ids of random prompts lie below this")
    p.add_argument("--tokenizer", default=None, help="send text prompts made with this tokenizer")
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to go on past EOS (vLLM's extra field)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    p.add_argument("--output-json", default=None, help="write the results here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _prompts(args) -> list:
    return random_prompts(args.seed, args.random_vocab_size, [args.random_input_len] * args.num_prompts,
                          args.random_prefix_len, args.tokenizer)


def random_prompts(seed: int, vocab_size: int, lengths: list[int], prefix_len: int = 0,
                   tokenizer: str | None = None) -> list:
    """One prompt per length: a shared prefix of `prefix_len` random ids, then `length` random ids,
    all below `vocab_size`; with `tokenizer`, the ids decoded to text."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    rows = [prefix + [rng.randrange(vocab_size) for _ in range(n)] for n in lengths]
    if tokenizer is None:
        return rows
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer)
    return [tok.decode([t % tok.vocab_size for t in row]) for row in rows]


async def first_model(client) -> str:
    resp = await client.get("/models")
    if resp.status_code != 200:
        raise RuntimeError(f"GET /v1/models: HTTP {resp.status_code}: {resp.text[:300]}")
    return resp.json()["data"][0]["id"]


def summary(xs: list[float]) -> dict:
    if not xs:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    s = sorted(xs)
    return {"mean": sum(s) / len(s), "median": s[len(s) // 2], "p99": s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]}


@dataclass
class StreamRecord:
    """One streamed completion as the client saw it; times in seconds from its sending."""
    ok: bool = False               # a token came and no error
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None   # to the stream's end, or to the client's closing it
    prompt_tokens: int = 0         # the server's usage chunk's counts
    output_tokens: int = 0
    chunks: int = 0                # chunks that carried tokens
    done: bool = False             # `data: [DONE]` came
    disconnected: bool = False     # the client closed the stream before its end
    error: str | None = None


def open_client(base_url: str, api_key: str | None = None):
    """An httpx client of the server's /v1, with the API key (else $OPENAI_API_KEY or
    $DISTENGINE_API_KEY). Plain HTTP and our own SSE parsing (as vLLM's bench does): the openai
    client builds a pydantic object per streamed chunk, and at hundreds of streams the load
    generator would then be what it measures."""
    import httpx
    key = api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("DISTENGINE_API_KEY") or "none"
    return httpx.AsyncClient(base_url=base_url.rstrip("/") + "/v1", headers={"Authorization": f"Bearer {key}"},
                             timeout=httpx.Timeout(3600.0, connect=30.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024))


async def stream_completion(client, body: dict, disconnect_after: int | None = None) -> StreamRecord:
    """POST /completions with `body` (`stream: true`) and read its events; with
    `disconnect_after`, close the stream once that many chunks of tokens have come, as a client
    that goes away does. A failure is recorded, not raised."""
    rec = StreamRecord()
    t0 = last = time.perf_counter()
    try:
        async with client.stream("POST", "/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    rec.done = True
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"the stream ended with an error: {chunk['error']}")
                # A chunk per step of tokens, its text possibly empty (a server without a
                # tokenizer, text held back for stop strings): vLLM's bench counts it too.
                if chunk.get("choices"):
                    if rec.ttft is None:
                        rec.ttft = now - t0
                    else:
                        rec.itl.append(now - last)
                    last = now
                    rec.chunks += 1
                if chunk.get("usage"):
                    rec.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
                if disconnect_after is not None and rec.chunks >= disconnect_after:
                    rec.disconnected = True
                    break  # leaving the block closes the connection mid-stream
        rec.latency = time.perf_counter() - t0
        rec.ok = rec.ttft is not None
        if not rec.ok:
            rec.error = "the stream ended without a token"
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def _benchmark(args, base_url: str) -> dict:
    import asyncio
    client = open_client(base_url, args.api_key)
    model = args.model or await first_model(client)
    prompts = _prompts(args)
    limit = asyncio.Semaphore(args.max_concurrency or len(prompts))
    rng = random.Random(args.seed + 1)
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(prompts), desc="requests", dynamic_ncols=True)
    body = {"model": model, "max_tokens": args.random_output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True

    async def one(prompt) -> StreamRecord:
        async with limit:
            rec = await stream_completion(client, {**body, "prompt": prompt})
            if bar is not None:
                bar.update(1)
            return rec

    start = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(one(prompt)))
        if math.isfinite(args.request_rate):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    await client.aclose()
    done = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {"model": model, "base_url": base_url, "num_prompts": len(prompts), "completed": len(done),
            "failed": len(records) - len(done), "errors": [r.error for r in records if r.error][:5],
            "duration_s": duration, "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
            "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
            "total_token_throughput": (in_tokens + out_tokens) / duration, "total_input_tokens": in_tokens,
            "total_output_tokens": out_tokens,
            "ttft_ms": {k: v * 1e3 for k, v in summary([r.ttft for r in done]).items()},
            "tpot_ms": {k: v * 1e3 for k, v in summary(tpot).items()},
            "itl_ms": {k: v * 1e3 for k, v in summary([x for r in done for x in r.itl]).items()}}


def run(args) -> int:
    import asyncio
    for name in ("num_prompts", "random_input_len", "random_output_len", "random_vocab_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.random_prefix_len < 0 or not args.request_rate > 0 or (args.max_concurrency or 1) < 1:
        raise ValueError("--random-prefix-len must be >= 0, --request-rate > 0 and --max-concurrency >= 1")
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    res = asyncio.run(_benchmark(args, base_url))
    print(f"\n{'Successful requests':32s} {res['completed']}  (failed {res['failed']})")
    print(f"{'Benchmark duration (s)':32s} {res['duration_s']:.2f}")
    print(f"{'Request throughput (req/s)':32s} {res['request_throughput']:.2f}")
    print(f"{'Output token throughput (tok/s)':32s} {res['output_throughput']:.2f}")
    print(f"{'Total token throughput (tok/s)':32s} {res['total_token_throughput']:.2f}")
    for name in ("ttft", "tpot", "itl"):
        s = res[f"{name}_ms"]
        print(f"{name.upper() + ' ms (mean / median / p99)':32s} {s['mean']:.2f} / {s['median']:.2f} / {s['p99']:.2f}")
    for e in res["errors"]:
        print(f"error: {e}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["completed"] else 1
