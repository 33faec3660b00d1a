"""The Triton backend (``backend="triton"``): the Pallas kernel lowered to Triton, for any
NVIDIA GPU and the Pallas interpreter (``kernel.py``)."""

from pallas_prefill.triton.kernel import MAX_GRID_DIM, ragged_attention_triton

__all__ = ["MAX_GRID_DIM", "ragged_attention_triton"]
