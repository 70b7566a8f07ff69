"""Static configuration of an MLA KV cache and the named real-world shapes.

`MLACacheConfig` holds everything that defines the shapes and dtypes of the cache
buffers. It is frozen and hashable: it travels as static pytree metadata of
`MLAKVCache`, so two caches with equal configs share compiled code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

QUANT_METHODS = (None, "per_token_head")
"""Supported storage modes (`quant_method`), see SPEC §2."""

PLAIN_DTYPES = (
    jnp.dtype(jnp.bfloat16),
    jnp.dtype(jnp.float16),
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.float8_e4m3fn),
    jnp.dtype(jnp.float8_e5m2),
)
MODEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def check_positive_int(value: Any, name: str) -> int:
  """`value` as an int >= 1 (a bool is not one), or a ValueError naming `name`."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value!r}")
  return int(value)


def _as_dtype(value: Any, name: str) -> np.dtype:
  try:
    return jnp.dtype(value)
  except TypeError as e:
    raise TypeError(f"{name} must be a JAX dtype, got {value!r}") from e


@dataclasses.dataclass(frozen=True)
class MLACacheConfig:
  """Geometry and storage mode of an MLA token-to-KV pool (SPEC §1-2).

  Attributes:
    size: usable token slots; each layer's buffer has `rows = size + page_size`
      rows (rows `[0, page_size)` are the padded page 0 that padding tokens
      write to).
    page_size: tokens per page.
    kv_lora_rank: latent ("nope") width R, e.g. 512.
    qk_rope_head_dim: rope width Rr, e.g. 64.
    layer_num: number of layers.
    dtype: cache dtype. Plain mode stores rows in it (bf16/f16/f32/fp8);
      per_token_head requires float8_e4m3fn.
    model_dtype: the model's activation dtype; per_token_head stores rope in it
      and dequantizes to it by default.
    quant_method: None (plain) or "per_token_head".
  """

  size: int
  page_size: int
  kv_lora_rank: int
  qk_rope_head_dim: int
  layer_num: int
  dtype: Any = jnp.bfloat16
  model_dtype: Any = jnp.bfloat16
  quant_method: str | None = None

  def __post_init__(self):
    for name in ("size", "page_size", "kv_lora_rank", "qk_rope_head_dim", "layer_num"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
      if value < 0 or (value == 0 and name != "size"):
        raise ValueError(f"{name} must be positive, got {value}")
      object.__setattr__(self, name, int(value))
    if self.size + self.page_size >= 2**31:
      raise ValueError(
          f"size + page_size (the rows of a layer) must be below 2**31, got {self.size} + "
          f"{self.page_size}: slots and page ids are int32 on the device")
    object.__setattr__(self, "dtype", _as_dtype(self.dtype, "dtype"))
    object.__setattr__(self, "model_dtype", _as_dtype(self.model_dtype, "model_dtype"))
    if self.quant_method not in QUANT_METHODS:
      raise ValueError(
          f"quant_method must be one of {QUANT_METHODS}, got {self.quant_method!r}"
      )
    if self.model_dtype not in MODEL_DTYPES:
      raise ValueError(
          f"model_dtype must be one of {[d.name for d in MODEL_DTYPES]}, got {self.model_dtype.name}"
      )
    if self.quant_method == "per_token_head":
      if self.dtype != jnp.float8_e4m3fn:
        raise ValueError(
            "quant_method='per_token_head' needs dtype=float8_e4m3fn, got "
            f"{self.dtype.name}"
        )
    elif self.dtype not in PLAIN_DTYPES:
      raise ValueError(
          f"dtype must be one of {[d.name for d in PLAIN_DTYPES]} for plain storage, "
          f"got {self.dtype.name}"
      )

  # ----------------------------------------------------------------- derived
  @property
  def rows(self) -> int:
    """Token rows per layer buffer: `size + page_size` (page 0 is padding)."""
    return self.size + self.page_size

  @property
  def kv_cache_dim(self) -> int:
    """Row width R + Rr."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  @property
  def quantized(self) -> bool:
    return self.quant_method == "per_token_head"

  @property
  def default_read_dtype(self) -> np.dtype:
    """`get_mla_kv_buffer`'s default dst_dtype (SPEC §4: model_dtype when quantized)."""
    return self.model_dtype if self.quantized else self.dtype

  def buffer_shapes(self) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
    """(shape, dtype) of each buffer of one layer, in storage order."""
    if self.quantized:
      return (
          ((self.rows, 1, self.kv_lora_rank), jnp.dtype(jnp.float8_e4m3fn)),
          ((self.rows, 1, 1), jnp.dtype(jnp.float32)),
          ((self.rows, 1, self.qk_rope_head_dim), self.model_dtype),
      )
    return (((self.rows, 1, self.kv_cache_dim), self.dtype),)

  @property
  def row_bytes(self) -> int:
    """Bytes per token row per layer (all buffers), as the seed counts them."""
    if self.quantized:
      return self.kv_lora_rank + self.qk_rope_head_dim * self.model_dtype.itemsize + 4
    return self.kv_cache_dim * self.dtype.itemsize

  @property
  def page_size_bytes(self) -> int:
    """`page_size * layer_num * row_bytes` (the seed's `page_size_bytes`)."""
    return self.page_size * self.layer_num * self.row_bytes

  @property
  def kv_size_bytes(self) -> int:
    """Bytes of all buffers of all layers."""
    return sum(
        int(np.prod(shape)) * dtype.itemsize for shape, dtype in self.buffer_shapes()
    ) * self.layer_num

  def replace(self, **changes: Any) -> "MLACacheConfig":
    return dataclasses.replace(self, **changes)


# Named real-world shapes, shared by tests, benchmarks and the demo.
DEEPSEEK_V3 = MLACacheConfig(
    size=2**18 - 64, page_size=64, kv_lora_rank=512, qk_rope_head_dim=64,
    layer_num=61, dtype=jnp.bfloat16, model_dtype=jnp.bfloat16,
)
"""DeepSeek-V2/V3/R1 (and Kimi-K2's 512+64 latent): 61 layers, 2^18 rows of 576 bf16."""

DEEPSEEK_V3_FP8 = DEEPSEEK_V3.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
"""DeepSeek-V3 with the per_token_head FP8 cache."""

SMALL = MLACacheConfig(
    size=192, page_size=16, kv_lora_rank=512, qk_rope_head_dim=64, layer_num=2,
)
"""A small 512+64 cache for CPU tests (208 rows, 2 layers)."""

SMALL_256 = SMALL.replace(kv_lora_rank=256)
"""A small 256+64 cache for CPU tests."""

NAMED_CONFIGS = {
    "deepseek_v3": DEEPSEEK_V3,
    "deepseek_v3_fp8": DEEPSEEK_V3_FP8,
    "small": SMALL,
    "small_256": SMALL_256,
}
