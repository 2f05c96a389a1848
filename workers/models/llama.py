"""Llama (3.x, rope scaling llama3), the template the other decoder files vary.

Each layer's attention type comes from the config (via the KV cache plan's reader), never from
the model's name: a sliding layer gets its window, a chunked one its chunk.
"""
from __future__ import annotations

import torch
from torch import nn

from distengine.model_config import CHUNKED, SLIDING, decoder_layer_kinds
from kernels.rotary import make_rope_cache
from workers.layers.attention import Attention, AttentionMetadata
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from workers.models.base import DecoderForCausalLM, rope_params
from workers.ops import act_and_mul, qk_norm_rope_op, rms_norm_op, rotary_op
from workers.parallel import TPGroup


class RMSNorm(nn.Module):
    """Replicated weight; `gemma` uses (1 + weight). With a residual: the fused add."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps, self.gemma = eps, gemma

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, feeds_dense_projection: bool = False):
        return rms_norm_op(x, self.weight, self.eps, residual, gemma=self.gemma,
                           feeds_dense_projection=feeds_dense_projection)


def reduce_add_norm(tp: TPGroup, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                    pre_norm: RMSNorm | None = None, reduce: bool = True,
                    feeds_dense_projection: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(pre_norm(all-reduce(x)) + residual), the stream after the add), x being partial sums
    (`reduce`) or already whole. One kernel where it can: the NVLink all-reduce with the norms
    fused (`workers.parallel.NVLinkAllReduce`), or after NCCL's all-reduce both norms in one
    launch (`kernels.layernorm`); two norm launches only when the norms differ in form.
    `feeds_dense_projection`: `kernels.layernorm.rms_norm`'s launch for the norm with the add."""
    same = pre_norm is None or (pre_norm.eps == norm.eps and pre_norm.gemma == norm.gemma)
    if reduce and tp.world_size > 1 and tp.custom is not None and same:
        fused = tp.custom.reduce_norm(x, residual, norm.weight, norm.eps, norm.gemma,
                                      None if pre_norm is None else pre_norm.weight)
        if fused is not None:
            return fused
    if reduce:
        x = tp.all_reduce(x)
    if pre_norm is not None and same:
        return rms_norm_op(x, norm.weight, norm.eps, residual, gemma=norm.gemma, pre_weight=pre_norm.weight,
                           feeds_dense_projection=feeds_dense_projection)
    return norm(x if pre_norm is None else pre_norm(x), residual, feeds_dense_projection=feeds_dense_projection)


class LlamaMLP(nn.Module):
    def __init__(self, config, tp: TPGroup, dtype, device, prefix: str, bias: bool = False,
                 intermediate: int | None = None) -> None:
        super().__init__()
        h, i = config.hidden_size, intermediate or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(h, [i, i], bias, tp, dtype, device, f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(i, h, bias, tp, dtype, device, f"{prefix}.down_proj")
        self.act = act_and_mul(getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), act=self.act)  # (inside an FP8 down_proj's one-row GEMV)


class LlamaAttention(nn.Module):
    qkv_bias = False
    qk_norm = False
    # q_proj gives each head [query | gate] and the attention output is scaled by sigmoid(gate)
    # before o_proj (Qwen3-Next, Qwen3.5).
    output_gate = False

    def __init__(self, config, layer_idx: int, kind: str, tp: TPGroup, dtype, device, prefix: str,
                 rope_cache: torch.Tensor | None) -> None:
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        bias = self.qkv_bias or bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, kv_heads, bias, tp, dtype, device,
                                          f"{prefix}.qkv_proj", q_gate=self.output_gate)
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size,
                                        bool(getattr(config, "attention_bias", False)) and not self.qkv_bias,
                                        tp, dtype, device, f"{prefix}.o_proj")
        if self.qk_norm:
            eps = config.rms_norm_eps
            self.q_norm = RMSNorm(self.head_dim, eps, dtype, device, gemma=self.gemma_norm)
            self.k_norm = RMSNorm(self.head_dim, eps, dtype, device, gemma=self.gemma_norm)
        self.rope_cache = rope_cache
        self.attn = Attention(self.qkv_proj.q_heads, self.qkv_proj.kv_heads, self.head_dim, self.scale(config),
                              f"model.layers.{layer_idx}",
                              sliding_window=config.sliding_window if kind == SLIDING else 0,
                              chunk_size=getattr(config, "attention_chunk_size", 0) if kind == CHUNKED else 0,
                              softcap=self.softcap(config))

    gemma_norm = False

    def scale(self, config) -> float:
        return self.head_dim ** -0.5

    def softcap(self, config) -> float:
        return 0.0

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v, *gate = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(n, -1, self.head_dim)
        k = k.view(n, -1, self.head_dim)
        if self.rope_cache is not None:
            # The launch that finishes the keys stores them and the values too.
            kv = self.attn.kv_write(v, meta)
            if self.qk_norm:
                # One launch, in place on the qkv output (four launches and two copies unfused).
                qk_norm_rope_op(q, k, positions, self.rope_cache, self.q_norm.weight, self.k_norm.weight,
                                self.q_norm.eps, self.gemma_norm, kv_write=kv)
            else:
                rotary_op(q, k, positions, self.rope_cache, kv_write=kv)
            out = self.attn(q, k, v, meta, stored=True)
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            out = self.attn(q, k, v, meta)
        if gate:  # the output gate, applied by o_proj (at one row inside its GEMV)
            return self.o_proj(out, gate=gate[0])
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention
    mlp_cls = LlamaMLP
    gemma_norm = False  # the layer norms scale by (1 + weight)

    def __init__(self, config, layer_idx: int, kind: str, tp, dtype, device, rope_cache) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        eps = config.rms_norm_eps
        self.self_attn = self.attention_cls(config, layer_idx, kind, tp, dtype, device, f"{prefix}.self_attn",
                                            rope_cache)
        self.mlp = self.mlp_cls(config, tp, dtype, device, f"{prefix}.mlp", bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device, gemma=self.gemma_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device, gemma=self.gemma_norm)
        self.tp = tp
        # The attention's all-reduce is fused with the residual add and the norm after it.
        if tp.world_size > 1 and self.forward_declares("reduces_attention"):
            self.self_attn.o_proj.defer_reduce()

    # What this class's own forward all-reduces itself (a deferred output nobody reduces would be
    # wrong, silently): a subclass that writes its own forward declares it again, or nothing is
    # deferred.
    reduces_attention = True

    def forward_declares(self, name: str) -> bool:
        owner = next(c for c in type(self).__mro__ if "forward" in vars(c))
        return bool(vars(owner).get(name, False))

    def attention_out(self, h: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                      pre_norm: RMSNorm | None = None, feeds_dense_projection: bool = False,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output (partial sums when its all-reduce is deferred) through the norms
        that follow it and the residual add."""
        return reduce_add_norm(self.tp, h, residual, norm, pre_norm, reduce=self.self_attn.o_proj.deferred,
                               feeds_dense_projection=feeds_dense_projection)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.attention_out(self.self_attn(positions, h, meta), residual, self.post_attention_layernorm)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    # Checkpoint names of the embedding and the final norm (Bamba's is final_layernorm).
    embed_name, norm_name = "embed_tokens", "norm"

    def __init__(self, config, layers: list[nn.Module], tp, dtype, device, norm: nn.Module) -> None:
        super().__init__()
        setattr(self, self.embed_name, VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp, dtype, device,
                                                              f"model.{self.embed_name}"))
        self.layers = nn.ModuleList(layers)
        setattr(self, self.norm_name, norm)

    @property
    def embedding(self) -> VocabParallelEmbedding:
        return getattr(self, self.embed_name)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(input_ids)

    def forward(self, input_ids, positions, meta):
        x, residual = self.embed(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = getattr(self, self.norm_name)(x, residual)
        return x


def partial_rotary_factor(config) -> float:
    """The share of each head that rotates: a config attribute, or (transformers 5) a key of
    rope_parameters."""
    factor = getattr(config, "partial_rotary_factor", None)
    if factor is None:
        factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor")
    return float(factor or 1.0)


def layer_kinds(config) -> list[str]:
    """Per-layer type (attention type, Mamba...), read as the KV cache plan reads it."""
    return decoder_layer_kinds(config.to_dict())


class LlamaForCausalLM(DecoderForCausalLM):
    decoder_layer_cls = LlamaDecoderLayer
    model_cls = DecoderModel  # a subclass may change the embedding (Gemma scales it)

    def __init__(self, config, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 max_positions: int | None = None) -> None:
        super().__init__()
        self.config, self.tp = config, tp
        # Rows of the rotary caches: every position the engine may run (its max_model_len).
        self.max_positions = max_positions or config.max_position_embeddings
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        kinds = layer_kinds(config)
        caches = self.rope_caches(config, kinds, device)
        layers = [self.make_layer(config, i, kind, tp, dtype, device, caches[i]) for i, kind in enumerate(kinds)]
        self.model = self.model_cls(config, layers, tp, dtype, device, self.final_norm(config, dtype, device))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp, dtype, device, "lm_head")
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embedding.weight

    def make_layer(self, config, i: int, kind: str, tp, dtype, device, rope_cache) -> nn.Module:
        return self.decoder_layer_cls(config, i, kind, tp, dtype, device, rope_cache)

    def final_norm(self, config, dtype, device) -> nn.Module:
        return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def rope_caches(self, config, kinds: list[str], device) -> list[torch.Tensor | None]:
        """One cos/sin cache per distinct (base, scaling), shared by the layers that use it."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rot = int(head_dim * partial_rotary_factor(config))
        cache: dict[str, torch.Tensor] = {}
        out = []
        for kind in kinds:
            base, scaling = rope_params(config, "sliding_attention" if kind == SLIDING else "full_attention")
            key = repr((base, scaling))
            if key not in cache:
                cache[key] = make_rope_cache(rot, self.max_positions, base, scaling, torch.float32, device)
            out.append(cache[key])
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)
