"""The CPU process set-up and the compilation cache under their first import path, which
notebooks and scripts outside this package use (`from hflax.xla_env import configure_cpu`,
importing no JAX). hflax's own code imports them from hflax.platforms and
hflax.platforms.compile_cache."""
from hflax.platforms.compile_cache import (CompileCacheStats, compile_cache_summary,  # noqa: F401
                                           default_compile_cache_dir, use_compile_cache)
from hflax.platforms import (accelerator_expected, configure_cpu, cpu_devices,  # noqa: F401
                             cpu_has_bf16, keep_freed_memory)
