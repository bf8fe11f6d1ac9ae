"""XLA:CPU: what hflax adds to make JAX fast on CPUs.

  settings.py       every HFLAX_CPU_* switch, read in one place
  process.py        set-up before JAX starts: simulated devices, glibc's malloc
  options.py        compiler options for training steps
  matmul.py         the packed decode matmul kernel (matmul.cc) and the kernels' build
  attention.py      the decode-attention kernel (attention.cc)
  decoding_copy.py  the model's decoding copy: kernels stored [out, in], fused, packed
  copy_modules.py   the copy's modules (the model's, as the copy computes them)

Nothing here is imported at package import: the process set-up must run before JAX.
"""
