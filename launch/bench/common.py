"""What `bench latency` and `bench throughput` share: the model (a folder or hub id, or a random
one of a known shape built locally), the reference ceilings measured in the same run (device copy
bandwidth, matrix-product rate), the roofline of a generation, Hugging Face `generate` on the same
weights, and the decode-step times read from the engine's step log.

Roofline of a decode step: every byte it must read from device memory once, over the copy
bandwidth: this rank's weights, plus each sequence's K/V in every layer (a sliding-window layer
reads at most its window, a chunked one at most its chunk). Of routed experts (MoE layers) a
step reads only those its tokens chose: with uniform routing (what random router weights give)
a layer of E experts, k per token, reads E * (1 - (1 - k/E)^B) of them at batch B. Tensor-
parallel ranks read their shares at the same time, so a step's roofline is one rank's bytes over
one GPU's bandwidth. Roofline of a prefill: its matrix products (2 x active parameters x tokens)
over the measured product rate. Communication and attention FLOPs are not counted: the roofline
is a floor.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from distengine.model_config import KV_CACHE_DTYPES
from distengine.quantization import QUANTIZATION_CHOICES
from kernels.bench.roofline import copy_bandwidth, matmul_rate, synchronize

_GEMMA3 = dict(max_position_embeddings=32768, sliding_window_pattern=6)
# The published gpt-oss checkpoints' quantization_config: experts in MXFP4, the rest bf16.
GPT_OSS_MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
# A shape: (transformers model_type, config fields), or (model_type, (a built-in config of
# distengine/configs, as `distengine kv-plan --config` plans it, changes)).
SHAPES = {
    # Gemma-3 text models (5 sliding-window : 1 full layers), the published shapes.
    "gemma-3-12b": ("gemma3_text", dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                                        num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                        sliding_window=1024, vocab_size=262208, **_GEMMA3)),
    "gemma-3-4b": ("gemma3_text", dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                                       num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                       sliding_window=1024, vocab_size=262208, **_GEMMA3)),
    # A Mamba-2 hybrid: 29 Mamba layers and 3 attention layers. Positions capped (published:
    # 262,144): transformers 5.17's Bamba builds a max_position_embeddings^2 mask (128 GiB).
    "bamba-9b": ("bamba", ("bamba-9b", dict(max_position_embeddings=16384))),
    # Mamba-2 and attention layers, each with 64 routed experts (6 per token) beside a shared MLP;
    # positions capped as Bamba's.
    "granite-4.0-h-tiny": ("granitemoehybrid", ("granite-4.0-h-tiny", dict(max_position_embeddings=16384))),
    # Sliding-window (128) and full layers alternating, attention sinks, 32 experts (4 per token),
    # in bf16 (the published checkpoint keeps its experts in MXFP4: gpt-oss-20b-mxfp4 below).
    "gpt-oss-20b": ("gpt_oss", ("gpt-oss-20b", {})),
    # gpt-oss-20b and -120b as published: experts in MXFP4 (their quantization_config: 4.25 bits a
    # weight, ~61 GB for 120b's 36 layers of 128 experts), the rest in bf16; --load-format dummy
    # only (random experts in the stored format), one H200.
    "gpt-oss-20b-mxfp4": ("gpt_oss", ("gpt-oss-20b", dict(quantization_config=GPT_OSS_MXFP4))),
    "gpt-oss-120b": ("gpt_oss", ("gpt-oss-120b", dict(quantization_config=GPT_OSS_MXFP4))),
    # Gated DeltaNet hybrids (3 linear-attention : 1 gated attention layer), the text models of the
    # published checkpoints: the largest dense one that fits one H200 in bf16, and the MoE one
    # (256 experts, 8 per token, beside a shared expert).
    "qwen3.6-27b": ("qwen3_5_text", ("qwen3.6-27b", {})),
    "qwen3.6-35b-a3b": ("qwen3_5_moe_text", ("qwen3.6-35b-a3b", {})),
    # Llama-4-Scout's language model: 3 chunked-local (8192) RoPE layers : 1 global NoPE layer, 16
    # experts (1 per token, scored on their input) beside a shared expert in every layer. Its 48
    # layers (~215 GB in bf16) fit no single GPU: --num-layers 8 keeps every width (~40 GB).
    "llama-4-scout": ("llama4_text", ("llama-4-scout", {})),
    # Nemotron-3-Nano-30B-A3B: 23 Mamba-2, 23 MoE (128 ungated relu^2 experts, 6 per token, beside
    # a shared expert) and 6 attention layers, one mixer a layer.
    "nemotron-3-nano-30b-a3b": ("nemotron_h", ("nemotron-3-nano-30b-a3b", {})),
    # Gemma 4: 5 sliding-window (head 256) : 1 full layers (head 512, keys as values), the text
    # models of the published checkpoints; 26B-A4B adds 128 experts (8 per token) beside each MLP.
    "gemma-4-31b": ("gemma4_text", ("gemma-4-31b", {})),
    "gemma-4-26b-a4b": ("gemma4_text", ("gemma-4-26b-a4b", {})),
    # Jamba-1.5-Mini: 28 Mamba-1 and 4 attention (GQA, no RoPE) layers, 16 experts (2 per token)
    # on every other layer and a gated MLP on the others; ~52B parameters, ~104 GB in bf16: one
    # H200 with --load-format dummy (its random checkpoint would not fit the disk), an H100 with
    # --num-layers 16 (~52 GB).
    "jamba-mini": ("jamba", ("jamba-mini", {})),
    # For tests on CPU.
    "tiny": ("gemma3_text", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, sliding_window=16, vocab_size=512, **_GEMMA3)),
    "tiny-bamba": ("bamba", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16,
                                 mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16, vocab_size=512,
                                 max_position_embeddings=4096)),
    "tiny-llama4": ("llama4_text", dict(hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
                                        num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        attention_chunk_size=16, interleave_moe_layer_step=2, num_local_experts=4,
                                        num_experts_per_tok=1, floor_scale=8, vocab_size=512,
                                        max_position_embeddings=4096)),
    "tiny-gpt-oss-mxfp4": ("gpt_oss", dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           sliding_window=16, num_local_experts=8, num_experts_per_tok=2,
                                           vocab_size=512, max_position_embeddings=4096,
                                           quantization_config=GPT_OSS_MXFP4)),
    "tiny-granite-moe": ("granitemoehybrid", dict(hidden_size=64, intermediate_size=32, shared_intermediate_size=64,
                                                  num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                                                  num_local_experts=8, num_experts_per_tok=2, num_attention_heads=4,
                                                  num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16,
                                                  mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16,
                                                  position_embedding_type="nope", vocab_size=512,
                                                  tie_word_embeddings=True, max_position_embeddings=4096)),
}


# Per-layer fields of a config: lists with one entry per layer, and lists of layer indices.
PER_LAYER_LISTS = ("layer_types", "layers_block_type", "no_rope_layers")
LAYER_INDEX_LISTS = ("moe_layers", "attn_layer_indices", "mlp_only_layers")


def with_layers(fields: dict, num_layers: int) -> dict:
    """A shape's fields cut (or grown) to its first `num_layers` layers, every width kept: the
    per-layer lists keep their first entries, the lists of layer indices those below it (a
    pattern repeating every few layers, as Llama-4's RoPE / NoPE one, starts as the full model's)."""
    if num_layers < 1:
        raise ValueError(f"--num-layers must be >= 1, got {num_layers}")
    out = dict(fields, num_hidden_layers=num_layers)
    for key in PER_LAYER_LISTS:
        if out.get(key):
            if len(out[key]) < num_layers:
                raise ValueError(f"{key} has {len(out[key])} entries: the shape has no layer {num_layers - 1}")
            out[key] = list(out[key][:num_layers])
    for key in LAYER_INDEX_LISTS:
        if out.get(key) is not None:
            out[key] = [i for i in out[key] if i < num_layers]
    pattern = out.get("hybrid_override_pattern")  # Nemotron-H's: one character a layer
    if pattern:
        if len(pattern) < num_layers:
            raise ValueError(f"hybrid_override_pattern has {len(pattern)} layers: the shape has no layer {num_layers - 1}")
        out["hybrid_override_pattern"] = pattern[:num_layers]
    return out


def shape_config(shape: str, num_layers: int | None = None):
    """The transformers config of a named shape (its first `num_layers` layers when given)."""
    from transformers import AutoConfig
    model_type, fields = SHAPES[shape]
    if isinstance(fields, tuple):  # a built-in config, with changes
        from distengine.model_config import CONFIG_DIR
        name, changes = fields
        fields = json.loads((CONFIG_DIR / f"{name}.json").read_text())
        fields = fields.get("text_config", fields)  # a multimodal checkpoint's language model
        fields = {k: v for k, v in fields.items() if k not in ("model_type", "architectures", "torch_dtype")}
        fields.update(changes)
    if num_layers is not None:
        fields = with_layers(fields, num_layers)
    return AutoConfig.for_model(model_type, **fields)

def add_model_arguments(p) -> None:
    p.add_argument("--model", default=None,
                   help="a model folder or Hugging Face id (default: a random model of --shape, built once)")
    p.add_argument("--shape", default="gemma-3-12b", choices=sorted(SHAPES),
                   help="the random model's shape when --model is not given (default: %(default)s)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="the random model's first N layers of --shape, every width kept (a model too large for "
                        "the GPUs, e.g. llama-4-scout) (default: all of the shape's)")
    p.add_argument("--model-dir", default=None,
                   help="where the random model is built (default: ~/.cache/distengine/bench-SHAPE, "
                        "bench-SHAPE-NL with --num-layers N)")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, help="tensor-parallel GPUs (default: 1)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="(default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="model dtype (default: the checkpoint's; bfloat16 on GPUs)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="(default: the longest prompt plus output the benchmark runs)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="(default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: 8192 on GPUs of 70 GiB or more, else 2048; at least "
                        "max-model-len up to 8192)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the attention K/V's dtype: auto (the model's) or fp8 / fp8_e4m3 (e4m3 with per-layer "
                        "scales) (default: %(default)s)")
    p.add_argument("--no-enable-prefix-caching", action="store_true", help="no prefix caching")
    p.add_argument("--mamba-checkpoint-interval", type=int, default=None,
                   help="Mamba hybrids: also keep the state every N tokens for prefix hits (default: only "
                        "at each step's last block end and where prompts diverge; 1: every block)")
    p.add_argument("--no-async-scheduling", action="store_true", help="no overlap of scheduling and execution")
    p.add_argument("--custom-all-reduce", action="store_true",
                   help="TP>1: small all-reduces over NVLink peer-to-peer (opt-in; NCCL otherwise)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights, no checkpoint read (no --hf then) (default: %(default)s)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                   help="fp8: FP8 linear weights (an FP8 checkpoint's, or with --load-format dummy random ones in "
                        "128x128 blocks); modelopt: a ModelOpt FP8 checkpoint's (dummy: per-tensor scales); the "
                        "roofline counts the weights' bytes as stored (default: the checkpoint's)")
    p.add_argument("--hf", action="store_true", help="also time transformers' generate() on the same weights")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--output-json", default=None, help="write the results here")


def resolve_model(args) -> str:
    if args.hf and args.load_format == "dummy":
        raise ValueError("--hf needs the checkpoint's weights: not with --load-format dummy")
    num_layers = getattr(args, "num_layers", None)
    if args.model:
        if num_layers is not None:
            raise ValueError("--num-layers changes a random model of --shape: not with --model")
        return args.model
    name = f"bench-{args.shape}" + (f"-{num_layers}L" if num_layers is not None else "")
    folder = args.model_dir or os.path.join(os.path.expanduser("~"), ".cache", "distengine", name)
    if not os.path.exists(os.path.join(folder, "config.json")):
        build_random_model(folder, args.shape, args.device, weights=args.load_format != "dummy", num_layers=num_layers)
    return folder


def build_random_model(folder: str, shape: str, device: str = "auto", weights: bool = True,
                       num_layers: int | None = None) -> None:
    """A model of a named shape (its first `num_layers` layers when given) with transformers'
    random initialisation, saved in bf16 (only its config.json without `weights`, for
    --load-format dummy)."""
    import torch
    from transformers import AutoModelForCausalLM
    dev = "cuda" if device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    cfg = shape_config(shape, num_layers)
    if weights and getattr(cfg, "quantization_config", None):
        raise ValueError(f"the {shape} shape keeps weights quantized ({cfg.quantization_config['quant_method']}): "
                         f"run it with --load-format dummy (random weights in the stored format)")
    if not weights:
        cfg.architectures = [AutoModelForCausalLM._model_mapping[type(cfg)].__name__]
        cfg.dtype = "bfloat16"
        os.makedirs(folder, exist_ok=True)
        cfg.save_pretrained(folder)
        return
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16 if dev == "cuda" else torch.float32)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder)
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()


# ---- ceilings measured in the same run ----------------------------------------------------------
# Measured by `kernels.bench.roofline`; this wrapper is what `collective_rpc` runs on a worker, so
# the figures come from the device the engine runs on and the workers need not know the lab.
def measure_ceilings(worker) -> tuple[float, float]:
    """(copy bandwidth in bytes/s, matrix-product rate in FLOP/s) of a worker's device, run on the
    worker through `collective_rpc`: the roofline, measured where the engine runs."""
    return copy_bandwidth(str(worker.device)), matmul_rate(str(worker.device))


# ---- the roofline -----------------------------------------------------------------------------------
@dataclass
class Roofline:
    weight_bytes: int  # one rank's, routed experts not included
    layers: tuple      # the plan's LayerKV
    tp: int
    dtype_bytes: int   # the model's (weights, Mamba states)
    bandwidth: float   # bytes/s, one GPU
    matmul: float      # FLOP/s, one GPU
    num_params: int    # the whole model's that a token passes through (its k experts, not all)
    experts: tuple = ()  # (experts, experts per token, one rank's bytes of them) per MoE layer
    kv_dtype_bytes: int = 0  # an attention K/V element as the cache stores it (1: fp8); 0: dtype_bytes

    def expert_bytes(self, batch: int) -> float:
        """Routed-expert bytes a step of `batch` tokens reads, its experts chosen uniformly."""
        return sum(size * (1.0 - (1.0 - k / e) ** batch) for e, k, size in self.experts)

    def kv_bytes(self, context: int) -> int:
        """Cache bytes one rank moves in a decode step of one sequence of `context` tokens, every
        layer: attention K/V read (as stored: 1 byte an element in an fp8 cache); a Mamba layer's
        state read and written back."""
        total = 0
        for layer in self.layers:
            if layer.kind == "mamba":
                total += 2 * layer.state_bytes(self.tp, self.dtype_bytes)
                continue
            tokens = context
            if layer.window:
                tokens = min(context, layer.window)
            if layer.chunk:
                tokens = min(context, layer.chunk)
            total += tokens * layer.bytes_per_token(self.tp, self.kv_dtype_bytes or self.dtype_bytes)
        return total

    def decode_step_s(self, contexts: list[int]) -> float:
        weights = self.weight_bytes + self.expert_bytes(len(contexts))
        return (weights + sum(self.kv_bytes(c) for c in contexts)) / self.bandwidth

    def decode_s(self, batch: int, input_len: int, output_len: int) -> float:
        """The decode steps of a batch: step j reads contexts of input_len + j tokens."""
        return sum(self.decode_step_s([input_len + j] * batch) for j in range(1, output_len))

    def prefill_s(self, tokens: int) -> float:
        return 2 * self.num_params * tokens / (self.matmul * self.tp)


def expert_layers(worker) -> list[tuple[int, int, int, int, int]]:
    """(experts, experts per token, this rank's bytes of their weights as stored, their weights'
    count, and the elements of the tensors that store them) per routed-experts layer, run on a
    worker through `collective_rpc`: a decode step reads only the experts its tokens chose (a
    shared expert kept in the same stack is not one of them); MXFP4 experts are 4.25 bits a
    weight, stored as bytes of two weights and scales."""
    from workers.layers.moe import FusedMoE
    return [(m.num_experts, m.top_k, m.routed_bytes(), m.routed_params(), m.routed_elements())
            for m in worker.runner.model.modules() if isinstance(m, FusedMoE)]


def weight_elements(worker) -> int:
    """Elements of a worker's weights (FP8 ones count one each, as bf16 ones: the product's
    FLOPs), run on it through `collective_rpc`."""
    return sum(p.numel() for p in worker.runner.model.parameters())


def roofline_of(engine, bandwidth: float | None = None, matmul: float | None = None) -> Roofline:
    """The roofline of the model an `LLM` or `AsyncLLM` serves; the ceilings not given are
    measured on rank 0's device, where the engine runs."""
    import math
    if bandwidth is None or matmul is None:
        bandwidth, matmul = engine.collective_rpc(measure_ceilings, ranks=[0])[0]
    layers = engine.collective_rpc(expert_layers, ranks=[0])[0]
    experts = tuple((e, k, size) for e, k, size, *_ in layers)
    info = engine.info
    plan = info.plan
    from distengine.hf_config import read_model_config
    hf = read_model_config(info.config.model).get_text_config()
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[info.config.dtype]
    # Bytes as stored (FP8 linear weights one byte an element, with their scales; MXFP4 experts
    # 4.25 bits a weight); parameters counted by weight (the routed experts' by `routed_params`).
    weight_bytes = info.memory[0].weight_bytes - sum(size for _, _, size in experts)
    elements = engine.collective_rpc(weight_elements, ranks=[0])[0] - sum(stored for *_, stored in layers)
    num_params = (elements + sum(params * k / e for e, k, _, params, _ in layers)) * plan.tp_size
    # Untied embeddings are read in full only for the rows used: count the LM head, not the table.
    if not getattr(hf, "tie_word_embeddings", True):
        num_params -= hf.vocab_size * hf.hidden_size
        weight_bytes -= math.ceil(hf.vocab_size / plan.tp_size) * hf.hidden_size * dtype_bytes
    return Roofline(weight_bytes, plan.layers, plan.tp_size, dtype_bytes, bandwidth, matmul, int(num_params),
                    experts, kv_dtype_bytes=plan.dtype_bytes)


def routing_note(rf: Roofline) -> str | None:
    """What the roofline assumes of a model with routed experts (None without experts)."""
    if not rf.experts:
        return None
    return ("routed experts: the roofline assumes uniform routing (E * (1 - (1 - k/E)^B) of a layer's E experts read "
            "at batch B); tokens that pick the same experts (random --load-format dummy weights often do) read fewer, "
            "and the figure may pass the roofline")


def engine_summary(info) -> dict:
    """What a benchmark's JSON records of the engine it measured (an `EngineInfo`)."""
    cfg, plan = info.config, info.plan
    return dict(device=info.devices[0].device, device_name=info.devices[0].name, tp_size=plan.tp_size,
                dtype=cfg.dtype, kv_cache_dtype=cfg.kv_cache_dtype, quantization=cfg.quantization,
                weight_bytes=info.memory[0].weight_bytes, block_size=plan.block_size,
                block_bytes=plan.block_bytes, num_blocks=info.num_blocks, num_groups=len(plan.groups),
                max_model_len=plan.max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
                cuda_graphs=list(cfg.cuda_graph_sizes) if info.uses_cuda_graphs else [],
                graph_memory_bytes=info.memory[0].graph_bytes)


# ---- the engine's own figures --------------------------------------------------------------------
def random_prompts(vocab_size: int, batch: int, input_len: int, seed: int) -> list[dict]:
    import torch
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, max(11, vocab_size - 10), (batch, input_len), generator=g)
    return [{"prompt_token_ids": row} for row in ids.tolist()]


def decode_steps(log: list, batch: int) -> list[float]:
    """Durations of the steps in which all `batch` sequences decoded (one token each), from the
    engine's step log (`StepRecord`s): the time between the ends of consecutive steps. With
    overlapped scheduling the loop waits on the device each step, so this is the device's step
    time once the host keeps up."""
    return [b.end_time - a.end_time for a, b in zip(log, log[1:]) if b.decode_only and b.num_seqs == batch]


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def hf_generate(model: str, prompts: list[dict], output_len: int, device: str) -> float:
    """transformers' generate() on the same weights, greedy, a fixed output length: output tokens/s
    (NaN, with a note on stderr, when it runs out of device memory: the reference's own limit)."""
    import sys

    import torch
    from transformers import AutoModelForCausalLM
    from distengine.hf_config import resolve_model_path
    dev = "cuda" if device in ("auto", "cuda") and torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    where = {"device_map": dev} if dev == "cuda" else {}
    m = AutoModelForCausalLM.from_pretrained(str(resolve_model_path(model)), dtype=dtype, **where).eval()
    ids = torch.tensor([p["prompt_token_ids"] for p in prompts], device=dev)
    try:
        with torch.no_grad():
            m.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, do_sample=False)
            synchronize(dev)
            t = time.perf_counter()
            out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False)
            synchronize(dev)
            dt = time.perf_counter() - t
        n = (out.shape[1] - ids.shape[1]) * ids.shape[0]
        return n / dt
    except torch.OutOfMemoryError as e:
        print(f"transformers generate() at batch {len(prompts)}: out of memory ({str(e).splitlines()[0]})",
              file=sys.stderr)
        return float("nan")
    finally:
        del m
        if dev == "cuda":
            torch.cuda.empty_cache()


def engine_options(args, max_model_len: int) -> dict:
    """The engine options (`EngineConfig`'s fields) that the bench commands' flags name."""
    return dict(tensor_parallel_size=args.tensor_parallel_size, device=args.device, dtype=args.dtype,
                max_model_len=args.max_model_len or max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
                async_scheduling=not args.no_async_scheduling, seed=args.seed, load_format=args.load_format,
                quantization=getattr(args, "quantization", None),
                disable_custom_all_reduce=not args.custom_all_reduce,
                enable_prefix_caching=not args.no_enable_prefix_caching,
                mamba_checkpoint_interval=args.mamba_checkpoint_interval,
                distributed_executor_backend=getattr(args, "distributed_executor_backend", None))


def make_llm(args, model: str, max_model_len: int):
    from distengine import LLM
    return LLM(model, **engine_options(args, max_model_len))


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)


def print_table(rows: list[tuple[str, str, str, str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


def has_cuda(device: str) -> bool:
    import torch
    return device in ("auto", "cuda") and torch.cuda.is_available()
