"""Every test sees 8 simulated CPU devices, so every mesh layout can be exercised here.

One persistent compilation cache per pytest run: most of the suite's time is XLA compiling
the same small programs again in each xdist worker, each `python -m hflax.launch`
subprocess and each Ray worker. The directory is fresh (nothing carries over between runs),
shared through xdist's worker input and the environment, and removed when the run ends.
"""
import gc
import os
import shutil
import tempfile

import pytest

# Level 0: LLVM's quickest code generation. Tests compile thousands of small programs and
# run most of them once; measured on the 2-core CPU, a compile-bound test took 20.0 s
# instead of 25.7-26.9, and the real-model and numerics files (gguf, bf16_paths,
# logprobs, attention: 90 tests) 549 s instead of 650, all passing at the same tolerances.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

_CACHE_KEY = "hflax_jax_cache_dir"
# Cache every program: on CPU the tests' programs compile in well under jax's default
# threshold of one second, yet there are thousands of them.
_CACHE_SETTINGS = {"jax_persistent_cache_min_compile_time_secs": 0,
                   "jax_persistent_cache_min_entry_size_bytes": -1}
_owned_cache = pytest.StashKey[str]()


def _use_cache(path: str):
  settings = {"jax_compilation_cache_dir": path, **_CACHE_SETTINGS}
  for name, value in settings.items():
    jax.config.update(name, value)
    os.environ[name.upper()] = str(value)  # for subprocesses and Ray workers


def pytest_configure(config):
  worker = getattr(config, "workerinput", None)
  if worker is not None:
    _use_cache(worker[_CACHE_KEY])
  else:
    config.stash[_owned_cache] = tempfile.mkdtemp(prefix="hflax-test-jax-cache-")
    _use_cache(config.stash[_owned_cache])


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
  node.workerinput[_CACHE_KEY] = node.config.stash[_owned_cache]


def pytest_unconfigure(config):
  path = config.stash.get(_owned_cache, None)
  if path is not None:
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Free each module's compiled programs when it ends.

  jax keeps every executable a process compiles, and XLA:CPU maps each one's code and data
  as separate memory regions (about 8,700 after tests/test_controller.py alone). An xdist
  worker running half the suite reached the kernel's limit of 65,530 mappings
  (vm.max_map_count), and the next compile or cache write aborted the worker. Later
  modules that need a program again read it back from the persistent cache.
  """
  yield
  jax.clear_caches()
  gc.collect()


def pytest_report_header(config):
  return (f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}, "
          f"compilation cache: {jax.config.jax_compilation_cache_dir}")
