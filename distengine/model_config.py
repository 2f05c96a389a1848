"""What each layer of a Hugging Face model keeps in the KV cache, read from its config.json.

The hybrid layout always comes from the config's fields (`layer_types`, `sliding_window`,
`sliding_window_pattern`, `attention_chunk_size`, `no_rope_layers`, Mamba layer indices...),
never from the model's name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class ConfigError(ValueError):
    """A config we cannot plan for; the message names what is missing or unsupported."""


CONFIG_DIR = Path(__file__).resolve().parent / "configs"

FULL, SLIDING, CHUNKED, MAMBA, CROSS = "full_attention", "sliding_window", "chunked_local", "mamba", "cross_attention"
# Decoder layers that keep nothing in the cache (Nemotron-H's MLP-only and MoE-only layers), and
# Falcon-H1's layers, where attention and a Mamba mixer run side by side (both keep a cache).
MLP, MOE, PARALLEL = "mlp", "moe", "attention+mamba"
# Gated DeltaNet layers (Qwen3-Next, Qwen3.5): linear attention with a recurrent state. The plan
# keeps their state as it keeps a Mamba layer's (kind MAMBA, a `DeltaNetShape`).
LINEAR = "linear_attention"

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
# vLLM's `kv_cache_dtype` values we serve: "auto" keeps the attention K/V in the model's dtype;
# "fp8" and "fp8_e4m3" store them as e4m3 (torch.float8_e4m3fn), 1 byte an element, with a
# per-layer scale. Mamba and Gated DeltaNet states keep their own dtypes either way.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {', '.join(repr(d) for d in KV_CACHE_DTYPES)}, "
                          f"got {kv_cache_dtype!r}")


@dataclass(frozen=True)
class MambaShape:
    version: int  # 1 (Jamba) or 2 (Bamba, Granite-4, Nemotron-H, Falcon-H1)
    intermediate: int
    d_state: int
    d_conv: int
    n_heads: int = 0  # Mamba2
    d_head: int = 0  # Mamba2
    n_groups: int = 1  # Mamba2
    ssm_dtype_bytes: int = 0  # the SSM state's element size when it differs from the cache's (0: the same)

    def state_elements(self, tp: int) -> int:
        """Conv + SSM state elements of one layer on one of `tp` ranks."""
        conv, ssm = self.state_shapes(tp)
        return conv[0] * conv[1] + ssm[0] * ssm[1] * ssm[2]

    def state_shapes(self, tp: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv state [d_conv - 1, conv channels], SSM state [heads, head dim, d_state]) on one rank;
        Mamba1 as one head of `intermediate` channels."""
        if self.version == 1:
            if self.intermediate % tp:
                raise ConfigError(f"Mamba intermediate size {self.intermediate} is not divisible by tp={tp}")
            inner = self.intermediate // tp
            return (self.d_conv - 1, inner), (1, inner, self.d_state)
        if self.n_heads % tp:
            raise ConfigError(f"Mamba2 heads ({self.n_heads}) are not divisible by tp={tp}")
        groups = mamba_groups_per_rank(self.n_groups, self.n_heads, tp)
        conv_dim = self.intermediate // tp + 2 * groups * self.d_state
        return (self.d_conv - 1, conv_dim), (self.n_heads // tp, self.d_head, self.d_state)

    def layout(self, tp: int, dtype_bytes: int) -> "StateLayout":
        conv, ssm = self.state_shapes(tp)
        return state_layout(conv, ssm, dtype_bytes, self.ssm_dtype_bytes or dtype_bytes)


@dataclass(frozen=True)
class DeltaNetShape:
    """A Gated DeltaNet layer's state: the causal conv's last d_conv - 1 inputs over the q, k and
    v channels (the model's dtype), and the recurrent state [value heads, key dim, value dim] in
    `state_dtype_bytes` (fp32 by default: the delta rule accumulates in it, as vLLM's
    mamba_ssm_cache_dtype). Heads split across ranks: the key heads and the value heads alike."""
    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    d_conv: int
    state_dtype_bytes: int = 4

    def heads_per_rank(self, tp: int) -> tuple[int, int]:
        if self.num_k_heads % tp or self.num_v_heads % tp:
            raise ConfigError(f"Gated DeltaNet heads ({self.num_k_heads} key, {self.num_v_heads} value) are not "
                              f"divisible by tp={tp}")
        if self.num_v_heads % self.num_k_heads:
            raise ConfigError(f"Gated DeltaNet value heads ({self.num_v_heads}) are not a multiple of its key heads "
                              f"({self.num_k_heads})")
        return self.num_k_heads // tp, self.num_v_heads // tp

    def state_shapes(self, tp: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(conv state [d_conv - 1, q + k + v channels], recurrent state [value heads, key dim,
        value dim]) on one of `tp` ranks."""
        hk, hv = self.heads_per_rank(tp)
        return (self.d_conv - 1, 2 * hk * self.k_dim + hv * self.v_dim), (hv, self.k_dim, self.v_dim)

    def layout(self, tp: int, dtype_bytes: int) -> "StateLayout":
        conv, state = self.state_shapes(tp)
        return state_layout(conv, state, dtype_bytes, self.state_dtype_bytes)


@dataclass(frozen=True)
class StateLayout:
    """One Mamba layer's state on one rank, as bytes of its page(s)."""

    conv_shape: tuple[int, int]
    ssm_shape: tuple[int, int, int]
    conv_dtype_bytes: int
    ssm_dtype_bytes: int
    ssm_offset: int
    nbytes: int


def state_layout(conv: tuple[int, int], ssm: tuple[int, int, int], dtype_bytes: int, ssm_bytes: int) -> StateLayout:
    """Where a state layer's conv and SSM (recurrent) states sit in its page(s): conv first, in the
    cache's dtype, then the SSM state in its own at the next 16-byte boundary (aligned vector
    loads)."""
    offset = -(-conv[0] * conv[1] * dtype_bytes // 16) * 16
    return StateLayout(conv, ssm, dtype_bytes, ssm_bytes, offset, offset + ssm[0] * ssm[1] * ssm[2] * ssm_bytes)


def mamba_groups_per_rank(n_groups: int, n_heads: int, tp: int) -> int:
    """B/C groups on one rank: split with the heads when tp divides them, else (one group, or
    tp a multiple of the groups) each rank keeps the group its heads read."""
    if n_groups % tp == 0:
        return n_groups // tp
    if tp % n_groups == 0 and n_heads % tp == 0:
        return 1
    raise ConfigError(f"{n_groups} Mamba2 groups cannot be sharded across tp={tp} ranks "
                      f"(tp must divide the groups or be a multiple of them)")


@dataclass(frozen=True)
class LayerKV:
    name: str
    kind: str
    num_kv_heads: int = 0
    head_dim: int = 0
    window: int = 0
    chunk: int = 0
    mamba: MambaShape | DeltaNetShape | None = None  # a state layer's (kind MAMBA)
    kv_sharing_target: str | None = None  # reads this layer's K/V, allocates nothing

    def bytes_per_token(self, tp: int, dtype_bytes: int) -> int:
        return 2 * _heads_per_rank(self.num_kv_heads, tp, "KV heads") * self.head_dim * dtype_bytes

    def state_bytes(self, tp: int, dtype_bytes: int) -> int:
        assert self.mamba is not None
        return self.mamba.layout(tp, dtype_bytes).nbytes


def _heads_per_rank(n: int, tp: int, what: str) -> int:
    """Heads split across ranks; replicated (one per rank) when tp exceeds them."""
    if n >= tp:
        if n % tp:
            raise ConfigError(f"{n} {what} cannot be split across tp={tp} ranks (not divisible)")
        return n // tp
    if tp % n:
        raise ConfigError(f"{n} {what} cannot be replicated across tp={tp} ranks (tp not a multiple)")
    return 1


@dataclass(frozen=True)
class ModelKVConfig:
    name: str
    architecture: str
    layers: tuple[LayerKV, ...]
    dtype_bytes: int  # an attention K/V element's (the KV cache dtype's)
    max_model_len: int
    # A Mamba / Gated DeltaNet state's element (the model's dtype) when it differs from the K/V's
    # (an fp8 KV cache); 0: the same.
    state_dtype_bytes: int = 0

    @property
    def state_bytes_per_element(self) -> int:
        return self.state_dtype_bytes or self.dtype_bytes


def builtin_names() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_config_dict(name_or_path: str) -> tuple[str, dict]:
    """A built-in name, a config.json path, or a folder holding config.json."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{name_or_path}: folder has no config.json")
    elif not path.is_file():
        builtin = CONFIG_DIR / f"{name_or_path}.json"
        if not builtin.is_file():
            raise ConfigError(f"{name_or_path!r} is neither a config.json, a folder holding one, nor a built-in "
                              f"model ({', '.join(builtin_names())})")
        path = builtin
    try:
        return path.stem if path.parent == CONFIG_DIR else str(name_or_path), json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def _need(cfg: dict, *keys: str, what: str = ""):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    raise ConfigError(f"config lacks {' or '.join(keys)}" + (f" ({what})" if what else ""))


# Published config.json files leave these to the transformers config class's defaults.
_MODEL_TYPE_DEFAULTS: dict[str, dict] = {
    "gemma3_text": {"head_dim": 256, "max_position_embeddings": 131072, "sliding_window_pattern": 6},
    "cohere2": {"sliding_window_pattern": 4},
    "llama4_text": {"no_rope_layer_interval": 4},
    # Gemma4TextConfig's defaults (its full-attention layers' global_head_dim, 512, is applied
    # per layer: `_per_layer_attention`).
    "gemma4_text": {"head_dim": 256, "num_key_value_heads": 4, "max_position_embeddings": 131072,
                    "sliding_window": 512, "sliding_window_pattern": 6},
}
_MODEL_TYPE_DEFAULTS["gemma3"] = _MODEL_TYPE_DEFAULTS["gemma3_text"]
_MODEL_TYPE_DEFAULTS["gemma4"] = _MODEL_TYPE_DEFAULTS["gemma4_text"]
_GEMMA4 = ("gemma4", "gemma4_text")
_GEMMA4_GLOBAL_HEAD_DIM = 512  # Gemma4TextConfig's default global_head_dim
_MODEL_TYPE_DEFAULTS["llama4"] = _MODEL_TYPE_DEFAULTS["llama4_text"]


def parse_model_config(cfg: dict, name: str = "model", kv_cache_dtype: str = "auto",
                       dtype: str = "auto") -> ModelKVConfig:
    """`dtype`: the model's (its states'; "auto": the checkpoint's, bfloat16 for a float32 one,
    as vLLM serves it); `kv_cache_dtype` (KV_CACHE_DTYPES): its attention K/V's."""
    check_kv_cache_dtype(kv_cache_dtype)
    arch = (cfg.get("architectures") or [cfg.get("model_type", "unknown")])[0]
    text = cfg.get("text_config") or cfg
    mt = text.get("model_type") or cfg.get("model_type") or ""
    text = {**_MODEL_TYPE_DEFAULTS.get(mt, {}), **{k: v for k, v in text.items() if v is not None}}
    get = lambda k, d=None: text.get(k, cfg.get(k, d))  # noqa: E731
    num_layers = _num_layers(text)
    heads = get("num_attention_heads")
    kv_heads = get("num_key_value_heads") or heads
    hidden = get("hidden_size")
    head_dim = get("head_dim") or (hidden // heads if hidden and heads else None)
    if dtype == "auto":
        # As vLLM's "auto": a float32 checkpoint is served in bfloat16.
        dtype = get("torch_dtype") or get("dtype") or "bfloat16"
        dtype = "bfloat16" if dtype in ("float32", "float") else dtype
    if dtype not in _DTYPE_BYTES:
        raise ConfigError(f"unsupported model dtype {dtype!r} (one of {', '.join(_DTYPE_BYTES)})")
    kv_bytes = 1 if kv_cache_dtype in FP8_KV_CACHE_DTYPES else _DTYPE_BYTES[dtype]
    max_len = get("max_position_embeddings") or get("max_seq_len") or get("seq_length")
    if not max_len:
        raise ConfigError("config lacks max_position_embeddings: give --max-model-len")

    kinds = _layer_kinds(text, cfg, int(num_layers))
    mamba = _mamba_shape(text, dtype) if MAMBA in kinds or PARALLEL in kinds else None
    deltanet = deltanet_shape(text) if LINEAR in kinds else None
    if any(k in (FULL, SLIDING, CHUNKED, CROSS, PARALLEL) for k in kinds):
        if not heads:
            raise ConfigError("config lacks num_attention_heads")
        if not head_dim:
            raise ConfigError("config lacks head_dim (or hidden_size)")
    window, chunk = get("sliding_window"), get("attention_chunk_size")
    if SLIDING in kinds and not window:
        raise ConfigError("config has sliding-window layers but no sliding_window size")
    if CHUNKED in kinds and not chunk:
        raise ConfigError("config has chunked-attention layers but no attention_chunk_size")

    names = [f"model.layers.{i}" for i in range(num_layers)]
    shared = _kv_sharing(text, kinds, names)
    overrides = _per_layer_attention(text, kinds, mt)

    def attention(i: int, kind: str) -> LayerKV:
        own = overrides.get(i, {})
        return LayerKV(name=names[i], kind=kind, num_kv_heads=int(own.get("num_key_value_heads") or kv_heads),
                       head_dim=int(own.get("head_dim") or head_dim),
                       window=int(window) if kind == SLIDING else 0, chunk=int(chunk) if kind == CHUNKED else 0,
                       kv_sharing_target=shared.get(i))

    layers: list[LayerKV] = []
    for i, k in enumerate(kinds):
        if k == MAMBA:
            layers.append(LayerKV(name=names[i], kind=MAMBA, mamba=mamba))
        elif k == LINEAR:
            layers.append(LayerKV(name=names[i], kind=MAMBA, mamba=deltanet))
        elif k == PARALLEL:  # both keep a cache: the attention under the layer's name
            layers += [attention(i, FULL), LayerKV(name=mamba_layer_name(i, k), kind=MAMBA, mamba=mamba)]
        elif k not in (MLP, MOE):
            layers.append(attention(i, k))
    state_bytes = _DTYPE_BYTES[dtype]
    return ModelKVConfig(name=name, architecture=arch, layers=tuple(layers), dtype_bytes=kv_bytes,
                         max_model_len=int(max_len), state_dtype_bytes=state_bytes if state_bytes != kv_bytes else 0)


def mamba_layer_name(i: int, kind: str) -> str:
    """The cache name of decoder layer i's Mamba mixer."""
    return f"model.layers.{i}.mamba" if kind == PARALLEL else f"model.layers.{i}"


def decoder_layer_kinds(cfg: dict) -> list[str]:
    """Per decoder layer: its attention type, MAMBA, LINEAR (Gated DeltaNet), PARALLEL (attention
    and Mamba side by side), MLP or MOE (no cache). The models build their layers from this, the
    plan its cache."""
    text = _text_with_defaults(cfg)
    return _layer_kinds(text, cfg, _num_layers(text))


def _num_layers(text: dict) -> int:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if text.get(key) is not None:
            return int(text[key])
    # transformers 5 derives Nemotron-H's from its layer list and does not save it.
    for key in ("hybrid_override_pattern", "layers_block_type", "layer_types"):
        if text.get(key):
            return len(text[key])
    raise ConfigError("config lacks num_hidden_layers (number of layers)")


_LAYER_TYPE_NAMES = {
    "full_attention": FULL, "attention": FULL, "global": FULL,
    "sliding_attention": SLIDING, "sliding_window": SLIDING, "local": SLIDING,
    "chunked_attention": CHUNKED,
    "mamba": MAMBA, "mamba2": MAMBA, "linear_attention": LINEAR,
    "cross_attention": CROSS,
    "mlp": MLP, "moe": MOE, "hybrid": PARALLEL,
}
# Nemotron-H's hybrid_override_pattern, one character per layer.
_PATTERN_KINDS = {"M": MAMBA, "*": FULL, "-": MLP, "E": MOE}


def _layer_kinds(text: dict, cfg: dict, n: int) -> list[str]:
    kinds = _layer_kinds_as_stated(text, cfg, n)
    mt = text.get("model_type") or cfg.get("model_type") or ""
    if mt in _GEMMA4 and kinds and kinds[-1] == SLIDING:
        kinds[-1] = FULL  # Gemma4TextConfig forces the last layer to full attention
    return kinds


def _layer_kinds_as_stated(text: dict, cfg: dict, n: int) -> list[str]:
    mt = text.get("model_type") or cfg.get("model_type") or ""
    if text.get("hybrid_override_pattern"):  # Nemotron-H (published config.json files)
        pattern = text["hybrid_override_pattern"]
        if len(pattern) != n:
            raise ConfigError(f"hybrid_override_pattern has {len(pattern)} layers, num_hidden_layers is {n}")
        unknown = sorted(set(pattern) - set(_PATTERN_KINDS))
        if unknown:
            raise ConfigError(f"hybrid_override_pattern has unknown layer code(s) {', '.join(unknown)} "
                              f"(known: M Mamba, * attention, - MLP, E MoE)")
        return [_PATTERN_KINDS[c] for c in pattern]
    if mt == "falcon_h1":  # every layer runs attention and a Mamba mixer side by side
        return [PARALLEL] * n
    key = "layer_types" if text.get("layer_types") else "layers_block_type"
    if text.get(key):  # (transformers 5 writes Nemotron-H's as layers_block_type)
        types = text[key]
        if len(types) != n:
            raise ConfigError(f"{key} has {len(types)} entries for {n} layers")
        unknown = sorted({t for t in types if t not in _LAYER_TYPE_NAMES})
        if unknown:
            raise ConfigError(f"unsupported layer type(s) {', '.join(unknown)} "
                              f"(supported: {', '.join(sorted(_LAYER_TYPE_NAMES))})")
        kinds = [_LAYER_TYPE_NAMES[t] for t in types]
        if LINEAR in kinds and not text.get("linear_num_value_heads"):
            # transformers names some Mamba layers so too: without Gated DeltaNet fields, Mamba.
            if not (text.get("mamba_d_state") or text.get("ssm_state_size")):
                raise ConfigError("linear_attention layers without Gated DeltaNet (linear_num_value_heads, ...) "
                                  "or Mamba (mamba_d_state) fields")
            kinds = [MAMBA if k == LINEAR else k for k in kinds]
        return kinds
    if text.get("full_attention_interval") and text.get("linear_num_value_heads"):  # Qwen3-Next without layer_types
        interval = int(text["full_attention_interval"])
        return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    if text.get("attn_layer_indices") is not None:  # Bamba
        idx = set(text["attn_layer_indices"])
        return [FULL if i in idx else MAMBA for i in range(n)]
    if text.get("attn_layer_period") is not None:  # Jamba
        period, offset = text["attn_layer_period"], text.get("attn_layer_offset", 0)
        return [FULL if i % period == offset else MAMBA for i in range(n)]
    if text.get("cross_attention_layers") is not None:  # Mllama
        idx = set(text["cross_attention_layers"])
        return [CROSS if i in idx else FULL for i in range(n)]
    if text.get("attention_chunk_size") and (text.get("no_rope_layers") is not None
                                             or text.get("no_rope_layer_interval")):  # Llama-4
        flags = text.get("no_rope_layers") or []
        if not flags:  # transformers' default: every interval-th layer is NoPE
            interval = text.get("no_rope_layer_interval", 4)
            flags = [int((i + 1) % interval != 0) for i in range(n)]
        if len(flags) != n:
            raise ConfigError(f"no_rope_layers has {len(flags)} entries for {n} layers")
        # 1 = a RoPE layer, which attends within its chunk; 0 = a NoPE layer with global attention.
        return [CHUNKED if f else FULL for f in flags]
    window = text.get("sliding_window")
    pattern = text.get("sliding_window_pattern") or text.get("_sliding_window_pattern")
    if window and pattern:  # Gemma-3, Cohere2: every pattern-th layer is global
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
    if window and mt == "gemma2":  # alternating, sliding first
        return [SLIDING if i % 2 == 0 else FULL for i in range(n)]
    if window and "use_sliding_window" in text:  # Qwen2/3: off unless asked, from max_window_layers on
        if not text["use_sliding_window"]:
            return [FULL] * n
        first = text.get("max_window_layers", 0)
        return [SLIDING if i >= first else FULL for i in range(n)]
    if window:
        return [SLIDING] * n
    return [FULL] * n


def _mamba_shape(text: dict, cache_dtype: str) -> MambaShape:
    """Bamba / Granite-4 / Falcon-H1 (mamba_*), Nemotron-H (ssm_state_size, conv_kernel,
    mamba_num_heads...) and Jamba (Mamba1) spell the same fields differently."""
    hidden = _need(text, "hidden_size")
    expand = text.get("mamba_expand", text.get("expand", 2))
    d_state = _need(text, "mamba_d_state", "ssm_state_size", what="Mamba state size")
    d_conv = _need(text, "mamba_d_conv", "conv_kernel", what="Mamba conv width")
    ssm_dtype = text.get("mamba_ssm_cache_dtype")
    ssm_bytes = _DTYPE_BYTES.get(ssm_dtype, 0) if ssm_dtype not in (None, "auto", cache_dtype) else 0
    n_heads = text.get("mamba_n_heads") or text.get("mamba_num_heads")
    if n_heads:
        d_head = _need(text, "mamba_d_head", "mamba_head_dim", what="Mamba2 head size")
        if d_head == "auto":
            d_head = (text.get("mamba_d_ssm") or int(expand * hidden)) // n_heads
        groups = text.get("mamba_n_groups", text.get("n_groups", 1))
        return MambaShape(2, int(n_heads * d_head), int(d_state), int(d_conv), int(n_heads), int(d_head), int(groups),
                          ssm_bytes)
    return MambaShape(1, int(expand * hidden), int(d_state), int(d_conv))


def deltanet_shape(text: dict) -> DeltaNetShape:
    """Qwen3-Next / Qwen3.5's linear_* fields; the recurrent state in `mamba_ssm_dtype` when the
    config names one, else fp32."""
    def need(key: str) -> int:
        return int(_need(text, key, what="Gated DeltaNet layer"))
    state_dtype = text.get("mamba_ssm_dtype") or text.get("mamba_ssm_cache_dtype") or "float32"
    if state_dtype not in _DTYPE_BYTES:
        raise ConfigError(f"unsupported Gated DeltaNet state dtype {state_dtype!r}")
    return DeltaNetShape(need("linear_num_key_heads"), need("linear_num_value_heads"), need("linear_key_head_dim"),
                         need("linear_value_head_dim"), need("linear_conv_kernel_dim"), _DTYPE_BYTES[state_dtype])


def _per_layer_attention(text: dict, kinds: list[str], mt: str) -> dict[int, dict]:
    """Per-layer KV heads and head size where they differ from the config's own (transformers'
    `per_layer_config`: layer index -> overridden fields).

    A config may state them explicitly (`per_layer_config`, as transformers 5 saves them). Else
    Gemma 4's full-attention layers have `global_head_dim` (default 512), and
    `num_global_key_value_heads` KV heads when `attention_k_eq_v` is set (Gemma4TextConfig's
    rule: without k_eq_v they keep `num_key_value_heads`)."""
    explicit = text.get("per_layer_config")
    if isinstance(explicit, dict):
        out = {}
        for key, fields in explicit.items():
            i = int(key)
            if not 0 <= i < len(kinds):
                raise ConfigError(f"per_layer_config names layer {key}; the model has {len(kinds)} layers")
            out[i] = {k: v for k, v in (fields or {}).items() if k in ("head_dim", "num_key_value_heads")}
        return out
    if mt not in _GEMMA4:
        return {}
    fields: dict = {"head_dim": text.get("global_head_dim") or _GEMMA4_GLOBAL_HEAD_DIM}
    if text.get("attention_k_eq_v") and text.get("num_global_key_value_heads"):
        fields["num_key_value_heads"] = text["num_global_key_value_heads"]
    return {i: fields for i, kind in enumerate(kinds) if kind == FULL}


def _kv_sharing(text: dict, kinds: list[str], names: list[str]) -> dict[int, str]:
    """Gemma-3n and Gemma 4: the last `num_kv_shared_layers` layers read the K/V of the last
    earlier layer of the same kind (transformers' "reuse" layers; their target is the "store"
    layer of that kind)."""
    n_shared = text.get("num_kv_shared_layers") or 0
    if not n_shared:
        return {}
    first_shared = len(kinds) - n_shared
    out = {}
    for i in range(first_shared, len(kinds)):
        targets = [j for j in range(first_shared) if kinds[j] == kinds[i]]
        if not targets:
            raise ConfigError(f"layer {i} shares KV but no earlier {kinds[i]} layer exists")
        out[i] = names[targets[-1]]
    return out


# Rope types whose config already states the extended length in max_position_embeddings.
_UNSCALED_ROPE = ("default", "su", "longrope", "llama3", "mrope")


def _rope_scalings(text: dict) -> list[dict]:
    """The rope scaling dicts of a text config: transformers 5's `rope_parameters` (one dict, or
    one per layer type as Gemma-3's) or the older `rope_scaling`."""
    found = []
    for key in ("rope_parameters", "rope_scaling"):
        value = text.get(key)
        if isinstance(value, dict):
            nested = [v for v in value.values() if isinstance(v, dict)]
            found += nested or [value]
    return found


def _text_with_defaults(cfg: dict) -> dict:
    text = cfg.get("text_config") or cfg
    mt = text.get("model_type") or cfg.get("model_type") or ""
    return {**_MODEL_TYPE_DEFAULTS.get(mt, {}), **{k: v for k, v in text.items() if v is not None}}


def config_positions(cfg: dict) -> tuple[int, str]:
    """(the positions the config states, the key stating them)."""
    text = _text_with_defaults(cfg)
    for key in ("max_position_embeddings", "max_seq_len", "seq_length", "n_positions"):
        value = text.get(key) or cfg.get(key)
        if value:
            return int(value), key
    raise ConfigError("config lacks max_position_embeddings: give max_model_len")


def max_positions(cfg: dict) -> tuple[int, str]:
    """(the longest sequence the model's positions allow, where that figure comes from).

    As vLLM's derived max_model_len: the config's max_position_embeddings (or max_seq_len,
    seq_length), times the rope scaling factor for scalings that extend it (linear, dynamic,
    yarn from its original_max_position_embeddings); llama3 and longrope configs already state
    the extended length."""
    base, source = config_positions(cfg)
    best, why = base, f"{source}={base} in config.json"
    for rs in _rope_scalings(_text_with_defaults(cfg)):
        kind = rs.get("rope_type", rs.get("type")) or "default"
        factor = rs.get("factor")
        if kind in _UNSCALED_ROPE or not factor:
            continue
        start = int(rs.get("original_max_position_embeddings") or base) if kind == "yarn" else base
        scaled = int(start * float(factor))
        if scaled > best:
            best, why = scaled, f"{source}={base} with {kind} rope scaling x{float(factor):g}"
    return best, why
