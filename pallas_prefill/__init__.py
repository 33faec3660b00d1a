"""pallas_prefill: ragged-batch attention prefill kernels for JAX on NVIDIA GPUs.

The kernels are Pallas GPU kernels: the Triton lowering (``pallas_prefill.ragged``, the
default backend) and Mosaic GPU for Hopper (``pallas_prefill.mosaic``, ``backend=
"mosaic_gpu"``); each kernel body is shared by MHA and MLA.
"""

from pallas_prefill import masks
from pallas_prefill import paged
from pallas_prefill import reference
from pallas_prefill.config import MhaConfig, MosaicConfig, MosaicOptions
from pallas_prefill.mha import mha_prefill
from pallas_prefill.mla import mla_prefill
from pallas_prefill.paged import PagedKV
from pallas_prefill.validation import validate_offsets

__all__ = [
    "MhaConfig", "MosaicConfig", "MosaicOptions", "PagedKV", "masks", "mha_prefill", "mla_prefill", "paged",
    "reference", "validate_offsets",
]
