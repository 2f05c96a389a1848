"""vLLM's own v1 KV cache manager behind our manager's interface: a same-run reference for
`distengine bench kvcache`.

    from launch.bench.vllm_reference import make_vllm_manager
    simulate(plan, num_blocks_vllm, trace, layout, time_calls=True, make_manager=make_vllm_manager)

`make_vllm_manager(plan, num_blocks)` builds vLLM 0.33.0's `vllm.v1.core.kv_cache_manager.
KVCacheManager` from a vLLM `KVCacheConfig` equivalent to `plan` (same layers, block size,
max_model_len) but grouped by vLLM's own code (`kv_cache_planning.get_kv_cache_groups`: one
FullAttentionSpec group for a full-attention model, 1 full + 6 sliding groups of 10 layers, padded,
for Gemma 3 27B). `num_blocks` is used as given: pass blocks of vLLM's layout, not ours.
Prefix caching is on, with vLLM's default hash (`CacheConfig.prefix_caching_hash_algo` =
"sha256": pickle + SHA-256, NONE_HASH from the fixed seed unless PYTHONHASHSEED is set).

The adapter mirrors what vLLM's scheduler and engine core do around the manager:
- one vLLM `Request` per request id, created at its first lookup with the engine core's block
  hasher (`get_request_block_hasher`), so the prompt's full blocks are hashed at creation;
- tokens our simulator appended since the last call are appended with
  `Request.append_output_token_ids`, which hashes newly completed blocks (vLLM does this in
  `Scheduler.update_from_output`; here it happens at the request's next call, so it is inside the
  timed region, as our own manager's lazy hashing is); `num_computed_tokens` is copied before
  every call;
- admissions (a request not running) call `allocate_slots` with the scheduler's admission
  arguments (`full_sequence_must_fit=True`, vLLM's default `scheduler_reserve_full_isl`, and
  `has_scheduled_reqs`); running requests call `allocate_slots(request, num_new_tokens)` as the
  scheduler's running loop does; `free` is `KVCacheManager.free`, after which the vLLM request is
  kept (status PREEMPTED) so a preempted request resumes with its block hashes, as in vLLM.
  Finished requests are kept too (the adapter cannot tell a finish from a preemption); `forget`
  drops one.
Timing caveat: a request's first prompt call creates its vLLM Request and hashes its whole prompt
(sha256 over pickle: ~440 us of the ~770 us per prompt call on the 600-request trace, full layout;
`hash_algo="xxhash"` saves ~100 us), work vLLM's engine core does before the scheduler sees the
request; decode calls include appending the token (~2.6 us, a hash every 16 tokens).
No watermark, no speculative decoding, no KV connector, no async scheduling
(`num_in_flight_tokens` stays 0), `new_step_starts` is not needed (Mamba only).

Installing the reference (CPU-only machine, system python 3.11 with torch 2.13.0+cpu; vLLM pins
torch 2.14.0 but the KV cache manager runs with 2.13: never let pip resolve dependencies, it would
pull a CUDA torch). No environment variable or platform workaround is needed: importing
`vllm.v1.core.kv_cache_manager` loads no compiled extension and detects no platform.

    pip download --no-deps -d /tmp/vllmdl vllm==0.33.0
    pip install --no-deps --target /tmp/vllm_site /tmp/vllmdl/vllm-0.33.0-*.whl  # ~15 s
    for p in psutil pyzmq msgspec cbor2 aiohttp multidict yarl propcache aiohappyeyeballs aiosignal \\
             frozenlist 'oss-harmony>=0.0.11' openai pillow pybase64 cachetools uvloop prometheus-client \\
             xgrammar==0.2.8 apache-tvm-ffi==0.1.11 'fastapi>=0.133.0,<0.137.0' starlette \\
             partial-json-parser 'llguidance>=1.7.0,<1.8.0'; do
        pip install --no-deps --target /tmp/vllm_site "$p"   # ~1-3 s each, ~35 s in all
    done
    PYTHONPATH=/work/main:/tmp/vllm_site python3 -m launch.cli bench kvcache ...

(The list is what `import vllm.v1.core.kv_cache_manager` asked for, one missing module at a
time, on top of what the system python already had (numpy, pydantic, transformers, ...); versions
follow vLLM's pins where it has them: the newest fastapi (0.165) imports opentelemetry, the
`openai_harmony` module comes from `oss-harmony`. Several are small binary wheels (psutil, pyzmq,
msgspec, aiohttp, ...), not pure Python. Whole install ~1 min with a warm pip cache, ~1 GB on
disk (vllm itself 878 MB); `import vllm.v1.core.kv_cache_manager` takes ~10 s.)

Our project does not depend on vLLM: it is imported lazily, and `make_vllm_manager` raises a
RuntimeError when it is not installed.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from distengine.model_config import CHUNKED, FULL, SLIDING
from distengine.kv_cache.plan import KVCachePlan
from distengine.request import Request

VLLM_VERSION = "0.33.0"
HASH_ALGO = "sha256"  # vLLM's default CacheConfig.prefix_caching_hash_algo


def _import_vllm() -> SimpleNamespace:
    try:
        import torch
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig,
                                                SlidingWindowSpec)
        from vllm.v1.request import Request as VllmRequest
        from vllm.v1.request import RequestStatus
    except ImportError as e:
        raise ImportError(
            f"vLLM is not installed (or lacks a dependency: {e}); the vLLM reference needs vllm=={VLLM_VERSION} "
            f"importable, e.g. installed with --no-deps into /tmp/vllm_site and put on PYTHONPATH: see "
            f"launch/bench/vllm_reference.py") from e
    return SimpleNamespace(torch=torch, vllm=vllm, version=getattr(vllm, "__version__", "?"),
                           SamplingParams=SamplingParams, get_hash_fn_by_name=get_hash_fn_by_name,
                           KVCacheManager=KVCacheManager, get_kv_cache_groups=get_kv_cache_groups,
                           get_request_block_hasher=get_request_block_hasher, init_none_hash=init_none_hash,
                           ChunkedLocalAttentionSpec=ChunkedLocalAttentionSpec, FullAttentionSpec=FullAttentionSpec,
                           KVCacheConfig=KVCacheConfig, SlidingWindowSpec=SlidingWindowSpec, VllmRequest=VllmRequest,
                           RequestStatus=RequestStatus)


_DTYPES = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32"}


def vllm_kv_cache_config(plan: KVCachePlan, num_blocks: int, v: SimpleNamespace | None = None):
    """A vLLM KVCacheConfig for the plan's layers, grouped by vLLM's own `get_kv_cache_groups`."""
    v = v or _import_vllm()
    dtype = getattr(v.torch, _DTYPES[plan.dtype_bytes])
    specs: dict[str, Any] = {}
    for layer in plan.layers:
        if layer.kv_sharing_target:  # vLLM gives KV-sharing layers no spec either
            continue
        heads = layer.bytes_per_token(plan.tp_size, plan.dtype_bytes) // (2 * layer.head_dim * plan.dtype_bytes)
        common = dict(block_size=plan.block_size, num_kv_heads=heads, head_size=layer.head_dim, dtype=dtype)
        if layer.kind == FULL:
            specs[layer.name] = v.FullAttentionSpec(**common)
        elif layer.kind == SLIDING:
            specs[layer.name] = v.SlidingWindowSpec(**common, sliding_window=layer.window)
        elif layer.kind == CHUNKED:
            specs[layer.name] = v.ChunkedLocalAttentionSpec(**common, attention_chunk_size=layer.chunk)
        else:
            raise NotImplementedError(f"{layer.name}: the vLLM reference handles attention layers only "
                                      f"(full, sliding, chunked), not {layer.kind}")
    if len({s.page_size_bytes for s in specs.values()}) > 1:
        raise NotImplementedError("the vLLM reference needs one page size across layers")
    # get_kv_cache_groups reads only these parts of a VllmConfig for attention layers of one page
    # size: no hybrid-manager opt-out, no HiSparse; the KV layout only matters for mixed page sizes.
    stub_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: SimpleNamespace(is_block_outermost=False)),
    )
    groups = v.get_kv_cache_groups(stub_config, specs)
    # No tensors: the manager never reads them (they tell the workers how to allocate).
    return v.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                           hash_block_size=plan.block_size)


class VllmKVCacheManagerAdapter:
    """vLLM's KVCacheManager driven through our manager's interface (see the module docstring)."""

    def __init__(self, plan: KVCachePlan, num_blocks: int, enable_caching: bool = True,
                 hash_algo: str = HASH_ALGO, reserve_full_isl: bool = True) -> None:
        v = self._v = _import_vllm()
        self.plan = plan
        self.block_size = plan.block_size
        self.kv_cache_config = vllm_kv_cache_config(plan, num_blocks, v)
        self.hash_algo = hash_algo
        hash_fn = v.get_hash_fn_by_name(hash_algo)
        v.init_none_hash(hash_fn)  # as EngineCore.__init__ does
        self._block_hasher = v.get_request_block_hasher(self.block_size, hash_fn) if enable_caching else None
        self.manager = v.KVCacheManager(
            kv_cache_config=self.kv_cache_config,
            max_model_len=plan.max_model_len,
            scheduler_block_size=self.block_size,
            hash_block_size=self.block_size,
            enable_caching=enable_caching,
        )
        self.block_pool = self.manager.block_pool
        self._free_queue = self.block_pool.free_block_queue
        self.reserve_full_isl = reserve_full_isl
        # One SamplingParams for every request: the manager reads nothing from it; max_tokens only
        # has to be set for vllm's Request.
        self._sampling_params = v.SamplingParams(max_tokens=plan.max_model_len)
        self._RUNNING = v.RequestStatus.RUNNING
        self._PREEMPTED = v.RequestStatus.PREEMPTED
        self._reqs: dict[str, Any] = {}
        self._num_running = 0

    @property
    def num_groups(self) -> int:
        return len(self.kv_cache_config.kv_cache_groups)

    @property
    def group_sizes(self) -> list[int]:
        """Real layers per group (vLLM leaves the padding slots out of `layer_names`)."""
        return [len(g.layer_names) for g in self.kv_cache_config.kv_cache_groups]

    @property
    def group_size(self) -> int:
        """Layer slots per group, padding included: what one of vLLM's blocks costs, in pages."""
        return max(self.group_sizes)

    @property
    def num_free_blocks(self) -> int:
        return self._free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return self.manager.usage

    def _sync(self, request: Request):
        """The vLLM request for ours, with the tokens ours gained since and its computed count."""
        vreq = self._reqs.get(request.request_id)
        if vreq is None:
            vreq = self._v.VllmRequest(request.request_id, list(request.prompt_token_ids),
                                       sampling_params=self._sampling_params, pooling_params=None,
                                       cache_salt=request.cache_salt, block_hasher=self._block_hasher)
            self._reqs[request.request_id] = vreq
        tokens = request.all_token_ids
        n = vreq.num_tokens
        if len(tokens) > n:
            vreq.append_output_token_ids(tokens[n] if len(tokens) == n + 1 else tokens[n:])
        vreq.num_computed_tokens = request.num_computed_tokens
        return vreq

    def get_computed_blocks(self, request: Request):
        vreq = self._sync(request)
        blocks, num_hit, _shared_prefix_boundary = self.manager.get_computed_blocks(vreq)
        return blocks, num_hit

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks=None):
        vreq = self._sync(request)
        if vreq.status is self._RUNNING:  # the scheduler's loop over running requests
            return self.manager.allocate_slots(vreq, num_new_tokens)
        # The scheduler's admission of a waiting or preempted request.
        new = self.manager.allocate_slots(
            vreq, num_new_tokens, num_new_computed_tokens=num_new_computed_tokens,
            new_computed_blocks=new_computed_blocks, full_sequence_must_fit=self.reserve_full_isl,
            has_scheduled_reqs=self._num_running > 0)
        if new is not None:
            vreq.status = self._RUNNING
            self._num_running += 1
        return new

    def free(self, request: Request) -> None:
        vreq = self._reqs[request.request_id]
        self.manager.free(vreq)
        if vreq.status is self._RUNNING:
            self._num_running -= 1
        # Finished or preempted: kept as a preempted request either way (see the module docstring).
        vreq.status = self._PREEMPTED
        vreq.num_computed_tokens = 0

    def forget(self, request_id: str) -> None:
        """Drop a finished request's vLLM request (its blocks must have been freed)."""
        self._reqs.pop(request_id, None)


def make_vllm_manager(plan: KVCachePlan, num_blocks: int) -> VllmKVCacheManagerAdapter:
    """`simulate`'s make_manager for the vLLM reference: `num_blocks` blocks of vLLM's layout."""
    return VllmKVCacheManagerAdapter(plan, num_blocks)
