"""Mosaic GPU Pallas kernels of jax_mla_cache (arrays in, arrays out)."""

from pallas_kernels.rows import get_rows as get_rows
from pallas_kernels.rows import get_rows_per_token_head as get_rows_per_token_head
from pallas_kernels.rows import RowConfig as RowConfig
from pallas_kernels.rows import tuned_config as tuned_config
from pallas_kernels.rows import set_rows as set_rows
from pallas_kernels.rows import set_rows_per_token_head as set_rows_per_token_head
from pallas_kernels.rope_set import rope_set_rows as rope_set_rows
from pallas_kernels.move import move_pages as move_pages, move_rows as move_rows, MoveTiling as MoveTiling
