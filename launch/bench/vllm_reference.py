"""vLLM's own v1 KV cache manager behind our manager's interface: a same-run reference for
`distengine bench kvcache`.

    from launch.bench.vllm_reference import make_vllm_manager
    simulate(plan, num_blocks_vllm, trace, layout, time_calls=True, make_manager=make_vllm_manager)

`make_vllm_manager(plan, num_blocks)` builds vLLM 0.33.0's `vllm.v1.core.kv_cache_manager.
KVCacheManager` from a vLLM `KVCacheConfig` equivalent to `plan` (same layers, block size,
max_model_len) but grouped by vLLM's own code (`kv_cache_planning.get_kv_cache_groups`: one
FullAttentionSpec group for a full-attention model, 1 full + 6 sliding groups of 10 layers, padded,
for Gemma 3 27B). `num_blocks` is used as given: pass blocks of vLLM's layout, not ours
(`vllm_block_bytes(plan)` is the memory of one).
Prefix caching is on, with vLLM's default hash (`CacheConfig.prefix_caching_hash_algo` =
"sha256": pickle + SHA-256, NONE_HASH from the fixed seed unless PYTHONHASHSEED is set), and
vLLM's default `prefix_cache_retention_interval=0`: sliding-window blocks and recurrent states
are kept only where a later request can resume (the block boundary before the prompt's last
token, and the end of the prefix a prompt shares with cached full-attention blocks, the
"shared-prefix junction"), not at every block end (`retention_interval=None`, vLLM's dense
retention, keeps them all: Gemma 3 27B then hits more).

Hybrids of attention and recurrent-state layers (Mamba2, Gated DeltaNet) are set up as vLLM 0.33
sets them up on an H100:
- `mamba_cache_mode="align"` (vLLM's default once prefix caching is on): a state is a page of a
  block, the attention block raised until a page holds a state (`Platform.
  _align_hybrid_block_size`), in multiples of FlashAttention's 16-token kernel block and of the
  state layer's prefill checkpoint alignment: 1 for Mamba2 (`MambaMixer2`), 64 for Gated DeltaNet
  (FlashInfer's GDN prefill, vLLM's choice on Hopper). So vLLM's block of Qwen3.6-35B-A3B is 1088
  tokens where `vllm_plan` (16-token multiples) says 1056; Bamba-9B's is 528 either way. The
  state page is padded to the attention page; `prefix_match_unit` is unset, so hits are whole
  blocks;
- Mamba2 and Gated DeltaNet layers export the state at the prompt's last block boundary from
  inside the prefill (`num_prefill_checkpoint_blocks=1`), so the scheduler does not cut a
  prompt there (it does for a Mamba1 layer, which exports none).

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
  drops one;
- for a hybrid, `new_step_starts` is passed on at each step (a state cached in a step is not a
  hit for a request admitted in the same step), the lookup's shared-prefix boundary is set on the
  request as the scheduler sets it, and each prefill is cut where the scheduler's own
  `Scheduler._mamba_block_aligned_split` cuts it (at a shared-prefix junction, so that its state
  is cached). vLLM runs the pieces in consecutive steps; the adapter allocates them one after the
  other in the one call the simulator makes, as the next step's running loop would (a piece that
  does not fit frees the request and fails the call, where vLLM would preempt another request).
Timing caveat: a request's first prompt call creates its vLLM Request and hashes its whole prompt
(sha256 over pickle: ~440 us of the ~770 us per prompt call on the 600-request trace, full layout;
`hash_algo="xxhash"` saves ~100 us), work vLLM's engine core does before the scheduler sees the
request; decode calls include appending the token (~2.6 us, a hash every 16 tokens).
No watermark, no speculative decoding, no KV connector, no async scheduling
(`num_in_flight_tokens` stays 0).

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

A python without cloudpickle or py-cpuinfo (the project's .venv) needs those two as well
(`pip install --no-deps --target /tmp/vllm_site cloudpickle py-cpuinfo`); `vllm.v1.core.sched.
scheduler`, imported for its prefill cut, needs nothing more. (The list is what `import vllm.v1.
core.kv_cache_manager` asked for, one missing module at a time, on top of what the system python
already had (numpy, pydantic, transformers, ...); versions follow vLLM's pins where it has them:
the newest fastapi (0.165) imports opentelemetry, the
`openai_harmony` module comes from `oss-harmony`. Several are small binary wheels (psutil, pyzmq,
msgspec, aiohttp, ...), not pure Python. Whole install ~1 min with a warm pip cache, ~1 GB on
disk (vllm itself 878 MB); `import vllm.v1.core.kv_cache_manager` takes ~10 s.)

Our project does not depend on vLLM: it is imported lazily, and `make_vllm_manager` raises an
ImportError when it is not installed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from distengine.model_config import CHUNKED, FULL, MAMBA, SLIDING, DeltaNetShape, LayerKV
from distengine.kv_cache.plan import KVCachePlan
from distengine.kv_cache.specs import cdiv
from distengine.request import Request

VLLM_VERSION = "0.33.0"
HASH_ALGO = "sha256"  # vLLM's default CacheConfig.prefix_caching_hash_algo
RETENTION_INTERVAL = 0  # vLLM's default CacheConfig.prefix_cache_retention_interval
# The smallest kernel block of FlashAttention, vLLM's attention backend for these models on an H100.
KERNEL_BLOCK = 16
# vLLM's FLASHINFER_GDN_CHECKPOINT_ALIGNMENT (vllm.v1.attention.backends.gdn_attn, not imported:
# that module loads the kernels' bindings).
GDN_CHECKPOINT_ALIGNMENT = 64


def import_vllm() -> SimpleNamespace:
    """The vLLM modules the reference drives, or an ImportError saying how to install them."""
    try:
        import torch
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig,
                                                MambaSpec, SlidingWindowSpec)
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
                           KVCacheConfig=KVCacheConfig, MambaSpec=MambaSpec, SlidingWindowSpec=SlidingWindowSpec,
                           VllmRequest=VllmRequest, RequestStatus=RequestStatus, Scheduler=Scheduler)


_DTYPES = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32"}


def _state_dtypes(layer: LayerKV, dtype_bytes: int) -> tuple[int, int]:
    """Element sizes of a state layer's (conv, recurrent) state."""
    shape = layer.mamba
    if isinstance(shape, DeltaNetShape):
        return dtype_bytes, shape.state_dtype_bytes
    return dtype_bytes, shape.ssm_dtype_bytes or dtype_bytes


def _state_bytes(layer: LayerKV, plan: KVCachePlan) -> int:
    """A state's bytes as vLLM counts them: its arrays back to back, no alignment between them."""
    conv, ssm = layer.mamba.state_shapes(plan.tp_size)
    conv_bytes, ssm_bytes = _state_dtypes(layer, plan.state_dtype_bytes or plan.dtype_bytes)
    return math.prod(conv) * conv_bytes + math.prod(ssm) * ssm_bytes


def _checkpoint_alignment(layer: LayerKV) -> int | None:
    """Token alignment of the prefill checkpoints vLLM's layer for this state exports (None: it
    exports none, and the scheduler splits a prefill where a state is to be cached)."""
    if isinstance(layer.mamba, DeltaNetShape):
        return GDN_CHECKPOINT_ALIGNMENT
    return 1 if layer.mamba.version == 2 else None


@dataclass(frozen=True)
class HybridLayout:
    """vLLM's layout of a hybrid: the block size every group uses, the (padded) state page and
    the state layers' prefill checkpoint alignment."""
    block_size: int
    state_page_bytes: int
    checkpoint_alignment: int | None


def vllm_hybrid_layout(plan: KVCachePlan) -> HybridLayout | None:
    """What `Platform._align_hybrid_block_size` makes of the plan's model (None: no state layer)."""
    states = [layer for layer in plan.layers if layer.kind == MAMBA and not layer.kv_sharing_target]
    if not states:
        return None
    attn = [layer for layer in plan.layers if layer.kind != MAMBA and not layer.kv_sharing_target]
    if not attn:
        raise NotImplementedError("the vLLM reference needs attention layers besides the state layers")
    alignments = {_checkpoint_alignment(layer) for layer in states}
    if len(alignments) > 1:
        raise NotImplementedError("the vLLM reference handles one kind of state layer per model")
    alignment = alignments.pop()
    page_1_token = max(layer.bytes_per_token(plan.tp_size, plan.dtype_bytes) for layer in attn)
    state_page = max(_state_bytes(layer, plan) for layer in states)
    step = math.lcm(max(KERNEL_BLOCK, plan.requested_block_size), alignment or 1)
    block_size = step * cdiv(state_page, step * page_1_token)
    return HybridLayout(block_size, block_size * page_1_token, alignment)


def vllm_kv_cache_config(plan: KVCachePlan, num_blocks: int, v: SimpleNamespace | None = None,
                         retention_interval: int | None = RETENTION_INTERVAL):
    """A vLLM KVCacheConfig for the plan's layers, grouped by vLLM's own `get_kv_cache_groups`."""
    v = v or import_vllm()
    dtype = getattr(v.torch, _DTYPES[plan.dtype_bytes])
    hybrid = vllm_hybrid_layout(plan)
    block_size = hybrid.block_size if hybrid else plan.block_size
    specs: dict[str, Any] = {}
    for layer in plan.layers:
        if layer.kv_sharing_target:  # vLLM gives KV-sharing layers no spec either
            continue
        if layer.kind == MAMBA:
            assert hybrid is not None
            conv, ssm = layer.mamba.state_shapes(plan.tp_size)
            state_dtypes = _state_dtypes(layer, plan.state_dtype_bytes or plan.dtype_bytes)
            dtypes = tuple(getattr(v.torch, _DTYPES[n]) for n in state_dtypes)
            exports = hybrid.checkpoint_alignment is not None
            specs[layer.name] = v.MambaSpec(
                shapes=(conv, ssm), dtypes=dtypes, block_size=block_size,
                page_size_padded=hybrid.state_page_bytes, mamba_cache_mode="align",
                num_prefill_checkpoint_blocks=int(exports),
                # The checkpoint grid: the block size when prefix_match_unit is unset.
                prefill_checkpoint_alignment=block_size if exports else None)
            continue
        heads = layer.bytes_per_token(plan.tp_size, plan.dtype_bytes) // (2 * layer.head_dim * plan.dtype_bytes)
        common = dict(block_size=block_size, num_kv_heads=heads, head_size=layer.head_dim, dtype=dtype)
        if layer.kind == FULL:
            specs[layer.name] = v.FullAttentionSpec(**common)
        elif layer.kind == SLIDING:
            specs[layer.name] = v.SlidingWindowSpec(**common, sliding_window=layer.window)
        elif layer.kind == CHUNKED:
            specs[layer.name] = v.ChunkedLocalAttentionSpec(**common, attention_chunk_size=layer.chunk)
        else:
            raise NotImplementedError(f"{layer.name}: the vLLM reference handles full, sliding, chunked and "
                                      f"state layers, not {layer.kind}")
    if len({s.page_size_bytes for s in specs.values()}) > 1:
        raise NotImplementedError("the vLLM reference needs one page size across layers")
    # get_kv_cache_groups reads only these parts of a VllmConfig for layers of one page size (a
    # state page is padded to it): no hybrid-manager opt-out, no HiSparse; the KV layout only
    # matters for mixed page sizes.
    stub_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        attention_config=SimpleNamespace(hisparse_config=None),
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: SimpleNamespace(is_block_outermost=False)),
    )
    groups = v.get_kv_cache_groups(stub_config, specs)
    # No tensors: the manager never reads them (they tell the workers how to allocate).
    return v.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                           hash_block_size=block_size, prefix_cache_retention_interval=retention_interval)


def vllm_block_bytes(plan: KVCachePlan) -> int:
    """Memory of one block of vLLM's layout of the plan's model: a page for each layer slot of a group."""
    groups = vllm_kv_cache_config(plan, 1).kv_cache_groups
    return max(len(g.layer_names) for g in groups) * groups[0].kv_cache_spec.page_size_bytes


class VllmKVCacheManagerAdapter:
    """vLLM's KVCacheManager driven through our manager's interface (see the module docstring)."""

    def __init__(self, plan: KVCachePlan, num_blocks: int, enable_caching: bool = True,
                 hash_algo: str = HASH_ALGO, reserve_full_isl: bool = True,
                 retention_interval: int | None = RETENTION_INTERVAL) -> None:
        v = self._v = import_vllm()
        self.plan = plan
        self.kv_cache_config = vllm_kv_cache_config(plan, num_blocks, v, retention_interval)
        if self.kv_cache_config.has_mamba_layers and not enable_caching:
            raise NotImplementedError("without prefix caching vLLM keeps one state per request "
                                      "(mamba_cache_mode='none'): the vLLM reference does not set that up")
        self.block_size = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
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
        self._split_stub = self._scheduler_stub() if self.kv_cache_config.has_mamba_layers else None

    def _scheduler_stub(self) -> SimpleNamespace:
        """What `Scheduler._mamba_block_aligned_split` reads of its scheduler, as the scheduler
        sets it up for this config: hashes of whole blocks, no speculative decoding, and a token
        budget that never cuts a prompt (the simulator computes whole prompts)."""
        mamba = next(g.kv_cache_spec for g in self.kv_cache_config.kv_cache_groups
                     if isinstance(g.kv_cache_spec, self._v.MambaSpec))
        return SimpleNamespace(
            block_size=self.block_size, cache_config=SimpleNamespace(block_size=self.block_size),
            hash_block_size=self.block_size, mamba_partial_cache_hit=False, mamba_shared_prefix_checkpoint=False,
            use_eagle_block_drop=False, num_hash_lookahead_tokens=0,
            mamba_has_prefill_checkpoint_blocks=mamba.num_prefill_checkpoint_blocks > 0,
            mamba_prefill_checkpoint_alignment=mamba.prefill_checkpoint_alignment,
            max_num_scheduled_tokens=self.plan.max_model_len,
            scheduler_config=SimpleNamespace(long_prefill_token_threshold=0))

    def _prefill_piece(self, vreq, num_new_tokens: int, num_new_computed_tokens: int = 0) -> int:
        """The scheduler's cut of a prefill of `num_new_tokens` tokens (all of them: not a hybrid)."""
        if self._split_stub is None:
            return num_new_tokens
        return self._v.Scheduler._mamba_block_aligned_split(self._split_stub, vreq, num_new_tokens,
                                                           num_new_computed_tokens)

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
    def block_bytes(self) -> int:
        """Memory of one block: a page for each layer slot of a group."""
        return self.group_size * self.kv_cache_config.kv_cache_groups[0].kv_cache_spec.page_size_bytes

    @property
    def num_free_blocks(self) -> int:
        return self._free_queue.num_free_blocks

    def new_step_starts(self) -> None:
        self.manager.new_step_starts()

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
        blocks, num_hit, vreq.shared_prefix_boundary = self.manager.get_computed_blocks(vreq)
        return blocks, num_hit

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks=None):
        vreq = self._sync(request)
        if vreq.status is self._RUNNING:  # the scheduler's loop over running requests
            return self.manager.allocate_slots(vreq, num_new_tokens)
        # The scheduler's admission of a waiting or preempted request.
        piece = self._prefill_piece(vreq, num_new_tokens, num_new_computed_tokens)
        new = self.manager.allocate_slots(
            vreq, piece, num_new_computed_tokens=num_new_computed_tokens,
            new_computed_blocks=new_computed_blocks, full_sequence_must_fit=self.reserve_full_isl,
            has_scheduled_reqs=self._num_running > 0)
        if new is None:
            return None
        vreq.status = self._RUNNING
        self._num_running += 1
        # The rest of a cut prefill, as the running loop of the next steps would allocate it.
        done = vreq.num_computed_tokens + num_new_computed_tokens + piece
        end = done - piece + num_new_tokens
        while done < end:
            vreq.num_computed_tokens = done
            piece = self._prefill_piece(vreq, end - done)
            if piece < 1:
                raise RuntimeError(f"request {request.request_id}: the scheduler's prefill cut left nothing "
                                   f"to compute at token {done} of {end}")
            if self.manager.allocate_slots(vreq, piece) is None:
                self.free(request)
                return None
            done += piece
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
