"""Training checkpoints: sharded arrays (params, optimizer state) plus small host-side state.

One checkpoint is one orbax step directory holding an item per array pytree (stored as a
flat {"layers/0/attn/q/kernel/value": array} dict, so any pytree, nnx.State or optax
NamedTuples alike, is saved the same way) and a JSON item "host" with the host state and an
index of every array's shape and dtype.

Atomicity comes from orbax: a step is written to `<step>.orbax-checkpoint-tmp`, gets a
`commit_success.txt`, and only then is renamed to `<step>`; step discovery skips anything
not finalized, and old steps are deleted only after the new one is renamed. A save killed
midway therefore leaves the previous checkpoints intact and `latest_step` ignores it; the
stale tmp directory is removed (quietly) when that step is saved again.

Restore reads every array straight into the caller's target shardings (any mesh, any
number of devices), then rebuilds the target's own pytree structure, so the result can be
passed back into jitted functions that were compiled for it.

Integrity: see hflax/checkpoint/checksums.py.

`restore_latest` tries the newest step, then older ones, warning for each that cannot be
restored; the steps it skipped are renamed to `<step>.corrupt` once an older one restored,
so that the run can save those steps again. Old steps are pruned by hflax after each save
(not by orbax): a failure to delete one is a warning, never a failed save.
"""
from __future__ import annotations

import gc
import os
import re
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from hflax.checkpoint.checksums import checksums, host_digest
from hflax.checkpoint.host_state import decode, encode

_HOST = "host"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_SET_ASIDE = ".corrupt"  # a step restore_latest skipped: <step>.corrupt (orbax ignores it)
_DELETING = ".deleting"  # a pruned step is renamed to this first, then removed


def pause_for_test(point: str) -> None:
  """For tests only: HFLAX_TEST_PAUSE="checkpoint=5,export=5" sleeps that many seconds at
  that point of a write, so a test can signal or kill -9 the launcher there: 'checkpoint'
  once a checkpoint's files are written to orbax's temporary directory, before it is
  committed; 'export' once an export's weights are written, before its tokenizer. Unset:
  nothing (one dictionary lookup)."""
  spec = os.environ.get("HFLAX_TEST_PAUSE")
  if spec:
    seconds = dict(p.split("=", 1) for p in spec.split(",") if "=" in p).get(point)
    if seconds:
      time.sleep(float(seconds))


def _pause_before_commit(handler):
  """Wraps handler.finalize (orbax commits the step after it) with pause_for_test."""
  finalize = handler.finalize

  def paused(*args, **kwargs):
    pause_for_test("checkpoint")
    return finalize(*args, **kwargs)
  handler.finalize = paused


class CorruptCheckpoint(ValueError):
  """A checkpoint step that cannot be restored: a checksum mismatch, or data, an item or
  metadata that cannot be read. The message is one line naming the step directory."""


def _one_line(e: BaseException, limit: int = 300) -> str:
  """`Type: first line` of the innermost cause (TensorStore's own reason, not orbax's
  wrapper with the whole spec), without TensorStore's source locations."""
  seen = {id(e)}
  while True:
    inner = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    if inner is None or id(inner) in seen:
      break
    seen.add(id(inner))
    e = inner
  text = str(e).strip().splitlines()[0] if str(e).strip() else ""
  text = re.sub(r"\s*\[source locations=.*$", "", text)
  text = text.split(" See full TensorStore details")[0]
  text = f"{type(e).__name__}: {text}" if text else type(e).__name__
  return text if len(text) <= limit else text[:limit - 3] + "..."


_quiet = False


def _quiet_orbax_leftovers():
  """When one array of an item cannot be read, orbax's reads of the others fail too and
  nobody awaits them: when each coroutine is finalised (at some later garbage collection)
  Python would print "Exception ignored in" with a whole TensorStore spec. The first
  failure is reported in one line; from then on (installed at the first failed read, so a
  run that never meets one keeps the hook as it was) those leftovers are dropped. Every
  other unraisable exception goes to the hook that was there."""
  global _quiet
  if _quiet:
    return
  previous = sys.unraisablehook

  def quiet(unraisable):
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename and \
        isinstance(unraisable.exc_value, Exception):
      return
    previous(unraisable)
  sys.unraisablehook, _quiet = quiet, True


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


class Checkpointer:
  """Keeps the last `keep` checkpoints of a run under `directory`.

  save(step, arrays, host_state) writes when step % save_every == 0 (or force=True).
  restore(step=None, targets=...) -> (arrays, host_state) from the latest complete step,
  verified against the checksums written at save (CorruptCheckpoint if they differ).
  restore_latest(targets) -> (step, arrays, host_state) from the newest step that restores,
  or None when there is none. `log` takes the one-line warnings (pruning, skipped steps).
  """

  def __init__(self, directory, *, keep: int | None = 3, save_every: int = 1,
               async_save: bool = False, log=print):
    if save_every < 1 or (keep is not None and keep < 1):
      raise ValueError(f"need save_every >= 1 and keep >= 1 (or None), got {save_every}, {keep}")
    # orbax needs an absolute path; a relative run_dir is relative to where the run started.
    self.directory, self.save_every = os.path.abspath(directory), save_every
    self.keep, self.log, self._async, self._prune_pending = keep, log, async_save, False
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            # The directory appears with the first save, not when a reader opens it. Old
            # steps are pruned here (_prune), where a failure to delete is only a warning.
            max_to_keep=None, create=False, enable_async_checkpointing=async_save))
    if "checkpoint=" in os.environ.get("HFLAX_TEST_PAUSE", ""):
      _pause_before_commit(self._manager._checkpointer.handler)  # noqa: SLF001 - tests only

  def all_steps(self) -> list[int]:
    """Complete checkpoints on disk, oldest first (waits for an in-flight async save)."""
    self.wait_until_finished()
    self._reload()  # the disk is the truth: another process may have written
    return list(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest complete checkpoint, or None; a save that died midway is never it."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def save(self, step: int, arrays: dict, host_state: dict | None = None, *,
           force: bool = False) -> bool:
    """Writes `arrays` ({name: pytree of jax.Array}) and `host_state` (JSON-able values,
    arrays, PRNG keys, tuples, NamedTuples) as checkpoint `step`, with a checksum of every
    array, then prunes steps beyond `keep` (warning if one cannot be deleted). Returns
    whether it wrote."""
    if not force and step % self.save_every:
      return False
    latest = self.latest_step()
    if latest is not None and step <= latest:
      raise ValueError(f"step {step} is not after the latest checkpoint {latest} in "
                       f"{self.directory}; remove the newer checkpoints or use a new directory")
    items, index, sums = {}, {}, {}
    for name, tree in arrays.items():
      if not _NAME.match(name) or name == _HOST:
        raise ValueError(f"array item name {name!r} must match {_NAME.pattern} and not be "
                         f"{_HOST!r}")
      flat, _ = _flatten(tree, name)
      index[name] = {k: [list(v.shape), jnp.dtype(v.dtype).name] for k, v in flat.items()}
      sums[name] = checksums(flat)
      if flat:  # orbax rejects empty items (an optax EmptyState); the index restores them
        items[name] = ocp.args.StandardSave(flat)
    host = {"host_state": encode(dict(host_state or {})), "arrays": index, "checksums": sums}
    host["digest"] = host_digest(host)
    # The checksums travel in the host item: committed by the same rename as the arrays.
    items[_HOST] = ocp.args.JsonSave(host)
    self._remove_unfinished(step)
    # force: whether to save was decided above; orbax's own policy would skip steps.
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    self._prune_pending = True
    if not self._async:
      self._prune()  # the new step is committed; an async one is pruned after it is
    return True

  def _remove_unfinished(self, step: int):
    """Removes what a save of `step` killed midway left (`<step>.orbax-checkpoint-tmp*`):
    orbax would remove it too, but with a warning on stderr, and a resumed run that is
    interrupted again must still say one line. Process 0 only: the others reach the
    directory after orbax's barrier in save."""
    if jax.process_index() or not os.path.isdir(self.directory):
      return
    prefix = f"{step}.orbax-checkpoint-tmp"
    for name in os.listdir(self.directory):
      if name.startswith(prefix):
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def restore(self, step: int | None = None, targets: dict | None = None, *,
              verify: bool = True):
    """(arrays, host_state) of `step` (default: the latest complete one).

    targets: {name: pytree of jax.Array or jax.ShapeDtypeStruct with .sharding}; each named
    item comes back in that pytree structure with those shardings and dtypes (an array is
    read in its saved dtype, verified, then cast). Items not named are not read, so
    targets=None reads only the host state (whose own digest is still verified).
    Raises CorruptCheckpoint (one line) when what was read does not match its checksum or
    cannot be read; KeyError/ValueError when the targets do not fit the checkpoint.
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
    where = f"checkpoint {self.step_dir(step)}"
    try:
      host = self._manager.restore(
          step, args=ocp.args.Composite(**{_HOST: ocp.args.JsonRestore()}))[_HOST]
    except Exception as e:  # noqa: BLE001 - orbax's errors carry whole TensorStore specs
      raise CorruptCheckpoint(f"{where}: its host item cannot be read ({_one_line(e)})") \
          from None
    if not isinstance(host, dict) or not isinstance(host.get("arrays"), dict) or \
        "host_state" not in host:
      raise CorruptCheckpoint(f"{where}: its host item is not an hflax checkpoint index")
    if verify and "digest" in host and host["digest"] != host_digest(host):
      raise CorruptCheckpoint(f"{where}: the host item does not match its digest")
    index, sums, args, layouts, casts = host["arrays"], host.get("checksums", {}), {}, {}, {}
    for name, target in (targets or {}).items():
      if name not in index:
        raise KeyError(f"checkpoint step {step} has no item {name!r}; it has {sorted(index)}")
      flat, treedef = _flatten(target, name)
      _check_matches(name, step, index[name], flat)
      layouts[name] = (list(flat), treedef)  # the target's leaf order and structure
      abstract = {}
      for k, v in flat.items():
        a, saved = _abstract(v), jnp.dtype(index[name][k][1])
        if verify and a.dtype != saved:  # read the stored bits, cast once verified
          casts[(name, k)] = a
          a = jax.ShapeDtypeStruct(a.shape, saved, sharding=a.sharding)
        abstract[k] = a
      if flat:
        args[name] = ocp.args.StandardRestore(abstract)
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**args)) if args else {}
      restored, why = {name: dict(restored[name]) for name in args}, None
    except Exception as e:  # noqa: BLE001
      why = _one_line(e)
      _quiet_orbax_leftovers()
    if why is not None:
      gc.collect()  # the reads orbax started beside the failed one end now, quietly
      raise CorruptCheckpoint(f"{where}: cannot be read ({why})")
    if verify:
      for name in args:
        expected = sums.get(name)
        if not expected:
          continue  # written before checksums existed
        got = checksums(restored[name])
        bad = [k for k in restored[name] if k in expected and got[k] != expected[k]]
        if bad:
          raise CorruptCheckpoint(f"{where}: array {name}/{bad[0]} does not match the checksum "
                                  f"written at save ({len(bad)} of {len(got)} arrays in "
                                  f"{name!r} differ)")
    for (name, k), a in casts.items():
      restored[name][k] = jax.jit(lambda x, dt=a.dtype: x.astype(dt),
                                  out_shardings=a.sharding)(restored[name][k])
    arrays = {name: jax.tree_util.tree_unflatten(treedef, [restored[name][k] for k in keys])
              for name, (keys, treedef) in layouts.items()}
    try:
      host_state = decode(host["host_state"])
    except Exception as e:  # noqa: BLE001 - a damaged index that still parsed as JSON
      raise CorruptCheckpoint(f"{where}: its host state cannot be decoded ({_one_line(e)})") \
          from None
    return arrays, host_state

  def restore_latest(self, targets: dict | None = None, log=None, *, set_aside: bool = True):
    """(step, arrays, host_state) from the newest step that restores, or None when there is
    no checkpoint (nor directory). A step that raises CorruptCheckpoint is skipped with one
    warning line (to `log`, default the checkpointer's) naming it and why; once an older
    step restored, the skipped ones are renamed to `<step>.corrupt` (set_aside=True, by
    process 0 only) so that the run can write those steps again. Raises CorruptCheckpoint
    (one line) when no step restores, leaving them all in place. Errors that are not about
    the checkpoint (targets that do not fit it) propagate at once: older steps would not
    fit either.

    For a single-process caller (the local trainer, the Ray driver's host-only state): in a
    multi-process pool, every process must reach the same verdict, which holds for
    checksum mismatches (the sums are global) but not necessarily for read errors that
    only one process meets, so pools restore an explicit step chosen by the driver.
    """
    log = log or self.log
    if not os.path.isdir(self.directory):
      return None
    steps = self.all_steps()
    if not steps:
      return None
    skipped, first = [], None
    for i, step in enumerate(reversed(steps)):
      try:
        arrays, host_state = self.restore(step, targets)
      except CorruptCheckpoint as e:
        first = first or e
        older = steps[-2 - i] if i + 1 < len(steps) else None
        then = f"trying step {older}" if older is not None else "no older checkpoint to try"
        log(f"warning: skipping {e}; {then}")
        skipped.append(step)
        continue
      if skipped and set_aside:
        self.set_aside(skipped, step, log)
      return step, arrays, host_state
    raise CorruptCheckpoint(f"no checkpoint in {self.directory} can be restored (steps "
                            f"{steps}); the latest: {first}")

  def set_aside(self, steps: list[int], restored: int, log):
    """Renames `steps` (which failed to restore; `restored` did) to <step>.corrupt, out of
    orbax's sight, so the run can write those steps again."""
    if jax.process_index() != 0:
      return
    moved = []
    for step in steps:
      target, n = self.step_dir(step) + _SET_ASIDE, 1
      while os.path.exists(target):
        target, n = f"{self.step_dir(step)}{_SET_ASIDE}-{n}", n + 1
      try:
        os.rename(self.step_dir(step), target)
        moved.append(os.path.basename(target))
      except OSError as e:
        log(f"warning: could not move unrestorable checkpoint step {step} aside "
            f"({_one_line(e)}); remove {self.step_dir(step)} before the run saves that step")
    self._manager.reload()
    if moved:
      log(f"warning: restored step {restored}; moved the unrestorable {', '.join(moved)} "
          f"aside in {self.directory} (remove once inspected)")

  def _prune(self):
    """Deletes committed steps beyond `keep`, oldest first. Each is first renamed to
    `<step>.deleting`, out of orbax's sight (a prune killed midway leaves no half-deleted
    step that looks complete), then removed; leftovers of earlier prunes go too. A failure
    is one warning line: the new checkpoint is already saved."""
    self._prune_pending = False
    if self.keep is None or jax.process_index() != 0:  # one process deletes
      return
    self._reload()
    old = list(self._manager.all_steps())[:-self.keep]
    stale = [n for n in os.listdir(self.directory) if re.fullmatch(r"\d+" + _DELETING, n)]
    for name in stale:
      shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    for step in old:
      doomed = self.step_dir(step) + _DELETING
      try:
        os.rename(self.step_dir(step), doomed)
      except OSError as e:
        self.log(f"warning: could not delete old checkpoint step {step} in {self.directory} "
                 f"({_one_line(e)}); it stays on disk")
        continue
      try:
        shutil.rmtree(doomed)
      except OSError as e:
        self.log(f"warning: could not delete old checkpoint step {step} in {self.directory} "
                 f"({_one_line(e)}); {os.path.basename(doomed)} is removed at the next prune")
    self._reload()

  def _reload(self, tries: int = 5):
    """Re-reads the steps on disk. Process 0 may rename an old step to `.deleting` between
    orbax listing the directory and reading that step; the step is gone, so list again.
    orbax reports the vanished step as missing or, when it checks the path's type first,
    as "not a directory" (seen on a faster VM: 2 of about 2000 polls)."""
    for attempt in range(tries):
      try:
        return self._manager.reload()
      except (FileNotFoundError, NotADirectoryError):
        if attempt == tries - 1:
          raise
        time.sleep(0.05 * (attempt + 1))

  def wait_until_finished(self):
    self._manager.wait_until_finished()
    if self._prune_pending:  # an async save has committed by now
      self._prune()

  def close(self):
    self.wait_until_finished()
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
