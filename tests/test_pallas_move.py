"""pallas_kernels.move: bit-exact against a numpy model (CPU interpret mode and GPU).

CPU: interpret mode runs programs one after another, so shapes are small. The streamed and
two-pass paths run in interpret mode (the direct path's thread-level code has no interpret
mode: its stand-in is the next path), token and page moves; overlapping index sets, skipped
pairs, T=0. A deviceless CUDA lowering checks that the real kernels lower, alias every
buffer and take the path the docstring of `pallas_kernels.move` says.
GPU (`pytest -m gpu`): 61 layers, 2**18 + 64 rows, T up to 4096, hostile indices.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla_cache as mc
from jax_mla_cache import reference as mc_reference

import pallas_kernels
from pallas_kernels import move_direct
from pallas_kernels.move import MoveTiling, choose, move_pages, move_rows

TWO_PASS = MoveTiling(path="two_pass")
STREAM = MoveTiling(path="stream")
DIRECT = MoveTiling(path="direct")
ROUNDS = MoveTiling(path="direct", direct_rounds=True)
TREE = MoveTiling(path="direct", direct_select="tree")
TREE_ROUNDS = MoveTiling(path="direct", direct_rounds=True, direct_select="tree")
# Small chunks and ring: several programs per buffer, slots reused within a chunk.
STREAM_SMALL = MoveTiling(path="stream", stream_programs=4096, stream_min_chunk=4,
                          stream_slots=4, stream_lookahead=2)


def make_buffers(rng, rows, plain_layers=2, trio_layers=1):
  """Plain bf16 (rows,1,576) layers, then per_token_head trios (fp8 nope, f32 scale, rope)."""
  out = []
  for _ in range(plain_layers):
    out.append(rng.standard_normal((rows, 1, 576)).astype(jnp.bfloat16))
  for _ in range(trio_layers):
    out.append(rng.standard_normal((rows, 1, 512)).astype(jnp.float8_e4m3fn))
    out.append(rng.standard_normal((rows, 1, 1)).astype(np.float32))
    out.append(rng.standard_normal((rows, 1, 64)).astype(jnp.bfloat16))
  return [jnp.asarray(b) for b in out]


def model_move(buffers, tgt, src, unit=1):
  """Snapshot semantics: read all sources first, then write; skip out-of-range pairs."""
  out = []
  for b in buffers:
    old = np.asarray(b)
    new = old.copy()
    units = old.shape[0] // unit
    for t, s in zip(np.asarray(tgt), np.asarray(src)):
      if 0 <= t < units and 0 <= s < units:
        new[t * unit:(t + 1) * unit] = old[s * unit:(s + 1) * unit]
    out.append(new)
  return out


def assert_bits_equal(got, want):
  assert len(got) == len(want)
  for i, (g, w) in enumerate(zip(got, want)):
    g = np.asarray(g)
    assert g.shape == w.shape and g.dtype == w.dtype, i
    np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=f"buffer {i}")


def hostile_pairs(rng, rows, count):
  """Distinct targets; swaps, a shift-by-one chain, identity moves, out-of-range pairs."""
  tgt, src = [], []
  base = int(rng.integers(2, rows - count - 4))
  chain = max(1, count // 4)
  tgt += list(range(base + 1, base + 1 + chain))  # shift by one: row k+1 <- row k
  src += list(range(base, base + chain))
  used = set(tgt) | set(src)
  free = [r for r in rng.permutation(rows).tolist() if r not in used]
  while len(tgt) < count:
    kind = len(tgt) % 4
    if kind == 0 and len(tgt) + 2 <= count:  # swap
      a, b = free.pop(), free.pop()
      tgt += [a, b]
      src += [b, a]
    elif kind == 1:  # identity
      a = free.pop()
      tgt.append(a)
      src.append(a)
    elif kind == 2:  # skipped: an index out of range
      tgt.append(free.pop())
      src.append(int(rng.choice([-1, rows, rows + 7, -(2**31)])))
    else:
      tgt.append(int(rng.choice([-1, rows, -5])))
      src.append(free.pop())
  order = rng.permutation(count)
  return np.asarray(tgt)[order].astype(np.int32), np.asarray(src)[order].astype(np.int32)


# ---------------------------------------------------------------------------------------
# CPU: interpret mode


@pytest.fixture(scope="module")
def small_buffers():
  return make_buffers(np.random.default_rng(1), rows=256)


@pytest.fixture(scope="module")
def wide_buffers(small_buffers):
  """Three row layouts, no one-element rows: what the streamed path takes."""
  return [b for b in small_buffers if b.shape[-1] != 1]


# default: the direct path's interpret stand-in (the next path that takes the move:
# two-pass for token moves).
@pytest.mark.parametrize("tiling", [None, STREAM_SMALL, TWO_PASS],
                         ids=["default", "stream_small", "two_pass"])
@pytest.mark.parametrize("wide", [False, True], ids=["all", "wide"])
@pytest.mark.parametrize("count", [1, 7, 40])
def test_move_rows_matches_model(small_buffers, wide_buffers, tiling, wide, count):
  if tiling is not None and count == 1 or tiling is TWO_PASS and wide:
    pytest.skip("covered by the other cases")
  buffers = wide_buffers if wide else small_buffers
  rng = np.random.default_rng(count)
  tgt, src = hostile_pairs(rng, 256, count)
  kwargs = {} if tiling is None else {"tiling": tiling}
  got = jax.jit(lambda b, t, s: move_rows(b, t, s, **kwargs))(buffers, tgt, src)
  assert_bits_equal(got, model_move(buffers, tgt, src))


@pytest.mark.parametrize("tiling", [None, STREAM_SMALL], ids=["default", "stream_small"])
def test_move_rows_disjoint_sets(wide_buffers, tiling):
  # No source is a target: the streamed path's one-pass mode (every chunk in parallel).
  rng = np.random.default_rng(5)
  perm = rng.permutation(256)
  tgt, src = perm[:30].astype(np.int32), perm[30:60].astype(np.int32)
  tgt[3], src[7] = -1, 256  # skipped pairs
  kwargs = {} if tiling is None else {"tiling": tiling}
  got = jax.jit(lambda b, t, s: move_rows(b, t, s, **kwargs))(wide_buffers, tgt, src)
  assert_bits_equal(got, model_move(wide_buffers, tgt, src))


def test_two_pass_in_batches_matches_model(small_buffers):
  # One buffer of each layout per launch: every batch moves its own buffers, same result.
  rng = np.random.default_rng(11)
  tgt, src = hostile_pairs(rng, 256, 7)
  tiling = MoveTiling(path="two_pass", two_pass_max_buffers=1)
  got = jax.jit(lambda b, t, s: move_rows(b, t, s, tiling=tiling))(small_buffers, tgt, src)
  assert_bits_equal(got, model_move(small_buffers, tgt, src))


def test_two_pass_batches_share_kernels():
  from pallas_kernels import move_two_pass
  plain = [jax.ShapeDtypeStruct((4096, 576), jnp.bfloat16)] * 61
  batches = move_two_pass._batches(plain, [False] * 61, 8)
  assert [len(b) for b in batches] == [8] * 5 + [7] * 3
  assert sorted(k for b in batches for k in b) == list(range(61))
  # Lowered: one kernel per distinct batch size and pass (8 and 7 buffers).
  buffers = [jax.ShapeDtypeStruct((4096, 1, 576), jnp.bfloat16)] * 61
  text = lower_for_cuda(lambda b, t, s: move_rows(b, t, s, tiling=TWO_PASS), buffers, 40)
  assert text.count("stablehlo.custom_call @mosaic_gpu_v2(") == 4


def test_endangered_compare_matches_counts():
  # The all-pairs compare (small T) and the writer counts (large T) against a direct loop;
  # duplicate targets, self-moves (tgt == src) and skipped pairs (tgt = -1) included.
  from pallas_kernels.move_common import endangered as _endangered
  rng = np.random.default_rng(3)
  for _ in range(5):
    tgt = rng.integers(-1, 40, 64).astype(np.int32)
    src = rng.integers(0, 40, 64).astype(np.int32)
    src[:4] = np.where(tgt[:4] >= 0, tgt[:4], src[:4])
    want = [int(t >= 0 and any(tgt[i] == s for i in range(64) if i != j))
            for j, (t, s) in enumerate(zip(tgt, src))]
    np.testing.assert_array_equal(_endangered(tgt, src, 40, 1024), want)
    np.testing.assert_array_equal(_endangered(tgt, src, 40, 0), want)


def test_move_rows_edge_rows_and_int64_indices(small_buffers):
  # The last rows (a scale window is clamped there) and int64 indices past int32.
  tgt = np.array([255, 0, 254, 3, 2**32 + 1], np.int64)
  src = np.array([0, 255, 255, 2**32 + 2, 1], np.int64)
  with jax.enable_x64(True):
    got = jax.jit(move_rows)(small_buffers, tgt, src)
  assert_bits_equal(got, model_move(small_buffers, tgt, src))


def test_move_rows_duplicate_target_one_writer_wins(small_buffers):
  tgt = np.array([9, 9, 9], np.int32)
  src = np.array([1, 2, 3], np.int32)
  got = jax.jit(move_rows)(small_buffers, tgt, src)
  for g, b in zip(got, small_buffers):
    g, b = np.asarray(g), np.asarray(b)
    assert any(np.array_equal(g[9].view(np.uint8), b[s].view(np.uint8)) for s in src)
    np.testing.assert_array_equal(np.delete(g, 9, 0).view(np.uint8),
                                  np.delete(b, 9, 0).view(np.uint8))


def test_move_rows_empty_is_noop(small_buffers):
  empty = np.zeros((0,), np.int32)
  got = move_rows(small_buffers, empty, empty)
  assert_bits_equal(got, [np.asarray(b) for b in small_buffers])


@pytest.mark.parametrize("tiling", [None, STREAM, STREAM_SMALL, TWO_PASS],
                         ids=["default", "stream", "stream_small", "two_pass"])
def test_move_pages_matches_model(small_buffers, tiling):
  # 256 rows / 16 = 16 pages. Overlapping sets: a rotation 1->2->3->1, a swap, skips.
  tgt = np.array([2, 3, 1, 5, 4, 16, 7, -1, 9], np.int32)
  src = np.array([1, 2, 3, 4, 5, 0, -2, 8, 9], np.int32)
  kwargs = {} if tiling is None else {"tiling": tiling}
  got = jax.jit(lambda b, t, s: move_pages(b, t, s, page_size=16, **kwargs))(
      small_buffers, tgt, src)
  assert_bits_equal(got, model_move(small_buffers, tgt, src, unit=16))


def test_move_pages_disjoint(small_buffers):
  tgt = np.array([2, 7, 11, 20], np.int32)
  src = np.array([5, 1, 12, 3], np.int32)
  got = jax.jit(lambda b, t, s: move_pages(b, t, s, page_size=16))(small_buffers, tgt, src)
  assert_bits_equal(got, model_move(small_buffers, tgt, src, unit=16))


def test_move_pages_one_row_pages(small_buffers):
  # page_size 1: a page of the 4-byte scale buffer is too small for a bulk copy.
  tgt = np.array([4, 5, 6], np.int32)
  src = np.array([5, 6, 4], np.int32)
  got = jax.jit(lambda b, t, s: move_pages(b, t, s, page_size=1))(small_buffers, tgt, src)
  assert_bits_equal(got, model_move(small_buffers, tgt, src))


@pytest.mark.parametrize("bad, error", [
    (dict(tgt_loc=np.zeros((3,), np.float32)), TypeError),
    (dict(tgt_loc=np.zeros((4,), np.int32)), ValueError),
    (dict(tgt_loc=np.zeros((3, 1), np.int32)), TypeError),
])
def test_move_rows_rejects_bad_indices(small_buffers, bad, error):
  args = dict(tgt_loc=np.zeros((3,), np.int32), src_loc=np.zeros((3,), np.int32)) | bad
  with pytest.raises(error, match="tgt_loc"):
    move_rows(small_buffers, **args)


def test_move_rows_rejects_mismatched_rows(small_buffers):
  with pytest.raises(ValueError, match=r"buffers\[1\]"):
    move_rows([small_buffers[0], small_buffers[1][:8]], np.zeros(1, np.int32),
              np.zeros(1, np.int32))


def test_move_rows_rejects_scale_rows_not_multiple_of_four():
  # A one-element-row buffer is read in aligned 16-byte windows: a kernel limit.
  scale = np.zeros((258, 1, 1), np.float32)
  with pytest.raises(pallas_kernels.Unsupported, match="multiple of 4 rows"):
    move_rows([scale], np.zeros(1, np.int32), np.zeros(1, np.int32))


def test_dispatch_moves_odd_row_quantized_cache_through_xla(rng, monkeypatch):
  # rows = 206: not a multiple of 4, which the move kernels do not cover: the default
  # implementation falls through to XLA (same result, a warning); explicit "pallas" raises.
  cfg = mc.SMALL.replace(size=206 - mc.SMALL.page_size, dtype=jnp.float8_e4m3fn,
                         quant_method="per_token_head", layer_num=1)
  assert cfg.rows % 4
  cache = mc.init_cache(cfg)
  loc = jnp.arange(8, dtype=jnp.int32) + cfg.page_size
  cache = mc.set_mla_kv_buffer(cache, 0, loc, jnp.asarray(rng.standard_normal((8, 1, 512)),
                                                          jnp.bfloat16),
                               jnp.asarray(rng.standard_normal((8, 1, 64)), jnp.bfloat16),
                               implementation="xla")
  expected = jax.device_get(mc.move_kv_cache(jax.tree.map(jnp.copy, cache), loc[::-1], loc,
                                             implementation="xla"))
  with pytest.raises(NotImplementedError, match=r"move_kv_cache: .*'pallas'.*multiple of 4 rows"):
    mc.move_kv_cache(cache, loc[::-1], loc, implementation="pallas")
  monkeypatch.setattr(mc.dispatch, "_default_implementation", lambda: "pallas")
  monkeypatch.setattr(mc.dispatch, "_WARNED", set())
  with pytest.warns(mc.dispatch.FallbackWarning, match="multiple of 4 rows"):
    got = jax.device_get(mc.move_kv_cache(cache, loc[::-1], loc))
  assert_bits_equal(jax.tree.leaves(got), jax.tree.leaves(expected))


# ---------------------------------------------------------------------------------------
# Deviceless CUDA lowering: the real kernels lower and alias every buffer


def lower_for_cuda(fn, buffers, count):
  types = [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers]
  index = jax.ShapeDtypeStruct((count,), jnp.int32)
  lowered = jax.jit(fn, donate_argnums=0).trace(types, index, index)
  return lowered.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kind, count, launches", [
    ("direct", 40, 1), ("direct", 2048, 1), ("stream", 40, 1), ("stream_wide", 40, 1),
    ("two_pass", 40, 2), ("pages", 40, 1), ("pages", 1, 1), ("rounds", 4096, 1),
    ("tree", 40, 1), ("tree_rounds", 4096, 1), ("pages_two_pass", 40, 2), ("pdl", 40, 1)])
def test_cuda_lowering_aliases_every_buffer(kind, count, launches):
  buffers = make_buffers(np.random.default_rng(0), rows=4096 + 64, plain_layers=3)
  if kind == "stream":  # with one-element rows the streamed path hands over to two-pass
    launches = 2
  if kind == "stream_wide":
    buffers = [b for b in buffers if b.shape[-1] != 1]
  fn = {
      "direct": move_rows,
      "rounds": lambda b, t, s: move_rows(b, t, s, tiling=ROUNDS),
      "tree": lambda b, t, s: move_rows(b, t, s, tiling=TREE),
      "tree_rounds": lambda b, t, s: move_rows(b, t, s, tiling=TREE_ROUNDS),
      "stream": lambda b, t, s: move_rows(b, t, s, tiling=STREAM),
      "stream_wide": lambda b, t, s: move_rows(b, t, s, tiling=STREAM),
      "two_pass": lambda b, t, s: move_rows(b, t, s, tiling=TWO_PASS),
      "pages": lambda b, t, s: move_pages(b, t, s, page_size=64),
      "pages_two_pass": lambda b, t, s: move_pages(b, t, s, page_size=64, tiling=TWO_PASS),
      "pdl": lambda b, t, s: move_rows(b, t, s, pdl=True),
  }[kind]
  text = lower_for_cuda(fn, buffers, count)
  assert text.count("stablehlo.custom_call @mosaic_gpu_v2(") == launches
  # The interpret branch (a host callback) is pruned: only the kernels are custom calls.
  assert set(re.findall(r"custom_call @(\w+)\(", text)) == {"mosaic_gpu_v2"}
  aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", text)
  assert len(aliases) == len(buffers)  # the move kernel aliases every buffer
  main = next(line for line in text.splitlines() if "func.func public @main" in line)
  assert main.count("tf.aliasing_output") == len(buffers)


@pytest.mark.parametrize("pages, count", [(False, 1), (False, 64), (False, 1024),
                                          (True, 1), (True, 16)])
def test_direct_path_needs_no_index_preparation(pages, count):
  # int32 indices go straight into the one kernel: no XLA op before it (the range checks,
  # and for small page moves the page -> row expansion, are in the kernel), and the kernel
  # body exists once per row layout, so 61 layers lower in well under a second.
  buffers = [jax.ShapeDtypeStruct((2**18 + 64, 1, 576), jnp.bfloat16)] * 61
  fn = (lambda b, t, s: move_pages(b, t, s, page_size=64)) if pages else move_rows
  text = lower_for_cuda(fn, buffers, count)
  main = text[text.index("func.func public @main"):]
  ops = set(re.findall(r"(stablehlo\.\w+)", main.split("func.func", 2)[1]))
  allowed = {"custom_call", "reshape", "case", "constant", "return", "call"}  # case: platform
  assert ops <= {f"stablehlo.{op}" for op in allowed}, ops
  stream = lower_for_cuda(lambda b, t, s: move_rows(b, t, s, tiling=STREAM), buffers[:2], count)
  assert "stablehlo.compare" in stream  # the streamed path's preparation, for contrast


@pytest.mark.parametrize("count", [2048, 4096])
def test_large_token_moves_take_two_pass_in_two_batches(count):
  # Above the direct path's T=1024, plain token moves go to two-pass (faster than the
  # streamed path on the H200): 61 buffers in 2 batches of <= 32, 2 passes = 4 launches.
  buffers = [jax.ShapeDtypeStruct((2**18 + 64, 1, 576), jnp.bfloat16)] * 61
  text = lower_for_cuda(move_rows, buffers, count)
  assert text.count("stablehlo.custom_call @mosaic_gpu_v2(") == 4


# ---------------------------------------------------------------------------------------
# GPU: DeepSeek-V3 sizes


GPU_ROWS = 2**18 + 64


@pytest.fixture(scope="module")
def gpu_buffers():
  keys = jax.random.split(jax.random.key(0), 61)
  return [jax.random.bits(k, (GPU_ROWS, 1, 576), jnp.uint16).view(jnp.bfloat16)
          for k in keys]


@jax.jit
def _same_bits(got, want):
  """One bool per buffer, reduced inside the jit (no (rows, 1, 576) comparison array)."""
  return jnp.stack([jnp.all(g.view(jnp.uint16) == w.view(jnp.uint16))
                    for g, w in zip(got, want)])


def assert_same_61_layers(got, want):
  """Bit equality of two lists of the 61 (GPU_ROWS, 1, 576) bf16 buffers. Three such lists
  (the inputs, the reference, the result) take 55 GB: the tests must fit an 80 GB H100."""
  same = np.asarray(_same_bits(got, want))
  assert same.all(), f"buffers that differ: {np.flatnonzero(~same).tolist()}"


def reference_move(buffers, tgt, src, unit=1):
  """Plain XLA with the same skip rule (distinct targets, so the scatter is exact)."""
  units = buffers[0].shape[0] // unit
  keep = (tgt >= 0) & (tgt < units) & (src >= 0) & (src < units)
  rows_t = (jnp.where(keep, tgt, units)[:, None] * unit + jnp.arange(unit)).reshape(-1)
  rows_s = (jnp.where(keep, src, 0)[:, None] * unit + jnp.arange(unit)).reshape(-1)
  return [b.at[rows_t].set(b[rows_s], mode="drop") for b in buffers]


@pytest.mark.gpu
@pytest.mark.parametrize("count", [1, 8, 64, 256, 1024, 1500, 4096])
def test_gpu_move_rows_61_layers(gpu_buffers, count):
  tgt, src = hostile_pairs(np.random.default_rng(count), GPU_ROWS, count)
  want = jax.jit(reference_move)(gpu_buffers, jnp.asarray(tgt), jnp.asarray(src))
  got = jax.jit(move_rows)(gpu_buffers, tgt, src)  # not donated: inputs stay for the check
  assert_same_61_layers(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("count", [64, 1024])
def test_gpu_move_rows_61_layers_streamed(gpu_buffers, count):
  # The streamed path where "auto" takes the direct one.
  tgt, src = hostile_pairs(np.random.default_rng(count + 1), GPU_ROWS, count)
  want = jax.jit(reference_move)(gpu_buffers, jnp.asarray(tgt), jnp.asarray(src))
  got = jax.jit(lambda b, t, s: move_rows(b, t, s, tiling=STREAM))(gpu_buffers, tgt, src)
  assert_same_61_layers(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("count, overlap", [(1500, True), (4096, True), (4096, False)])
def test_gpu_direct_rounds_61_layers(gpu_buffers, count, overlap):
  # T beyond the registers: rounds; overlapping sets take the temporary, disjoint ones not.
  rng = np.random.default_rng(count + overlap)
  if overlap:
    tgt, src = hostile_pairs(rng, GPU_ROWS, count)
  else:
    perm = rng.permutation(GPU_ROWS)[:2 * count].astype(np.int32)
    tgt, src = perm[:count], perm[count:]
  want = jax.jit(reference_move)(gpu_buffers, jnp.asarray(tgt), jnp.asarray(src))
  for tiling in (ROUNDS, TREE_ROUNDS):
    got = jax.jit(lambda b, t, s: move_rows(b, t, s, tiling=tiling))(gpu_buffers, tgt, src)
    assert_same_61_layers(got, want)
    del got   # 18 GB: the next tiling's result must fit next to `want` on an 80 GB card


@pytest.mark.gpu
@pytest.mark.parametrize("count", [5, 300, 2048])
def test_gpu_direct_duplicate_targets(count):
  # Duplicated targets (and sources) on the GPU: every 16-byte item of a duplicated row is
  # that item of one of its writers' sources; rows with one writer and untouched rows exact.
  rng = np.random.default_rng(count)
  rows = 4096
  buffers = make_buffers(rng, rows=rows, plain_layers=2, trio_layers=1)
  tgt = rng.integers(0, rows // 8, count).astype(np.int32)
  src = rng.integers(0, rows, count).astype(np.int32)
  got = jax.jit(lambda b, t, s: move_rows(b, t, s, tiling=DIRECT))(buffers, tgt, src)
  for g, b in zip(got, buffers):
    g, b = np.asarray(g), np.asarray(b)
    item = 16 if b[0].nbytes % 16 == 0 else b.dtype.itemsize
    gi = g.view(np.uint8).reshape(rows, -1, item)
    bi = b.view(np.uint8).reshape(rows, -1, item)
    untouched = np.setdiff1d(np.arange(rows), tgt)
    np.testing.assert_array_equal(gi[untouched], bi[untouched])
    for t in np.unique(tgt):
      writers = bi[src[tgt == t]]  # (w, items, item)
      match = (gi[t][None] == writers).all(axis=-1).any(axis=0)
      assert match.all(), (t, np.flatnonzero(~match)[:5])


@pytest.mark.gpu
@pytest.mark.parametrize("count", [7, 256, 4096])
def test_gpu_move_rows_per_token_head(count):
  rng = np.random.default_rng(count)
  rows = 2**16 + 64
  buffers = make_buffers(rng, rows=rows, plain_layers=0, trio_layers=4)
  tgt, src = hostile_pairs(rng, rows, count)
  tgt, src = np.array(tgt), np.array(src)
  src[np.flatnonzero((tgt >= 0) & (tgt < rows))[:1]] = rows - 1  # the last aligned scale window
  for tiling in (MoveTiling(), DIRECT, ROUNDS, TREE, TREE_ROUNDS, TWO_PASS):
    got = jax.jit(lambda b, t, s: move_rows(b, t, s, tiling=tiling))(buffers, tgt, src)
    assert_bits_equal(got, model_move(buffers, tgt, src))


@pytest.mark.gpu
@pytest.mark.parametrize("count", [1, 16, 17, 256, 300])  # direct, stream, two-pass
def test_gpu_move_pages_61_layers(gpu_buffers, count):
  pages = GPU_ROWS // 64
  tgt, src = hostile_pairs(np.random.default_rng(count), pages, count)
  want = jax.jit(lambda b, t, s: reference_move(b, t, s, unit=64))(
      gpu_buffers, jnp.asarray(tgt), jnp.asarray(src))
  got = jax.jit(lambda b, t, s: move_pages(b, t, s, page_size=64))(gpu_buffers, tgt, src)
  assert_same_61_layers(got, want)


@pytest.mark.gpu
def test_gpu_donated_move_has_no_buffer_copy(gpu_buffers):
  types = [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in gpu_buffers[:4]]
  index = jax.ShapeDtypeStruct((64,), jnp.int32)
  for fn in (move_rows, lambda b, t, s: move_pages(b, t, s, page_size=64)):
    hlo = jax.jit(fn, donate_argnums=0).lower(types, index, index).compile().as_text()
    copies = [line for line in hlo.splitlines() if " copy(" in line and "576" in line]
    assert not copies, copies


def test_direct_plan_bands_cover_every_row_once():
  # Every (buffer, 16-byte item) belongs to exactly one program, bands are powers of two,
  # each thread holds at most `direct_items_per_thread` items; too many tokens -> no plan.
  buffers = [jax.ShapeDtypeStruct((2**18 + 64, 1, 576), jnp.bfloat16)] * 3 + [
      jax.ShapeDtypeStruct((4096, 1, 512), jnp.float8_e4m3fn),
      jax.ShapeDtypeStruct((4096, 1, 1), jnp.float32),
      jax.ShapeDtypeStruct((4096, 1, 64), jnp.bfloat16)]
  for tiling, tokens, unit in [(MoveTiling(), t, 1) for t in (1, 8, 64, 300, 1024)] + [
      (ROUNDS, 2048, 1), (ROUNDS, 4096, 1), (MoveTiling(), 16, 64), (ROUNDS, 64, 64)]:
    plan = move_direct.plan(buffers, tokens, unit, tiling)
    assert plan.tokens == tokens * unit and plan.unit_rows == unit
    owners = {}
    for g in plan.groups:
      assert g.band & (g.band - 1) == 0 and g.steps <= tiling.direct_items_per_thread
      assert g.rounds * g.steps * (128 // g.band) >= tokens * unit  # every row has a thread
      assert g.rounds == 1 or g.band == min(2, g.row_bytes // g.item_bytes)
      for m, k in enumerate(g.members):
        for band in range(g.bands):
          program = g.first + m * g.bands + band
          for col in range(band * g.band, min((band + 1) * g.band,
                                              g.row_bytes // g.item_bytes)):
            assert (k, col) not in owners
            owners[k, col] = program
    want = {(k, c) for k, b in enumerate(buffers)
            for c in range(max(1, b.shape[-1] * b.dtype.itemsize // 16))}
    assert set(owners) == want
    assert max(owners.values()) < plan.programs
  no_rounds = MoveTiling(direct_rounds=False)
  assert move_direct.plan(buffers, 2048, 1, no_rounds) is None  # "auto": above 1024
  no_rounds_forced = dataclasses.replace(DIRECT, direct_rounds=False)
  assert move_direct.plan(buffers, 4096 * 4, 1, no_rounds_forced) is None  # registers
  assert move_direct.plan(buffers, 4096, 1, MoveTiling(direct_max_tokens=4096,
                                                       direct_rounds=False)) is not None  # C=1
  assert move_direct.plan(buffers, 17, 64, MoveTiling()) is None  # pages: above 1024 rows


PLAIN = [jax.ShapeDtypeStruct((2**16 + 64, 1, 576), jnp.bfloat16)] * 2
PTH = [jax.ShapeDtypeStruct((2**16 + 64, 1, 512), jnp.float8_e4m3fn),
       jax.ShapeDtypeStruct((2**16 + 64, 1, 1), jnp.float32),
       jax.ShapeDtypeStruct((2**16 + 64, 1, 64), jnp.bfloat16)]


@pytest.mark.parametrize("layout, count, page_size, want", [
    ("plain", 1024, 1, "direct"), ("plain", 1025, 1, "two_pass"), ("plain", 4096, 1, "two_pass"),
    ("plain", 4097, 1, "two_pass"), ("pth", 1024, 1, "direct"), ("pth", 4096, 1, "rounds"),
    ("pth", 16384, 1, "rounds"), ("pth", 16385, 1, "two_pass"),
    ("plain", 1, 64, "direct"), ("plain", 16, 64, "direct"), ("plain", 17, 64, "stream"),
    ("plain", 512, 64, "stream"), ("plain", 513, 64, "two_pass"), ("pth", 16, 64, "direct"),
    ("pth", 17, 64, "stream"), ("pth", 2048, 64, "stream"), ("pth", 2049, 64, "two_pass")])
def test_auto_path_choice(layout, count, page_size, want):
  # The order and limits of `pallas_kernels.move`'s docstring (H200 figures: README).
  buffers = PLAIN if layout == "plain" else PTH
  name, plan = choose(buffers, count, page_size)
  if name == "direct" and plan.in_rounds:
    name = "rounds"
  assert name == want


def test_direct_select_auto():
  plain = [jax.ShapeDtypeStruct((4096, 1, 576), jnp.bfloat16)] * 3
  pth = [jax.ShapeDtypeStruct((4096, 1, 512), jnp.float8_e4m3fn),
         jax.ShapeDtypeStruct((4096, 1, 1), jnp.float32)]
  assert move_direct.plan(plain, 8, 1, MoveTiling()).select == "chain"
  assert move_direct.plan(pth, 8, 1, MoveTiling()).select == "tree"
  assert move_direct.plan(pth, 8, 1, MoveTiling(direct_select="chain")).select == "chain"
  with pytest.raises(ValueError, match="direct_select"):
    MoveTiling(direct_select="binary")
  with pytest.raises(ValueError, match="tiling.path"):
    MoveTiling(path="staged")


def test_direct_stand_in_beyond_the_streamed_indices():
  # Interpret mode runs the direct path's stand-in: the next path that takes the move
  # (two-pass here: the indices do not fit a tiny stream_index_bytes).
  rng = np.random.default_rng(7)
  buffers = [b for b in make_buffers(rng, rows=256, plain_layers=1, trio_layers=1)
             if b.shape[-1] != 1]
  tgt, src = hostile_pairs(rng, 256, 40)
  tiling = MoveTiling(path="direct", direct_rounds=True, stream_index_bytes=256)
  assert choose(buffers, 40, 1, tiling, after="direct")[0] == "two_pass"
  got = jax.jit(lambda b, t, s: move_rows(b, t, s, tiling=tiling))(buffers, tgt, src)
  assert_bits_equal(got, model_move(buffers, tgt, src))


@pytest.mark.gpu
@pytest.mark.parametrize("count", [1, 5, 16, 40])
def test_gpu_move_pages_per_token_head(count):
  # Small page moves take the direct path (page ids expanded in the kernel), 40 pages the
  # streamed one; overlapping pages, skipped pairs, the last page.
  rng = np.random.default_rng(count)
  rows = 4096 * 4
  buffers = make_buffers(rng, rows=rows, plain_layers=1, trio_layers=3)
  tgt, src = hostile_pairs(rng, rows // 64, count)
  src[np.flatnonzero((tgt >= 0) & (tgt < rows // 64))[:1]] = rows // 64 - 1
  for tiling in (MoveTiling(), TREE, TWO_PASS):
    got = jax.jit(lambda b, t, s: move_pages(b, t, s, page_size=64, tiling=tiling))(
        buffers, tgt, src)
    assert_bits_equal(got, model_move(buffers, tgt, src, unit=64))


@pytest.mark.gpu
@pytest.mark.parametrize("count, overlap", [(8192, True), (8192, False), (16384, True)])
def test_gpu_per_token_head_rounds_large_t(count, overlap):
  # Beyond the streamed path's indices per_token_head takes the direct path in rounds,
  # the one-element scale rows too.
  rng = np.random.default_rng(count + overlap)
  rows = 2 * count + 64
  buffers = make_buffers(rng, rows=rows, plain_layers=0, trio_layers=3)
  if overlap:
    tgt, src = hostile_pairs(rng, rows, count)
  else:
    perm = rng.permutation(rows)[:2 * count].astype(np.int32)
    tgt, src = perm[:count], perm[count:]
  got = jax.jit(move_rows)(buffers, tgt, src)
  assert_bits_equal(got, model_move(buffers, tgt, src))


# ---------------------------------------------------------------------------------------
# Stacked buffers (`layers`: a StackedMLAKVCache's layers as blocks of one buffer)


def model_move_stacked(buffers, tgt, src, layers, unit=1):
  """`model_move` on each block of `rows // layers` rows (blocks need not be whole units)."""
  out = []
  for b in buffers:
    blocks = np.split(np.asarray(b), layers)
    out.append(np.concatenate([model_move([x], tgt, src, unit)[0] for x in blocks]))
  return out


def stacked_of(buffers_per_layer):
  """Per-layer buffer lists -> one stacked buffer per kind (layer-major rows)."""
  return [jnp.concatenate(kind) for kind in zip(*buffers_per_layer)]


@pytest.mark.parametrize("kind", ["plain", "pth"])
@pytest.mark.parametrize("tokens, unit, tiling", [
    (1, 1, MoveTiling()), (64, 1, MoveTiling()), (1024, 1, MoveTiling()),
    (4096, 1, MoveTiling()), (16, 64, MoveTiling()), (2048, 1, ROUNDS)])
def test_stacked_direct_plan_is_the_unstacked_plan(kind, tokens, unit, tiling):
  # 61 layers stacked in one buffer: the same groups, bands, steps and programs as 61
  # separate buffers; the members are (buffer, layer) blocks and the index range a layer's.
  rows = 2**16 + 64
  one = PLAIN[:1] if kind == "plain" else PTH
  stacked = [jax.ShapeDtypeStruct((61 * rows, *b.shape[1:]), b.dtype) for b in one]
  separate = [b for b in one for _ in range(61)]   # buffer k's layers next to each other
  want = move_direct.plan(separate, tokens, unit, tiling)
  got = move_direct.plan(stacked, tokens, unit, tiling, layers=61)
  if want is None:
    assert got is None
    return
  assert got.units == want.units == rows // unit and got.layer_rows == rows
  assert (got.layers, got.programs, got.tokens) == (61, want.programs, want.tokens)
  assert got.groups == want.groups   # members k * 61 + layer: the separate buffers' order


def test_stacked_direct_move_lowers_as_one_kernel_on_one_buffer():
  # The stacked direct move: one launch, no XLA work before it, the one buffer aliased.
  buffers = [jax.ShapeDtypeStruct((61 * (2**18 + 64), 1, 576), jnp.bfloat16)]
  for fn in (lambda b, t, s: move_rows(b, t, s, layers=61),
             lambda b, t, s: move_pages(b, t, s, page_size=64, layers=61)):
    text = lower_for_cuda(fn, buffers, 16)
    assert text.count("stablehlo.custom_call @mosaic_gpu_v2(") == 1
    main = text[text.index("func.func public @main"):]
    ops = set(re.findall(r"(stablehlo\.\w+)", main.split("func.func", 2)[1]))
    assert ops <= {f"stablehlo.{op}" for op in
                   ("custom_call", "reshape", "case", "constant", "return", "call")}, ops
    assert main.splitlines()[0].count("tf.aliasing_output") == 1
  # Beyond the direct path: the other paths get every layer's pairs (XLA work first).
  text = lower_for_cuda(lambda b, t, s: move_rows(b, t, s, layers=61), buffers, 2048)
  assert text.count("stablehlo.custom_call @mosaic_gpu_v2(") == 2   # two-pass


@pytest.mark.parametrize("unit, block_rows", [(1, 200), (8, 200), (8, 204), (64, 1000)])
def test_stacked_moves_interpreted_equal_the_model(unit, block_rows):
  # Interpret mode runs the next path with every layer's pairs; blocks that are not whole
  # pages (204 rows of pages of 8: page 25 would straddle two layers) move page rows.
  rng = np.random.default_rng(unit + block_rows)
  layers = 3
  per_layer = [make_buffers(rng, rows=block_rows, plain_layers=1, trio_layers=1)
               for _ in range(layers)]
  buffers = stacked_of(per_layer)
  units = block_rows // unit
  count = min(12, units // 2 - 2)
  tgt, src = hostile_pairs(rng, units, count)
  want = model_move_stacked(buffers, tgt, src, layers, unit)
  if unit == 1:
    got = move_rows(buffers, tgt, src, layers=layers)
    xla = mc_reference.move_rows(buffers, tgt, src, layers=layers)
  else:
    got = move_pages(buffers, tgt, src, page_size=unit, layers=layers)
    xla = mc_reference.move_pages(buffers, tgt, src, page_size=unit, layers=layers)
  assert_bits_equal(got, want)
  assert_bits_equal(xla, want)


def test_stacked_layers_must_divide_the_rows():
  buffers = make_buffers(np.random.default_rng(0), rows=100, plain_layers=1, trio_layers=0)
  idx = np.arange(3, dtype=np.int32)
  for bad in (3, 0, 2.0):
    with pytest.raises(ValueError, match="layers"):
      move_rows(buffers, idx, idx[::-1], layers=bad)
    with pytest.raises(ValueError, match="layers"):
      mc_reference.move_rows(buffers, idx, idx[::-1], layers=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["plain-64", "plain-1024", "pth-64", "pth-4096-rounds",
                                  "plain-pages-1", "plain-pages-16", "pth-pages-16",
                                  "plain-pages-3-ragged", "plain-2048-two-pass"])
def test_gpu_stacked_moves_61_layers(case):
  # The stacked direct kernel (each layer a member) and the fallbacks, on the GPU, with
  # hostile pairs, against XLA with the same `layers` and against each layer moved alone.
  kind, rest = case.split("-", 1)
  pages = "pages" in rest
  count = int(rest.split("-")[1] if pages else rest.split("-")[0])
  unit = 8 if "ragged" in rest else 64 if pages else 1
  block_rows = 2**14 + 68 if "ragged" in rest else 2**14 + 64   # ragged: not whole pages
  rng = np.random.default_rng(count)
  kinds = [(576, jnp.bfloat16)] if kind == "plain" else [
      (512, jnp.float8_e4m3fn), (1, jnp.float32), (64, jnp.bfloat16)]
  bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}   # random bytes, made on the GPU
  buffers = [jax.random.bits(jax.random.key(k), (61 * block_rows, 1, w),
                             bits[jnp.dtype(d).itemsize]).view(d)
             for k, (w, d) in enumerate(kinds)]
  tgt, src = hostile_pairs(rng, block_rows // unit, count)
  if pages:
    fn = lambda b, t, s, impl: impl.move_pages(b, t, s, page_size=unit, layers=61)
  else:
    fn = lambda b, t, s, impl: impl.move_rows(b, t, s, layers=61)
  want = jax.jit(lambda b, t, s: fn(b, t, s, mc_reference))(buffers, tgt, src)
  got = jax.jit(lambda b, t, s: fn(b, t, s, pallas_kernels))(buffers, tgt, src)
  assert_bits_equal(got, [np.asarray(w) for w in want])
  layer = 60   # the last layer against its own unstacked move
  alone = [b[layer * block_rows:(layer + 1) * block_rows] for b in buffers]
  alone = (mc_reference.move_pages(alone, tgt, src, page_size=unit) if pages
           else mc_reference.move_rows(alone, tgt, src))
  assert_bits_equal([g[layer * block_rows:(layer + 1) * block_rows] for g in got],
                    [np.asarray(a) for a in alone])
