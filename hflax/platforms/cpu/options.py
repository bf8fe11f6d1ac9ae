"""XLA:CPU compiler options for training steps.

In float32, YNNPACK fusions of dots only (xla_cpu_experimental_ynn_fusion_type=dot
instead of XLA:CPU's default set): the GRPO policy update of bench/rl_step.py and
SmolLM2's gradients ran faster with it, the loss equal to 1e-6. Not in bfloat16: there the
option makes XLA:CPU widen every bf16 x bf16 -> f32 dot to float32. Training steps only:
the option made the sampler's small decode matmuls slower, so generation and forward
passes keep the default. In bfloat16, LLVM's fast-math reassociation and contraction
(BF16_FAST_MATH). HFLAX_CPU_YNN=0 turns the first off, HFLAX_CPU_FAST_MATH=0 the second
(settings.py); bench/README.md has the measurements.
"""
from __future__ import annotations

import jax.numpy as jnp

from hflax.platforms.cpu import settings

# A bfloat16 step's float32 reductions (log-softmax sums over the vocabulary, norms,
# attention's online softmax) may be reassociated, which lets XLA:CPU vectorize them, and
# multiply-adds fused; NaNs, infinities, division and math functions keep their IEEE
# behaviour (the masks' -1e30 scores, a row that sees no key). The gradient's distance to
# the float32 one moves within bfloat16's own (tests/test_training).
BF16_FAST_MATH = {"xla_cpu_enable_fast_math": True, "xla_cpu_fast_math_honor_nans": True,
                  "xla_cpu_fast_math_honor_infs": True,
                  "xla_cpu_fast_math_honor_division": True,
                  "xla_cpu_fast_math_honor_functions": True}
YNN_DOTS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}


def train_options(compute_dtype) -> dict | None:
  """The options for a CPU training step computing in `compute_dtype`, or None."""
  dtype = jnp.dtype(compute_dtype)
  if dtype == jnp.float32:
    return None if settings.turned_off(settings.YNN) else dict(YNN_DOTS)
  if dtype == jnp.bfloat16 and not settings.turned_off(settings.FAST_MATH):
    return dict(BF16_FAST_MATH)
  return None
