"""RoPE tables and rotation (jax_mla_cache.rope) against float64 numpy formulas."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jax_mla_cache import rope


def test_plain_table_matches_float64_formula():
  table = rope.rope_cos_sin_cache(64, 16, base=10000.0)
  assert table.shape == (64, 16) and table.dtype == np.float32
  inv = 10000.0 ** (-np.arange(0, 16, 2) / 16)
  angles = np.arange(64)[:, None] * inv[None, :]
  np.testing.assert_allclose(table[:, :8], np.cos(angles), atol=2e-5)
  np.testing.assert_allclose(table[:, 8:], np.sin(angles), atol=2e-5)


def test_yarn_table_deepseek_v3_shape_and_scales():
  v3 = dict(qk_rope_head_dim=64, rope_theta=10000.0, max_position_embeddings=163840,
            rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096,
                              beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0))
  table = rope.cos_sin_cache_from_hf_config(v3, max_position=512)
  assert table.shape == (512, 64)
  # mscale == mscale_all_dim: cos^2 + sin^2 == 1 (no magnitude change).
  np.testing.assert_allclose(table[:, :32] ** 2 + table[:, 32:] ** 2, 1.0, atol=1e-5)
  inv = rope.yarn_inv_freq(64, 10000.0, factor=40, original_max_position_embeddings=4096)
  plain = rope.rope_inv_freq(64, 10000.0)
  # High frequencies are kept, the lowest are interpolated by the factor.
  np.testing.assert_allclose(inv[0], plain[0], rtol=1e-6)
  np.testing.assert_allclose(inv[-1], plain[-1] / 40, rtol=1e-6)
  assert np.all(inv <= plain * (1 + 1e-6))
  m = 0.1 * math.log(40) + 1.0
  assert rope.deepseek_softmax_scale(192, v3["rope_scaling"]) == pytest.approx(192 ** -0.5 * m * m)
  assert rope.deepseek_softmax_scale(192, None) == pytest.approx(192 ** -0.5)
  scaled = rope.yarn_cos_sin_cache(8, 64, 10000.0, factor=40,
                                   original_max_position_embeddings=4096, mscale=1.0,
                                   mscale_all_dim=0.0)
  np.testing.assert_allclose(scaled[0, :32], m, rtol=1e-6)  # cos(0) * mscale ratio


@pytest.mark.parametrize("is_neox", [False, True])
def test_apply_rope_matches_float64(is_neox, rng):
  T, H, d = 5, 3, 8
  table = rope.rope_cos_sin_cache(32, d)
  x = rng.standard_normal((T, H, d)).astype(np.float32)
  pos = np.array([0, 1, 7, 31, 40])  # 40: past the table, clamped to 31
  got = np.asarray(rope.apply_rope(jnp.asarray(x), jnp.asarray(pos), jnp.asarray(table),
                                   is_neox=is_neox))
  c = table[np.minimum(pos, 31), : d // 2].astype(np.float64)[:, None]
  s = table[np.minimum(pos, 31), d // 2:].astype(np.float64)[:, None]
  x64 = x.astype(np.float64)
  if is_neox:
    a, b = x64[..., : d // 2], x64[..., d // 2:]
    want = np.concatenate([a * c - b * s, b * c + a * s], -1)
  else:
    a, b = x64[..., 0::2], x64[..., 1::2]
    want = np.stack([a * c - b * s, b * c + a * s], -1).reshape(x.shape)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_gptj_and_hf_interleave_give_the_same_dot_products(rng):
  """HF DeepSeek-V3 de-interleaves before rotate-half: same q.k as GPT-J style."""
  d = 16
  table = rope.rope_cos_sin_cache(16, d)
  q, k = (rng.standard_normal((4, d)).astype(np.float32) for _ in range(2))
  pos = jnp.arange(4)
  gptj = [np.asarray(rope.apply_rope(jnp.asarray(v), pos, table)) for v in (q, k)]
  perm = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
  hf = [np.asarray(rope.apply_rope(jnp.asarray(v[:, perm]), pos, table, is_neox=True))
        for v in (q, k)]
  np.testing.assert_allclose((gptj[0] * gptj[1]).sum(-1), (hf[0] * hf[1]).sum(-1), rtol=1e-5)


def test_bad_arguments():
  with pytest.raises(ValueError, match="rotary_dim"):
    rope.rope_cos_sin_cache(8, 7)
  with pytest.raises(ValueError, match="cos_sin_cache"):
    rope.apply_rope(jnp.zeros((2, 8)), jnp.arange(2), jnp.zeros((4, 6)))
  with pytest.raises(NotImplementedError, match="yarn"):
    rope.cos_sin_cache_from_hf_config(dict(qk_rope_head_dim=8, max_position_embeddings=8,
                                           rope_scaling=dict(type="linear", factor=2)))
