"""The engine's configuration: what the user asked for, checked and resolved once on the driver.

`EngineConfig.create(model, **options)` validates every option, reads the model's config.json
(through the driver's own copy: a folder, or the Hugging Face cache / hub), checks
`max_model_len` against the model's positions, and fills in the derived values (the CUDA graph
batch sizes). The result is a frozen dataclass that travels to every worker as plain data.
Two values depend on where the workers run and are resolved when that is known, each in one
place here: the device and dtype by the executor (`placed`), the token budget from the devices
the workers report (`with_token_budget`).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace

from distengine.model_config import check_kv_cache_dtype
from distengine.worker_info import DeviceInfo

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# Structured outputs' library (`distengine.structured_outputs`): "auto" picks one per kind of spec.
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")


def default_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Decode batch sizes captured as CUDA graphs (a batch runs in the smallest one that holds
    it): fine steps where padding would cost most, coarser ones above."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16)) + list(range(288, 1025, 32))
    out = [s for s in sizes if s < max_num_seqs] + [max_num_seqs]
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class EngineConfig:
    model: str                         # a folder or a hub id, as given (each worker resolves it)
    tokenizer: str | None = None       # None: the model's own
    tensor_parallel_size: int = 1
    device: str = "auto"               # "auto", "cuda" or "cpu"; resolved by the executor (`placed`)
    dtype: str = "auto"                # "auto" or a name in distengine.hf_config.DTYPES; resolved by `placed`
    block_size: int = 16
    # vLLM's name: the attention K/V's dtype, "auto" (the model's) or "fp8" / "fp8_e4m3" (e4m3, 1
    # byte an element, scaled per layer by the checkpoint's k/v scales, else 1.0; twice the tokens
    # in the same memory). Mamba and Gated DeltaNet states keep their own dtypes.
    kv_cache_dtype: str = "auto"
    max_model_len: int = 0             # resolved: the model's max_position_embeddings unless given
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None  # vLLM's name: the KV cache per rank, on any device
    cpu_kv_cache_space_gib: float = 1.0  # a CPU rank's default; VLLM_CPU_KVCACHE_SPACE (GiB) sets it
    enable_prefix_caching: bool = True
    # Mamba hybrids: besides the states kept at each step's last block end and where prompts
    # diverge, keep the recurrent state every this many tokens (rounded up to whole blocks) for
    # prefix hits; None or 0: no periodic ones; 1: every block.
    mamba_checkpoint_interval: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 0    # 0: resolved for the workers' devices (`with_token_budget`)
    seed: int = 0
    ray_address: str | None = None
    placement_strategy: str = "PACK"
    enforce_eager: bool = False        # vLLM's name: no CUDA graphs
    async_scheduling: bool = True      # schedule step N+1 while step N runs
    cuda_graph_sizes: tuple[int, ...] = field(default=())  # resolved from max_num_seqs
    debug_checks: bool = False         # check the workers' block tables against the invariant
    load_format: str = "auto"          # "auto": the checkpoint; "dummy": random weights (benchmarks)
    # vLLM's name. None: the checkpoint's quantization_config (FP8 served, the rest refused by name);
    # "fp8": FP8 linear weights, from an FP8 checkpoint or, with load_format "dummy", random ones
    # in 128 x 128 blocks; "modelopt": a ModelOpt FP8 checkpoint's, or random ones with per-tensor
    # scales (distengine.quantization).
    quantization: str | None = None
    # vLLM's name: "ray" runs the workers as Ray actors even at TP=1; None: Ray only when needed.
    distributed_executor_backend: str | None = None
    # vLLM's name. False: the small all-reduces of TP>1 on GPUs go over NVLink peer-to-peer
    # (symmetric memory, one shot), larger ones NCCL. Off by default here (unlike vLLM) until it is
    # validated end to end; see the README's tensor-parallel section.
    disable_custom_all_reduce: bool = True
    # Structured outputs' library (vLLM's `--structured-outputs-config.backend`): "auto" uses
    # llguidance for JSON schemas, JSON objects, regexes and choices (its bitmask fill is the
    # faster) and xgrammar for grammars (EBNF, as vLLM's default reads them); "xgrammar" or
    # "guidance" (llguidance; grammars are then Lark) for every spec. A request may name its own.
    structured_outputs_backend: str = "auto"

    @classmethod
    def create(cls, model: str, **options) -> "EngineConfig":
        """Checks every option (ValueError / TypeError naming it) and resolves the derived ones."""
        from distengine.hf_config import read_model_config, resolve_dtype
        from distengine.model_config import config_positions, max_positions
        from distengine.quantization import resolve_quantization

        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a folder or a Hugging Face id (str), got {type(model).__name__}")
        # None means "the default" for the derived options, as in vLLM's signatures.
        for name in ("max_model_len", "max_num_batched_tokens"):
            if options.get(name, 0) is None:
                options[name] = 0
        if options.get("cuda_graph_sizes") is None:
            options.pop("cuda_graph_sizes", None)
        space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        if space and "cpu_kv_cache_space_gib" not in options:
            try:
                options["cpu_kv_cache_space_gib"] = float(space)
            except ValueError:
                raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got {space!r}") from None
        cfg = cls(model=str(model), **options)
        cfg._check()
        cfg._check_device()
        hf_config = read_model_config(cfg.model)
        resolve_dtype(hf_config, cfg.dtype, "cpu")  # a dtype we cannot serve is refused now, not on a worker
        hf = hf_config.to_dict()
        resolve_quantization(hf, cfg.quantization, cfg.load_format)  # likewise a quantization
        limit, source = max_positions(hf)
        max_len = cfg.max_model_len or min(limit, config_positions(hf)[0])
        if max_len > limit:
            raise ValueError(f"max_model_len ({max_len}) is larger than the model's positions allow ({limit}: "
                             f"{source}); a prompt past them would read beyond the rotary cache. "
                             f"Set max_model_len <= {limit}")
        sizes = tuple(sorted(set(cfg.cuda_graph_sizes))) or default_graph_sizes(cfg.max_num_seqs)
        if any(s < 1 or s > cfg.max_num_seqs for s in sizes):
            raise ValueError(f"cuda_graph_sizes must lie in [1, max_num_seqs={cfg.max_num_seqs}], got {sizes}")
        return cls(**{**asdict(cfg), "max_model_len": max_len, "cuda_graph_sizes": sizes})

    def _check(self) -> None:
        def want(name: str, ok: bool, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        def integer(name: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")

        for name in ("tensor_parallel_size", "block_size", "max_num_seqs", "seed", "max_model_len",
                     "max_num_batched_tokens"):
            integer(name)
        want("tensor_parallel_size", self.tensor_parallel_size >= 1, ">= 1")
        want("block_size", self.block_size >= 1, ">= 1")
        want("max_num_seqs", self.max_num_seqs >= 1, ">= 1")
        want("max_model_len", self.max_model_len >= 0, ">= 1 (or 0 for the model's own)")
        want("max_num_batched_tokens", self.max_num_batched_tokens >= 0, ">= 1 (or 0 for the default)")
        want("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "in (0, 1]")
        want("cpu_kv_cache_space_gib", self.cpu_kv_cache_space_gib > 0, "> 0")
        if self.kv_cache_memory_bytes is not None:
            integer("kv_cache_memory_bytes")
            want("kv_cache_memory_bytes", self.kv_cache_memory_bytes > 0, "> 0 bytes")
        want("device", isinstance(self.device, str) and (self.device in ("auto", "cpu", "cuda")
                                                         or self.device.startswith("cuda:")),
             "'auto', 'cuda' or 'cpu'")
        want("placement_strategy", self.placement_strategy in PLACEMENT_STRATEGIES, f"one of {PLACEMENT_STRATEGIES}")
        want("load_format", self.load_format in ("auto", "dummy"), "'auto' or 'dummy'")
        check_kv_cache_dtype(self.kv_cache_dtype)
        want("structured_outputs_backend", self.structured_outputs_backend in STRUCTURED_OUTPUTS_BACKENDS,
             f"one of {', '.join(repr(b) for b in STRUCTURED_OUTPUTS_BACKENDS)}")
        want("distributed_executor_backend", self.distributed_executor_backend in (None, "ray", "uni"),
             "None, 'ray' or 'uni'")
        if self.distributed_executor_backend == "uni" and (self.tensor_parallel_size > 1 or self.ray_address):
            raise ValueError("distributed_executor_backend='uni' runs tensor_parallel_size=1 in this process only")
        if self.mamba_checkpoint_interval is not None:
            integer("mamba_checkpoint_interval")
            want("mamba_checkpoint_interval", self.mamba_checkpoint_interval >= 0, ">= 0 tokens (or None)")
        if self.num_gpu_blocks_override is not None:
            integer("num_gpu_blocks_override")
            want("num_gpu_blocks_override", self.num_gpu_blocks_override >= 2, ">= 2")

    def _check_device(self) -> None:
        """A GPU asked for in this process must be there (a Ray cluster's GPUs are checked when the
        placement group is made)."""
        if self.use_ray or os.environ.get("RAY_ADDRESS") or not self.device.startswith("cuda"):
            return
        import torch
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device={self.device!r} but this machine has no CUDA GPU that torch can use "
                             f"(torch {torch.__version__}); use device='cpu' or 'auto'")
        index = int(self.device.split(":")[1]) if ":" in self.device else 0
        if index >= count:
            raise ValueError(f"device={self.device!r} but this machine has {count} CUDA GPU(s) (cuda:0..cuda:{count - 1})")

    def placed(self, gpus_available: bool) -> "EngineConfig":
        """This config for workers that run where GPUs are (or are not) available: the device
        ("auto": a GPU where there is one) and the dtype ("auto": the checkpoint's, served as
        bfloat16 on a GPU when it is float32) resolved. The executor calls it once it knows."""
        from distengine.hf_config import dtype_name, read_model_config, resolve_dtype
        device = self.device_for(gpus_available)
        dtype = resolve_dtype(read_model_config(self.model), self.dtype, device.split(":")[0])
        return replace(self, device=device, dtype=dtype_name(dtype))

    def device_for(self, gpus_available: bool) -> str:
        """The one rule for "auto": a GPU where there is one."""
        if self.device != "auto":
            return self.device
        return "cuda" if gpus_available else "cpu"

    def with_token_budget(self, devices: list[DeviceInfo]) -> "EngineConfig":
        """A step's token budget where this config leaves it to us (0), for the workers' devices:
        vLLM's defaults, 8192 on GPUs of 70 GiB or more (H100, H200; not A100s, on which vLLM
        measured larger budgets lose: its PR 17885), else 2048. Bigger prefill steps run the
        products at a higher rate and interleave fewer steps with the decodes (+8.6% `bench
        throughput` at 8192 on an H200). At least max_model_len up to 8192 (such a prompt in one
        step) and max_num_seqs (every running request decodes each step)."""
        if self.max_num_batched_tokens:
            return self
        large = bool(devices) and all(d.is_cuda and d.total_memory >= LARGE_GPU_BYTES and "a100" not in d.name.lower()
                                      for d in devices)
        base = 8192 if large else 2048
        budget = max(base, self.max_model_len if self.max_model_len <= 8192 else base, self.max_num_seqs)
        return replace(self, max_num_batched_tokens=budget)

    @property
    def use_ray(self) -> bool:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend == "ray"
        return self.tensor_parallel_size > 1 or bool(self.ray_address)


LARGE_GPU_BYTES = 70 << 30
