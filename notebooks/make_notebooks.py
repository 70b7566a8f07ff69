"""Build the notebooks from the cells below, execute them on the local device and save
them with their outputs:

    python notebooks/make_notebooks.py            # both
    python notebooks/make_notebooks.py 02         # those whose name starts with 02

Edit the cells here, not in the .ipynb files. Re-run after `benchmarks/results/h200.json`
changes so 02_benchmarks.ipynb shows the committed figures. `tests/test_notebooks.py`
executes the saved notebooks so they cannot rot.
"""

from __future__ import annotations

import os
import sys

import nbformat
from nbclient import NotebookClient

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL = "python3"  # jupyter_client runs a "python" kernelspec with the current interpreter

SETUP = '''\
import pathlib, sys
# The repository root, so the notebook runs from a checkout without `pip install -e .`.
ROOT = next(p for p in [pathlib.Path.cwd(), *pathlib.Path.cwd().parents]
            if (p / "jax_mla_cache" / "__init__.py").exists())
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
'''


def md(text: str):
  return nbformat.v4.new_markdown_cell(text.strip())


def code(text: str):
  return nbformat.v4.new_code_cell(text.strip())


QUICKSTART = [
    md("""
# jax_mla_cache quick start

The KV cache of Multi-head Latent Attention (DeepSeek-V2/V3/R1, Kimi-K2) in JAX. Each layer
caches one *latent row* per token: `kv_lora_rank` latent values ("nope", 512) and
`qk_rope_head_dim` rope values (64). This notebook shows

1. the stateful pool `MLATokenToKVPool` (the serving engine's API),
2. the buffer layout of both storage modes (plain bf16 and `per_token_head` FP8),
3. the functional API inside a jitted step that donates the cache,
4. the donation rules: what happens if you reuse a donated cache,
5. the host offload round trip,
6. a decode step: the fused RoPE write and the paged attention that reads the cache in place.

It runs on whatever device JAX finds (small sizes, under a minute on CPU). `implementation=None`
picks the Pallas kernels on Hopper+ GPUs and plain XLA elsewhere.
"""),
    code(SETUP + '''
import jax, jax.numpy as jnp, numpy as np
import jax_mla_cache as mc

print("jax", jax.__version__, "on", jax.devices()[0].device_kind)
print("cache ops run as:", mc.resolve_implementation(None))
'''),
    md("""
## 1. The pool API

`MLATokenToKVPool` takes the serving engine's constructor arguments (JAX dtypes). Each layer has
`rows = size + page_size` rows; rows `[0, page_size)` are page 0, where padded tokens of a
static-shape batch write (loc 0). Every method runs a jitted functional op with the cache
donated, so the buffers are updated in place; `pool.cache` is the current state.
"""),
    code('''
pool = mc.MLATokenToKVPool(
    size=240, model_dtype=jnp.bfloat16, dtype=jnp.bfloat16, quant_method=None,
    kv_lora_rank=512, qk_rope_head_dim=64, layer_num=2, page_size=16)
print(pool.config)
print(f"rows per layer: {pool.config.rows}, cache bytes: {pool.get_kv_size_bytes():,}, "
      f"bytes per page (all layers): {pool.page_size_bytes:,}")

rng = np.random.default_rng(0)
loc = np.array([16, 17, 40, 41, 42], np.int32)              # token slots (rows)
nope = jnp.asarray(rng.standard_normal((5, 1, 512)), jnp.bfloat16)
rope = jnp.asarray(rng.standard_normal((5, 1, 64)), jnp.bfloat16)
pool.set_mla_kv_buffer(0, loc, nope, rope)                   # layer 0: write [nope | rope]
got_nope, got_rope = pool.get_mla_kv_buffer(0, loc)
print("read back bit-exact:", bool((got_nope == nope).all() and (got_rope == rope).all()))

pool.move_kv_cache(tgt_loc=np.array([100, 101]), src_loc=np.array([16, 17]))  # every layer
moved, _ = pool.get_mla_kv_buffer(0, np.array([100, 101]))
print("moved rows equal the sources:", bool((moved == nope[:2]).all()))
'''),
    md("""
## 2. Buffer layout

Buffers keep the serving engine's `(rows, 1, width)` shape, one tuple of buffers per layer
(`cache.buffers[layer]`), so a layer's buffer can be handed to an attention kernel with no copy.

* **plain** (`quant_method=None`): one buffer `kv (rows, 1, 576)` of `dtype`: `[nope 512 | rope 64]`.
* **per_token_head** (FP8): three buffers: `nope (rows, 1, 512)` float8_e4m3fn,
  `scale (rows, 1, 1)` float32 and `rope (rows, 1, 64)` in `model_dtype`. Per token,
  `scale = amax(|nope|) / 448`; the stored nope is `nope / scale` in e4m3 and the stored rope is
  `rope / scale` (so rope keeps bf16 precision). Reads dequantize (`value * scale`).
"""),
    code('''
plain = mc.SMALL
fp8 = mc.SMALL.replace(dtype=jnp.float8_e4m3fn, quant_method="per_token_head")
for name, cfg in (("plain bf16", plain), ("per_token_head", fp8)):
    shapes = ", ".join(f"{jnp.dtype(d).name}{s}" for s, d in cfg.buffer_shapes())
    print(f"{name:15s} per layer: {shapes}; {cfg.row_bytes} bytes per row per layer")

cache = mc.init_cache(fp8)
x = jnp.asarray(rng.standard_normal((1, 1, 512)) * 3, jnp.bfloat16)
r = jnp.asarray(rng.standard_normal((1, 1, 64)), jnp.bfloat16)
cache = mc.set_mla_kv_buffer(cache, 0, np.array([20]), x, r)
q_buf, scale_buf, rope_buf = cache.layer(0)
print("stored scale:", float(scale_buf[20, 0, 0]), " amax/448:", float(jnp.abs(x).max()) / 448)
print("stored fp8 codes (first 6):", q_buf[20, 0, :6])
back, _ = mc.get_mla_kv_buffer(cache, 0, np.array([20]), jnp.float32)
err = jnp.abs(back - x.astype(jnp.float32))
# e4m3 rounds to within half a step: 2^-4 relative, or 2^-10 x scale for the smallest (subnormal) codes
bound = 2.0**-4 * jnp.abs(x).astype(jnp.float32) + 2.0**-10 * scale_buf[20, 0, 0]
print(f"dequantized nope: max |error| {float(err.max()):.4f}, within the e4m3 bound: {bool((err <= bound).all())}")
'''),
    md("""
## 3. The functional API inside a jitted step

The functional ops (`mc.set_mla_kv_buffer`, `mc.get_mla_kv_buffer`, `mc.move_kv_cache`, ...) take
the immutable `MLAKVCache` pytree and return a new one. Inside your own jitted model step they
inline; donate the cache at *that* jit boundary (`donate_argnums`) and XLA updates every layer's
buffer in place: the compiled step aliases each cache input to its output and copies no cache
buffer.
"""),
    code('''
def step(cache, loc, nope, rope):
    """A model-like step: write each layer's new rows, read them back (attention would use them)."""
    total = 0.0
    for layer_id in range(cache.config.layer_num):
        cache = mc.set_mla_kv_buffer(cache, layer_id, loc, nope, rope)
        ctx_nope, ctx_rope = mc.get_mla_kv_buffer(cache, layer_id, loc)
        total += ctx_nope.astype(jnp.float32).sum() + ctx_rope.astype(jnp.float32).sum()
    return cache, total

jitted_step = jax.jit(step, donate_argnums=0)
cache = mc.init_cache(mc.SMALL)
loc = jnp.array([16, 17, 18], jnp.int32)
nope = jnp.ones((3, 1, 512), jnp.bfloat16)
rope = jnp.ones((3, 1, 64), jnp.bfloat16)

hlo = jitted_step.lower(cache, loc, nope, rope).compile().as_text()
cache_shape = "bf16[208,1,576]"
copies = [l for l in hlo.splitlines() if ("copy(" in l or "copy-start(" in l) and cache_shape in l]
print("input_output_alias in compiled step:", "input_output_alias" in hlo)
print("copies of a cache buffer:", len(copies))

cache, total = jitted_step(cache, loc, nope, rope)
print("checksum:", float(total))
'''),
    md("""
## 4. Donation rules

Donating hands the buffers to the computation: after the call the old `cache` object is
*deleted*, and using it raises a clear error (never a crash or silent garbage). Always continue
with the returned state. Two more rules follow:

* Inside a jitted step, do not keep the *old* cache alive after an update (e.g. return it, or read
  it after writing): XLA must then copy the whole buffer to preserve both versions.
* The pool invalidates arrays it handed out (`pool.cache`, `get_key_buffer`) on its next update:
  read them again after it.
"""),
    code('''
old = mc.init_cache(mc.SMALL)
new, _ = jitted_step(old, loc, nope, rope)
try:
    mc.get_mla_kv_buffer(old, 0, loc)              # `old` was donated to jitted_step
except RuntimeError as e:
    print("reusing a donated cache:", type(e).__name__, "-", str(e).splitlines()[0])

def keeps_old(cache, loc, nope, rope):
    updated = mc.set_mla_kv_buffer(cache, 0, loc, nope, rope)
    return updated, cache.layer(0)[0]              # the old buffer must survive: a copy
hlo = jax.jit(keeps_old, donate_argnums=0).lower(new, loc, nope, rope).compile().as_text()
copies = [l for l in hlo.splitlines() if ("copy(" in l or "copy-start(" in l) and cache_shape in l]
print("copies when the old cache is kept alive:", len(copies))

key_buffer = pool.get_key_buffer(0)                # (rows, 1, 576) of layer 0
pool.set_mla_kv_buffer(0, np.array([5]), nope[:1], rope[:1])
try:
    key_buffer.sum()
except RuntimeError as e:
    print("stale pool buffer after an update:", type(e).__name__)
print("fresh buffer after the update:", pool.get_key_buffer(0).shape)
'''),
    md("""
## 5. Host offload round trip

`get_cpu_copy(token_indices)` copies those rows of every layer and buffer to host memory (the
`pinned_host` memory kind where the device has one), in chunks of `offload_chunk_page_num`
tokens, one transfer per chunk and buffer kind for all layers; it returns at once and blocks
when read. `load_cpu_copy` writes such a copy back into the
same or other rows. The round trip is bit-exact: raw stored bytes, fp8 codes and scales included.
"""),
    code('''
fp8_pool = mc.MLATokenToKVPool(
    size=240, model_dtype=jnp.bfloat16, dtype=jnp.float8_e4m3fn, quant_method="per_token_head",
    kv_lora_rank=512, qk_rope_head_dim=64, layer_num=2, page_size=16, offload_chunk_page_num=4)
src = np.arange(32, 42, dtype=np.int32)
for layer in range(2):
    fp8_pool.set_mla_kv_buffer(layer, src, jnp.asarray(rng.standard_normal((10, 1, 512)), jnp.bfloat16),
                               jnp.asarray(rng.standard_normal((10, 1, 64)), jnp.bfloat16))

host = fp8_pool.get_cpu_copy(src).block_until_ready()
# one host array per chunk and buffer kind, all layers stacked: (layers, tokens, 1, width)
print(f"host copy: {len(host)} layers x {len(host[0])} chunks, {host.nbytes:,} bytes, "
      f"memory kind {host.memory_kind!r}, chunk 0 arrays {[x.shape for x in host.stacked[0]]}")

dst = np.arange(120, 130, dtype=np.int32)
fp8_pool.load_cpu_copy(host, dst)
exact = all(bool((buf[src] == buf[dst]).all()) for layer in fp8_pool.cache.buffers for buf in layer)
print("rows loaded back into other slots are bit-identical (codes, scales, rope):", exact)
'''),
    md("""
## 6. A decode step that reads the cache in place

A decode step writes each sequence's newest token and attends over its context. The write is
`rope_set_mla_kv_buffer`: RoPE of the query's and the key's rope parts, the row
`[k_nope | rope(k_rope)]` stored at `loc`, and the absorbed query `q = [q_nope @ W_UK | rope(q_rope)]`
returned, in one launch. The read is `mla_decode(cache, layer, q, page_table, seq_lens, sm_scale=...)`:
sequence b's token at position p lives in row `page_table[b, p // page_size] * page_size +
p % page_size`; `seq_lens` counts its tokens, the new one included. It returns the attention
output in the latent space (apply `W_UV` next) and the log-sum-exp. On a Hopper GPU it runs a
Mosaic GPU kernel over the paged rows; elsewhere the XLA reference, which gathers them. Padding
entries of a page table are -1 (masked), a padded sequence has `seq_lens` 0 (output 0, lse -inf).
"""),
    code('''
cfg = mc.SMALL.replace(layer_num=1, page_size=16)              # 16-token pages
cache = mc.init_cache(cfg)
B, H, R, Rr = 3, 16, cfg.kv_lora_rank, cfg.qk_rope_head_dim
page_table = np.array([[1, 2, 3], [4, 5, -1], [6, -1, -1]], np.int32)  # -1: padding
seq_lens = np.array([40, 20, 0], np.int32)                    # sequence 2 is a padded slot

# The context written earlier (prefill): positions 0 .. seq_len - 2 of each live sequence.
for b in range(2):
    pos = np.arange(seq_lens[b] - 1)
    rows = page_table[b, pos // 16] * 16 + pos % 16
    cache = mc.set_mla_kv_buffer(cache, 0, rows,
                                 jnp.asarray(rng.standard_normal((len(pos), 1, R)), jnp.bfloat16),
                                 jnp.asarray(rng.standard_normal((len(pos), 1, Rr)), jnp.bfloat16))

@jax.jit
def decode_step(cache, loc, positions, q_nope, q_rope, k_nope, k_rope, cos_sin, page_table, seq_lens):
    cache, q = mc.rope_set_mla_kv_buffer(cache, 0, loc, positions, q_nope, q_rope, k_nope, k_rope,
                                         cos_sin)                                # (B, H, R + Rr)
    out, lse = mc.mla_decode(cache, 0, q[:, None], page_table, seq_lens, sm_scale=R ** -0.5)
    return cache, out, lse

positions = np.maximum(seq_lens - 1, 0)                        # the new token of each sequence
loc = np.where(seq_lens > 0, page_table[np.arange(B), positions // 16] * 16 + positions % 16, -1)
cos_sin = jnp.asarray(mc.rope.rope_cos_sin_cache(64, Rr))
step_args = (jnp.asarray(rng.standard_normal((B, H, R)) * 0.05, jnp.bfloat16),
             jnp.asarray(rng.standard_normal((B, H, Rr)), jnp.bfloat16),
             jnp.asarray(rng.standard_normal((B, 1, R)), jnp.bfloat16),
             jnp.asarray(rng.standard_normal((B, 1, Rr)), jnp.bfloat16))
cache, out, lse = decode_step(cache, loc, positions, *step_args, cos_sin, page_table, seq_lens)
print("out", out.shape, out.dtype, "| lse", lse.shape, lse.dtype)
print("padded sequence: out all 0:", bool((out[2] == 0).all()), "| lse:", float(lse[2, 0, 0]))
'''),
    md("""
The same attention as a copy: `get_mla_kv_buffer` of every context row, then a softmax in
float32: the copy of every context row is what `mla_decode` saves a serving engine (the H200
figures: README, Performance).
"""),
    code('''
q = mc.rope_set_mla_kv_buffer(mc.init_cache(cfg), 0, np.full(B, -1), positions, step_args[0],
                              step_args[1], step_args[2], step_args[3], cos_sin)[1]  # the same q
ref_out = []
for b in range(2):
    pos = np.arange(seq_lens[b])
    nope, rope = mc.get_mla_kv_buffer(cache, 0, page_table[b, pos // 16] * 16 + pos % 16, jnp.float32)
    k = jnp.concatenate([nope, rope], -1)[:, 0]                                 # (n, R + Rr)
    p = jax.nn.softmax(q[b].astype(jnp.float32) @ k.T * R ** -0.5, axis=-1)     # (H, n)
    ref_out.append(p @ k[:, :R])
err = max(float(jnp.abs(out[b, 0].astype(jnp.float32) - ref_out[b]).max()) for b in range(2))
print(f"mla_decode vs gather + softmax: max |difference| {err:.2e} (bf16 output rounding)")
'''),
    md("""
Next: `jax_mla_cache.models.mla_demo` runs a small DeepSeek-style model on the cache
(`python -m jax_mla_cache demo`), and `02_benchmarks.ipynb` plots the kernel benchmark.
"""),
]

BENCHMARKS = [
    md("""
# Benchmarks: Pallas vs XLA vs the copy bandwidth

`python -m jax_mla_cache bench` (on an H200) writes `benchmarks/results/h200.json`: for each op and
size, the device time per call and the GB/s (bytes read plus written), for the Pallas kernels and
the XLA reference, with the device copy bandwidth and the pinned-host copy bandwidth measured in
the same run. The plot below draws GB/s against T (log scale) per op with `jax_mla_cache.plots`,
the same helper the bench command uses for its PNG.
"""),
    code(SETUP + '''
import json
from jax_mla_cache import plots

RESULTS = ROOT / "benchmarks" / "results" / "h200.json"
others = sorted(p.name for p in RESULTS.parent.glob("*.json")) if RESULTS.parent.exists() else []
print("result files:", others or "none")
'''),
    code('''
if not RESULTS.exists():
    results = None
    print(f"No results yet: {RESULTS.relative_to(ROOT)} does not exist. Run "
          "`python -m jax_mla_cache bench` on an H200 to write it, then re-run this notebook "
          "(python notebooks/make_notebooks.py 02). No figures are shown until then.")
else:
    results = plots.load_results(RESULTS)
    print(f"{results['device']}, jax {results['jax']}, commit {results['commit']}, {results['date']}")
    print("method:", results["method"])
    pinned = results.get("pinned_copy_gbps")
    print(f"device copy: {results['copy_gbps']:,.1f} GB/s; pinned-host copy: "
          + (f"{pinned:,.1f} GB/s" if pinned else "not measured"))
'''),
    code('''
if results is not None:
    print(f"{'op':12s} {'impl':6s} {'T':>6s} {'layers':>6s} {'us':>10s} {'GB/s':>8s}")
    for r in sorted(results["records"], key=lambda r: (r["op"], r["T"], r["impl"])):
        print(f"{r['op']:12s} {r['impl']:6s} {r['T']:6d} {r['layers']:6d} {r['us']:10.2f} {r['gbps']:8.1f}")
'''),
    code('''
%matplotlib inline
if results is not None:
    from IPython.display import display
    display(plots.plot_results(results))
'''),
]

NOTEBOOKS = {"01_quickstart.ipynb": QUICKSTART, "02_benchmarks.ipynb": BENCHMARKS}


def build(cells) -> nbformat.NotebookNode:
  nb = nbformat.v4.new_notebook(cells=cells)
  nb.metadata["kernelspec"] = {"name": KERNEL, "display_name": "Python 3", "language": "python"}
  nb.metadata["language_info"] = {"name": "python"}
  return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 300) -> nbformat.NotebookNode:
  """Run every cell in a fresh kernel, with the notebooks folder as working directory."""
  NotebookClient(nb, timeout=timeout, kernel_name=KERNEL,
                 resources={"metadata": {"path": HERE}}).execute()
  return nb


def main(argv: list[str]) -> None:
  prefixes = argv or [""]
  for name, cells in NOTEBOOKS.items():
    if not any(name.startswith(p) for p in prefixes):
      continue
    nb = execute(build(cells))
    path = os.path.join(HERE, name)
    nbformat.write(nb, path)
    print("wrote", path)


if __name__ == "__main__":
  main(sys.argv[1:])
