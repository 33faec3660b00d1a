"""ptxas's register and spill report of the FP8 Mosaic GPU kernel with and without
``MosaicOptions.fp8_vt_in_kernel`` (BUILD_NOTES.md, twenty-seventh session), on the H200:

    MOSAIC_GPU_DUMP_PTXAS=1 python3 -m benchmarks.experiments.fp8_vt_ptxas on 2>&1 \\
        | grep -i "spill\\|Used"

(``off`` for the V^T pass). One call of 2048 query rows, 32/8 heads, depth 128, compiled
and run once; prints the option and the output's mean magnitude.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_prefill as pp


def main(argv):
  on = argv[1:] == ["on"]
  e4 = jnp.float8_e4m3fn
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((2048, h, 128)), jnp.float32).astype(e4)
             for h in (32, 8, 8))
  off = jnp.array([0, 1000, 2048], jnp.int32)
  config = pp.MosaicConfig(options=pp.MosaicOptions(fp8_vt_in_kernel=on))
  one = jnp.float32(1.0)
  fn = jax.jit(lambda q, k, v, off: pp.mha_prefill(
      q, k, v, off, max_prompt_len=1048, q_scale=one, k_scale=one, v_scale=one,
      backend="mosaic_gpu", config=config))
  out = fn(q, k, v, off).astype(jnp.float32)
  print("on" if on else "off", float(jnp.abs(out).mean()))


if __name__ == "__main__":
  main(sys.argv)
