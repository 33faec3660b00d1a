"""pallas_prefill: ragged-batch attention prefill kernels for JAX on NVIDIA GPUs.

The entry points (``mha_prefill``, ``mla_prefill`` over packed ragged batches, and
``dot_product_attention`` over padded ones with lengths or segment ids) validate their
arguments and hand the logits' terms to ``pallas_prefill.dispatch``, which picks a backend: the Pallas Mosaic GPU
kernel on Hopper (``pallas_prefill.mosaic_gpu``, the default there) or the Pallas Triton
kernel (``pallas_prefill.triton``) on any NVIDIA GPU and in interpret mode. Each kernel
body is shared by MHA and MLA; ``pallas_prefill.reference`` defines the results.
"""

from pallas_prefill import masks
from pallas_prefill import paged
from pallas_prefill import reference
from pallas_prefill.config import MhaConfig, MosaicConfig, MosaicOptions
from pallas_prefill.mha import mha_prefill
from pallas_prefill.mla import mla_prefill
from pallas_prefill.padded import dot_product_attention
from pallas_prefill.paged import PagedKV
from pallas_prefill.validation import validate_offsets

__all__ = [
    "MhaConfig", "MosaicConfig", "MosaicOptions", "PagedKV", "dot_product_attention", "masks",
    "mha_prefill",
    "mla_prefill", "paged",
    "reference", "validate_offsets",
]
