"""Plots of benchmark results (`benchmarks/results/*.json`, written by `jax_mla_cache.bench`).

Results schema: `{device, jax, commit, date, method, copy_gbps, pinned_copy_gbps,
records: [{op, impl, T, layers, us, gbps}]}` (optionally `pinned_d2h_gbps`,
`pinned_h2d_gbps`; the fused RoPE write's records add `H`, the query heads). `plot_results`
draws GB/s against T (log x) for each op, one line per implementation (and head count),
with the measured copy bandwidth as the ceiling: the
device copy for device ops, the pinned-host copy for the offload ops.

Uses matplotlib's object-oriented API with the Agg canvas, so it neither needs
nor changes pyplot's backend (it works the same in a notebook, a script and CI).
"""

from __future__ import annotations

import json
import math
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

OPS = ("set_mla", "set_mla_pth", "get_mla", "move", "move_pth", "move_pages", "move_stacked",
       "offload_d2h", "offload_h2d")
"""The benchmark's ops, in plotting order."""

OP_TITLES = {
    "set_mla": "set_mla_kv_buffer, bf16",
    "set_mla_pth": "set_mla_kv_buffer, per_token_head fp8",
    "get_mla": "get_mla_kv_buffer, bf16",
    "move": "move_kv_cache, all layers, bf16",
    "move_pth": "move_kv_cache, all layers, per_token_head",
    "move_pages": "move_kv_pages, all layers",
    "move_stacked": "move_kv_cache, all layers, bf16, StackedMLAKVCache",
    "offload_d2h": "get_cpu_copy (device -> host)",
    "offload_h2d": "load_cpu_copy (host -> device)",
    "rope_set": "rope_set_mla_kv_buffer (RoPE + q_out + write), bf16",
    "rope_set_pth": "rope_set_mla_kv_buffer, per_token_head fp8",
    "mla_decode": "mla_decode (cache bytes read / time), bf16",
    "mla_decode_pth": "mla_decode, per_token_head fp8",
}
IMPL_STYLES = {"pallas": dict(color="C0", marker="o"), "xla": dict(color="C1", marker="s"),
               "unfused": dict(color="C2", marker="^")}


def load_results(path: str) -> dict[str, Any]:
  """A results JSON file as a dict."""
  with open(path) as f:
    return json.load(f)


def _ceiling(results: dict[str, Any], op: str) -> tuple[float | None, str]:
  """The copy bandwidth an op is measured against, and its label."""
  if op.startswith("offload"):
    direction = "pinned_d2h_gbps" if op.endswith("d2h") else "pinned_h2d_gbps"
    value = results.get(direction) or results.get("pinned_copy_gbps")
    return value, "pinned-host copy"
  return results.get("copy_gbps"), "device copy"


def _bars(ax, results: dict[str, Any], op: str, op_records: list[dict[str, Any]]) -> None:
  """One bar per implementation, labelled with GB/s and the share of the copy ceiling."""
  ceiling, ceiling_label = _ceiling(results, op)
  names = [r["impl"] for r in op_records]
  values = [r["gbps"] for r in op_records]
  bars = ax.bar(range(len(values)), values, color="tab:orange")
  for bar, value in zip(bars, values):
    share = f"\n{100 * value / ceiling:.0f}%" if ceiling else ""
    ax.annotate(f"{value:.1f}{share}", (bar.get_x() + bar.get_width() / 2, value),
                ha="center", va="bottom", fontsize=8)
  if ceiling:
    ax.axhline(ceiling, color="gray", linestyle="--", label=f"{ceiling_label} {ceiling:,.1f} GB/s")
    ax.legend(fontsize=8, loc="lower right")
  ax.set_xticks(range(len(names)), names, fontsize=8)
  t, layers = op_records[0]["T"], op_records[0].get("layers", 1)
  ax.set_xlabel(f"T = {t} tokens x {layers} layers")
  ax.set_ylabel("GB/s")
  ax.set_ylim(0, 1.25 * max(values + [ceiling or 0]))
  ax.set_title(OP_TITLES.get(op, op), fontsize=10)
  ax.grid(True, axis="y", alpha=0.3)


def plot_results(results: dict[str, Any], path: str | None = None) -> Figure:
  """GB/s vs T per op, one line per implementation, copy bandwidth dashed.

  Args:
    results: the benchmark results (schema in the module docstring).
    path: if given, the figure is saved there (format from the extension).
  Returns:
    The matplotlib Figure.
  """
  records = results.get("records", [])
  present = {r["op"] for r in records}
  ops = [op for op in OPS if op in present] + sorted(present - set(OPS))
  ncols = min(3, max(1, len(ops)))
  nrows = max(1, math.ceil(len(ops) / ncols))
  fig = Figure(figsize=(5 * ncols, 3.6 * nrows), layout="constrained")
  FigureCanvasAgg(fig)
  axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
  if not ops:
    axes[0].text(0.5, 0.5, "no records", ha="center", va="center", transform=axes[0].transAxes)
  for ax, op in zip(axes, ops):
    op_records = [r for r in records if r["op"] == op]
    if len({r["T"] for r in op_records}) == 1:  # one size (host copies): bars, not a point
      _bars(ax, results, op, op_records)
      continue
    layer_counts = sorted({r.get("layers", 1) for r in op_records})
    # Query shapes (H; and B, s_q for decode attention): one line each, T on the x axis.
    shape_of = lambda r: (r.get("H") or 0, r.get("B") or 0, r.get("s_q") or 0)
    shapes = sorted({shape_of(r) for r in op_records})
    for impl in sorted({r["impl"] for r in op_records}):
      for layers in layer_counts:
        for k, shape in enumerate(shapes):
          pts = sorted((r["T"], r["gbps"]) for r in op_records
                       if r["impl"] == impl and r.get("layers", 1) == layers
                       and shape_of(r) == shape)
          if not pts:
            continue
          label = impl if len(layer_counts) == 1 else f"{impl}, {layers} layers"
          style = dict(IMPL_STYLES.get(impl, {}))
          heads, batch, s_q = shape
          if heads:
            label += f", H={heads}" + (f" B={batch} s_q={s_q}" if batch else "")
            style["linestyle"] = ("-", ":", "-.", "--")[k % 4]
          if len(pts) == 1:
            style["marker"] = style.get("marker") or "o"
          ax.plot(*zip(*pts), label=label, **style)
    ceiling, ceiling_label = _ceiling(results, op)
    if ceiling:
      ax.axhline(ceiling, color="gray", linestyle="--", label=f"{ceiling_label} {ceiling:,.0f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("pages moved" if op == "move_pages" else "T (tokens)")
    ax.set_ylabel("GB/s")
    ax.set_title(OP_TITLES.get(op, op), fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    if len(ax.get_legend_handles_labels()[1]) > 8:  # many query shapes: beside the axes
      ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
      ax.legend(fontsize=8)
  for ax in axes[len(ops) or 1:]:
    ax.set_visible(False)
  fig.suptitle(
      f"{results.get('device', '?')} · jax {results.get('jax', '?')} · commit "
      f"{results.get('commit', '?')} · {results.get('date', '?')}\n{results.get('method', '')}",
      fontsize=9,
  )
  if path is not None:
    fig.savefig(path, dpi=110)
  return fig
