"""GPUs: the plain XLA path (platforms/xla.py) plus the kernels that beat it where asked.

  attention.py       cuDNN flash attention through jax.nn.dot_product_attention
  logprobs.py        the fused Pallas (Triton) per-token log-prob and entropy kernel
  logprob_kernel.py  when that kernel serves (HFLAX_LOGPROB_KERNEL)
"""
