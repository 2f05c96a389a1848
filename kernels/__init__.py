"""Triton kernels (paged attention over the shared group buffers, KV store, norms, rotary), each
with a plain-torch reference beside it. `kernels.bench` times them on a GPU."""


def compiled_variants() -> int:
    """How many compiled variants our Triton kernels hold (all devices): a count that grows when
    a kernel is specialised anew, e.g. on an integer argument's value."""
    import importlib
    total = 0
    for name in ("paged_attention", "kv_store", "layernorm", "rotary", "qk_norm_rope", "activation", "gemv",
                 "mamba_conv", "mamba_ssd", "mamba_state_update", "gated_rmsnorm", "fused_moe", "gated_delta"):
        for obj in vars(importlib.import_module(f"kernels.{name}")).values():
            for cache in getattr(obj, "device_caches", {}).values():
                total += len(cache[0])
    return total
