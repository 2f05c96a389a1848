"""The engine's KV cache, decided once on the driver: the plan (the code `distengine kv-plan`
runs, on the model's config.json), how many blocks every rank holds (from what each worker
measured of its memory), and the check that one request of max_model_len fits in them."""
from __future__ import annotations

from distengine.config import EngineConfig
from distengine.kv_cache.plan import KVCachePlan, make_plan
from distengine.model_config import parse_model_config
from distengine.worker_info import MemoryProfile

GIB = 1 << 30


class KVCacheTooSmallError(ValueError):
    """The KV cache cannot hold one request of max_model_len; the message says what would fit."""


def engine_plan(config: EngineConfig, text_config: dict) -> KVCachePlan:
    """The plan of a placed config (its dtype resolved) for the model's text config."""
    model = parse_model_config(text_config, kv_cache_dtype=config.kv_cache_dtype, dtype=config.dtype)
    return make_plan(model, config.tensor_parallel_size,
                     config.block_size, config.max_model_len,
                     mamba_checkpoint_interval=config.mamba_checkpoint_interval)


def num_blocks(config: EngineConfig, plan: KVCachePlan, profiles: list[MemoryProfile], on_gpu: bool) -> int:
    """Blocks per rank (the null block included): `num_gpu_blocks_override` when set; else what
    the smallest rank's share holds: `kv_cache_memory_bytes` when set, else on a GPU what
    `gpu_memory_utilization` of it leaves after the profiling pass and the graphs, on a CPU
    `cpu_kv_cache_space_gib`. Refuses a cache that cannot hold one request of max_model_len."""
    if config.num_gpu_blocks_override is not None:
        n = config.num_gpu_blocks_override
        check_fits(config, plan, n, on_gpu)
        return n
    budgets = [_budget(config, p, on_gpu) for p in profiles]
    rank = min(range(len(budgets)), key=lambda r: budgets[r])
    n = max(0, int(budgets[rank] // plan.block_bytes))
    check_fits(config, plan, n, on_gpu, _how_found(config, profiles[rank]) if on_gpu else "")
    return n


def _budget(config: EngineConfig, p: MemoryProfile, on_gpu: bool) -> float:
    if not on_gpu:
        return config.kv_cache_memory_bytes or config.cpu_kv_cache_space_gib * GIB
    if config.kv_cache_memory_bytes is None:
        return p.usable_bytes(config.gpu_memory_utilization)
    if config.kv_cache_memory_bytes > p.room_bytes:
        raise KVCacheTooSmallError(
            f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} ({config.kv_cache_memory_bytes / GIB:.2f} GiB) "
            f"but only {p.room_bytes / GIB:.2f} GiB of this GPU are left after the model, its activations "
            f"and CUDA graphs")
    return config.kv_cache_memory_bytes


def _how_found(config: EngineConfig, p: MemoryProfile) -> str:
    if config.kv_cache_memory_bytes is not None:
        return f"kv_cache_memory_bytes={config.kv_cache_memory_bytes}"
    return (f"{config.gpu_memory_utilization} x {p.total_bytes / GIB:.1f} GiB, less the peak of the profiling "
            f"pass {p.peak_bytes / GIB:.2f} GiB, memory outside PyTorch's allocator "
            f"{p.outside_torch_bytes / GIB:.2f} GiB and the CUDA graphs {p.graph_bytes / GIB:.2f} GiB")


def check_fits(config: EngineConfig, plan: KVCachePlan, num_blocks: int, on_gpu: bool, how_found: str = "") -> None:
    """One request of max_model_len must fit alone, at its peak: while a prefill chunk of
    max_num_batched_tokens tokens is written, a sliding-window group holds the chunk's blocks
    besides its window's (else the scheduler could never run it). `how_found`: how the cache's
    share of a GPU was found, for the message."""
    chunk = min(config.max_num_batched_tokens, plan.max_model_len)

    def need(length: int) -> int:
        return sum(plan.peak_blocks_per_group(length, chunk)) + 1  # + the null block

    if num_blocks >= need(plan.max_model_len):
        return
    fits, lo, hi = 0, 1, plan.max_model_len
    while lo <= hi:  # the largest length whose request fits
        mid = (lo + hi) // 2
        if need(mid) <= num_blocks:
            fits, lo = mid, mid + 1
        else:
            hi = mid - 1
    if on_gpu:
        advice = "raise gpu_memory_utilization (or set kv_cache_memory_bytes), use more GPUs (tensor_parallel_size)"
        if how_found:
            advice = f"(the cache's share: {how_found}) {advice}"
    else:
        advice = "raise kv_cache_memory_bytes (or VLLM_CPU_KVCACHE_SPACE, in GiB)"
    total = need(plan.max_model_len)
    raise KVCacheTooSmallError(
        f"the KV cache holds {num_blocks} blocks ({num_blocks * plan.block_bytes / GIB:.3f} GiB per rank) "
        f"but one request of max_model_len={plan.max_model_len} needs {total} "
        f"({total * plan.block_bytes / GIB:.3f} GiB) with prefill chunks of up to {chunk} tokens: "
        f"{advice}, lower max_num_batched_tokens, or set max_model_len <= {fits}")
