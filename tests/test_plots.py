"""`jax_mla_cache.plots`: one panel per op, a line per implementation, the copy ceiling."""

import json

from jax_mla_cache import plots


def results(ops=plots.OPS):
  """A results dict in the benchmark's schema (synthetic values: a test input only)."""
  records = [dict(op=op, impl=impl, T=t, layers=61 if op.startswith(("move", "offload")) else 1,
                  us=1.0, gbps=float(t))
             for op in ops for impl in ("pallas", "xla") for t in (1, 64, 4096)]
  return dict(device="test", jax="0", commit="abc", date="today", method="synthetic",
              copy_gbps=4000.0, pinned_copy_gbps=50.0, records=records)


def test_plot_results_panels_and_file(tmp_path):
  path = tmp_path / "r.png"
  fig = plots.plot_results(results(), str(path))
  visible = [ax for ax in fig.axes if ax.get_visible()]
  assert [ax.get_title() for ax in visible] == [plots.OP_TITLES[op] for op in plots.OPS]
  for ax in visible:
    assert ax.get_xscale() == "log"
    labels = [line.get_label() for line in ax.get_lines()]
    assert "pallas" in labels and "xla" in labels
  ceilings = [ax.get_lines()[-1].get_ydata()[0] for ax in visible]
  assert ceilings[:7] == [4000.0] * 7 and ceilings[7:] == [50.0, 50.0]
  assert path.stat().st_size > 0


def test_plot_results_partial_and_empty(tmp_path):
  fig = plots.plot_results(results(ops=("get_mla",)))
  assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == [plots.OP_TITLES["get_mla"]]
  plots.plot_results(dict(records=[]), str(tmp_path / "empty.png"))
  path = tmp_path / "r.json"
  path.write_text(json.dumps(results()))
  assert plots.load_results(str(path)) == results()
