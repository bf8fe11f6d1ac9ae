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

# The suite is compile-bound: in tests/test_sampler.py XLA's backend compile is three
# quarters of the time, execution under a tenth. These options buy compile speed only;
# every test passes at the same tolerances with them, and the tests about what users'
# compilation does (fast-math options; the CPU sampler's exact categorical draw, which the
# older emitters at level 0 miscompile) compile with XLA's defaults via compiler_options:
# - level 0: LLVM's quickest code generation (a compile-bound test 20.0 s instead of 26);
# - XLA:CPU's older loop emitters instead of its MLIR fusion emitters, which compile the
#   same fusions in less time (test_sampler.py's llama tests 29 s instead of 48);
# - one codegen thread per program: the two xdist workers already fill the two cores.
TEST_ONLY_XLA_FLAGS = ("--xla_backend_optimization_level=0",
                       "--xla_cpu_use_fusion_emitters=false",
                       "--xla_cpu_parallel_codegen_split_count=1")
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                    "--xla_force_host_platform_device_count=8",
                                    *TEST_ONLY_XLA_FLAGS]).strip()
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


# Mappings past which a module's end frees the compiled programs (the kernel's limit,
# vm.max_map_count, is 65,530 by default).
_MAPPINGS_KEPT = 20_000


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Free the compiled programs at a module's end once the process maps many regions.

  jax keeps every executable a process compiles, and XLA:CPU maps each one's code and data
  as separate memory regions. An xdist worker running half the suite reached the kernel's
  limit of 65,530 mappings, and the next compile or cache write aborted the worker; so past
  _MAPPINGS_KEPT the caches are cleared, and later modules that need a program again read
  it back from the persistent cache. Below it they stay: the persistent cache saves only
  XLA's compile, while a program kept in memory also skips tracing and lowering, which
  modules sharing the tiny trainer's programs would otherwise repeat.
  """
  yield
  if os.path.exists("/proc/self/maps"):  # Linux; elsewhere every module's end frees them
    with open("/proc/self/maps") as maps:
      if sum(1 for _ in maps) < _MAPPINGS_KEPT:
        return
  jax.clear_caches()
  gc.collect()


def pytest_report_header(config):
  return (f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}, "
          f"compilation cache: {jax.config.jax_compilation_cache_dir}")
