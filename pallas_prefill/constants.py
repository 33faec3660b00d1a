"""Numeric constants that the kernels of both backends and the reference share."""

import math

import numpy as np

# Finite stand-in for -inf in the Triton kernel's scores: a row that sees no key must come
# out as zeros, never NaN.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
# The log-sum-exp reported for a row that sees no key and has no sink.
EMPTY_ROW_LSE = -1e30
# The kernels' softmax runs in base 2: exp(x) = exp2(x * LOG2_E), ln(x) = log2(x) * LN_2.
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
# The largest sink logit the kernels take (sink * LOG2_E must stay finite in float32):
# larger concrete sink weights raise ValueError, traced ones are taken as SINK_MAX; sinks
# below -SINK_MAX are taken as -SINK_MAX (above the mask value once times log2(e)).
SINK_MAX = 1e38
