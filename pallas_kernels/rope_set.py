"""Fused RoPE + query assembly + latent-row write (SPEC §8) in one Mosaic GPU launch.

Public function (arrays in, arrays out; the cache buffers are aliased, never copied)::

    rope_set_rows(buffers, loc, positions, q_nope, q_rope, k_nope, k_rope, cos_sin_cache,
                  *, is_neox=False, q_out_dtype=None, sanitize=False) -> (buffers, q_out)

`buffers` is one layer's tuple: ``(kv,)`` (plain, kv (rows, 1, R+Rr) of any storage dtype)
or ``(nope_buf, scale_buf, rope_buf)`` (per_token_head, as `rows.set_rows_per_token_head`).
loc (T,) int32 slots (outside [0, rows): skipped); positions (T,) int32, clamped to
[0, max_position) (the rule of `jax_mla_cache.rope.apply_rope`); q_nope (T, H, R) and
q_rope (T, H, Rr), k_nope (T, 1, R), k_rope (T, 1, Rr) of any float dtypes;
cos_sin_cache (max_position, Rr) float32, [cos | sin] per row. Returns the new buffers and
q_out (T, H, R+Rr) = [q_nope | rope(q_rope)] in q_out_dtype (bf16/f16/f32).

What it computes equals the unfused composition (SPEC §8): k_rope and q_rope rotated in
float32 (neox: pairs (x[i], x[i+Rr/2]); GPT-J: pairs (x[2i], x[2i+1]); each pair
(a, b) -> (a*c - b*s, b*c + a*s)), the row [k_nope | rope(k_rope)] written as
`set_rows` / `set_rows_per_token_head` write float32 rows (cast, or quantized as SPEC §3
from the unrounded float32 rotation), and q_out cast from float32. With `sanitize` (SPEC
§9) k_rope's NaN / +-inf become 0 / +-its dtype's largest finite value before the rotation
and the row is written with `sanitize`; q_out is never sanitized (it is not stored).

Design
------
A 2-D grid: program (b, g) owns tokens [t0, t0 + B) (B = min(T, 4); t0 shifted back at
the end as in `rows`). Programs g < H / Hb own heads [g*Hb, (g+1)*Hb) of q; the last program
of each token block (g = H / Hb) writes the tokens' cache rows, in parallel with the query
programs (at small T the launch is as long as its slowest program, and the quantized write
is the slowest piece). Every program bulk-loads each token's cos/sin table row (one
256-byte copy per token, at the position read as a scalar and clamped) with its inputs on
one barrier. A query program:

1. bulk-loads its tokens' q_nope and q_rope heads (one contiguous copy per token each: a
   token's Hb heads are adjacent);
2. in registers, for each head: casts the nope part and rotates the rope part into a
   shared-memory block laid out as q_out (a token's Hb heads of R+Rr values, contiguous);
3. stores that block with one bulk copy per token.

The cache program loads the tokens' k_nope and k_rope, casts or quantizes the rotated row
in registers, and stores it with one bulk copy per in-range slot (pl.when around each: bad
slots are skipped on every backend). So one launch rotates, assembles and writes; small T
is a few programs of short latency, large T is bandwidth bound (q read and written once,
the latent row read and written once).

Sizes: H is split in blocks of Hb heads, the largest divisor of H whose shared memory keeps
a program within `SMEM_BUDGET` (four programs per SM; Hb = 4 for bf16 R=512, Rr=64). The
register blocks have 4 rows (tokens), the smallest for which every layout below exists;
rows past B hold garbage that nothing stores.

Register layouts: a head's slab of the block (4 tokens x Rr) is a strided view, so it is
processed in `WG_STRIDED` layouts, where thread t holds elements [(i*128 + t)*v, +v) of
the flattened slab. With v = 2 for the (4, Rr) values and v = 1 for the (4, Rr/2) cos and
sin, a thread's register i holds exactly one GPT-J pair and its cos/sin: the pair swap and
the cos/sin duplication are shuffles within a thread's vector (`_gptj_tables`,
`_swap_pairs`; inline Mosaic GPU on the GPU, plain jnp in interpret mode), no shared-memory
or cross-thread traffic. Neox needs none: its halves are two slices of the slab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.common import F32
from pallas_kernels.rows import (FP8_E4M3, _PROMISE, _check_buffer, _check_bulk, _check_float,
                                 _check_loc, _kernel, quantize_block, store_rows)

BLOCK_ROWS = 4
"""Register block rows: a program's most tokens (B <= 4) and the rows of its blocks."""

SMEM_BUDGET = 56 * 1024
"""Shared memory per program that the head-block size keeps within (bytes): four programs
fit the 227 KB of an H100/H200 SM, so one program's loads overlap another's stores."""


def unsupported_reason(R: int, Rr: int) -> str | None:
  """Why the kernel cannot take rows of R + Rr values (None when it can).

  The layouts need Rr a multiple of 64 (a (4, Rr/2) float32 block spread over 128 threads)
  and R a multiple of 32 (per_token_head's row layout)."""
  if Rr % 64:
    return f"qk_rope_head_dim must be a multiple of 64, got {Rr}"
  if R % 32:
    return f"kv_lora_rank must be a multiple of 32, got {R}"
  return None


def heads_per_program(H: int, program_bytes) -> int:
  """The largest divisor Hb of H with program_bytes(Hb) <= SMEM_BUDGET (at least 1)."""
  fits = [d for d in range(1, H + 1) if H % d == 0 and program_bytes(d) <= SMEM_BUDGET]
  return max(fits, default=1)


def rope_set_rows(buffers, loc, positions, q_nope, q_rope, k_nope, k_rope, cos_sin_cache, *,
                  is_neox: bool = False, q_out_dtype=None, sanitize: bool = False):
  """The fused write (module docstring). Returns (new buffers tuple, q_out (T, H, R+Rr))."""
  buffers = tuple(buffers)
  if len(buffers) == 1:
    _check_buffer("kv", buffers[0], common.STORAGE_DTYPES)
    rows, W = buffers[0].shape[0], buffers[0].shape[2]
    R = q_nope.shape[-1]
    storage = jnp.dtype(buffers[0].dtype)
    rope_dtype = None
  elif len(buffers) == 3:
    _check_buffer("nope_buf", buffers[0], (FP8_E4M3,))
    _check_buffer("scale_buf", buffers[1], (jnp.dtype(F32),))
    _check_buffer("rope_buf", buffers[2], common.MODEL_DTYPES)
    rows, R = buffers[0].shape[0], buffers[0].shape[2]
    W = R + buffers[2].shape[2]
    if buffers[1].shape != (rows, 1, 1) or buffers[2].shape[0] != rows:
      raise ValueError(f"buffers disagree: {[b.shape for b in buffers]}")
    storage, rope_dtype = None, jnp.dtype(buffers[2].dtype)
  else:
    raise ValueError(f"buffers must be (kv,) or (nope, scale, rope), got {len(buffers)} arrays")
  Rr = W - R
  _check_loc(loc)
  T = loc.shape[0]
  for name, x in (("q_nope", q_nope), ("q_rope", q_rope), ("k_nope", k_nope),
                  ("k_rope", k_rope)):
    _check_float(name, x)
  H = q_nope.shape[1] if q_nope.ndim == 3 else -1
  for name, x, shape in (("q_nope", q_nope, (T, H, R)), ("q_rope", q_rope, (T, H, Rr)),
                         ("k_nope", k_nope, (T, 1, R)), ("k_rope", k_rope, (T, 1, Rr)),
                         ("positions", positions, (T,)),
                         ("cos_sin_cache", cos_sin_cache, (cos_sin_cache.shape[0], Rr))):
    if x.shape != shape or (name == "q_nope" and H < 1):
      raise ValueError(f"{name} must have shape {shape}, got {x.shape}")
  if positions.dtype != jnp.int32:
    raise TypeError(f"positions must be int32, got {positions.dtype}")
  if cos_sin_cache.dtype != jnp.float32 or cos_sin_cache.shape[0] < 1:
    raise TypeError(f"cos_sin_cache must be a non-empty float32 table, got "
                    f"{cos_sin_cache.dtype}{list(cos_sin_cache.shape)}")
  out_dtype = jnp.dtype(q_out_dtype or q_rope.dtype)
  if out_dtype not in common.MODEL_DTYPES:
    raise TypeError(f"q_out_dtype must be one of {[str(d) for d in common.MODEL_DTYPES]}, "
                    f"got {out_dtype}")
  if (reason := unsupported_reason(R, Rr)) is not None:
    raise NotImplementedError(f"rope_set_rows: {reason}")
  in_dtypes = tuple(jnp.dtype(x.dtype) for x in (q_nope, q_rope, k_nope, k_rope))
  for name, width, dt in (("q_nope", R, in_dtypes[0]), ("q_rope", Rr, in_dtypes[1]),
                          ("k_nope", R, in_dtypes[2]), ("k_rope", Rr, in_dtypes[3]),
                          ("q_out", W, out_dtype), ("cache row", W, storage or FP8_E4M3),
                          ("rope_buf", Rr, rope_dtype or FP8_E4M3)):
    _check_bulk(name, width, dt)
  if T == 0:
    return buffers, jnp.zeros((0, H, W), out_dtype)

  def program_bytes(Hb):
    per_head = R * in_dtypes[0].itemsize + Rr * in_dtypes[1].itemsize + W * out_dtype.itemsize
    k_in = R * in_dtypes[2].itemsize + Rr * in_dtypes[3].itemsize + Rr * 4  # + cos/sin
    k_out = (W * storage.itemsize if storage is not None
             else R + Rr * (4 + rope_dtype.itemsize) + 4)  # q8, rotated f32, rope, scale
    return BLOCK_ROWS * (Hb * per_head + k_in + k_out)

  build = functools.partial(
      _build, T=T, H=H, Hb=heads_per_program(H, program_bytes), B=min(T, BLOCK_ROWS),
      rows=rows, R=R, Rr=Rr, positions=cos_sin_cache.shape[0], in_dtypes=in_dtypes,
      out_dtype=out_dtype, storage=storage, rope_dtype=rope_dtype, is_neox=bool(is_neox),
      sanitize=bool(sanitize))
  flat = tuple(b.reshape(rows, b.shape[2]) if b.shape[2] > 1 else b.reshape(rows)
               for b in buffers)
  *new, q_out = common.dispatch(
      build, loc.astype(jnp.int32), positions, q_nope.reshape(T, H * R),
      q_rope.reshape(T, H * Rr), common.as_rows(k_nope), common.as_rows(k_rope),
      cos_sin_cache, *flat)
  new = tuple(n.reshape(b.shape) for n, b in zip(new, buffers))
  return new, q_out.reshape(T, H, W)


# ----------------------------------------------------------------------------------------
# rotation helpers (register blocks of BLOCK_ROWS rows)


def _layouts(Rr: int):
  """(values, cos/sin) layouts: thread register i holds one GPT-J pair and its cos/sin."""
  return (plgpu.Layout.WG_STRIDED((BLOCK_ROWS, Rr), 2),
          plgpu.Layout.WG_STRIDED((BLOCK_ROWS, Rr // 2), 1))


def _shuffled(layout, *sources_and_masks):
  """An inline Mosaic GPU function: each output register is a vector.shuffle of the
  registers at the same index of two inputs (pair swaps and duplications)."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import vector
  from jax.experimental.mosaic import gpu as mgpu

  def make(a, b, mask):
    regs = np.empty_like(a.registers)
    for idx in np.ndindex(*regs.shape):
      regs[idx] = vector.shuffle(a.registers[idx], b.registers[idx],
                                 mask=ir.DenseI64ArrayAttr.get(mask))
    return mgpu.FragmentedArray(_registers=regs, _layout=layout.to_mgpu(), _is_signed=None)

  return [make(a, b, mask) for a, b, mask in sources_and_masks]


def _gptj_tables(c, s, interpret: bool, Rr: int):
  """GPT-J cos/sin at full width: C[j] = c[j // 2], S[j] = -s[j // 2] (j even) or
  +s[j // 2] (j odd), so that out = x * C + swap_pairs(x) * S (SPEC §8's pair rotation,
  the same float32 products and sum as a*c - b*s, b*c + a*s)."""
  rows = c.shape[0]
  if interpret:
    return (jnp.repeat(c, 2, axis=1),
            jnp.stack([-s, s], axis=-1).reshape(rows, Rr))
  full, half = _layouts(Rr)
  out = plgpu.ShapeDtypeStruct((rows, Rr), F32, layout=full)

  @plgpu.inline_mgpu(arg_types=(half, half, half), return_type=(out, out))
  def expand(_, c, neg_s, s):
    # Registers are vector<1>: concat(a, b) = [a0, b0]; mask [0, 1] picks a0 then b0.
    return tuple(_shuffled(full, (c, c, [0, 1]), (neg_s, s, [0, 1])))

  return expand(c, -s, s)


def _swap_pairs(x, interpret: bool, Rr: int):
  """x[..., j ^ 1]: each GPT-J pair swapped (within one thread's vector<2> on the GPU)."""
  rows = x.shape[0]
  if interpret:
    return x.reshape(rows, Rr // 2, 2)[..., ::-1].reshape(rows, Rr)
  full, _ = _layouts(Rr)

  @plgpu.inline_mgpu(arg_types=(full,),
                     return_type=plgpu.ShapeDtypeStruct((rows, Rr), F32, layout=full))
  def swap(_, x):
    return _shuffled(full, (x, x, [1, 0]))[0]

  return swap(x)


def _rope_tables(cs_sm, *, Rr: int, is_neox: bool, interpret: bool):
  """The block's cos/sin (loaded once per program, used for every head and for k)."""
  _, half_layout = _layouts(Rr)
  half = Rr // 2
  c = plgpu.load(cs_sm.at[:, pl.ds(0, half)], layout=half_layout)
  s = plgpu.load(cs_sm.at[:, pl.ds(half, half)], layout=half_layout)
  if is_neox:
    return c, s
  return _gptj_tables(c, s, interpret, Rr)


def _rotate(x_ref, tables, *, Rr: int, is_neox: bool, interpret: bool, prepare=None):
  """Rotate a (BLOCK_ROWS, Rr) ref view: [(column offset, float32 block)] to store.

  `prepare` maps the float32 inputs first (the sanitize of k_rope)."""
  prepare = prepare or (lambda v: v)
  full, half_layout = _layouts(Rr)
  if is_neox:
    half = Rr // 2
    c, s = tables
    a = prepare(plgpu.load(x_ref.at[:, pl.ds(0, half)], layout=half_layout).astype(F32))
    b = prepare(plgpu.load(x_ref.at[:, pl.ds(half, half)], layout=half_layout).astype(F32))
    return [(0, a * c - b * s), (half, b * c + a * s)]
  C, S = tables
  x = prepare(plgpu.load(x_ref, layout=full).astype(F32))
  return [(0, x * C + _swap_pairs(x, interpret, Rr) * S)]


# ----------------------------------------------------------------------------------------
# the kernel


def _build(interpret, *, T, H, Hb, B, rows, R, Rr, positions, in_dtypes, out_dtype, storage,
           rope_dtype, is_neox, sanitize):
  W = R + Rr
  Bc = BLOCK_ROWS
  qn_dtype, qr_dtype, kn_dtype, kr_dtype = in_dtypes
  pth = storage is None
  n_head_blocks = H // Hb
  rot = functools.partial(_rotate, Rr=Rr, is_neox=is_neox, interpret=interpret)
  nope_layout = common.strided_layout((Bc, R), qn_dtype, out_dtype)
  # k_rope's NaN / inf are replaced before the rotation (SPEC §9 on the composition's input).
  prepare_k = (lambda v: common.sanitize_f32(v, common.finite_max(kr_dtype))) if sanitize else None

  def body(loc_ref, pos_ref, qn_ref, qr_ref, kn_ref, kr_ref, cs_ref, *refs):
    n_buf = 3 if pth else 1
    bufs, (qo_ref, qn_sm, qr_sm, qo_sm, cs_sm, kn_sm, kr_sm, *k_sm, bar_q, bar_k) = (
        refs[:n_buf], refs[n_buf:])
    t0 = jnp.minimum(lax.axis_index("b") * B, T - B)
    g = lax.axis_index("h")

    def load_tables(bar):
      for i in range(B):
        # Positions outside the table are clamped to it (as rope.apply_rope).
        p = jnp.clip(pos_ref[t0 + i], 0, positions - 1)
        plgpu.copy_gmem_to_smem(cs_ref.at[p], cs_sm.at[i], bar, **_PROMISE)
      plgpu.barrier_wait(bar)
      return _rope_tables(cs_sm, Rr=Rr, is_neox=is_neox, interpret=interpret)

    @pl.when(g < n_head_blocks)
    def _queries():
      for i in range(B):
        plgpu.copy_gmem_to_smem(qn_ref.at[t0 + i, pl.ds(g * (Hb * R), Hb * R)], qn_sm.at[i],
                                bar_q, **_PROMISE)
        plgpu.copy_gmem_to_smem(qr_ref.at[t0 + i, pl.ds(g * (Hb * Rr), Hb * Rr)],
                                qr_sm.at[i], bar_q, **_PROMISE)
      tables = load_tables(bar_q)
      for h in range(Hb):
        x = plgpu.load(qn_sm.at[:, pl.ds(h * R, R)], layout=nope_layout)
        qo_sm.at[:, pl.ds(h * W, R)][...] = common.cast_to(x, out_dtype)
        for offset, y in rot(qr_sm.at[:, pl.ds(h * Rr, Rr)], tables):
          qo_sm.at[:, pl.ds(h * W + R + offset, y.shape[1])][...] = y.astype(out_dtype)
      plgpu.commit_smem()
      for i in range(B):
        plgpu.copy_smem_to_gmem(qo_sm.at[i], qo_ref.at[t0 + i, pl.ds(g * (Hb * W), Hb * W)],
                                commit_group=False)

    @pl.when(g == n_head_blocks)
    def _cache_rows():
      plgpu.copy_gmem_to_smem(kn_ref.at[pl.ds(t0, B)], kn_sm.at[pl.ds(0, B)], bar_k, **_PROMISE)
      plgpu.copy_gmem_to_smem(kr_ref.at[pl.ds(t0, B)], kr_sm.at[pl.ds(0, B)], bar_k, **_PROMISE)
      rs = [loc_ref[t0 + i] for i in range(B)]
      tables = load_tables(bar_k)
      if pth:
        _write_quantized(bufs, k_sm, kn_sm, kr_sm, rs, tables)
      else:
        _write_plain(bufs[0], k_sm[0], kn_sm, kr_sm, rs, tables)

    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def _write_plain(kv_ref, row_sm, kn_sm, kr_sm, rs, tables):
    layout = common.strided_layout((Bc, R), kn_dtype, storage)
    row_sm.at[:, pl.ds(0, R)][...] = common.cast_to(plgpu.load(kn_sm, layout=layout), storage,
                                                    sanitize)
    for offset, y in rot(kr_sm, tables, prepare=prepare_k):
      row_sm.at[:, pl.ds(R + offset, y.shape[1])][...] = common.cast_to(y, storage, sanitize)
    plgpu.commit_smem()
    store_rows(rs, rows, [(row_sm, kv_ref)])

  def _write_quantized(bufs, k_sm, kn_sm, kr_sm, rs, tables):
    qb_ref, sb_ref, rb_ref = bufs
    rot_sm, q8_sm, ro_sm, s_sm = k_sm
    ln = common.row_layout(R, kn_dtype, FP8_E4M3)
    lr = common.row_layout(Rr, F32, rope_dtype)
    # The rotation's layout is not the row layout the scale broadcasts onto: the rotated
    # block takes a trip through shared memory (Rr float32 values per token).
    for offset, y in rot(kr_sm, tables, prepare=prepare_k):
      rot_sm.at[:, pl.ds(offset, y.shape[1])][...] = y
    plgpu.commit_smem()  # warpgroup barrier: the rotated block is visible to every thread
    limits = (common.finite_max(kn_dtype), common.finite_max(F32)) if sanitize else None
    q8_sm[...], ro_sm[...], s_sm[...] = quantize_block(
        plgpu.load(kn_sm, layout=ln).astype(F32), plgpu.load(rot_sm, layout=lr),
        ln=ln, lr=lr, rope_dtype=rope_dtype, interpret=interpret, sanitize_limits=limits,
        valid_rows=B, x_dtype=kn_dtype)
    plgpu.commit_smem()
    store_rows(rs, rows, [(q8_sm, qb_ref), (ro_sm, rb_ref)], [(s_sm, sb_ref)])

  k_out = ([plgpu.SMEM((Bc, Rr), F32), plgpu.SMEM((Bc, R), FP8_E4M3),
            plgpu.SMEM((Bc, Rr), rope_dtype), plgpu.SMEM((Bc,), F32)] if pth
           else [plgpu.SMEM((Bc, W), storage)])
  kernel = _kernel(
      body, grid=(pl.cdiv(T, B), n_head_blocks + 1), grid_names=("b", "h"), interpret=interpret,
      name="mla_rope_set_rows" + ("_per_token_head" if pth else ""),
      out_type=jax.ShapeDtypeStruct((T, H * W), out_dtype),
      scratch=[plgpu.SMEM((Bc, Hb * R), qn_dtype), plgpu.SMEM((Bc, Hb * Rr), qr_dtype),
               plgpu.SMEM((Bc, Hb * W), out_dtype), plgpu.SMEM((Bc, Rr), F32),
               plgpu.SMEM((Bc, R), kn_dtype), plgpu.SMEM((Bc, Rr), kr_dtype), *k_out,
               plgpu.Barrier(num_arrivals=3 * B), plgpu.Barrier(num_arrivals=2 + B)],
  )

  def run(loc, pos, qn, qr, kn, kr, cs, *buffers):
    refs = [jax.new_ref(b) for b in buffers]
    q_out = kernel(loc, pos, qn, qr, kn, kr, cs, *refs)
    return (*(jax.freeze(r) for r in refs), q_out)

  return run
