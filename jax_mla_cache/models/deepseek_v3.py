"""DeepSeek-V3 (and V2) from a Hugging Face checkpoint directory, with its KV in an `MLAKVCache`.

    params = deepseek_v3.load_checkpoint("path/to/DeepSeek-V3")        # config.json + *.safetensors
    cache = mc.init_cache(deepseek_v3.cache_config(params.config, size=4096, page_size=64))
    page_table = mla_demo.make_page_table(batch, max_context, cache.config)
    logits, cache = deepseek_v3.prefill(params, cache, prompts, lengths, page_table)
    logits, cache = deepseek_v3.decode_step(params, cache, tokens, positions, page_table)
    # or: tokens, step_logits, cache = deepseek_v3.generate(params, cache, prompts, lengths,
    #                                                        page_table, steps=8)

The model, per layer (D hidden, H heads, R = kv_lora_rank, dr = qk_rope_head_dim,
dn = qk_nope_head_dim, dv = v_head_dim; Hugging Face weight names in brackets)::

    h             = rms_norm(x)                                  [input_layernorm]
    q             = q_b(rms_norm(q_a(h)))  or  q_proj(h) (V2)    (H, dn + dr) -> q_nope | q_rope
    c_kv | k_rope = kv_a(h)                                      [kv_a_proj_with_mqa]
    c_kv          = rms_norm(c_kv)                               [kv_a_layernorm], the latent
    W_UK, W_UV    = kv_b_proj split per head                     (H, dn, R), (H, R, dv)
    cache[slot]   = [c_kv | rope(k_rope)]                        one latent row per token
    prefill: attention over the prompt's own latents in the expanded form (k_nope = c_kv W_UK^T,
             v = c_kv W_UV), as serving engines run prefill; the rows are only written.
    decode:  q = [q_nope @ W_UK | rope(q_rope)]                  the absorbed query (H, R + dr)
             (mla_decode, or the gather path)
             o_latent = softmax(sm_scale * q . [c | k_r]) @ c     over the cached rows
             o = o_latent @ W_UV                                 (H, dv)
    x            += o_proj(o)
    x            += mlp(rms_norm(x))                             dense, or MoE from layer
                                                                 first_k_dense_replace on
  logits = lm_head(rms_norm(x))

RoPE is `jax_mla_cache.rope` (YaRN table from the config, GPT-J interleaved rotation: the
same attention as Hugging Face's de-interleaved `rope_interleave`); the softmax scale is
`deepseek_softmax_scale`. Tokens live in cache rows through a page table
(`mla_demo.token_slots`; page 0 is the padding page).

The decode step's two cache calls:

* the latent write: `jax_mla_cache.rope_set_mla_kv_buffer` (SPEC §8: RoPE of q_rope and
  k_rope, the row `[c_kv | rope(k_rope)]` written at the step's slots, and the absorbed query
  `[q_nope @ W_UK | rope(q_rope)]` assembled; one Mosaic GPU kernel on sm_90+).
* the attention (SPEC §7): `attention="mla_decode"` (default) calls `jax_mla_cache.mla_decode`,
  which reads the cache in place (the Mosaic GPU kernel on sm_90+); `attention="gather"` runs
  `gather_mla_decode`, the same semantics through `get_mla_kv_buffer` of every context row
  and a masked float32 softmax. The query goes to either in `attention_q_dtype` (what the
  kernel reads: bf16 for a bf16 or per_token_head cache).

Supported: `model_type` "deepseek_v3" (sigmoid scores + `e_score_correction_bias`, group scores
= sum of each group's top 2, `noaux_tc`) and "deepseek_v2" (softmax scores, `topk_method`
"greedy" or "group_limited_greedy" with group max, the scaling factor applied only without
`norm_topk_prob`, as DeepSeek's own V2 code); `q_lora_rank` null or not; `moe_layer_freq`;
YaRN or no rope scaling; float32/bfloat16/float16 weights, and FP8 block-quantized weights
with `weight_scale_inv` (DeepSeek-V3's release; blocks of
`quantization_config.weight_block_size`, dequantized to float32 on load, then cast to the
params' dtype). Weight layouts: the per-expert names of real checkpoints
(`mlp.experts.{e}.gate_proj.weight`, ...) and transformers 5's fused in-memory names
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`). Layers past `num_hidden_layers`
(DeepSeek-V3's multi-token-prediction layer 61) are ignored.

The MoE computes every routed expert for every token and weights them by the router's
(sparse) top-k weights: correct, not fast (E times the FLOPs of a sparse dispatch). Fine for
the tests and demos here; a serving engine would gather tokens per expert.

Not supported (a NotImplementedError names it): `attention_bias`/`mlp_bias` true, an
activation other than silu, tied embeddings with no lm_head, rope scaling other than YaRN.

Numerics: matmuls in the params' dtype (float32: `Precision.HIGHEST`, so GPUs do not round
through TF32); norms, router, softmax and the residual stream in float32.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import os
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_mla_cache import dispatch
from jax_mla_cache.attention import mla_decode, mla_decode_reference, positions_rows
from jax_mla_cache.rope_write import rope_set_mla_kv_buffer
from jax_mla_cache.config import MLACacheConfig, check_positive_int
from jax_mla_cache.models.mla_demo import rms_norm, token_slots
from jax_mla_cache.rope import apply_rope, cos_sin_cache_from_hf_config, deepseek_softmax_scale
from jax_mla_cache.state import MLAKVCache

F32 = jnp.float32
Attention = Literal["gather", "mla_decode"]
ATTENTIONS = ("gather", "mla_decode")


# ----------------------------------------------------------------- config
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "max_position_embeddings")
WEIGHT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
  """The shapes and routing settings of a DeepSeek-V2/V3 checkpoint (its config.json).

  Frozen and hashable (static metadata of `DeepseekParams`); `rope_scaling` is kept as a
  sorted tuple of items, `rope_scaling_dict` gives it back as a dict.
  """

  model_type: str
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  q_lora_rank: int | None
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  moe_intermediate_size: int = 0
  n_routed_experts: int | None = None
  n_shared_experts: int | None = None
  num_experts_per_tok: int | None = None
  n_group: int | None = None
  topk_group: int | None = None
  first_k_dense_replace: int = 0
  moe_layer_freq: int = 1
  routed_scaling_factor: float = 1.0
  norm_topk_prob: bool = False
  scoring_func: str = "sigmoid"
  topk_method: str = "noaux_tc"
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  max_position_embeddings: int = 4096

  @classmethod
  def from_hf(cls, config: Mapping[str, Any]) -> "DeepseekConfig":
    """From a Hugging Face config dict (real checkpoints' `rope_scaling` + `rope_theta`,
    or transformers 5's `rope_parameters`)."""
    model_type = config.get("model_type")
    if model_type not in ("deepseek_v3", "deepseek_v2"):
      raise ValueError(f"config: model_type must be 'deepseek_v3' or 'deepseek_v2', got "
                       f"{model_type!r}")
    for key, supported in (("attention_bias", False), ("mlp_bias", False),
                           ("hidden_act", "silu"), ("rope_interleave", True)):
      if config.get(key, supported) != supported:
        raise NotImplementedError(f"config: {key}={config[key]!r} (supported: {supported!r})")
    rope = dict(config.get("rope_scaling") or {})
    params = dict(config.get("rope_parameters") or {})
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    if not rope and params.get("rope_type", params.get("type", "default")) != "default":
      rope = {k: v for k, v in params.items() if k != "rope_theta"}
    v3 = model_type == "deepseek_v3"
    missing = [key for key in _REQUIRED_KEYS if config.get(key) is None]
    if missing:
      raise ValueError(f"config: missing {', '.join(missing)} (a DeepSeek-V2/V3 config.json "
                       f"has {', '.join(_REQUIRED_KEYS)})")
    return cls(
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=int(config["num_attention_heads"]),
        q_lora_rank=None if config.get("q_lora_rank") is None else int(config["q_lora_rank"]),
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=int(config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        moe_intermediate_size=int(config.get("moe_intermediate_size") or 0),
        n_routed_experts=config.get("n_routed_experts"),
        n_shared_experts=config.get("n_shared_experts"),
        num_experts_per_tok=config.get("num_experts_per_tok"),
        n_group=config.get("n_group"),
        topk_group=config.get("topk_group"),
        first_k_dense_replace=int(config.get("first_k_dense_replace") or 0),
        moe_layer_freq=int(config.get("moe_layer_freq") or 1),
        routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        scoring_func=config.get("scoring_func", "sigmoid" if v3 else "softmax"),
        topk_method=config.get("topk_method", "noaux_tc" if v3 else "greedy"),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=tuple(sorted(rope.items())) if rope else None,
        max_position_embeddings=int(config["max_position_embeddings"]),
    )

  @property
  def rope_scaling_dict(self) -> dict[str, Any] | None:
    return dict(self.rope_scaling) if self.rope_scaling else None

  @property
  def softmax_scale(self) -> float:
    """`deepseek_softmax_scale(qk_nope_head_dim + qk_rope_head_dim, rope_scaling)`."""
    return deepseek_softmax_scale(self.qk_nope_head_dim + self.qk_rope_head_dim,
                                  self.rope_scaling_dict)

  def is_moe_layer(self, layer_id: int) -> bool:
    return bool(self.n_routed_experts) and layer_id >= self.first_k_dense_replace \
        and layer_id % self.moe_layer_freq == 0

  def cos_sin_cache(self, max_position: int | None = None) -> np.ndarray:
    """(max_position, qk_rope_head_dim) float32 [cos | sin]
    (`rope.cos_sin_cache_from_hf_config`)."""
    return cos_sin_cache_from_hf_config(
        dict(qk_rope_head_dim=self.qk_rope_head_dim, rope_theta=self.rope_theta,
             max_position_embeddings=self.max_position_embeddings,
             rope_scaling=self.rope_scaling_dict), max_position)


# ----------------------------------------------------------------- params
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionWeights:
  """MLA weights (D hidden, H heads, R latent, dr rope, dn/dv head dims, Lq = q_lora_rank)."""

  kv_a_proj: jax.Array            # (D, R + dr)
  kv_a_norm: jax.Array            # (R,) float32
  w_uk: jax.Array                 # (H, dn, R): the key half of kv_b_proj
  w_uv: jax.Array                 # (H, R, dv): the value half of kv_b_proj
  o_proj: jax.Array               # (H, dv, D)
  q_a_proj: jax.Array | None      # (D, Lq), or None (V2: q_proj)
  q_a_norm: jax.Array | None      # (Lq,) float32
  q_b_proj: jax.Array | None      # (Lq, H, dn + dr)
  q_proj: jax.Array | None        # (D, H, dn + dr) when q_lora_rank is null


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseMLP:
  """SwiGLU MLP: down(silu(x @ gate) * (x @ up))."""

  gate: jax.Array  # (D, F)
  up: jax.Array    # (D, F)
  down: jax.Array  # (F, D)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoEWeights:
  """Routed experts (E of them, inner width I) and the shared experts."""

  router: jax.Array                 # (D, E) float32
  correction_bias: jax.Array | None  # (E,) float32 (V3's e_score_correction_bias)
  gate: jax.Array                   # (E, D, I)
  up: jax.Array                     # (E, D, I)
  down: jax.Array                   # (E, I, D)
  shared: DenseMLP | None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerWeights:
  input_norm: jax.Array         # (D,) float32
  attention: AttentionWeights
  post_attention_norm: jax.Array  # (D,) float32
  mlp: DenseMLP | MoEWeights


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeepseekParams:
  """All weights, the RoPE table, and (static) the config and the matmul dtype."""

  embed: jax.Array                  # (V, D)
  layers: tuple[LayerWeights, ...]
  norm: jax.Array                   # (D,) float32
  lm_head: jax.Array                # (D, V)
  cos_sin_cache: jax.Array          # (max_position, dr) float32
  config: DeepseekConfig = dataclasses.field(metadata=dict(static=True))
  dtype: Any = dataclasses.field(default=jnp.dtype(jnp.float32), metadata=dict(static=True))


# ----------------------------------------------------------------- checkpoint reading
_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsDirectory:
  """The tensors of every `*.safetensors` file in a directory, read on demand as numpy.

  Read with the `safetensors` package (`safe_open(..., framework="np")`); its numpy reader
  knows no float8 dtype, so FP8 tensors are memory-mapped at the offsets of the file's header
  (the safetensors format: an 8-byte little-endian header length, a JSON header, the data).
  """

  def __init__(self, path: str):
    import safetensors  # a declared dependency (extra "models"); imported where used

    self._safe_open = safetensors.safe_open
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
      raise FileNotFoundError(f"load_checkpoint: no *.safetensors file in path={path!r}")
    self.file_of: dict[str, str] = {}
    self.header_of: dict[str, dict[str, Any]] = {}
    for file in files:
      with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
      for name, info in header.items():
        if name != "__metadata__":
          self.file_of[name] = file
          self.header_of[name] = dict(info, data_start=8 + n)

  def __contains__(self, name: str) -> bool:
    return name in self.file_of

  def get(self, name: str) -> np.ndarray:
    if name not in self.file_of:
      raise KeyError(f"load_checkpoint: tensor {name!r} is not in the checkpoint")
    info, file = self.header_of[name], self.file_of[name]
    if info["dtype"].startswith("F8_"):
      start, end = info["data_offsets"]
      raw = np.memmap(file, np.uint8, "r", offset=info["data_start"] + start, shape=(end - start,))
      return np.asarray(raw).view(_SAFETENSORS_DTYPES[info["dtype"]]).reshape(info["shape"])
    with self._safe_open(file, framework="np") as f:  # BF16 needs ml_dtypes (imported above)
      return f.get_tensor(name)


def dequantize_fp8_block(weight: np.ndarray, scale_inv: np.ndarray,
                         block_size: tuple[int, int] = (128, 128)) -> np.ndarray:
  """DeepSeek-V3's FP8 checkpoint weights -> float32.

  Args:
    weight: (out, in) float8_e4m3fn.
    scale_inv: (ceil(out / block_size[0]), ceil(in / block_size[1])) float32, one per block
      (the config's `quantization_config.weight_block_size`, [128, 128] for DeepSeek-V3).
  Returns:
    (out, in) float32 `weight * scale_inv[i // block_size[0], j // block_size[1]]`.
  """
  out_dim, in_dim = weight.shape
  rows, cols = -(-out_dim // block_size[0]), -(-in_dim // block_size[1])
  if scale_inv.shape != (rows, cols):
    raise ValueError(f"dequantize_fp8_block: scale_inv must have shape {(rows, cols)} for a "
                     f"{weight.shape} weight in {tuple(block_size)} blocks, got {scale_inv.shape}")
  scale = np.repeat(np.repeat(scale_inv.astype(np.float32), block_size[0], 0), block_size[1], 1)
  return weight.astype(np.float32) * scale[:out_dim, :in_dim]


def _reshaped(w: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray:
  """`w.reshape(shape)`, or a ValueError naming the tensor (a config that does not match
  the checkpoint's weights)."""
  if w.size != math.prod(shape):
    raise ValueError(f"load_checkpoint: {name} has {w.size} values (shape "
                     f"{tuple(w.shape)}), config.json's widths need {shape}: the config does "
                     "not match the weights")
  return w.reshape(shape)


def load_checkpoint(
    path: str, *, dtype: Any = jnp.float32, max_position: int | None = None,
    device: Any = None,
) -> DeepseekParams:
  """Load a Hugging Face DeepSeek-V2/V3 directory (`config.json` + `*.safetensors`).

  Args:
    path: the directory.
    dtype: matmul weight dtype (float32, bfloat16 or float16); norms, the router and the
      RoPE table stay float32.
    max_position: rows of the RoPE table (default `max_position_embeddings`); positions
      past it are clamped, so it must cover the longest sequence.
    device: where to put the weights (default: JAX's default device).
  Returns:
    The params (module docstring for the layout).
  """
  dtype = jnp.dtype(dtype)
  if dtype not in WEIGHT_DTYPES:
    raise TypeError(f"load_checkpoint: dtype must be float32, bfloat16 or float16, got {dtype}")
  if max_position is not None:    # (before any weight is read)
    check_positive_int(max_position, "load_checkpoint: max_position")
  config_path = os.path.join(path, "config.json")
  with open(config_path) as f:
    try:
      hf_config = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"load_checkpoint: {config_path} is not valid JSON: {e}") from None
  if not isinstance(hf_config, dict):
    raise ValueError(f"load_checkpoint: {config_path} must hold a JSON object, got "
                     f"{type(hf_config).__name__}")
  config = DeepseekConfig.from_hf(hf_config)
  quantization = hf_config.get("quantization_config") or {}
  scheme = quantization.get("quant_method")
  if scheme not in (None, "fp8"):
    raise NotImplementedError(
        f"load_checkpoint: quantization_config.quant_method={scheme!r}: only DeepSeek's "
        "block-scaled 'fp8' checkpoints (or unquantized ones) are supported")
  block_size = tuple(quantization.get("weight_block_size") or (128, 128))
  files = SafetensorsDirectory(path)
  put = functools.partial(jax.device_put, device=device)

  def raw(name: str) -> np.ndarray:
    """A weight as float32; FP8 block-quantized weights dequantized."""
    w = files.get(name)
    if w.dtype in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2):
      scale_name = name[: -len("weight")] + "weight_scale_inv"
      if scale_name not in files:
        raise NotImplementedError(f"load_checkpoint: {name} is {w.dtype} without a "
                                  f"{scale_name}: unknown FP8 scheme")
      return dequantize_fp8_block(w, files.get(scale_name), block_size)
    if not np.issubdtype(w.dtype, np.floating) and w.dtype != ml_dtypes.bfloat16:
      raise NotImplementedError(f"load_checkpoint: {name} is {w.dtype}: only float weights "
                                "and DeepSeek's block-scaled fp8 ones are supported")
    return w.astype(np.float32)

  def linear(name: str, shape: tuple[int, ...] | None = None, keep=None) -> jax.Array:
    """A torch Linear weight (out, in) as (in, out) [reshaped to `shape`] in `dtype`."""
    w = raw(name).T
    return put(jnp.asarray(_reshaped(w, shape, name) if shape else w, keep or dtype))

  def f32(name: str) -> jax.Array:
    return put(jnp.asarray(raw(name), F32))

  c = config
  H, dn, dr, dv, R = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                      c.v_head_dim, c.kv_lora_rank)

  def mlp(prefix: str) -> DenseMLP:
    return DenseMLP(gate=linear(f"{prefix}.gate_proj.weight"),
                    up=linear(f"{prefix}.up_proj.weight"),
                    down=linear(f"{prefix}.down_proj.weight"))

  def experts(prefix: str) -> tuple[jax.Array, jax.Array, jax.Array]:
    E, inner = c.n_routed_experts, c.moe_intermediate_size
    if f"{prefix}.gate_up_proj" in files:  # transformers 5's fused in-memory layout
      gate_up = raw(f"{prefix}.gate_up_proj")                 # (E, 2I, D)
      gate, up = gate_up[:, :inner].transpose(0, 2, 1), gate_up[:, inner:].transpose(0, 2, 1)
      down = raw(f"{prefix}.down_proj").transpose(0, 2, 1)    # (E, D, I) -> (E, I, D)
    else:
      stack = lambda proj: np.stack([raw(f"{prefix}.{e}.{proj}.weight").T for e in range(E)])
      gate, up, down = stack("gate_proj"), stack("up_proj"), stack("down_proj")
    return tuple(put(jnp.asarray(w, dtype)) for w in (gate, up, down))

  layers = []
  for i in range(c.num_hidden_layers):
    p = f"model.layers.{i}"
    kv_b = _reshaped(raw(f"{p}.self_attn.kv_b_proj.weight"), (H, dn + dv, R),
                     f"{p}.self_attn.kv_b_proj.weight")
    if c.q_lora_rank is None:
      q = dict(q_proj=linear(f"{p}.self_attn.q_proj.weight", (c.hidden_size, H, dn + dr)),
               q_a_proj=None, q_a_norm=None, q_b_proj=None)
    else:
      q = dict(q_proj=None, q_a_proj=linear(f"{p}.self_attn.q_a_proj.weight"),
               q_a_norm=f32(f"{p}.self_attn.q_a_layernorm.weight"),
               q_b_proj=linear(f"{p}.self_attn.q_b_proj.weight", (c.q_lora_rank, H, dn + dr)))
    attention = AttentionWeights(
        kv_a_proj=linear(f"{p}.self_attn.kv_a_proj_with_mqa.weight"),
        kv_a_norm=f32(f"{p}.self_attn.kv_a_layernorm.weight"),
        w_uk=put(jnp.asarray(kv_b[:, :dn], dtype)),
        w_uv=put(jnp.asarray(kv_b[:, dn:].transpose(0, 2, 1), dtype)),
        o_proj=linear(f"{p}.self_attn.o_proj.weight", (H, dv, c.hidden_size)), **q)
    if c.is_moe_layer(i):
      bias = f"{p}.mlp.gate.e_score_correction_bias"
      gate, up, down = experts(f"{p}.mlp.experts")
      block = MoEWeights(
          router=linear(f"{p}.mlp.gate.weight", keep=F32),
          correction_bias=f32(bias) if bias in files else None,
          gate=gate, up=up, down=down,
          shared=mlp(f"{p}.mlp.shared_experts") if c.n_shared_experts else None)
    else:
      block = mlp(f"{p}.mlp")
    layers.append(LayerWeights(
        input_norm=f32(f"{p}.input_layernorm.weight"), attention=attention,
        post_attention_norm=f32(f"{p}.post_attention_layernorm.weight"), mlp=block))
  if "lm_head.weight" not in files:
    raise NotImplementedError("load_checkpoint: no lm_head.weight (tied embeddings)")
  return DeepseekParams(
      embed=put(jnp.asarray(raw("model.embed_tokens.weight"), dtype)),
      layers=tuple(layers), norm=f32("model.norm.weight"), lm_head=linear("lm_head.weight"),
      cos_sin_cache=put(jnp.asarray(config.cos_sin_cache(max_position))),
      config=config, dtype=dtype)


def cache_config(
    config: DeepseekConfig, *, size: int, page_size: int = 64, dtype: Any = jnp.bfloat16,
    model_dtype: Any = jnp.bfloat16, quant_method: str | None = None,
) -> MLACacheConfig:
  """The `MLACacheConfig` of this model: its layers and latent widths, the given geometry."""
  return MLACacheConfig(size=size, page_size=page_size, kv_lora_rank=config.kv_lora_rank,
                        qk_rope_head_dim=config.qk_rope_head_dim,
                        layer_num=config.num_hidden_layers, dtype=dtype,
                        model_dtype=model_dtype, quant_method=quant_method)


# ----------------------------------------------------------------- building blocks
def _dot(spec: str, a: jax.Array, b: jax.Array, dtype: Any) -> jax.Array:
  """einsum in `dtype` (float32 at full precision), result float32."""
  precision = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == F32 else None
  return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), precision=precision).astype(F32)


def _mlp(w: DenseMLP, h: jax.Array, dtype) -> jax.Array:
  """(N, D) -> (N, D) float32."""
  gate = _dot("nd,df->nf", h, w.gate, dtype)
  up = _dot("nd,df->nf", h, w.up, dtype)
  return _dot("nf,fd->nd", jax.nn.silu(gate) * up, w.down, dtype)


def route(w: MoEWeights, h: jax.Array, config: DeepseekConfig) -> jax.Array:
  """The router: (N, D) -> (N, E) float32 weights, nonzero for each token's top-k experts.

  V3 (`noaux_tc`): sigmoid scores; experts chosen on `scores + correction_bias`, within the
  `topk_group` groups whose two best biased scores sum highest; weights are the unbiased
  scores, normalized to sum 1 if `norm_topk_prob`, times `routed_scaling_factor`.
  V2: softmax scores; `greedy` top-k, or `group_limited_greedy` (groups ranked by their
  best score); times `routed_scaling_factor` (or normalized instead if `norm_topk_prob`).
  """
  c = config
  E, k = c.n_routed_experts, c.num_experts_per_tok
  logits = jnp.einsum("nd,de->ne", h.astype(F32), w.router, precision=jax.lax.Precision.HIGHEST)
  if c.scoring_func == "sigmoid":
    scores = jax.nn.sigmoid(logits)
  elif c.scoring_func == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
  else:
    raise NotImplementedError(f"scoring_func {c.scoring_func!r}")
  choice = scores if w.correction_bias is None else scores + w.correction_bias
  groups = c.n_group or 1
  if c.topk_method in ("noaux_tc", "group_limited_greedy") and groups > 1:
    grouped = choice.reshape(-1, groups, E // groups)
    if c.topk_method == "noaux_tc":
      group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
    else:
      group_scores = grouped.max(-1)
    chosen_groups = jax.lax.top_k(group_scores, c.topk_group)[1]                 # (N, topk_group)
    in_group = jax.nn.one_hot(chosen_groups, groups, dtype=bool).any(1)          # (N, groups)
    in_group = jnp.repeat(in_group, E // groups, axis=1)
    choice = jnp.where(in_group, choice, -jnp.inf if c.topk_method == "noaux_tc" else 0.0)
  elif c.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
    raise NotImplementedError(f"topk_method {c.topk_method!r}")
  experts = jax.lax.top_k(choice, k)[1]                                          # (N, k)
  weights = jnp.take_along_axis(scores, experts, axis=1)
  if c.model_type == "deepseek_v3":
    if c.norm_topk_prob:
      weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * c.routed_scaling_factor
  elif k > 1 and c.norm_topk_prob:
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
  else:
    weights = weights * c.routed_scaling_factor
  return (jax.nn.one_hot(experts, E, dtype=F32) * weights[..., None]).sum(1)


def _moe(w: MoEWeights, h: jax.Array, config: DeepseekConfig, dtype) -> jax.Array:
  """(N, D) -> (N, D) float32: every expert on every token (dense; see the module docstring),
  weighted by the router, plus the shared experts."""
  weights = route(w, h, config)                                                   # (N, E)
  gate = _dot("nd,edi->nei", h, w.gate, dtype)
  up = _dot("nd,edi->nei", h, w.up, dtype)
  hidden = jax.nn.silu(gate) * up * weights[..., None]
  out = _dot("nei,eid->nd", hidden, w.down, dtype)
  return out + _mlp(w.shared, h, dtype) if w.shared is not None else out


def _feed_forward(layer: LayerWeights, x: jax.Array, config: DeepseekConfig, dtype) -> jax.Array:
  """x + mlp(rms_norm(x)) for x (..., D) float32."""
  h = rms_norm(x, layer.post_attention_norm, config.rms_norm_eps)
  flat = h.reshape(-1, h.shape[-1])
  y = (_moe(layer.mlp, flat, config, dtype) if isinstance(layer.mlp, MoEWeights)
       else _mlp(layer.mlp, flat, dtype))
  return x + y.reshape(x.shape)


def _project(w: AttentionWeights, h: jax.Array, config: DeepseekConfig, dtype):
  """h (N, D) -> q_nope (N, H, dn), q_rope (N, H, dr) unrotated, c_kv (N, R), k_rope (N, dr)
  unrotated; float32."""
  c = config
  if w.q_proj is not None:
    q = _dot("nd,dhk->nhk", h, w.q_proj, dtype)
  else:
    q_a = rms_norm(_dot("nd,dl->nl", h, w.q_a_proj, dtype), w.q_a_norm, c.rms_norm_eps)
    q = _dot("nl,lhk->nhk", q_a, w.q_b_proj, dtype)
  kv = _dot("nd,dk->nk", h, w.kv_a_proj, dtype)
  c_kv = rms_norm(kv[:, :c.kv_lora_rank], w.kv_a_norm, c.rms_norm_eps)
  return q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:], c_kv, kv[:, c.kv_lora_rank:]


def _logits(params: DeepseekParams, x: jax.Array) -> jax.Array:
  """(..., D) -> (..., V) float32."""
  h = rms_norm(x, params.norm, params.config.rms_norm_eps)
  return _dot("...d,dv->...v", h, params.lm_head, params.dtype)


# ----------------------------------------------------------------- decode attention
def gather_mla_decode(
    cache: MLAKVCache, layer_id: int, q: jax.Array, page_table: jax.Array, seq_lens: jax.Array,
    *, sm_scale: float, implementation: dispatch.Implementation = None,
) -> tuple[jax.Array, jax.Array]:
  """SPEC §7's paged MLA decode attention on the gather path (`attention="gather"`).

  Copies the P * page_size rows of each sequence out of the cache through the page table with
  `get_mla_kv_buffer` (dequantized to float32; the Pallas gather kernel on sm_90+), then runs
  `mla_decode_reference`'s masked float32 softmax over that copy, laid out as contiguous
  pages (a page whose id is outside the cache stays masked out).

  Args:
    cache: the cache (not donated).
    layer_id: static layer.
    q: (B, s_q, H, R + Rr) the absorbed query `[q_nope @ W_UK | rope(q_rope)]`.
    page_table: (B, P) int32 pages of each sequence.
    seq_lens: (B,) int32 tokens of each sequence in the cache, its s_q newest included.
    sm_scale: the softmax scale.
  Returns:
    (out (B, s_q, H, R) in q.dtype, lse (B, s_q, H) float32 natural log); a query that sees
    no position gets out 0 and lse -inf.
  """
  cfg = cache.config
  B, s_q, H, width = q.shape
  if width != cfg.kv_cache_dim:
    raise ValueError(f"gather_mla_decode: q must have shape (B, s_q, H, {cfg.kv_cache_dim}), "
                     f"got {tuple(q.shape)}")
  if page_table.ndim != 2 or page_table.shape[0] != B or seq_lens.shape != (B,):
    raise ValueError(f"gather_mla_decode: page_table and seq_lens must have shapes ({B}, P) "
                     f"and ({B},), got {tuple(page_table.shape)} and {tuple(seq_lens.shape)}")
  P, ps = page_table.shape[1], cfg.page_size
  rows, _ = positions_rows(page_table, ps, cfg.rows)                              # (B, P * ps)
  nope, rope = dispatch.get_mla_kv_buffer(cache, layer_id, rows.reshape(-1), F32,
                                          implementation=implementation)
  copy = jnp.concatenate([nope, rope], axis=-1)                          # (B * P * ps, 1, R+Rr)
  in_cache = (page_table >= 0) & (page_table < cfg.rows // ps)
  copy_pages = jnp.where(in_cache, jnp.arange(B * P, dtype=jnp.int32).reshape(B, P), -1)
  return mla_decode_reference((copy,), q, copy_pages, seq_lens, sm_scale=sm_scale,
                              page_size=ps, kv_lora_rank=cfg.kv_lora_rank)


def _decode_attention(attention: str):
  if attention == "gather":
    return gather_mla_decode
  if attention == "mla_decode":
    return mla_decode
  raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")


def attention_q_dtype(cache_config: MLACacheConfig) -> np.dtype:
  """The dtype the decode query is handed to the attention in: what `mla_decode`'s kernel
  reads (the cache's dtype for plain bf16/f16 rows, `model_dtype` for per_token_head), else
  float32 (a float32 or plain fp8 cache: the XLA path)."""
  if cache_config.quantized:
    return jnp.dtype(cache_config.model_dtype)
  if cache_config.dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return jnp.dtype(cache_config.dtype)
  return jnp.dtype(F32)


# ----------------------------------------------------------------- forward passes
def _check_batch(tokens: jax.Array, positions_or_lengths: jax.Array, page_table: jax.Array,
                 op: str, second: str) -> None:
  B = tokens.shape[0]
  if positions_or_lengths.shape != (B,):
    raise ValueError(f"{op}: {second} must have shape ({B},), got "
                     f"{tuple(positions_or_lengths.shape)}")
  if page_table.ndim != 2 or page_table.shape[0] != B:
    raise ValueError(f"{op}: page_table must have shape ({B}, P), got {tuple(page_table.shape)}")


def _check_cache(params: DeepseekParams, cache: MLAKVCache, op: str) -> None:
  c, cc = params.config, cache.config
  want = (c.num_hidden_layers, c.kv_lora_rank, c.qk_rope_head_dim)
  got = (cc.layer_num, cc.kv_lora_rank, cc.qk_rope_head_dim)
  if want != got:
    raise ValueError(f"{op}: cache must have (layer_num, kv_lora_rank, qk_rope_head_dim) = "
                     f"{want} for this model, got {got}")


@dispatch.host_index_arguments("lengths", "page_table")
@functools.partial(jax.jit, static_argnames=("implementation", "all_logits"),
                   donate_argnames=("cache",))
def prefill(
    params: DeepseekParams, cache: MLAKVCache, tokens: jax.Array, lengths: jax.Array,
    page_table: jax.Array, implementation: dispatch.Implementation = None,
    all_logits: bool = False,
) -> tuple[jax.Array, MLAKVCache]:
  """Run right-padded prompts, writing every prompt token's latent row (donates `cache`).

  Args:
    tokens: (B, S) int prompts, right-padded; lengths: (B,) int (1 <= length <= S;
      others are clamped there for the logits: a length <= 0 writes only padding rows).
    page_table: (B, P) int pages (P * page_size >= S); padded tokens write to row 0.
    implementation: the cache ops' implementation.
    all_logits: return the logits of every position, not only each prompt's last.
  Returns:
    (logits (B, V) float32 of each prompt's last token, or (B, S, V) with `all_logits`
    (positions past a prompt's end: don't care), the new cache).
  """
  _check_cache(params, cache, "prefill")
  _check_batch(tokens, lengths, page_table, "prefill", "lengths")
  c, dtype = params.config, params.dtype
  B, S = tokens.shape
  H, dr = c.num_attention_heads, c.qk_rope_head_dim
  positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  slots = token_slots(page_table, positions, cache.config.page_size,
                      cache.config.rows // cache.config.page_size)
  write_loc = jnp.where(positions < lengths[:, None], slots, 0).reshape(B * S)
  flat_positions = positions.reshape(B * S)
  causal = jnp.tril(jnp.ones((S, S), bool))[None, None]                       # (1, 1, S, S)

  x = params.embed[tokens].astype(F32)
  for layer_id, layer in enumerate(params.layers):
    w = layer.attention
    h = rms_norm(x, layer.input_norm, c.rms_norm_eps).reshape(B * S, -1)
    q_nope, q_rope, c_kv, k_rope = _project(w, h, c, dtype)
    k_rope = apply_rope(k_rope, flat_positions, params.cos_sin_cache)
    q_rope = apply_rope(q_rope, flat_positions, params.cos_sin_cache)
    cache = dispatch.set_mla_kv_buffer(cache, layer_id, write_loc, c_kv[:, None], k_rope[:, None],
                                       implementation=implementation)
    # Expanded (non-absorbed) attention over the prompt's own latents.
    k_nope = _dot("nr,hdr->nhd", c_kv, w.w_uk, dtype).reshape(B, S, H, -1)
    v = _dot("nr,hrv->nhv", c_kv, w.w_uv, dtype).reshape(B, S, H, -1)
    scores = (_dot("bqhd,bkhd->bhqk", q_nope.reshape(B, S, H, -1), k_nope, dtype)
              + _dot("bqhd,bkd->bhqk", q_rope.reshape(B, S, H, dr), k_rope.reshape(B, S, dr),
                     dtype)) * c.softmax_scale
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    o = _dot("bhqk,bkhv->bqhv", probs, v, dtype)
    x = x + _dot("bqhv,hvd->bqd", o, w.o_proj, dtype)
    x = _feed_forward(layer, x, c, dtype)
  if all_logits:
    return _logits(params, x), cache
  last = jnp.take_along_axis(x, jnp.clip(lengths - 1, 0, S - 1)[:, None, None], axis=1)[:, 0]
  return _logits(params, last), cache


def _decode_layer(
    params: DeepseekParams, layer_id: int, cache: MLAKVCache, x: jax.Array, positions: jax.Array,
    write_loc: jax.Array, page_table: jax.Array, implementation, attention: str,
) -> tuple[jax.Array, MLAKVCache]:
  """One layer of a decode step: x (B, D) float32 -> (B, D) float32."""
  c, dtype = params.config, params.dtype
  layer = params.layers[layer_id]
  w = layer.attention
  h = rms_norm(x, layer.input_norm, c.rms_norm_eps)
  q_nope, q_rope, c_kv, k_rope = _project(w, h, c, dtype)
  q_latent = _dot("bhd,hdr->bhr", q_nope, w.w_uk, dtype)                       # absorbed: (B, H, R)
  # The fused RoPE + query assembly + latent write (SPEC §8).
  cache, q = rope_set_mla_kv_buffer(
      cache, layer_id, write_loc, positions, q_latent, q_rope, c_kv[:, None], k_rope[:, None],
      params.cos_sin_cache, q_out_dtype=attention_q_dtype(cache.config),
      implementation=implementation)
  # The paged decode attention (SPEC §7).
  out, _ = _decode_attention(attention)(
      cache, layer_id, q[:, None], page_table, positions + 1, sm_scale=c.softmax_scale,
      implementation=implementation)
  o = _dot("bhr,hrv->bhv", out[:, 0], w.w_uv, dtype)
  x = x + _dot("bhv,hvd->bd", o, w.o_proj, dtype)
  return _feed_forward(layer, x, c, dtype), cache


@dispatch.host_index_arguments("positions", "page_table")
@functools.partial(jax.jit, static_argnames=("implementation", "attention"),
                   donate_argnames=("cache",))
def decode_step(
    params: DeepseekParams, cache: MLAKVCache, tokens: jax.Array, positions: jax.Array,
    page_table: jax.Array, implementation: dispatch.Implementation = None,
    attention: Attention = "mla_decode",
) -> tuple[jax.Array, MLAKVCache]:
  """One decode step (donates `cache`).

  Args:
    tokens: (B,) int, each sequence's newest token; positions: (B,) int, its position
      (= tokens already cached for that sequence).
    page_table: (B, P) int.
    implementation: the cache ops' implementation.
    attention: "mla_decode" (`jax_mla_cache.mla_decode`, reads the cache in place) or
      "gather" (`gather_mla_decode`: the context rows copied out by `get_mla_kv_buffer`).
  Returns:
    (logits (B, V) float32, the new cache).
  """
  _check_cache(params, cache, "decode_step")
  _check_batch(tokens, positions, page_table, "decode_step", "positions")
  positions = positions.astype(jnp.int32)
  write_loc = token_slots(page_table, positions[:, None], cache.config.page_size,
                          cache.config.rows // cache.config.page_size)[:, 0]
  x = params.embed[tokens].astype(F32)
  for layer_id in range(len(params.layers)):
    x, cache = _decode_layer(params, layer_id, cache, x, positions, write_loc, page_table,
                             implementation, attention)
  return _logits(params, x), cache


def generate(
    params: DeepseekParams, cache: MLAKVCache, tokens: Any, lengths: Any, page_table: Any,
    steps: int, implementation: dispatch.Implementation = None,
    attention: Attention = "mla_decode",
) -> tuple[np.ndarray, np.ndarray, MLAKVCache]:
  """Greedy generation for a batch of prompts of different lengths.

  Args:
    tokens: (B, S) int right-padded prompts; lengths: (B,) int.
    page_table: (B, P) int with P * page_size >= max(lengths) + steps.
    steps: decode steps.
  Returns:
    (generated (B, steps) int32: token i is the argmax of the logits before it (the prefill's
    for i = 0), step_logits (B, steps, V) float32: the logits of decode step i (after
    feeding token i), the new cache).
  """
  # Host indices narrowed without wrapping (jnp.asarray(x, int32) would wrap 2**32 + 3 to
  # page 3): a page id or length outside int32 becomes -1 (masked, nothing written).
  tokens = jnp.asarray(tokens, jnp.int32)
  lengths, page_table = (jnp.asarray(dispatch.host_indices(x)).astype(jnp.int32)
                         for x in (lengths, page_table))
  logits, cache = prefill(params, cache, tokens, lengths, page_table, implementation)
  generated, step_logits = [], []
  for i in range(steps):
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits, cache = decode_step(params, cache, token, lengths + i, page_table, implementation,
                                attention)
    generated.append(token)
    step_logits.append(logits)
  B, V = tokens.shape[0], params.config.vocab_size
  if not steps:
    return np.zeros((B, 0), np.int32), np.zeros((B, 0, V), np.float32), cache
  return (np.asarray(jnp.stack(generated, 1)), np.asarray(jnp.stack(step_logits, 1)), cache)


# ----------------------------------------------------------------- random weights (demo)
def random_params(config: DeepseekConfig, *, dtype: Any = jnp.bfloat16, seed: int = 0,
                  max_position: int = 4096) -> DeepseekParams:
  """Random weights of `config`'s shapes, drawn on the default device with jax.random
  (std 1/sqrt(fan_in); norms one; router bias 0.1 * normal). For timing, not for meaning."""
  c, dtype = config, jnp.dtype(dtype)
  H, dn, dr, dv, R, D = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim,
                         c.v_head_dim, c.kv_lora_rank, c.hidden_size)
  keys = iter(jax.random.split(jax.random.key(seed), 64 * (c.num_hidden_layers + 1)))

  @functools.partial(jax.jit, static_argnames=("shape", "fan_in", "out_dtype"))
  def normal(key, shape, fan_in, out_dtype):
    return (jax.random.normal(key, shape, F32) / math.sqrt(fan_in)).astype(out_dtype)

  new = lambda shape, fan_in, out_dtype=dtype: normal(next(keys), shape, fan_in, out_dtype)
  ones = lambda n: jnp.ones((n,), F32)

  def mlp(inner):
    return DenseMLP(gate=new((D, inner), D), up=new((D, inner), D), down=new((inner, D), inner))

  layers = []
  for i in range(c.num_hidden_layers):
    if c.q_lora_rank is None:
      q = dict(q_proj=new((D, H, dn + dr), D), q_a_proj=None, q_a_norm=None, q_b_proj=None)
    else:
      q = dict(q_proj=None, q_a_proj=new((D, c.q_lora_rank), D), q_a_norm=ones(c.q_lora_rank),
               q_b_proj=new((c.q_lora_rank, H, dn + dr), c.q_lora_rank))
    attention = AttentionWeights(
        kv_a_proj=new((D, R + dr), D), kv_a_norm=ones(R), w_uk=new((H, dn, R), R),
        w_uv=new((H, R, dv), R), o_proj=new((H, dv, D), H * dv), **q)
    if c.is_moe_layer(i):
      E, inner = c.n_routed_experts, c.moe_intermediate_size
      block = MoEWeights(
          router=new((D, E), D, F32), correction_bias=new((E,), 100.0, F32),
          gate=new((E, D, inner), D), up=new((E, D, inner), D), down=new((E, inner, D), inner),
          shared=mlp(inner * c.n_shared_experts) if c.n_shared_experts else None)
    else:
      block = mlp(c.intermediate_size)
    layers.append(LayerWeights(input_norm=ones(D), attention=attention,
                               post_attention_norm=ones(D), mlp=block))
  return DeepseekParams(
      embed=new((c.vocab_size, D), 1), layers=tuple(layers), norm=ones(D),
      lm_head=new((D, c.vocab_size), D),
      cos_sin_cache=jnp.asarray(c.cos_sin_cache(max_position)), config=c, dtype=dtype)


DEEPSEEK_V3_SHAPES = dict(
    model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=2048, n_shared_experts=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=163840,
    rope_scaling=(("beta_fast", 32), ("beta_slow", 1), ("factor", 40.0), ("mscale", 1.0),
                  ("mscale_all_dim", 1.0), ("original_max_position_embeddings", 4096),
                  ("type", "yarn")),
)
"""DeepSeek-V3's attention and expert widths (all real); layer and expert counts are
chosen by `deepseek_v3_shaped`."""


def deepseek_v3_shaped(num_hidden_layers: int = 4, first_k_dense_replace: int = 1,
                       n_routed_experts: int = 16, num_experts_per_tok: int = 4,
                       n_group: int = 4, topk_group: int = 2) -> DeepseekConfig:
  """A DeepSeek-V3 config with every width real and fewer layers and experts (real: 61
  layers, 3 dense, 256 experts, top 8 of 8 groups, 4 groups)."""
  return DeepseekConfig(num_hidden_layers=num_hidden_layers,
                        first_k_dense_replace=first_k_dense_replace,
                        n_routed_experts=n_routed_experts, num_experts_per_tok=num_experts_per_tok,
                        n_group=n_group, topk_group=topk_group, **DEEPSEEK_V3_SHAPES)
