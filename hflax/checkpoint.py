"""Training checkpoints: sharded arrays (params, optimizer state) plus small host-side state.

One checkpoint is one orbax step directory holding an item per array pytree (stored as a
flat {"layers/0/attn/q/kernel/value": array} dict, so any pytree, nnx.State or optax
NamedTuples alike, is saved the same way) and a JSON item "host" with the host state and an
index of every array's shape and dtype.

Atomicity comes from orbax: a step is written to `<step>.orbax-checkpoint-tmp`, gets a
`commit_success.txt`, and only then is renamed to `<step>`; step discovery skips anything
not finalized, and old steps are deleted only after the new one is renamed. A save killed
midway therefore leaves the previous checkpoints intact and `latest_step` ignores it; the
stale tmp directory is removed when that step is saved again.

Restore reads every array straight into the caller's target shardings (any mesh, any
number of devices), then rebuilds the target's own pytree structure, so the result can be
passed back into jitted functions that were compiled for it.
"""
from __future__ import annotations

import importlib
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

_HOST = "host"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_TAGS = ("__array__", "__key__", "__tuple__", "__namedtuple__")


def _flatten(tree, what: str) -> tuple[dict, object]:
  """{path string: leaf} and the treedef that puts the leaves back."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  flat = {jax.tree_util.keystr(p, simple=True, separator="/"): x for p, x in leaves}
  if len(flat) != len(leaves):  # e.g. a dict key "0" next to a list index 0
    raise ValueError(f"{what}: two leaves map to the same checkpoint key")
  return flat, treedef


def _abstract(x):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"restore targets must be arrays or ShapeDtypeStructs, got {type(x)}")
  # Without a sharding the array lands on the default device, like jnp.asarray would.
  sharding = getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


# -- host state: JSON plus tagged arrays, PRNG keys, tuples and NamedTuples -----------------
def _encode(x, path="host_state"):
  if x is None or isinstance(x, (bool, int, float, str)):
    return x
  if isinstance(x, dict):
    for k in x:
      if not isinstance(k, str) or k in _TAGS:
        raise TypeError(f"{path}: key {k!r} cannot be stored (keys are strings, not {_TAGS})")
    return {k: _encode(v, f"{path}[{k!r}]") for k, v in x.items()}
  if isinstance(x, tuple) and hasattr(x, "_fields"):
    cls = type(x)
    return {"__namedtuple__": f"{cls.__module__}:{cls.__qualname__}",
            "fields": {f: _encode(getattr(x, f), f"{path}.{f}") for f in x._fields}}
  if isinstance(x, (list, tuple)):
    items = [_encode(v, f"{path}[{i}]") for i, v in enumerate(x)]
    return items if isinstance(x, list) else {"__tuple__": items}
  if isinstance(x, (jax.Array, np.ndarray, np.generic)):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      # Typed keys cannot be copied to the host as such; their raw data plus the impl can.
      return {"__key__": str(jax.random.key_impl(x)),
              "data": np.asarray(jax.random.key_data(x)).tolist()}
    # tolist() is exact: every float dtype widens to a Python float and narrows back.
    a = np.asarray(x)
    return {"__array__": a.dtype.name, "shape": list(a.shape), "data": a.tolist(),
            "jax": isinstance(x, jax.Array)}
  raise TypeError(f"{path}: {type(x).__name__} is not storable host state")


def _decode(x):
  if isinstance(x, list):
    return [_decode(v) for v in x]
  if not isinstance(x, dict):
    return x
  if "__key__" in x:
    return jax.random.wrap_key_data(jnp.asarray(x["data"], jnp.uint32), impl=x["__key__"])
  if "__array__" in x:
    a = np.asarray(x["data"], dtype=jnp.dtype(x["__array__"])).reshape(x["shape"])
    return jnp.asarray(a) if x["jax"] else a
  if "__tuple__" in x:
    return tuple(_decode(v) for v in x["__tuple__"])
  if "__namedtuple__" in x:
    module, qualname = x["__namedtuple__"].split(":")
    cls = importlib.import_module(module)
    for part in qualname.split("."):
      cls = getattr(cls, part)
    return cls(**{k: _decode(v) for k, v in x["fields"].items()})
  return {k: _decode(v) for k, v in x.items()}


class Checkpointer:
  """Keeps the last `keep` checkpoints of a run under `directory`.

  save(step, arrays, host_state) writes when step % save_every == 0 (or force=True).
  restore(step=None, targets=...) -> (arrays, host_state) from the latest complete step.
  """

  def __init__(self, directory, *, keep: int | None = 3, save_every: int = 1,
               async_save: bool = False):
    if save_every < 1 or (keep is not None and keep < 1):
      raise ValueError(f"need save_every >= 1 and keep >= 1 (or None), got {save_every}, {keep}")
    # orbax needs an absolute path; a relative run_dir is relative to where the run started.
    self.directory, self.save_every = os.path.abspath(directory), save_every
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            # The directory appears with the first save, not when a reader opens it.
            max_to_keep=keep, create=False, enable_async_checkpointing=async_save))

  def all_steps(self) -> list[int]:
    """Complete checkpoints on disk, oldest first (waits for an in-flight async save)."""
    self.wait_until_finished()
    self._manager.reload()  # the disk is the truth: another process may have written
    return list(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest complete checkpoint, or None; a save that died midway is never it."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def save(self, step: int, arrays: dict, host_state: dict | None = None, *,
           force: bool = False) -> bool:
    """Writes `arrays` ({name: pytree of jax.Array}) and `host_state` (JSON-able values,
    arrays, PRNG keys, tuples, NamedTuples) as checkpoint `step`. Returns whether it wrote."""
    if not force and step % self.save_every:
      return False
    latest = self.latest_step()
    if latest is not None and step <= latest:
      raise ValueError(f"step {step} is not after the latest checkpoint {latest} in "
                       f"{self.directory}; remove the newer checkpoints or use a new directory")
    items, index = {}, {}
    for name, tree in arrays.items():
      if not _NAME.match(name) or name == _HOST:
        raise ValueError(f"array item name {name!r} must match {_NAME.pattern} and not be "
                         f"{_HOST!r}")
      flat, _ = _flatten(tree, name)
      index[name] = {k: [list(v.shape), jnp.dtype(v.dtype).name] for k, v in flat.items()}
      if flat:  # orbax rejects empty items (an optax EmptyState); the index restores them
        items[name] = ocp.args.StandardSave(flat)
    host = {"host_state": _encode(dict(host_state or {})), "arrays": index}
    items[_HOST] = ocp.args.JsonSave(host)
    # force: whether to save was decided above; orbax's own policy would skip steps.
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    return True

  def restore(self, step: int | None = None, targets: dict | None = None):
    """(arrays, host_state) of `step` (default: the latest complete one).

    targets: {name: pytree of jax.Array or jax.ShapeDtypeStruct with .sharding}; each named
    item comes back in that pytree structure with those shardings and dtypes (orbax casts).
    Items not named are not read, so targets=None reads only the host state.
    """
    if not os.path.isdir(self.directory):
      raise FileNotFoundError(f"checkpoint directory {self.directory} does not exist")
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
    step = steps[-1] if step is None else step
    if step not in steps:
      raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; "
                              f"complete steps: {steps}")
    host = self._manager.restore(
        step, args=ocp.args.Composite(**{_HOST: ocp.args.JsonRestore()}))[_HOST]
    index, args, layouts = host["arrays"], {}, {}
    for name, target in (targets or {}).items():
      if name not in index:
        raise KeyError(f"checkpoint step {step} has no item {name!r}; it has {sorted(index)}")
      flat, treedef = _flatten(target, name)
      _check_matches(name, step, index[name], flat)
      layouts[name] = (list(flat), treedef)  # the target's leaf order and structure
      if flat:
        args[name] = ocp.args.StandardRestore({k: _abstract(v) for k, v in flat.items()})
    restored = self._manager.restore(step, args=ocp.args.Composite(**args)) if args else {}
    arrays = {name: jax.tree_util.tree_unflatten(treedef, [restored[name][k] for k in keys])
              for name, (keys, treedef) in layouts.items()}
    return arrays, _decode(host["host_state"])

  def wait_until_finished(self):
    self._manager.wait_until_finished()

  def close(self):
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _check_matches(name, step, saved: dict, flat: dict):
  """Raises naming the first key whose presence or shape differs from the checkpoint."""
  extra, missing = sorted(flat.keys() - saved.keys()), sorted(saved.keys() - flat.keys())
  if extra:
    raise KeyError(f"{name}: target key {extra[0]!r} is not in checkpoint step {step}")
  if missing:
    raise KeyError(f"{name}: checkpoint step {step} has key {missing[0]!r} that the target "
                   f"lacks")
  for key, (shape, _) in saved.items():
    if tuple(flat[key].shape) != tuple(shape):
      raise ValueError(f"{name}: {key!r} has shape {tuple(shape)} in checkpoint step {step} "
                       f"but {tuple(flat[key].shape)} in the target")
