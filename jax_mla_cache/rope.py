"""Rotary position embeddings for MLA: cos/sin tables and their application.

The table layout is the vLLM/SGLang convention that `rope_set_mla_kv_buffer` (SPEC §8)
takes: `cos_sin_cache (max_position, rotary_dim)` float32, its first `rotary_dim / 2`
columns cos, its last `rotary_dim / 2` sin, row p for position p.

Two builders:

* `rope_cos_sin_cache` -- plain RoPE, `inv_freq[i] = base ** (-2i / rotary_dim)`.
* `yarn_cos_sin_cache` -- DeepSeek-V2/V3's YaRN scaling (`rope_scaling.type == "yarn"`):
  frequencies blended between interpolated (`/ factor`) and original by a linear ramp over
  the correction range of `beta_fast`/`beta_slow` rotations, and cos/sin multiplied by
  `yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)`
  (1.0 for DeepSeek-V3, whose config sets both to 1.0). The attention's softmax scale
  grows by `yarn_get_mscale(factor, mscale_all_dim) ** 2` (`deepseek_softmax_scale`).

`cos_sin_cache_from_hf_config` builds the right one from a Hugging Face DeepSeek config.

Two rotation styles (`apply_rope`), each pair `(a, b) -> (a*c - b*s, b*c + a*s)` with
`c = cos[pos, i]`, `s = sin[pos, i]`, in float32:

* GPT-J (`is_neox=False`, DeepSeek checkpoints in SGLang/vLLM): pairs `(x[2i], x[2i+1])`,
  kept interleaved.
* neox (`is_neox=True`): pairs `(x[i], x[i + rotary_dim/2])` (rotate-half).

Hugging Face's DeepSeek-V3 (`rope_interleave=True`) applies the GPT-J rotation and then
writes the result de-interleaved (even outputs, then odd ones); queries and keys get the
same permutation, so their dot products, and the attention, are those of GPT-J style.

Positions outside `[0, max_position)` are clamped to the table (documented behaviour of
every RoPE entry point here; the table should cover the model's context).

Equivalent plain code (GPT-J style, one vector at position p)::

    half = rotary_dim // 2
    c, s = table[p, :half], table[p, half:]
    a, b = x[0::2], x[1::2]
    out = stack([a * c - b * s, b * c + a * s], -1).reshape(rotary_dim)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla_cache.config import check_positive_int

F32 = jnp.float32


def _check_rotary_dim(rotary_dim: int) -> int:
  if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, np.integer)):
    raise TypeError(f"rotary_dim must be an int, got {type(rotary_dim).__name__}")
  if rotary_dim <= 0 or rotary_dim % 2:
    raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim}")
  return int(rotary_dim)


def _table(inv_freq: np.ndarray, max_position: int, scale: float = 1.0) -> np.ndarray:
  """(max_position, 2 * len(inv_freq)) float32 [cos | sin] of positions x inv_freq, in
  float32 arithmetic as the PyTorch engines compute it."""
  t = np.arange(check_positive_int(max_position, "max_position"), dtype=np.float32)
  freqs = np.outer(t, inv_freq.astype(np.float32)).astype(np.float32)
  cos = (np.cos(freqs) * np.float32(scale)).astype(np.float32)
  sin = (np.sin(freqs) * np.float32(scale)).astype(np.float32)
  return np.concatenate([cos, sin], axis=-1)


def _positive(value: Any, name: str, *, above: float = 0.0) -> float:
  """`value` as a finite float > `above`, or a ValueError naming it."""
  try:
    x = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"{name} must be a number, got {value!r}") from None
  if isinstance(value, bool) or not math.isfinite(x) or x <= above:
    raise ValueError(f"{name} must be a finite number > {above:g}, got {value!r}")
  return x


def rope_inv_freq(rotary_dim: int, base: float = 10000.0) -> np.ndarray:
  """(rotary_dim / 2,) float32: `base ** (-2i / rotary_dim)`."""
  rotary_dim = _check_rotary_dim(rotary_dim)
  base = _positive(base, "base (rope_theta)", above=1.0)
  exponent = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
  return (np.float32(1.0) / (np.float32(base) ** exponent)).astype(np.float32)


def rope_cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0) -> np.ndarray:
  """Plain RoPE table: (max_position, rotary_dim) float32, [cos | sin] per row."""
  return _table(rope_inv_freq(rotary_dim, base), max_position)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
  """DeepSeek's YaRN magnitude correction: `0.1 * mscale * ln(scale) + 1` (1 if scale <= 1)."""
  if scale <= 1:
    return 1.0
  return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(rotations: float, dim: int, base: float, max_position: int) -> float:
  return (dim * math.log(max_position / (rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_inv_freq(
    rotary_dim: int, base: float, *, factor: float, original_max_position_embeddings: int,
    beta_fast: float = 32.0, beta_slow: float = 1.0,
) -> np.ndarray:
  """(rotary_dim / 2,) float32 YaRN frequencies (DeepSeek-V2/V3, vLLM and Hugging Face)."""
  rotary_dim = _check_rotary_dim(rotary_dim)
  base = _positive(base, "base (rope_theta)", above=1.0)
  factor = _positive(factor, "rope_scaling factor")
  original_max_position_embeddings = _positive(
      original_max_position_embeddings, "rope_scaling original_max_position_embeddings")
  beta_fast = _positive(beta_fast, "rope_scaling beta_fast")
  beta_slow = _positive(beta_slow, "rope_scaling beta_slow")
  pos_freqs = np.float32(base) ** (np.arange(0, rotary_dim, 2, dtype=np.float32)
                                   / np.float32(rotary_dim))
  extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
  interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
  low = math.floor(_yarn_correction_dim(beta_fast, rotary_dim, base,
                                        original_max_position_embeddings))
  high = math.ceil(_yarn_correction_dim(beta_slow, rotary_dim, base,
                                        original_max_position_embeddings))
  low, high = max(low, 0), min(high, rotary_dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float32) - np.float32(low))
                 / np.float32(high - low), 0, 1).astype(np.float32)
  extrapolation_weight = (np.float32(1.0) - ramp).astype(np.float32)
  return (interpolation * (np.float32(1.0) - extrapolation_weight)
          + extrapolation * extrapolation_weight).astype(np.float32)


def yarn_cos_sin_cache(
    max_position: int, rotary_dim: int, base: float, *, factor: float,
    original_max_position_embeddings: int, beta_fast: float = 32.0, beta_slow: float = 1.0,
    mscale: float = 1.0, mscale_all_dim: float = 0.0,
) -> np.ndarray:
  """DeepSeek YaRN table: (max_position, rotary_dim) float32 [cos | sin], both multiplied
  by `yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)`."""
  inv_freq = yarn_inv_freq(
      rotary_dim, base, factor=factor,
      original_max_position_embeddings=original_max_position_embeddings,
      beta_fast=beta_fast, beta_slow=beta_slow)
  scale = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
  return _table(inv_freq, max_position, scale)


def deepseek_softmax_scale(qk_head_dim: int, rope_scaling: Mapping[str, Any] | None) -> float:
  """The attention's softmax scale of DeepSeek-V2/V3: `qk_head_dim ** -0.5`, times
  `yarn_get_mscale(factor, mscale_all_dim) ** 2` under YaRN scaling.

  `qk_head_dim = qk_nope_head_dim + qk_rope_head_dim` (192 for DeepSeek-V3).
  """
  scale = check_positive_int(qk_head_dim, "deepseek_softmax_scale: qk_head_dim") ** -0.5
  if rope_scaling:
    mscale_all_dim = float(rope_scaling.get("mscale_all_dim", 0) or 0)
    if mscale_all_dim:
      m = yarn_get_mscale(float(rope_scaling["factor"]), mscale_all_dim)
      scale *= m * m
  return scale


def cos_sin_cache_from_hf_config(config: Mapping[str, Any], max_position: int | None = None
                                 ) -> np.ndarray:
  """The table for a Hugging Face DeepSeek-V2/V3 `config.json` (a dict).

  Uses `qk_rope_head_dim`, `rope_theta` and `rope_scaling` (None, or type/rope_type
  "yarn" with factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
  mscale_all_dim). `max_position` defaults to `max_position_embeddings`.
  """
  rotary_dim = int(config["qk_rope_head_dim"])
  base = float(config.get("rope_theta", 10000.0))
  if max_position is None:       # (checked by the table, as given: 2.7 is not 2 rows)
    max_position = config["max_position_embeddings"]
  scaling = config.get("rope_scaling")
  if not scaling:
    return rope_cos_sin_cache(max_position, rotary_dim, base)
  kind = scaling.get("rope_type", scaling.get("type"))
  if kind != "yarn":
    raise NotImplementedError(f"rope_scaling type {kind!r}: only 'yarn' (DeepSeek) is supported")
  return yarn_cos_sin_cache(
      max_position, rotary_dim, base, factor=float(scaling["factor"]),
      original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
      beta_fast=float(scaling.get("beta_fast", 32)), beta_slow=float(scaling.get("beta_slow", 1)),
      mscale=float(scaling.get("mscale", 1) or 1),
      mscale_all_dim=float(scaling.get("mscale_all_dim", 0) or 0),
  )


def apply_rope(x: jax.Array, positions: jax.Array, cos_sin_cache: jax.Array, *,
               is_neox: bool = False) -> jax.Array:
  """Rotate the last axis of `x` by the table rows at `positions`; float32 result.

  Args:
    x: (T, ..., rotary_dim) any float dtype.
    positions: (T,) integer positions (clamped to the table).
    cos_sin_cache: (max_position, rotary_dim) float32 [cos | sin].
    is_neox: rotate-half pairs (True) or interleaved GPT-J pairs (False).
  Returns:
    (T, ..., rotary_dim) float32.
  """
  rotary_dim = x.shape[-1]
  if cos_sin_cache.ndim != 2 or cos_sin_cache.shape[1] != rotary_dim:
    raise ValueError(
        f"apply_rope: cos_sin_cache must have shape (max_position, {rotary_dim}), got "
        f"{tuple(cos_sin_cache.shape)}")
  if positions.shape != x.shape[:1]:
    raise ValueError(f"apply_rope: positions must have shape {x.shape[:1]}, got "
                     f"{tuple(positions.shape)}")
  half = rotary_dim // 2
  pos = jnp.clip(positions, 0, cos_sin_cache.shape[0] - 1)
  rows = jnp.asarray(cos_sin_cache, F32)[pos]                        # (T, rotary_dim)
  rows = rows.reshape(rows.shape[:1] + (1,) * (x.ndim - 2) + rows.shape[1:])
  c, s = rows[..., :half], rows[..., half:]
  x = x.astype(F32)
  if is_neox:
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)
  a, b = x[..., 0::2], x[..., 1::2]
  return jnp.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(x.shape)
