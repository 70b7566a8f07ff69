"""A small DeepSeek-style Multi-head Latent Attention model that keeps its KV in the cache.

Random weights; the point is the cache inside a real model step. Per layer
(DeepSeek-V2/V3 attention without the q low-rank path):

    h          = rms_norm(x)
    q          = h @ w_q                       (B, Q, H, dn + dr) -> q_nope | rope(q_rope)
    c_kv | k_r = h @ w_kv_down                 (B, Q, R + dr)
    c_kv       = rms_norm(c_kv)                the latent row, R = kv_lora_rank
    k_rope     = rope(k_r)                     shared by all heads, dr = qk_rope_head_dim
    cache[slot] = [c_kv | k_rope]              set_mla_kv_buffer
    # absorbed form: the key up-projection w_uk moves onto the query, so the
    # attention runs in the latent space and reads only the cached rows.
    q_latent   = q_nope @ w_uk                 (B, Q, H, R)
    o_latent   = attention over the cached rows of each sequence:
      decode ("mla_decode", the default): mla_decode(cache, [q_latent | q_rope], page_table),
        with the write, both RoPEs and the query assembly fused into one launch before it
        (rope_set_mla_kv_buffer; write="set" keeps them separate)
      prefill, or decode with attention="gather":
        ctx_c, ctx_r = cache[context slots]    get_mla_kv_buffer, (B, C, R), (B, C, dr)
        scores   = (q_latent . ctx_c + q_rope . ctx_r) / sqrt(dn + dr)
        o_latent = softmax(scores) @ ctx_c     (B, Q, H, R)
    x         += (o_latent @ w_uv) @ w_o       value up-projection, then output projection
    x         += mlp(rms_norm(x))
  logits = rms_norm(x) @ lm_head

`reference_forward` recomputes the same model over a whole sequence with no
cache, in the naive (non-absorbed) form -- keys and values expanded per head --
which is what the tests compare the cached decode with.

Token slots come from a page table: sequence b's token at position p lives in row
`page_table[b, p // page_size] * page_size + p % page_size`. Page 0 is the padding
page (SPEC §1): padded prompt tokens write there and the page table never hands it
to a sequence.

Numerics: matmuls run in `MLADemoConfig.dtype` (float32 by default; bfloat16 for
speed on a GPU); norms, softmax and the residual stream in float32; the cache stores
the latent rows in its own format (plain bf16, or per_token_head fp8) and they are
read back in `dtype`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla_cache import attention as attention_ops
from jax_mla_cache import dispatch, reference, rope, rope_write
from jax_mla_cache.config import MLACacheConfig
from jax_mla_cache.state import MLAKVCache, StackedMLAKVCache

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class MLADemoConfig:
  """Model shapes. The latent widths and the layer count come from the cache config.

  Attributes:
    cache: the cache geometry: kv_lora_rank (R), qk_rope_head_dim (dr),
      layer_num (the model's layers), page_size and the storage mode.
    hidden_size: D.
    num_heads: H.
    qk_nope_head_dim: dn, the per-head query/key width outside rope.
    v_head_dim: dv.
    mlp_size: F, the MLP's inner width.
    vocab_size: V.
    dtype: weight and matmul dtype (norms, softmax and the residual stream are float32).
    rope_theta: rotary base.
    rms_eps: RMSNorm epsilon.
  """

  cache: MLACacheConfig
  hidden_size: int = 256
  num_heads: int = 4
  qk_nope_head_dim: int = 64
  v_head_dim: int = 64
  mlp_size: int = 512
  vocab_size: int = 512
  dtype: Any = jnp.float32
  rope_theta: float = 10000.0
  rms_eps: float = 1e-6

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

  @property
  def num_layers(self) -> int:
    return self.cache.layer_num

  @property
  def softmax_scale(self) -> float:
    return 1.0 / math.sqrt(self.qk_nope_head_dim + self.cache.qk_rope_head_dim)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerWeights:
  """One layer's weights (D hidden, H heads, R latent, dr rope, dn/dv head dims, F mlp)."""

  attn_norm: jax.Array  # (D,)
  w_q: jax.Array        # (D, H, dn + dr)
  w_kv_down: jax.Array  # (D, R + dr): DeepSeek's wkv_a
  kv_norm: jax.Array    # (R,)
  w_uk: jax.Array       # (H, dn, R): the key half of DeepSeek's wkv_b
  w_uv: jax.Array       # (H, R, dv): the value half of wkv_b
  w_o: jax.Array        # (H, dv, D)
  mlp_norm: jax.Array   # (D,)
  w_up: jax.Array       # (D, F)
  w_down: jax.Array     # (F, D)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLADemoParams:
  """All weights; `config` is static metadata (shapes only)."""

  embed: jax.Array                    # (V, D)
  layers: tuple[LayerWeights, ...] | LayerWeights   # (one stacked LayerWeights: stack_layers)
  final_norm: jax.Array               # (D,)
  lm_head: jax.Array                  # (D, V)
  config: MLADemoConfig = dataclasses.field(metadata=dict(static=True))


def init_params(config: MLADemoConfig, seed: int = 0) -> MLADemoParams:
  """Random weights, normal with std 1/sqrt(fan_in); norms start at one.

  Drawn with numpy (deterministic per seed, and much faster to start than
  compiling jax.random for every weight shape on CPU).
  """
  c, dt = config, config.dtype
  R, dr = c.cache.kv_lora_rank, c.cache.qk_rope_head_dim
  D, H, dn, dv, F = c.hidden_size, c.num_heads, c.qk_nope_head_dim, c.v_head_dim, c.mlp_size
  rng = np.random.default_rng(seed)

  def normal(shape, fan_in):
    return jnp.asarray(rng.standard_normal(shape, np.float32) / np.float32(math.sqrt(fan_in)), dt)

  def layer():
    return LayerWeights(
        attn_norm=jnp.ones((D,), dt),
        w_q=normal((D, H, dn + dr), D),
        w_kv_down=normal((D, R + dr), D),
        kv_norm=jnp.ones((R,), dt),
        w_uk=normal((H, dn, R), R),
        w_uv=normal((H, R, dv), R),
        w_o=normal((H, dv, D), H * dv),
        mlp_norm=jnp.ones((D,), dt),
        w_up=normal((D, F), D),
        w_down=normal((F, D), F),
    )

  return MLADemoParams(
      embed=normal((c.vocab_size, D), 1),
      layers=tuple(layer() for _ in range(c.num_layers)),
      final_norm=jnp.ones((D,), dt),
      lm_head=normal((D, c.vocab_size), D),
      config=c,
  )


def stack_layers(params: MLADemoParams) -> MLADemoParams:
  """The same weights with the layers stacked: `layers` one `LayerWeights` whose leaves
  have a leading layer axis. `forward` (`prefill`, `decode`) then runs the layers under
  `jax.lax.scan` -- one compiled layer body -- over a `StackedMLAKVCache`."""
  if isinstance(params.layers, LayerWeights):
    return params
  stacked = jax.tree.map(lambda *w: jnp.stack(w), *params.layers)
  return dataclasses.replace(params, layers=stacked)


# ----------------------------------------------------------------- building blocks
def _einsum(spec: str, a: jax.Array, b: jax.Array, dtype) -> jax.Array:
  """einsum of `a` and `b` in the model dtype, upcast to float32 for what follows.

  (A bf16 x bf16 -> f32 `preferred_element_type` dot would keep more bits, but
  XLA:CPU cannot run it.)
  """
  return jnp.einsum(spec, a.astype(dtype), b.astype(dtype)).astype(F32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """(..., N) -> (..., N) float32."""
  x = x.astype(F32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight.astype(F32)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding (rotate-half form) of x (B, Q, [H,] dr) at positions (B, Q); float32."""
  half = x.shape[-1] // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=F32) / half)
  angles = positions.astype(F32)[..., None] * inv_freq          # (B, Q, dr/2)
  if x.ndim == 4:
    angles = angles[:, :, None, :]                               # broadcast over heads
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1, x2 = x[..., :half].astype(F32), x[..., half:].astype(F32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def project_latents(
    layer: LayerWeights, h: jax.Array, positions: jax.Array, config: MLADemoConfig
) -> tuple[jax.Array, jax.Array]:
  """The cached row of each token: (c_kv (B, Q, R), k_rope (B, Q, dr)), float32."""
  R = config.cache.kv_lora_rank
  kv = _einsum("bqd,dk->bqk", h, layer.w_kv_down, config.dtype)
  c_kv = rms_norm(kv[..., :R], layer.kv_norm, config.rms_eps)
  k_rope = apply_rope(kv[..., R:], positions, config.rope_theta)
  return c_kv, k_rope


def project_queries(
    layer: LayerWeights, h: jax.Array, positions: jax.Array, config: MLADemoConfig
) -> tuple[jax.Array, jax.Array]:
  """(q_nope (B, Q, H, dn), q_rope (B, Q, H, dr)), float32."""
  q = _einsum("bqd,dhk->bqhk", h, layer.w_q, config.dtype)
  dn = config.qk_nope_head_dim
  return q[..., :dn], apply_rope(q[..., dn:], positions, config.rope_theta)


def masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax over the last axis where `mask`; every row has at least one True."""
  return jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)


def mlp_and_residual(layer: LayerWeights, x: jax.Array, attn_out: jax.Array, config) -> jax.Array:
  """x + attn_out, then + mlp(rms_norm(.)); (B, Q, D) float32."""
  x = x + attn_out
  h = rms_norm(x, layer.mlp_norm, config.rms_eps)
  up = jax.nn.silu(_einsum("bqd,df->bqf", h, layer.w_up, config.dtype))
  return x + _einsum("bqf,fd->bqd", up, layer.w_down, config.dtype)


def final_logits(params: MLADemoParams, x: jax.Array) -> jax.Array:
  """(B, Q, D) -> (B, Q, V) float32."""
  c = params.config
  return _einsum("bqd,dv->bqv", rms_norm(x, params.final_norm, c.rms_eps), params.lm_head, c.dtype)


# ----------------------------------------------------------------- page table
def token_slots(page_table: jax.Array, positions: jax.Array, page_size: int,
                n_pages: int | None = None) -> jax.Array:
  """Cache rows of tokens: page_table (B, P) int, positions (B, Q) int -> (B, Q) int32.

  A token whose row does not exist maps to -1, which the cache skips (SPEC §5): a
  negative position, one past the page table, or a page id outside `[0, n_pages)` (the
  cache's `rows // page_size`; None: any id whose rows fit in int32). Ids are checked
  before the multiplication, so a large id never wraps onto a real row.
  """
  P = page_table.shape[1]
  page_index = positions // page_size
  in_table = (positions >= 0) & (page_index < P)
  pages = jnp.take_along_axis(page_table, jnp.clip(page_index, 0, P - 1), axis=1)
  limit = (2**31 - page_size) // page_size + 1 if n_pages is None else n_pages
  real = in_table & (pages >= 0) & (pages < limit)
  row = jnp.where(real, pages, 0).astype(jnp.int32) * page_size + positions % page_size
  return jnp.where(real, row, -1).astype(jnp.int32)


def make_page_table(
    batch: int, max_context: int, cache: MLACacheConfig, seed: int = 0
) -> np.ndarray:
  """(B, ceil(max_context / page_size)) int32: distinct pages from 1.., shuffled so a
  sequence's pages are not contiguous (as after a while of serving). Page 0 is never used."""
  pages_per_seq = -(-max_context // cache.page_size)
  available = cache.rows // cache.page_size - 1
  if batch * pages_per_seq > available:
    raise ValueError(
        f"make_page_table: {batch} sequences x {pages_per_seq} pages need "
        f"{batch * pages_per_seq} pages, the cache has {available} (size={cache.size}, "
        f"page_size={cache.page_size})"
    )
  pages = np.random.default_rng(seed).permutation(available)[: batch * pages_per_seq] + 1
  return pages.reshape(batch, pages_per_seq).astype(np.int32)


# ----------------------------------------------------------------- cached forward
def forward(
    params: MLADemoParams,
    cache: MLAKVCache,
    tokens: jax.Array,
    positions: jax.Array,
    write_loc: jax.Array,
    page_table: jax.Array,
    implementation: dispatch.Implementation = None,
    attention: str = "gather",
    write: str = "set",
) -> tuple[jax.Array, MLAKVCache]:
  """Run Q new tokens per sequence through the model, caching their latent rows.

  Args:
    params: the weights.
    cache: the KV cache (updated functionally; donate it at the jit boundary).
    tokens: (B, Q) int token ids.
    positions: (B, Q) int positions of those tokens in their sequences.
    write_loc: (B, Q) int cache rows the tokens' latents are written to (0 for padding).
    page_table: (B, P) int pages of each sequence; the attention reads the
      C = P * page_size context rows of each sequence and masks those at
      positions after the query's.
    implementation: the cache ops' implementation (None: the device's best).
    attention: "gather" (get_mla_kv_buffer of every context row, then attention in
      XLA) or "mla_decode" (the paged decode attention reads the cache in place; needs
      the Q tokens to be each sequence's newest, right-aligned at `positions`).
    write: "set" (RoPE in XLA, then `set_mla_kv_buffer`) or "rope_set" (the fused
      `rope_set_mla_kv_buffer`: RoPE of q and k, the latent write and the absorbed query
      in one launch; with attention="mla_decode").
  Returns:
    (logits (B, Q, V) float32, the new cache).
  """
  if attention not in ("gather", "mla_decode"):
    raise ValueError(f"attention must be 'gather' or 'mla_decode', got {attention!r}")
  if write not in ("set", "rope_set") or (write == "rope_set" and attention != "mla_decode"):
    raise ValueError(f"write must be 'set', or 'rope_set' with attention='mla_decode', got "
                     f"write={write!r}, attention={attention!r}")
  c = params.config
  R, dr = c.cache.kv_lora_rank, c.cache.qk_rope_head_dim
  B, Q = tokens.shape
  C = page_table.shape[1] * c.cache.page_size
  context_positions = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, C))
  context_loc = token_slots(page_table, context_positions, c.cache.page_size,
                            c.cache.rows // c.cache.page_size).reshape(B * C)
  mask = (context_positions[:, None, :] <= positions[:, :, None])[:, None]   # (B, 1, Q, C)

  # The fused write's cos/sin table of the context's positions: one constant for all layers.
  table = rope.rope_cos_sin_cache(C, dr, c.rope_theta) if write == "rope_set" else None

  def layer_step(x, cache, layer, layer_id):
    """One layer: (x, cache) -> (x, cache). `layer_id` is a Python int, or traced under
    the scan of stacked layers."""
    h = rms_norm(x, layer.attn_norm, c.rms_eps)
    if write == "rope_set":
      cache, q = _fused_write(layer, layer_id, cache, h, positions, write_loc, table, c,
                              implementation)
      q_latent = q_rope = None
    else:
      c_kv, k_rope = project_latents(layer, h, positions, c)
      cache = dispatch.set_mla_kv_buffer(
          cache, layer_id, write_loc.reshape(B * Q),
          c_kv.reshape(B * Q, 1, R), k_rope.reshape(B * Q, 1, dr),
          implementation=implementation,
      )
      q_nope, q_rope = project_queries(layer, h, positions, c)
      q_latent = _einsum("bqhd,hdr->bqhr", q_nope, layer.w_uk, c.dtype)
      q = None
    if attention == "mla_decode":
      # In the model dtype: the kernel takes it when it is the cache's (bf16 on the GPU);
      # otherwise (a float32 model) mla_decode runs its XLA implementation.
      if q is None:
        q = jnp.concatenate([q_latent, q_rope], axis=-1).astype(c.dtype)
      o_latent, _ = attention_ops.mla_decode(
          cache, layer_id, q, page_table, positions[:, -1] + 1, sm_scale=c.softmax_scale,
          implementation=implementation)
      o_latent = o_latent.astype(F32)
    else:
      ctx_c, ctx_r = dispatch.get_mla_kv_buffer(
          cache, layer_id, context_loc, c.dtype, implementation=implementation
      )
      ctx_c, ctx_r = ctx_c.reshape(B, C, R), ctx_r.reshape(B, C, dr)
      scores = (_einsum("bqhr,bcr->bhqc", q_latent, ctx_c, c.dtype)
                + _einsum("bqhd,bcd->bhqc", q_rope, ctx_r, c.dtype)) * c.softmax_scale
      probs = masked_softmax(scores, mask)
      o_latent = _einsum("bhqc,bcr->bqhr", probs, ctx_c, c.dtype)
    o = _einsum("bqhr,hrv->bqhv", o_latent, layer.w_uv, c.dtype)
    x = mlp_and_residual(layer, x, _einsum("bqhv,hvd->bqd", o, layer.w_o, c.dtype), c)
    return x, cache

  x = params.embed[tokens].astype(F32)
  if isinstance(params.layers, LayerWeights):   # stacked (`stack_layers`): one layer body
    if not isinstance(cache, StackedMLAKVCache):
      raise TypeError("stacked layers (stack_layers) run under lax.scan and need a "
                      "StackedMLAKVCache (init_cache(..., stacked=True))")

    def scan_step(carry, xs):
      layer, layer_id = xs
      return layer_step(*carry, layer, layer_id), None

    (x, cache), _ = jax.lax.scan(
        scan_step, (x, cache), (params.layers, jnp.arange(c.num_layers, dtype=jnp.int32)))
  else:
    for layer_id, layer in enumerate(params.layers):
      x, cache = layer_step(x, cache, layer, layer_id)
  return final_logits(params, x), cache


def _fused_write(layer, layer_id, cache, h, positions, write_loc, table, c, implementation):
  """The decode write in one launch: `rope_set_mla_kv_buffer` rotates q_rope and k_rope
  (rotate-half, as `apply_rope`, from `table`: cos/sin of the context's positions), writes
  the latent rows and returns the absorbed query `[q_nope @ w_uk | rope(q_rope)]`
  (B, Q, H, R + dr) in the model dtype."""
  B, Q = positions.shape
  R, dr = c.cache.kv_lora_rank, c.cache.qk_rope_head_dim
  kv = _einsum("bqd,dk->bqk", h, layer.w_kv_down, c.dtype)
  c_kv = rms_norm(kv[..., :R], layer.kv_norm, c.rms_eps)
  q = _einsum("bqd,dhk->bqhk", h, layer.w_q, c.dtype)
  dn = c.qk_nope_head_dim
  q_latent = _einsum("bqhd,hdr->bqhr", q[..., :dn], layer.w_uk, c.dtype)
  T = B * Q
  cache, q_out = rope_write.rope_set_mla_kv_buffer(
      cache, layer_id, write_loc.reshape(T), positions.reshape(T),
      q_latent.reshape(T, -1, R), q[..., dn:].reshape(T, -1, dr),
      c_kv.reshape(T, 1, R), kv[..., R:].reshape(T, 1, dr), table, is_neox=True,
      q_out_dtype=c.dtype, implementation=implementation)
  return cache, q_out.reshape(B, Q, -1, R + dr)


@dispatch.host_index_arguments("lengths", "page_table")
@functools.partial(jax.jit, static_argnames=("implementation",), donate_argnames=("cache",))
def prefill(
    params: MLADemoParams,
    cache: MLAKVCache,
    tokens: jax.Array,
    lengths: jax.Array,
    page_table: jax.Array,
    implementation: dispatch.Implementation = None,
) -> tuple[jax.Array, MLAKVCache]:
  """Process right-padded prompts (donates `cache`).

  Args:
    tokens: (B, S) int prompts, right-padded.
    lengths: (B,) int prompt lengths (1 <= length <= S; others are clamped there
      for the logits: a length <= 0 writes only padding rows).
    page_table: (B, P) int.
  Returns:
    (logits of each prompt's last token (B, V) float32, the new cache). Padded
    tokens write to row 0, the padding page.
  """
  B, S = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  slots = token_slots(page_table, positions, params.config.cache.page_size,
                      params.config.cache.rows // params.config.cache.page_size)
  write_loc = jnp.where(positions < lengths[:, None], slots, 0)
  logits, cache = forward(params, cache, tokens, positions, write_loc, page_table, implementation)
  last = jnp.take_along_axis(logits, jnp.clip(lengths - 1, 0, S - 1)[:, None, None], axis=1)
  return last[:, 0], cache


@dispatch.host_index_arguments("positions", "page_table")
@functools.partial(jax.jit, static_argnames=("implementation", "attention", "write"),
                   donate_argnames=("cache",))
def decode(
    params: MLADemoParams,
    cache: MLAKVCache,
    tokens: jax.Array,
    positions: jax.Array,
    page_table: jax.Array,
    implementation: dispatch.Implementation = None,
    attention: str = "mla_decode",
    write: str = "rope_set",
) -> tuple[jax.Array, MLAKVCache]:
  """One decode step (donates `cache`).

  Args:
    tokens: (B,) int, the newest token of each sequence.
    positions: (B,) int, its position (= the number of tokens before it).
    page_table: (B, P) int.
    attention: "mla_decode" (reads the cache in place) or "gather" (see `forward`).
    write: "rope_set" (the fused RoPE + write; with mla_decode) or "set" (see `forward`).
  Returns:
    (logits (B, V) float32, the new cache).
  """
  tokens, positions = tokens[:, None], positions[:, None]
  write_loc = token_slots(page_table, positions, params.config.cache.page_size,
                          params.config.cache.rows // params.config.cache.page_size)
  if attention == "gather":
    write = "set"  # the fused write hands its query to mla_decode
  logits, cache = forward(params, cache, tokens, positions, write_loc, page_table, implementation,
                          attention, write)
  return logits[:, 0], cache


# ----------------------------------------------------------------- no-cache reference
def storage_roundtrip(
    cache: MLACacheConfig, c_kv: jax.Array, k_rope: jax.Array, dtype
) -> tuple[jax.Array, jax.Array]:
  """What the cache gives back for rows it was given (SPEC §2-3), without a cache.

  c_kv (..., R), k_rope (..., dr) -> the same shapes in `dtype`: cast to the storage
  dtype (plain) or quantized per token (per_token_head), then read back.
  """
  if cache.quantized:
    shape = c_kv.shape
    q, scale, rope = reference.quantize_per_token_head(
        c_kv.reshape(-1, 1, shape[-1]), k_rope.reshape(-1, 1, k_rope.shape[-1]), cache.model_dtype
    )
    nope, rope = reference.dequantize_per_token_head(q, scale, rope, dtype)
    return nope.reshape(shape), rope.reshape(k_rope.shape)
  return (reference.cast_to_storage(c_kv, cache.dtype).astype(dtype),
          reference.cast_to_storage(k_rope, cache.dtype).astype(dtype))


@functools.partial(jax.jit, static_argnames=("storage",))
def reference_forward(
    params: MLADemoParams, tokens: jax.Array, storage: MLACacheConfig | None = None
) -> tuple[jax.Array, tuple[tuple[jax.Array, jax.Array], ...]]:
  """The model over whole sequences from scratch, no cache, naive (non-absorbed) attention.

  Args:
    tokens: (B, S) int.
    storage: if given, the latent rows pass through `storage_roundtrip` for this
      cache config (what a cache of that format would hand back); None keeps them
      exact in float32.
  Returns:
    (logits (B, S, V) float32 for every position (causal), and per layer the
    exact latent rows (c_kv (B, S, R), k_rope (B, S, dr)) float32, before any
    storage round trip).
  """
  c = params.config
  B, S = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  mask = jnp.tril(jnp.ones((S, S), bool))[None, None]                    # (1, 1, S, S)
  x = params.embed[tokens].astype(F32)
  latents = []
  for layer in params.layers:
    h = rms_norm(x, layer.attn_norm, c.rms_eps)
    c_kv, k_rope = project_latents(layer, h, positions, c)
    latents.append((c_kv, k_rope))
    if storage is not None:
      c_kv, k_rope = storage_roundtrip(storage, c_kv, k_rope, c.dtype)
    q_nope, q_rope = project_queries(layer, h, positions, c)
    k_nope = _einsum("bsr,hdr->bshd", c_kv, layer.w_uk, c.dtype)       # (B, S, H, dn)
    v = _einsum("bsr,hrv->bshv", c_kv, layer.w_uv, c.dtype)            # (B, S, H, dv)
    scores = (_einsum("bqhd,bkhd->bhqk", q_nope, k_nope, c.dtype)
              + _einsum("bqhd,bkd->bhqk", q_rope, k_rope, c.dtype)) * c.softmax_scale
    o = _einsum("bhqk,bkhv->bqhv", masked_softmax(scores, mask), v, c.dtype)
    x = mlp_and_residual(layer, x, _einsum("bqhv,hvd->bqd", o, layer.w_o, c.dtype), c)
  return final_logits(params, x), tuple(latents)
