"""hflax.platforms.cpu.process: process settings made before JAX starts."""
import os
import pathlib
import platform
import subprocess
import sys

import pytest

from hflax.platforms.cpu import process

_GLIBC = platform.libc_ver()[0] == "glibc"
_THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
_HUGE_PAGES_ALWAYS = _THP.exists() and "[always]" in _THP.read_text()

_FAULTS = """
import resource, sys
sys.path.insert(0, {root!r})
from hflax.platforms.cpu.process import keep_freed_memory
print(keep_freed_memory())
import ctypes, threading
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def work():  # 96 MiB buffers written then freed on a worker thread, as XLA:CPU's are
  for _ in range(8):
    p = libc.malloc(96 << 20)
    ctypes.memset(p, 1, 96 << 20)
    libc.free(p)
def churn():
  t = threading.Thread(target=work)
  t.start()
  t.join()
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(env_extra: dict) -> tuple[str, int]:
  """(whether keep_freed_memory applied, page faults of the second churn) in a fresh
  process, since malloc settings are process-wide."""
  repo = str(pathlib.Path(process.__file__).resolve().parents[3])
  env = {k: v for k, v in os.environ.items()
         if k not in process._MALLOC_VARIABLES + ("HFLAX_CPU_MALLOC",)}
  env.update(env_extra)
  out = subprocess.run([sys.executable, "-c", _FAULTS.format(root=repo)],
                       env=env, capture_output=True, text=True, check=True).stdout.split()
  return out[0], int(out[1])


@pytest.mark.skipif(not _GLIBC, reason="keep_freed_memory configures glibc's malloc only")
@pytest.mark.skipif(_HUGE_PAGES_ALWAYS, reason="transparent huge pages are always on here, "
                    "so fresh mappings fault once per 2 MiB and the counts do not separate")
def test_freed_memory_is_reused_without_page_faults():
  applied, faults = _faults({})
  assert applied == "True"
  off, faults_off = _faults({"HFLAX_CPU_MALLOC": "0"})
  assert off == "False"
  # 8 buffers of 96 MiB are 197k pages if mapped fresh each time; reused, almost none.
  assert faults < 2_000 and faults_off > 10 * max(faults, 1), (faults, faults_off)


def test_user_malloc_settings_are_left_alone(monkeypatch):
  monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
  assert process.keep_freed_memory() is False
  monkeypatch.delenv("MALLOC_ARENA_MAX")
  monkeypatch.setenv("HFLAX_CPU_MALLOC", "0")
  assert process.keep_freed_memory() is False


def test_configure_cpu_keeps_a_device_count_the_user_set(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=3 --foo=1")
  monkeypatch.setenv("HFLAX_CPU_MALLOC", "0")
  assert process.configure_cpu(devices=5) == "--xla_force_host_platform_device_count=3 --foo=1"
  monkeypatch.setenv("XLA_FLAGS", "--foo=1")
  assert process.configure_cpu(devices=5) == "--foo=1 --xla_force_host_platform_device_count=5"


def test_accelerator_expected_reads_jax_platforms(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
  assert process.accelerator_expected()
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert not process.accelerator_expected()


@pytest.mark.parametrize("text,expected", [
    ("processor\t: 0\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\nbogomips\t: 1\n", True),
    ("flags\t\t: fpu avx2 amx_tile amx_bf16\n", True),
    ("flags\t\t: fpu sse4_2 avx2 fma vaes\nflags\t\t: avx512_bf16\n", False),  # the first
    ("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n", True),  # Arm
    ("processor\t: 0\nFeatures\t: fp asimd crc32\n", False),
    ("processor\t: 0\nmodel name\t: unknown\n", None),
])
def test_cpu_has_bf16_reads_cpuinfo_flags(tmp_path, text, expected):
  info = tmp_path / "cpuinfo"
  info.write_text(text)
  assert process.cpu_has_bf16(str(info)) is expected


def test_cpu_has_bf16_cannot_tell_without_cpuinfo(tmp_path):
  assert process.cpu_has_bf16(str(tmp_path / "missing")) is None


def test_the_process_set_up_imports_no_jax():
  """It runs before JAX starts: importing it (or its first path, hflax.xla_env) must not
  start JAX, so hflax.platforms imports jax only inside its functions."""
  code = ("import sys; import hflax.xla_env, hflax.platforms.cpu.process, hflax.platforms; "
          "print('jax' in sys.modules)")
  repo = str(pathlib.Path(process.__file__).resolve().parents[3])
  out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True,
                       check=True).stdout
  assert out.strip() == "False"
