"""Design study (CPU, numpy + ml_dtypes): could per_token_head decode compute its scores with fp8
tensor-core products instead of converting each KV block to bf16 first?

Hopper's fp8 wgmma takes e4m3 x e4m3 with both operands K-major, which the nope rows (tokens x
features) and the queries (rows x features) are; q is bf16, so it would be split into e4m3 parts
(each with a per-row scale: q ~ q_1 + q_2 + ...), one fp8 product per part. This prints the error
of the attention output (float64 model, DeepSeek-V3's softmax scale) for 1-3 parts against the
exact scores, next to the bf16 rounding of the output itself (what the kernels' output carries
anyway). The values would still need the converted tile (fp8 wgmma cannot take V transposed).

    python benchmarks/fp8_scores_accuracy.py [--rows 16] [--context 4096] [--seed 0]

Session 2026-12-04f: two parts stay under the output's bf16 rounding (4.3e-4 vs 9.7e-4 at 16 rows,
context 4096, unit-normal q and cache rows); one part does not (1.7e-2).
"""

import argparse

import ml_dtypes
import numpy as np

E4M3, BF16 = ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16
FP8_MAX = 448.0


def quantize_rows(x: np.ndarray) -> np.ndarray:
  """x (rows, D) float64 -> its per_token_head round trip (SPEC section 3: amax / 448 scale)."""
  scale = np.maximum(np.abs(x).max(1, keepdims=True) / FP8_MAX, np.finfo(np.float32).tiny)
  return np.clip(x / scale, -FP8_MAX, FP8_MAX).astype(E4M3).astype(np.float64) * scale


def split_e4m3(q: np.ndarray, parts: int) -> np.ndarray:
  """The sum of `parts` e4m3 parts (per-row scales) that approximate q, each part taken from
  what the previous ones left."""
  total, rest = np.zeros_like(q), q.copy()
  for _ in range(parts):
    part = quantize_rows(rest)
    total, rest = total + part, rest - part
  return total


def attention(scores: np.ndarray, values: np.ndarray, sm_scale: float) -> np.ndarray:
  s = scores * sm_scale
  p = np.exp(s - s.max(1, keepdims=True))
  return (p / p.sum(1, keepdims=True)) @ values


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--rows", type=int, default=16, help="query rows (s_q x H)")
  parser.add_argument("--context", type=int, default=4096)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  rng = np.random.default_rng(args.seed)
  sm_scale = 1 / np.sqrt(192)          # DeepSeek-V3: qk head dim 128 + 64
  q = rng.standard_normal((args.rows, 512)).astype(BF16).astype(np.float64)
  kv = quantize_rows(rng.standard_normal((args.context, 512)))   # the cache's nope rows
  exact = q @ kv.T
  ref = attention(exact, kv, sm_scale)
  rounding = np.abs(ref.astype(BF16).astype(np.float64) - ref).max()
  print(f"{args.rows} rows, context {args.context}: |scores x sm_scale| <= "
        f"{np.abs(exact).max() * sm_scale:.2f}, |out| <= {np.abs(ref).max():.3f}; "
        f"bf16 rounding of the output: {rounding:.2e}")
  for parts in (1, 2, 3):
    scores = split_e4m3(q, parts) @ kv.T
    err = np.abs(attention(scores, kv, sm_scale) - ref).max()
    print(f"  q as {parts} e4m3 part(s): max |d scores x sm_scale| = "
          f"{np.abs(scores - exact).max() * sm_scale:.2e}, max |d out| = {err:.2e}"
          f" ({'under' if err < rounding else 'over'} the output's rounding)")


if __name__ == "__main__":
  main()
