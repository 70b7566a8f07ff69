"""pallas_kernels.move: bit-exact against a numpy model (CPU interpret mode and GPU).

CPU: interpret mode runs programs one after another, so shapes are small. Every path is
covered: the staged one-launch token move, the two-pass token move (forced with a zero
staged budget) and page moves; overlapping index sets, skipped pairs, T=0. A deviceless
CUDA lowering checks that the real kernels lower and alias every buffer.
GPU (`pytest -m gpu`): 61 layers, 2**18 + 64 rows, T up to 4096, hostile indices.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla_cache as mc

import pallas_kernels
from pallas_kernels.move import MoveTiling, move_pages, move_rows

TWO_PASS = MoveTiling(token_path="two_pass")
STREAM = MoveTiling(token_path="stream")
DIRECT = MoveTiling(token_path="direct")
ROUNDS = MoveTiling(token_path="direct", direct_rounds=True)
TREE = MoveTiling(token_path="direct", direct_select="tree")
TREE_ROUNDS = MoveTiling(token_path="direct", direct_rounds=True, direct_select="tree")
STAGED = MoveTiling(token_path="staged")
NARROW_FIRST = MoveTiling(token_path="stream", stream_programs=4096, stream_min_chunk=4,
                          stream_narrow_first=True)
# Small chunks and ring: several programs per buffer, slots reused within a chunk.
STREAM_SMALL = MoveTiling(token_path="stream", stream_programs=4096, stream_min_chunk=4,
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


@pytest.mark.parametrize("tiling", [None, STREAM_SMALL, NARROW_FIRST, STAGED, TWO_PASS],
                         ids=["stream", "stream_small", "narrow_first", "staged", "two_pass"])
@pytest.mark.parametrize("count", [1, 7, 40])
def test_move_rows_matches_model(small_buffers, tiling, count):
  if tiling is not None and count == 1 or tiling in (STAGED, NARROW_FIRST) and count == 40:
    pytest.skip("covered by the other counts")
  rng = np.random.default_rng(count)
  tgt, src = hostile_pairs(rng, 256, count)
  kwargs = {} if tiling is None else {"tiling": tiling}
  got = jax.jit(lambda b, t, s: move_rows(b, t, s, **kwargs))(small_buffers, tgt, src)
  assert_bits_equal(got, model_move(small_buffers, tgt, src))


@pytest.mark.parametrize("tiling", [None, STREAM_SMALL], ids=["stream", "stream_small"])
def test_move_rows_disjoint_sets(small_buffers, tiling):
  # No source is a target: the streamed path's one-pass mode (every chunk in parallel).
  rng = np.random.default_rng(5)
  perm = rng.permutation(256)
  tgt, src = perm[:30].astype(np.int32), perm[30:60].astype(np.int32)
  tgt[3], src[7] = -1, 256  # skipped pairs
  kwargs = {} if tiling is None else {"tiling": tiling}
  got = jax.jit(lambda b, t, s: move_rows(b, t, s, **kwargs))(small_buffers, tgt, src)
  assert_bits_equal(got, model_move(small_buffers, tgt, src))


def test_endangered_compare_matches_counts():
  # The all-pairs compare (small T) and the writer counts (large T) against a direct loop;
  # duplicate targets, self-moves (tgt == src) and skipped pairs (tgt = -1) included.
  from pallas_kernels.move import _endangered
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


@pytest.mark.parametrize("tiling", [None, STREAM_SMALL, TWO_PASS],
                         ids=["stream", "stream_small", "two_pass"])
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
    ("direct", 40, 1), ("direct", 2048, 1), ("stream", 40, 1), ("staged", 40, 1),
    ("two_pass", 40, 2), ("pages", 40, 1), ("rounds", 4096, 1), ("tree", 40, 1),
    ("tree_rounds", 4096, 1),
    ("pages_two_pass", 40, 2), ("pdl", 40, 1), ("narrow_first", 40, 1)])
def test_cuda_lowering_aliases_every_buffer(kind, count, launches):
  buffers = make_buffers(np.random.default_rng(0), rows=4096 + 64, plain_layers=3)
  fn = {
      "direct": move_rows,
      "rounds": lambda b, t, s: move_rows(b, t, s, tiling=ROUNDS),
      "tree": lambda b, t, s: move_rows(b, t, s, tiling=TREE),
      "tree_rounds": lambda b, t, s: move_rows(b, t, s, tiling=TREE_ROUNDS),
      "stream": lambda b, t, s: move_rows(b, t, s, tiling=STREAM),
      "staged": lambda b, t, s: move_rows(b, t, s, tiling=STAGED),
      "two_pass": lambda b, t, s: move_rows(b, t, s, tiling=TWO_PASS),
      "pages": lambda b, t, s: move_pages(b, t, s, page_size=64),
      "pages_two_pass": lambda b, t, s: move_pages(b, t, s, page_size=64, tiling=TWO_PASS),
      "pdl": lambda b, t, s: move_rows(b, t, s, pdl=True),
      "narrow_first": lambda b, t, s: move_rows(b, t, s, tiling=NARROW_FIRST),
  }[kind]
  text = lower_for_cuda(fn, buffers, count)
  assert text.count("stablehlo.custom_call @mosaic_gpu_v2(") == launches
  # The interpret branch (a host callback) is pruned: only the kernels are custom calls.
  assert set(re.findall(r"custom_call @(\w+)\(", text)) == {"mosaic_gpu_v2"}
  aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", text)
  assert len(aliases) == len(buffers)  # the move kernel aliases every buffer
  main = next(line for line in text.splitlines() if "func.func public @main" in line)
  assert main.count("tf.aliasing_output") == len(buffers)


@pytest.mark.parametrize("count", [1, 64, 1024])
def test_direct_path_needs_no_index_preparation(count):
  # int32 indices go straight into the one kernel: no XLA op before it (the range checks
  # are in the kernel), and the kernel body exists once per row layout, so 61 layers lower
  # in well under a second (the streamed kernel takes ~20 s).
  buffers = [jax.ShapeDtypeStruct((2**18 + 64, 1, 576), jnp.bfloat16)] * 61
  text = lower_for_cuda(move_rows, buffers, count)
  main = text[text.index("func.func public @main"):]
  ops = set(re.findall(r"(stablehlo\.\w+)", main.split("func.func", 2)[1]))
  allowed = {"custom_call", "reshape", "case", "constant", "return"}  # case: the platform
  assert ops <= {f"stablehlo.{op}" for op in allowed}, ops
  stream = lower_for_cuda(lambda b, t, s: move_rows(b, t, s, tiling=STREAM), buffers[:2], count)
  assert "stablehlo.compare" in stream  # the streamed path's preparation, for contrast


@pytest.mark.parametrize("count", [4096])
def test_one_launch_up_to_large_t(count):
  # At the DeepSeek-V3 shape the streamed one-launch path holds T up to 4096.
  buffers = [jax.ShapeDtypeStruct((2**18 + 64, 1, 576), jnp.bfloat16)] * 61
  text = lower_for_cuda(move_rows, buffers, count)
  assert text.count("stablehlo.custom_call @mosaic_gpu_v2(") == 1


# ---------------------------------------------------------------------------------------
# GPU: DeepSeek-V3 sizes


GPU_ROWS = 2**18 + 64


@pytest.fixture(scope="module")
def gpu_buffers():
  keys = jax.random.split(jax.random.key(0), 61)
  return [jax.random.bits(k, (GPU_ROWS, 1, 576), jnp.uint16).view(jnp.bfloat16)
          for k in keys]


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
  for g, w in zip(got, want):
    assert bool(jnp.all(g.view(jnp.uint16) == w.view(jnp.uint16)))


@pytest.mark.gpu
@pytest.mark.parametrize("count", [64, 1024])
def test_gpu_move_rows_61_layers_streamed(gpu_buffers, count):
  # The streamed path where "auto" now takes the direct one (~20 s of lowering each).
  tgt, src = hostile_pairs(np.random.default_rng(count + 1), GPU_ROWS, count)
  want = jax.jit(reference_move)(gpu_buffers, jnp.asarray(tgt), jnp.asarray(src))
  got = jax.jit(lambda b, t, s: move_rows(b, t, s, tiling=STREAM))(gpu_buffers, tgt, src)
  for g, w in zip(got, want):
    assert bool(jnp.all(g.view(jnp.uint16) == w.view(jnp.uint16)))


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
    for g, w in zip(got, want):
      assert bool(jnp.all(g.view(jnp.uint16) == w.view(jnp.uint16)))


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
  for tiling in (MoveTiling(), DIRECT, ROUNDS, TREE, TREE_ROUNDS, STREAM, NARROW_FIRST,
                 STAGED, TWO_PASS):
    got = jax.jit(lambda b, t, s: move_rows(b, t, s, tiling=tiling))(buffers, tgt, src)
    assert_bits_equal(got, model_move(buffers, tgt, src))


@pytest.mark.gpu
@pytest.mark.parametrize("count", [1, 16, 256])
def test_gpu_move_pages_61_layers(gpu_buffers, count):
  pages = GPU_ROWS // 64
  tgt, src = hostile_pairs(np.random.default_rng(count), pages, count)
  want = jax.jit(lambda b, t, s: reference_move(b, t, s, unit=64))(
      gpu_buffers, jnp.asarray(tgt), jnp.asarray(src))
  got = jax.jit(lambda b, t, s: move_pages(b, t, s, page_size=64))(gpu_buffers, tgt, src)
  for g, w in zip(got, want):
    assert bool(jnp.all(g.view(jnp.uint16) == w.view(jnp.uint16)))


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
  from pallas_kernels.move import _direct_plan
  buffers = [jax.ShapeDtypeStruct((2**18 + 64, 1, 576), jnp.bfloat16)] * 3 + [
      jax.ShapeDtypeStruct((4096, 1, 512), jnp.float8_e4m3fn),
      jax.ShapeDtypeStruct((4096, 1, 1), jnp.float32),
      jax.ShapeDtypeStruct((4096, 1, 64), jnp.bfloat16)]
  for tiling, tokens in [(MoveTiling(), t) for t in (1, 8, 64, 300, 1024)] + [
      (ROUNDS, 2048), (ROUNDS, 4096)]:
    plan = _direct_plan(buffers, tokens, tiling)
    owners = {}
    for g in plan.groups:
      assert g.band & (g.band - 1) == 0 and g.steps <= tiling.direct_items_per_thread
      assert g.rounds * g.steps * (128 // g.band) >= tokens  # every token has a thread
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
  assert _direct_plan(buffers, 4096 * 4, MoveTiling()) is None
  assert _direct_plan(buffers, 4096, MoveTiling(direct_max_tokens=4096)) is not None  # C=1


@pytest.mark.parametrize("layout, count, want", [
    ("plain", 1024, "direct"), ("plain", 4096, "stream"), ("pth", 1024, "direct"),
    ("pth", 4096, "rounds"), ("pth", 16384, "rounds"), ("pth", 32768, "two_pass")])
def test_auto_path_choice(monkeypatch, layout, count, want):
  # "auto": direct up to 1024 tokens; beyond, per_token_head (one-element scale rows) takes
  # the direct path in rounds up to 16384 and plain rows the streamed path, then two-pass
  # (H200 figures in MoveTiling's docstring).
  from pallas_kernels import move
  taken = []
  for name in ("_direct", "_stream", "_two_pass"):
    def spy(*args, _name=name, _fn=getattr(move, name), **kwargs):
      taken.append(_name if _name != "_direct" or not kwargs["dplan"].in_rounds else "rounds")
      return _fn(*args, **kwargs)
    monkeypatch.setattr(move, name, spy)
  if layout == "plain":
    buffers = [jax.ShapeDtypeStruct((2**16 + 64, 1, 576), jnp.bfloat16)] * 2
  else:
    buffers = [jax.ShapeDtypeStruct((2**16 + 64, 1, 512), jnp.float8_e4m3fn),
               jax.ShapeDtypeStruct((2**16 + 64, 1, 1), jnp.float32),
               jax.ShapeDtypeStruct((2**16 + 64, 1, 64), jnp.bfloat16)]
  lower_for_cuda(move_rows, buffers, count)
  assert [t.strip("_") for t in taken] == [want]


def test_direct_select_auto():
  from pallas_kernels.move import _direct_plan
  plain = [jax.ShapeDtypeStruct((4096, 1, 576), jnp.bfloat16)] * 3
  pth = [jax.ShapeDtypeStruct((4096, 1, 512), jnp.float8_e4m3fn),
         jax.ShapeDtypeStruct((4096, 1, 1), jnp.float32)]
  assert _direct_plan(plain, 8, MoveTiling()).select == "chain"
  assert _direct_plan(pth, 8, MoveTiling()).select == "tree"
  assert _direct_plan(pth, 8, MoveTiling(direct_select="chain")).select == "chain"
  with pytest.raises(ValueError, match="direct_select"):
    move_rows([jnp.zeros((8, 1, 576), jnp.bfloat16)], jnp.zeros(1, jnp.int32),
              jnp.zeros(1, jnp.int32), tiling=MoveTiling(direct_select="binary"))


def test_direct_stand_in_beyond_the_streamed_indices():
  # Interpret mode runs the direct path's stand-in: the streamed path, or two-pass when the
  # T indices do not fit its shared memory (here forced by a tiny stream_index_bytes).
  rng = np.random.default_rng(7)
  buffers = make_buffers(rng, rows=256, plain_layers=1, trio_layers=1)
  tgt, src = hostile_pairs(rng, 256, 40)
  tiling = MoveTiling(token_path="direct", direct_rounds=True, stream_index_bytes=256)
  got = jax.jit(lambda b, t, s: move_rows(b, t, s, tiling=tiling))(buffers, tgt, src)
  assert_bits_equal(got, model_move(buffers, tgt, src))


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
