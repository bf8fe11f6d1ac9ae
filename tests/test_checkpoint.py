"""Checkpoints: bit-identical resume, restore into other layouts, retention, that a save
that dies midway leaves the previous checkpoint intact and invisible partial state, and
integrity: damaged data is detected at restore, in one line, and the previous step is used."""
import glob
import json
import os
import shutil
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
from hflax import checkpoint as checkpoint_lib
from hflax.checkpoint.checksums import checksums
from hflax.checkpoint import Checkpointer, CorruptCheckpoint
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
from hflax import checkpoint as checkpoint_lib
from hflax.checkpoint import Checkpointer, CorruptCheckpoint
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


def test_killed_save_leaves_previous_checkpoint_intact(tmp_path, caplog):
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

  # Saving that step again replaces the leftover (quietly: orbax would warn on stderr, and
  # an interrupted launcher says one line) and then retires step 1.
  with caplog.at_level("WARNING"):
    ckpt.save(2, {"a": _tiny(2)}, {"step": 2})
  assert not [r for r in caplog.records if "already exists" in r.getMessage()]
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


# -- integrity ---------------------------------------------------------------------------------
def _data_files(step_dir):
  """The array data files of a step (TensorStore's OCDBT `d/` files), largest first."""
  files = [f for f in glob.glob(os.path.join(step_dir, "**", "d", "*"), recursive=True)
           if os.path.isfile(f)]
  return sorted(files, key=os.path.getsize, reverse=True)


def _flip(path, size=4096):
  """Inverts `size` bytes (all of them if fewer) in the middle of a file."""
  data = bytearray(open(path, "rb").read())
  start = max(0, len(data) // 2 - size // 2)
  for i in range(start, min(len(data), start + size)):
    data[i] ^= 0xFF
  with open(path, "wb") as f:
    f.write(data)


def _one_line(e, *names):
  text = str(e.value)
  assert "\n" not in text and len(text) < 500, text
  assert "TensorStore(" not in text and "source locations" not in text, text
  for name in names:
    assert name in text, (name, text)
  return text


def _big(seed):
  """192 KiB of random bits: zstd stores them raw, in one chunk on one device, so a 4 KiB
  flip in the middle of its data file changes values instead of breaking the framing (zstd
  has no checksum there, and TensorStore reads the damage back without complaint)."""
  return {"w": jax.random.bits(jax.random.key(seed), (48, 1024), jnp.uint32),
          "b": jnp.arange(4) + seed}


def test_bit_flip_is_detected_and_the_previous_step_restored(tmp_path, run):
  """Step 2 damaged: restore names it; restore_latest warns, uses step 1, and a run that
  goes on from there reaches the parameters of the uninterrupted run."""
  params, opt_state, step = run
  ckpt = Checkpointer(tmp_path, keep=3)
  ckpt.save(1, {"params": params, "opt": opt_state, "big": _big(1)}, {"step": 1})
  params2, opt2 = step(params, opt_state)
  ckpt.save(2, {"params": params2, "opt": opt2, "big": _big(2)}, {"step": 2})
  targets = {"params": params, "opt": opt_state, "big": _big(0)}

  _flip(_data_files(tmp_path / "2")[0])
  with pytest.raises(CorruptCheckpoint) as e:
    ckpt.restore(2, targets)
  _one_line(e, f"{tmp_path}/2:", "big/w", "does not match the checksum")
  assert isinstance(e.value, ValueError)

  lines = []
  step_no, arrays, host = Checkpointer(tmp_path, log=lines.append).restore_latest(targets)
  assert step_no == 1 and host == {"step": 1}
  _assert_same_arrays(arrays, {"params": params, "opt": opt_state, "big": _big(1)})
  for x, y in zip(jax.tree.leaves(arrays), jax.tree.leaves(targets)):
    assert x.sharding == y.sharding
  assert len(lines) == 2 and all("\n" not in line for line in lines)
  assert lines[0].startswith(f"warning: skipping checkpoint {tmp_path}/2: array big/w")
  assert lines[0].endswith("trying step 1")
  assert "2.corrupt" in lines[1]
  # The damaged step is set aside, so the resumed run can write step 2 again.
  assert sorted(os.listdir(tmp_path)) == ["1", "2.corrupt"]
  resumed = step(arrays["params"], arrays["opt"])
  _assert_same_arrays(resumed, (params2, opt2))
  ckpt.save(2, {"params": resumed[0], "opt": resumed[1], "big": _big(2)}, {"step": 2})
  assert ckpt.latest_step() == 2
  _assert_same_arrays(ckpt.restore(2, targets)[0]["params"], params2)


def test_unreadable_data_is_one_line(tmp_path):
  ckpt = Checkpointer(tmp_path, keep=None)
  for s in (1, 2, 3):
    ckpt.save(s, {"big": _big(s)}, {"step": s})
  os.remove(_data_files(tmp_path / "3")[0])  # TensorStore's error carries its whole spec
  with pytest.raises(CorruptCheckpoint) as e:
    ckpt.restore(3, {"big": _big(0)})
  _one_line(e, f"{tmp_path}/3:", "cannot be read")
  shutil.rmtree(tmp_path / "2" / "big")  # an item the index lists but the disk lacks
  with pytest.raises(CorruptCheckpoint) as e:
    ckpt.restore(2, {"big": _big(0)})
  _one_line(e, f"{tmp_path}/2:")

  lines = []
  got = ckpt.restore_latest({"big": _big(0)}, log=lines.append)
  assert got[0] == 1 and len(lines) == 3
  _assert_same_arrays(got[1]["big"], _big(1))
  assert lines[0].startswith(f"warning: skipping checkpoint {tmp_path}/3: cannot be read")
  assert lines[1].startswith(f"warning: skipping checkpoint {tmp_path}/2: cannot be read")
  assert sorted(os.listdir(tmp_path)) == ["1", "2.corrupt", "3.corrupt"]


def test_damaged_host_item(tmp_path):
  """The host state alone (what the Ray driver restores) is verified too."""
  ckpt = Checkpointer(tmp_path)
  ckpt.save(1, {"a": _tiny(1)}, {"step": 1, "loader": {"position": 384}})
  ckpt.save(2, {"a": _tiny(2)}, {"step": 2, "loader": {"position": 768}})
  meta = tmp_path / "2" / "host" / "metadata"
  host = json.loads(meta.read_text())
  host["host_state"]["loader"]["position"] = 769  # still valid JSON, another value
  meta.write_text(json.dumps(host))
  with pytest.raises(CorruptCheckpoint) as e:
    ckpt.restore(2)
  _one_line(e, f"{tmp_path}/2:", "digest")
  lines = []
  assert ckpt.restore_latest(log=lines.append) == (1, {}, {"step": 1,
                                                          "loader": {"position": 384}})
  assert "host item does not match its digest" in lines[0]

  ckpt.save(2, {"a": _tiny(2)}, {"step": 2})
  (tmp_path / "2" / "host" / "metadata").write_text('{"host_state": {"st')
  with pytest.raises(CorruptCheckpoint) as e:
    ckpt.restore(2, {})
  _one_line(e, f"{tmp_path}/2:", "host item cannot be read")


def test_restore_latest_edges(tmp_path):
  assert Checkpointer(tmp_path / "nowhere").restore_latest() is None
  assert not (tmp_path / "nowhere").exists()
  ckpt = Checkpointer(tmp_path / "run")
  (tmp_path / "run").mkdir()
  assert ckpt.restore_latest({"a": _tiny(0)}) is None
  ckpt.save(1, {"a": _tiny(1)}, {"step": 1})
  ckpt.save(2, {"a": _tiny(2)}, {"step": 2})
  assert ckpt.restore_latest({"a": _tiny(0)})[0] == 2

  # Targets that do not fit are the caller's mistake: no fallback, nothing moved.
  with pytest.raises(KeyError, match="no item 'critic'"):
    ckpt.restore_latest({"critic": _tiny(0)})
  with pytest.raises(ValueError, match="has shape") as e:
    ckpt.restore_latest({"a": {**_tiny(0), "w": jnp.zeros((2, 4))}})
  assert not isinstance(e.value, CorruptCheckpoint)

  # Every step damaged: one line naming the latest reason, all left in place.
  for s in (1, 2):
    os.remove(tmp_path / "run" / str(s) / "host" / "metadata")
  lines = []
  with pytest.raises(CorruptCheckpoint) as e:
    ckpt.restore_latest({"a": _tiny(0)}, log=lines.append)
  _one_line(e, f"no checkpoint in {tmp_path}/run can be restored (steps [1, 2])",
            f"{tmp_path}/run/2:")
  assert len(lines) == 2 and lines[1].endswith("no older checkpoint to try")
  assert sorted(os.listdir(tmp_path / "run")) == ["1", "2"]


@pytest.mark.parametrize("fails", ["rename", "rmtree"])
def test_pruning_failure_warns_and_the_save_stands(tmp_path, monkeypatch, fails):
  lines = []
  ckpt = Checkpointer(tmp_path, keep=1, log=lines.append)
  ckpt.save(1, {"a": _tiny(1)}, {"step": 1})
  real = {"rename": os.rename, "rmtree": shutil.rmtree}[fails]

  def refuse(*args, **kwargs):
    if str(args[-1 if fails == "rename" else 0]).endswith(".deleting"):
      raise PermissionError(13, "Permission denied", str(args[0]))
    return real(*args, **kwargs)
  monkeypatch.setattr(checkpoint_lib.os if fails == "rename" else checkpoint_lib.shutil,
                      fails, refuse)
  assert ckpt.save(2, {"a": _tiny(2)}, {"step": 2})  # no exception: step 2 is saved
  monkeypatch.undo()
  assert len(lines) == 1 and "\n" not in lines[0]
  assert lines[0].startswith(f"warning: could not delete old checkpoint step 1 in {tmp_path}")
  assert "PermissionError" in lines[0]
  assert ckpt.latest_step() == 2
  _assert_same_arrays(ckpt.restore(targets={"a": _tiny(0)})[0]["a"], _tiny(2))
  if fails == "rename":
    assert ckpt.all_steps() == [1, 2]
  else:  # renamed out of the step list, removed by the next prune
    assert ckpt.all_steps() == [2] and sorted(os.listdir(tmp_path)) == ["1.deleting", "2"]
  ckpt.save(3, {"a": _tiny(3)}, {"step": 3})
  assert sorted(os.listdir(tmp_path)) == ["3"] and len(lines) == 1


def test_a_reader_polling_while_old_steps_are_pruned_never_fails(tmp_path):
  """A pool's other processes read the step list while process 0 renames old steps out of
  it; before the list was re-read on a vanished step, a reader failed about one poll in 40."""
  writer = Checkpointer(tmp_path, keep=1)
  writer.save(1, {"a": _tiny(1)}, {"step": 1})
  reader, errors, polls, stop = Checkpointer(tmp_path, keep=1), [], [], threading.Event()

  def poll():
    while not stop.is_set():
      try:
        polls.append(reader.all_steps())
      except Exception as e:  # noqa: BLE001 - any failure is the defect under test
        errors.append(repr(e))
  thread = threading.Thread(target=poll)
  thread.start()
  try:
    for step in range(2, 30):
      writer.save(step, {"a": _tiny(step)}, {"step": step})
  finally:
    stop.set()
    thread.join()
  assert errors == [] and len(polls) > 50
  assert all(len(steps) <= 2 for steps in polls)  # the newest, at most one being pruned
  assert reader.all_steps() == [29] and sorted(os.listdir(tmp_path)) == ["29"]


def test_async_save_prunes_once_committed(tmp_path):
  ckpt = Checkpointer(tmp_path, keep=1, async_save=True)
  for s in (1, 2, 3):
    ckpt.save(s, {"a": _tiny(s)}, {"step": s})
  ckpt.wait_until_finished()
  assert sorted(os.listdir(tmp_path)) == ["3"]
  _assert_same_arrays(ckpt.restore(targets={"a": _tiny(0)})[0]["a"], _tiny(3))
  ckpt.close()


def test_checksums_do_not_depend_on_the_layout(tmp_path, run):
  """A value has one checksum on 8 devices, 4, 1 or in host memory; checkpoints saved
  sharded verify when restored into other layouts (test_restore_into_other_layouts reads
  them), and a single changed element changes the checksum."""
  params = run[0]
  flat, _ = checkpoint_lib._flatten(params, "params")
  mesh4 = train_mesh(jax.devices()[4:], fsdp=2, tensor=2)
  layouts = [
      lambda x: x,
      lambda x: jax.device_put(x, SingleDeviceSharding(jax.devices()[5])),
      lambda x: jax.device_put(x, NamedSharding(mesh4, P(None, "tensor") if x.ndim > 1 and
                                                x.shape[1] % 2 == 0 else P())),
      lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host")),
      np.asarray,
  ]
  sums = [checksums({k: place(v) for k, v in flat.items()})
          for place in layouts]
  assert all(s == sums[0] for s in sums[1:])
  key = next(k for k, v in flat.items() if v.ndim == 2)
  changed = checksums({key: flat[key].at[1, 1].add(1e-3)})
  assert changed[key] != sums[0][key]
  swapped = checksums({key: flat[key][::-1]})
  assert swapped[key] != sums[0][key]

  ckpt = Checkpointer(tmp_path)
  ckpt.save(1, {"params": params}, {})
  host = json.loads((tmp_path / "1" / "host" / "metadata").read_text())
  assert host["checksums"]["params"] == sums[0]


def test_checkpoints_written_before_checksums_restore_unverified(tmp_path):
  ckpt = Checkpointer(tmp_path)
  ckpt.save(1, {"a": _tiny(1)}, {"step": 1})
  meta = tmp_path / "1" / "host" / "metadata"
  host = json.loads(meta.read_text())
  meta.write_text(json.dumps({"host_state": host["host_state"], "arrays": host["arrays"]}))
  arrays, state = ckpt.restore(1, {"a": _tiny(0)})
  _assert_same_arrays(arrays["a"], _tiny(1))
  assert state == {"step": 1}
