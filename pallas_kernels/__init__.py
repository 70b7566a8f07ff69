"""Mosaic GPU Pallas kernels of jax_mla_cache (arrays in, arrays out).

The kernel modules load on first use of their names, so `pallas_kernels.exact` (plain jnp,
shared with jax_mla_cache's XLA reference) imports without Pallas.
"""

import importlib

_EXPORTS = {
    "get_rows": "rows", "get_rows_per_token_head": "rows", "RowConfig": "rows",
    "tuned_config": "rows", "set_rows": "rows", "set_rows_per_token_head": "rows",
    "rope_set_rows": "rope_set",
    "move_pages": "move", "move_rows": "move", "MoveTiling": "move",
    "Unsupported": "common",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'pallas_kernels' has no attribute {name!r}")
  return getattr(importlib.import_module(f"pallas_kernels.{_EXPORTS[name]}"), name)
