"""Checkpoints: bit-identical resume, restore into other layouts, retention, and that a save
that dies midway leaves the previous checkpoint intact and invisible partial state."""
import os
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from hflax.algorithms.kl import adaptive_kl_controller, update_kl_controller
from hflax.checkpoint import Checkpointer
from hflax.models import ModelConfig, create
from hflax.sharding.layouts import TRAIN_RULES, state_shardings, train_mesh

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2)
TX = optax.adamw(1e-2)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _update(params, opt_state):
  """A stand-in train step: deterministic gradients, a real optimizer update."""
  grads = jax.tree.map(lambda p: jnp.sin(p) + 0.01, params)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


@pytest.fixture(scope="module")
def run():
  """Actor params on an 8-device FSDP mesh plus adamw state after one step, and the step
  function jitted for exactly those shardings."""
  _, state = create(CFG)
  mesh = train_mesh(jax.devices())
  params = jax.device_put(state, state_shardings(state, mesh, TRAIN_RULES))
  # Moments follow their params (eager init keeps the shardings; jit would put them on one
  # device), the step count is replicated over the mesh.
  opt_state = jax.tree.map(
      lambda x: x if x.ndim else jax.device_put(x, NamedSharding(mesh, P())), TX.init(params))
  shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
  step = jax.jit(_update, in_shardings=shardings, out_shardings=shardings)
  params, opt_state = step(params, opt_state)
  return params, opt_state, step


def _host(rng, kl):
  return {"step": 10, "loader": {"epoch": 1, "position": 384}, "rng": rng, "kl": kl,
          "config": {"lr": 1e-6, "model": "tiny", "layers": [2, 2], "pair": (1, "a")}}


def _assert_same_arrays(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _tiny(value):
  return {"w": jnp.full((4, 2), value, jnp.float32), "b": jnp.arange(3) + int(value)}


def test_resume_continues_bit_identically(tmp_path, run):
  params, opt_state, step = run
  rng, kl = jax.random.key(42), adaptive_kl_controller(0.05, 6.0, 1000.0)
  rng, _ = jax.random.split(rng)
  kl = update_kl_controller(kl, 3.7, 64)
  saved = {"actor_params": params, "actor_opt_state": opt_state}
  Checkpointer(tmp_path, keep=2).save(10, saved, _host(rng, kl))
  # The uninterrupted run goes on from here...
  expected = step(params, opt_state), jax.random.normal(jax.random.split(rng)[1], (5,))

  # ...and a fresh process-equivalent resumes from disk into the same layout.
  arrays, host = Checkpointer(tmp_path).restore(targets=saved)
  _assert_same_arrays(arrays["actor_params"], params)
  _assert_same_arrays(arrays["actor_opt_state"], opt_state)
  for x, y in zip(jax.tree.leaves(arrays), jax.tree.leaves(saved)):
    assert x.sharding == y.sharding
  assert host.keys() == _host(rng, kl).keys()
  assert host["step"] == 10 and host["loader"] == {"epoch": 1, "position": 384}
  assert host["config"] == {"lr": 1e-6, "model": "tiny", "layers": [2, 2], "pair": (1, "a")}
  assert type(host["kl"]) is type(kl)
  _assert_same_arrays(host["kl"], kl)
  np.testing.assert_array_equal(jax.random.key_data(host["rng"]), jax.random.key_data(rng))

  resumed = (step(arrays["actor_params"], arrays["actor_opt_state"]),
             jax.random.normal(jax.random.split(host["rng"])[1], (5,)))
  assert step._cache_size() == 1  # same structure and shardings: no recompilation
  _assert_same_arrays(resumed, expected)


def test_restore_into_other_layouts(tmp_path, run):
  params, opt_state, _ = run
  ckpt = Checkpointer(tmp_path)
  ckpt.save(1, {"params": params, "opt": opt_state}, {})

  # 4 other devices as fsdp=2 x tensor=2, and one device: neither matches the saved 8.
  mesh4 = train_mesh(jax.devices()[4:], fsdp=2, tensor=2)
  split = lambda x: NamedSharding(mesh4, P(("fsdp", "tensor")) if x.ndim and  # noqa: E731
                                  x.shape[0] % 4 == 0 else P())
  one = lambda x: SingleDeviceSharding(jax.devices()[3])  # noqa: E731
  for place in (split, one):
    targets = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=place(x)),
                           {"params": params, "opt": opt_state})
    arrays, _ = ckpt.restore(targets=targets)
    _assert_same_arrays(arrays, {"params": params, "opt": opt_state})
    for x, t in zip(jax.tree.leaves(arrays), jax.tree.leaves(targets)):
      assert x.sharding == t.sharding

  # Only the named items are read; a dtype in the target is honoured.
  as_bf16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16,
                                                        sharding=x.sharding), params)
  arrays, _ = ckpt.restore(1, targets={"params": as_bf16})
  assert list(arrays) == ["params"]
  assert {x.dtype for x in jax.tree.leaves(arrays)} == {jnp.dtype(jnp.bfloat16)}


def test_retention_and_save_every(tmp_path):
  ckpt = Checkpointer(tmp_path, keep=2, save_every=2)
  wrote = [ckpt.save(s, {"a": _tiny(s)}, {"step": s}) for s in range(1, 8)]
  assert wrote == [False, True, False, True, False, True, False]
  assert ckpt.all_steps() == [4, 6] and ckpt.latest_step() == 6
  assert ckpt.save(7, {"a": _tiny(7)}, {"step": 7}, force=True)
  assert ckpt.all_steps() == [6, 7]
  assert sorted(os.listdir(tmp_path)) == ["6", "7"]
  arrays, host = ckpt.restore(6, targets={"a": _tiny(0)})
  _assert_same_arrays(arrays["a"], _tiny(6))
  assert host == {"step": 6}
  with pytest.raises(ValueError, match="not after the latest checkpoint 7"):
    ckpt.save(6, {"a": _tiny(6)}, {}, force=True)


def test_async_save(tmp_path):
  ckpt = Checkpointer(tmp_path, async_save=True)
  ckpt.save(1, {"a": _tiny(1), "empty": optax.EmptyState()}, {"step": 1})
  ckpt.wait_until_finished()
  assert ckpt.latest_step() == 1
  arrays, _ = ckpt.restore(targets={"a": _tiny(0), "empty": optax.EmptyState()})
  _assert_same_arrays(arrays["a"], _tiny(1))
  assert arrays["empty"] == optax.EmptyState()
  ckpt.close()


# The child saves step 2 but blocks at the final rename of the step directory, when every
# item is already on disk: the last moment a crash can hit.
_CHILD = """
import sys, time
import jax.numpy as jnp
import orbax.checkpoint as ocp
from hflax.checkpoint import Checkpointer
temp = ocp.path.atomicity.AtomicRenameTemporaryPath
rename = temp.finalize
async def finalize(self):
  if self.get_final().name == "2":
    print("READY", flush=True)
    time.sleep(600)
  return await rename(self)
temp.finalize = finalize
Checkpointer(sys.argv[1], keep=1).save(
    2, {"a": {"w": jnp.full((4, 2), 2.0), "b": jnp.arange(3) + 2}}, {"step": 2})
"""


def test_killed_save_leaves_previous_checkpoint_intact(tmp_path):
  Checkpointer(tmp_path, keep=1).save(1, {"a": _tiny(1)}, {"step": 1})
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [REPO, os.environ.get("PYTHONPATH", "")]), "JAX_PLATFORMS": "cpu"}
  child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  guard = threading.Timer(120, child.kill)  # never hang the suite on a child that stalls
  guard.start()
  try:
    assert child.stdout.readline().strip() == "READY"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
  finally:
    guard.cancel()
  assert child.returncode == -signal.SIGKILL
  # The partial step is on disk, complete but for the rename; keep=1 deleted nothing.
  assert sorted(os.listdir(tmp_path)) == ["1", "2.orbax-checkpoint-tmp"]
  assert "a" in os.listdir(tmp_path / "2.orbax-checkpoint-tmp")

  ckpt = Checkpointer(tmp_path, keep=1)
  assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
  arrays, host = ckpt.restore(targets={"a": _tiny(0)})
  _assert_same_arrays(arrays["a"], _tiny(1))
  assert host == {"step": 1}

  # Saving that step again replaces the leftover and then retires step 1.
  ckpt.save(2, {"a": _tiny(2)}, {"step": 2})
  assert sorted(os.listdir(tmp_path)) == ["2"]
  _assert_same_arrays(ckpt.restore(targets={"a": _tiny(0)})[0]["a"], _tiny(2))


def test_failed_save_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
  ckpt = Checkpointer(tmp_path, keep=1)
  ckpt.save(1, {"a": _tiny(1)}, {"step": 1})

  async def fail(self):
    raise OSError("disk full")
  monkeypatch.setattr(ocp.path.atomicity.AtomicRenameTemporaryPath, "finalize", fail)
  with pytest.raises(OSError, match="disk full"):
    ckpt.save(2, {"a": _tiny(2)}, {"step": 2})
  monkeypatch.undo()

  assert ckpt.latest_step() == 1
  arrays, host = ckpt.restore(targets={"a": _tiny(0)})
  _assert_same_arrays(arrays["a"], _tiny(1))
  assert host == {"step": 1}
  ckpt.save(2, {"a": _tiny(2)}, {"step": 2})  # the same instance carries on
  assert ckpt.all_steps() == [2]


def test_errors_say_what_is_wrong(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    Checkpointer(tmp_path / "nowhere").restore()
  assert not (tmp_path / "nowhere").exists()  # a reader does not create directories
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
    Checkpointer(tmp_path / "empty").restore()

  ckpt = Checkpointer(tmp_path / "run")
  with pytest.raises(TypeError, match=r"host_state\['bad'\]\[1\]: object"):
    ckpt.save(1, {"a": _tiny(1)}, {"bad": [1, object()]})
  assert ckpt.latest_step() is None
  ckpt.save(1, {"a": _tiny(1)}, {})
  with pytest.raises(FileNotFoundError, match=r"step 5 .* complete steps: \[1\]"):
    ckpt.restore(5, targets={})
  with pytest.raises(KeyError, match="no item 'critic'"):
    ckpt.restore(targets={"critic": _tiny(0)})
  with pytest.raises(KeyError, match="target key 'extra'"):
    ckpt.restore(targets={"a": {**_tiny(0), "extra": jnp.zeros(1)}})
  with pytest.raises(KeyError, match="has key 'w' that the target lacks"):
    ckpt.restore(targets={"a": {"b": jnp.zeros(3, jnp.int32)}})
  with pytest.raises(ValueError, match=r"'w' has shape \(4, 2\) .* but \(2, 4\)"):
    ckpt.restore(targets={"a": {**_tiny(0), "w": jnp.zeros((2, 4))}})
  with pytest.raises(ValueError, match="item name 'host'"):
    ckpt.save(2, {"host": _tiny(2)}, {})


def test_optimizer_state_saved_from_host_memory_restores_on_device(tmp_path, run):
  """With actor.optimizer_offload a save can meet the optimizer state in pinned host memory
  (e.g. after validation generated): it is written as is and restored on the device."""
  params, opt_state = run[0], run[1]
  offloaded = jax.device_put(opt_state, jax.tree.map(
      lambda x: x.sharding.with_memory_kind("pinned_host"), opt_state))
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(1, {"opt_state": offloaded}, {"step": 1}, force=True)
  arrays, _ = ckpt.restore(1, {"opt_state": opt_state})
  for a, b in zip(jax.tree.leaves(arrays["opt_state"]), jax.tree.leaves(opt_state)):
    assert a.sharding.memory_kind == b.sharding.memory_kind
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
