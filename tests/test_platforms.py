"""hflax.platforms: the one place that reads the backend, and its attention choice."""
import jax
import jax.numpy as jnp
import pytest

from hflax import platforms
from hflax.platforms import attention
from hflax.platforms.cpu import options, settings
from hflax.platforms.tpu import attention as tpu_attention

BF16 = jnp.bfloat16


def _choose(impl="auto", queries=256, short=False, dtype=BF16, **kw):
  kw = {"head_dim": 64, "teacher_forced": True, "packed": False, "prefix": False, **kw}
  return attention.choose(impl, queries=queries, short=short, q_dtype=dtype, **kw)


@pytest.mark.parametrize("backend,long,decoding", [
    ("cpu", "blockwise", "one_query"), ("gpu", "cudnn", "reference"),
    ("tpu", "splash", "reference")])
def test_auto_picks_each_backends_implementation(monkeypatch, backend, long, decoding):
  monkeypatch.setattr(jax, "default_backend", lambda: backend)
  if backend == "tpu" and not tpu_attention.importable():
    pytest.skip("jax ships no splash kernel here")
  assert _choose() == long
  assert _choose(queries=1) == decoding
  assert _choose(short=True) == "reference"
  assert _choose(teacher_forced=False) == "blockwise"  # no kernel takes a free mask
  assert _choose("blockwise") == "blockwise" and _choose("reference") == "reference"


def test_a_forced_kernel_applies_only_where_it_fits(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  assert _choose("cudnn") == "cudnn"
  assert _choose("cudnn", dtype=jnp.float32) == "blockwise"  # cuDNN takes 16-bit only
  assert _choose("cudnn", packed=True) == "blockwise"
  assert _choose("cudnn", queries=1, teacher_forced=False) == "one_query"  # decoding: "auto"


def test_the_decode_kernel_is_chosen_only_where_asked_and_it_serves(monkeypatch):
  from hflax.platforms.cpu import attention as cpu
  monkeypatch.setattr(cpu, "serves", lambda q, k, v: True)
  kv = (jnp.uint16, BF16)
  assert _choose(queries=1, decode_kernel=True, kv_dtypes=kv) == "decode_kernel"
  assert _choose(queries=1, kv_dtypes=kv) == "one_query"
  assert _choose("reference", queries=1, decode_kernel=True, kv_dtypes=kv) == "reference"
  monkeypatch.setattr(cpu, "serves", lambda q, k, v: False)  # e.g. HFLAX_CPU_ATTENTION=0
  assert _choose(queries=1, decode_kernel=True, kv_dtypes=kv) == "one_query"


def test_training_options_are_xla_cpus_only(monkeypatch):
  monkeypatch.delenv(settings.YNN, raising=False)
  assert platforms.train_compiler_options(jax.devices()[:1]) == options.YNN_DOTS

  class Gpu:
    platform = "gpu"
  assert platforms.train_compiler_options([Gpu()]) is None


def test_a_switch_is_off_for_0_false_or_off(monkeypatch):
  for value in ("0", "false", "OFF"):
    monkeypatch.setenv(settings.MATMUL, value)
    assert settings.turned_off(settings.MATMUL) == f"{settings.MATMUL}={value}"
  for value in ("1", "", "on"):
    monkeypatch.setenv(settings.MATMUL, value)
    assert settings.turned_off(settings.MATMUL) is None
  monkeypatch.setenv(settings.DEVICES, "two")
  with pytest.raises(ValueError, match="HFLAX_CPU_DEVICES"):
    settings.devices()


class _Device:
  def __init__(self, platform, limit=0, used=0):
    self.platform, self._stats = platform, {"bytes_limit": limit, "bytes_in_use": used}

  def memory_stats(self):
    return self._stats


def test_free_memory_is_the_fullest_accelerators_times_the_devices_or_the_hosts(monkeypatch):
  gpus = [_Device("gpu", 80 << 30, 20 << 30), _Device("gpu", 80 << 30, 50 << 30)]
  assert platforms.free_memory(gpus) == 2 * (30 << 30)  # the fuller device bounds each share
  assert platforms.free_memory([_Device("gpu")]) == 2**62  # no limit reported: unbounded
  from hflax.platforms.cpu import process
  monkeypatch.setattr(process, "available_memory", lambda: 123 << 20)
  cpus = [_Device("cpu"), _Device("cpu")]  # CPU devices share the host's memory once
  assert platforms.free_memory(cpus) == 123 << 20
  assert platforms.free_memory(jax.devices()[:2]) == 123 << 20
