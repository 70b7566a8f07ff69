"""jax_mla_cache: the KV cache for Multi-head Latent Attention in JAX.

Functional core (pure, jittable, donation-friendly) over an immutable pytree state,
Mosaic GPU kernels for Hopper/Blackwell, and a stateful seed-compatible wrapper.
"""

from jax_mla_cache.config import (
    DEEPSEEK_V3,
    DEEPSEEK_V3_FP8,
    NAMED_CONFIGS,
    QUANT_METHODS,
    SMALL,
    SMALL_256,
    MLACacheConfig,
)
from jax_mla_cache.attention import mla_decode, mla_decode_reference
from jax_mla_cache.dispatch import (
    IMPLEMENTATIONS,
    get_mla_kv_buffer,
    move_kv_cache,
    move_kv_pages,
    resolve_implementation,
    set_kv_buffer,
    set_mla_kv_buffer,
)
from jax_mla_cache.offload import HostCopy, get_cpu_copy, load_cpu_copy
from jax_mla_cache import rope
from jax_mla_cache.rope_write import rope_set_mla_kv_buffer
from jax_mla_cache.state import MLAKVCache, StackedMLAKVCache, cache_spec, init_cache
from jax_mla_cache.wrapper import MLATokenToKVPool

__version__ = "0.1.0"

__all__ = [
    "DEEPSEEK_V3", "DEEPSEEK_V3_FP8", "NAMED_CONFIGS", "QUANT_METHODS", "SMALL", "SMALL_256",
    "MLACacheConfig", "MLAKVCache", "StackedMLAKVCache", "init_cache", "cache_spec",
    "IMPLEMENTATIONS", "resolve_implementation",
    "set_kv_buffer", "set_mla_kv_buffer", "get_mla_kv_buffer", "move_kv_cache", "move_kv_pages",
    "mla_decode", "mla_decode_reference", "rope_set_mla_kv_buffer", "rope",
    "HostCopy", "get_cpu_copy", "load_cpu_copy",
    "MLATokenToKVPool",
]
