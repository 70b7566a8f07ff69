"""A numpy model of the seed pool (SPEC §3-5), independent of the JAX code.

numpy's `/` is an IEEE division and ml_dtypes casts round to nearest even, so
this model pins the bits the JAX reference and the kernels must reproduce.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F8 = np.dtype(ml_dtypes.float8_e4m3fn)


def np_dtype(dtype) -> np.dtype:
  return np.dtype(dtype)


def cast_to_storage(x: np.ndarray, dtype) -> np.ndarray:
  dtype = np_dtype(dtype)
  if dtype in (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)):
    limit = float(ml_dtypes.finfo(dtype).max)
    return np.clip(x.astype(np.float32), -limit, limit).astype(dtype)
  return x.astype(dtype)


def quantize(nope: np.ndarray, rope: np.ndarray, rope_dtype):
  """The seed's torch expressions, in numpy (SPEC §3)."""
  nope = nope.astype(np.float32)
  with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
    amax = np.max(np.abs(nope), axis=-1, keepdims=True)
    scale = np.maximum(amax, np.float32(1e-26)) * (np.float32(1) / np.float32(448))
    q = np.clip(nope / scale, -448, 448).astype(F8)
    rope_stored = (rope.astype(np.float32) / scale).astype(np_dtype(rope_dtype))
  return q, scale.astype(np.float32), rope_stored


def dequantize(q, scale, rope_stored, dst_dtype):
  dst = np_dtype(dst_dtype)
  return (cast_to_storage(q.astype(np.float32) * scale, dst),
          cast_to_storage(rope_stored.astype(np.float32) * scale, dst))


class NumpyPool:
  """Per layer, a list of numpy buffers mirroring `MLAKVCache.buffers`."""

  def __init__(self, config):
    self.config = config
    self.buffers = [
        [np.zeros(shape, np_dtype(dtype)) for shape, dtype in config.buffer_shapes()]
        for _ in range(config.layer_num)
    ]

  @classmethod
  def from_cache(cls, cache):
    pool = cls(cache.config)
    pool.buffers = [[np.array(b) for b in layer] for layer in cache.buffers]
    return pool

  def _valid(self, idx):
    return [(i, int(r)) for i, r in enumerate(np.asarray(idx)) if 0 <= r < self.config.rows]

  def set_mla(self, layer_id, loc, nope, rope):
    cfg = self.config
    nope, rope = np.asarray(nope), np.asarray(rope)
    bufs = self.buffers[layer_id]
    if cfg.quantized:
      q, scale, rope_stored = quantize(nope, rope, cfg.model_dtype)
      for i, r in self._valid(loc):  # sequential: the last duplicate wins
        bufs[0][r], bufs[1][r], bufs[2][r] = q[i], scale[i], rope_stored[i]
    else:
      row = np.concatenate(
          [cast_to_storage(nope, cfg.dtype), cast_to_storage(rope, cfg.dtype)], axis=-1)
      for i, r in self._valid(loc):
        bufs[0][r] = row[i]

  def get_mla(self, layer_id, loc, dst_dtype=None):
    cfg = self.config
    dst = np_dtype(dst_dtype or cfg.default_read_dtype)
    loc = np.asarray(loc)
    out = [np.zeros((len(loc),) + b.shape[1:], b.dtype) for b in self.buffers[layer_id]]
    for i, r in self._valid(loc):
      for o, b in zip(out, self.buffers[layer_id]):
        o[i] = b[r]
    if cfg.quantized:
      return dequantize(*out, dst)
    rows = cast_to_storage(out[0], dst)
    return rows[..., : cfg.kv_lora_rank], rows[..., cfg.kv_lora_rank:]

  def move(self, tgt, src):
    tgt, src = np.asarray(tgt), np.asarray(src)
    rows = self.config.rows
    pairs = [(int(t), int(s)) for t, s in zip(tgt, src) if 0 <= t < rows and 0 <= s < rows]
    for layer in self.buffers:
      for b in layer:
        old = b.copy()
        for t, s in pairs:
          b[t] = old[s]

  def move_pages(self, tgt_pages, src_pages):
    ps, rows = self.config.page_size, self.config.rows
    npages = rows // ps
    tgt_rows, src_rows = [], []
    for t, s in zip(np.asarray(tgt_pages), np.asarray(src_pages)):
      if 0 <= t < npages and 0 <= s < npages:
        tgt_rows += list(range(t * ps, (t + 1) * ps))
        src_rows += list(range(s * ps, (s + 1) * ps))
    self.move(np.array(tgt_rows, np.int64), np.array(src_rows, np.int64))

  def assert_equal(self, cache):
    assert len(cache.buffers) == len(self.buffers)
    for layer_id, (mine, theirs) in enumerate(zip(self.buffers, cache.buffers)):
      for k, (m, t) in enumerate(zip(mine, theirs)):
        t = np.asarray(t)
        assert t.dtype == m.dtype and t.shape == m.shape, (layer_id, k, t.dtype, t.shape)
        np.testing.assert_array_equal(
            t.view(np.uint8), m.view(np.uint8), err_msg=f"layer {layer_id} buffer {k}")
