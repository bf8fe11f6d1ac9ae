"""Batched sampling with a preallocated KV cache: one prefill, then a lax.while_loop decode.

Prompts are left-padded to a length bucket (a power of two or three quarters of one) so
the compiled program is reused across calls; the loop stops as soon as every row has
produced an end token. The returned log-probs are those of the sampled tokens under
softmax(logits / temperature) (the raw model distribution for greedy decoding), before
top-k/top-p truncation: what teacher-forced `sequence_log_probs` computes for the same
sequences: in float32 to float precision (so a PPO step can start from them on-policy), in
bfloat16 within its rounding (~1e-3; the actor then recomputes them).
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hflax.platforms.decoding import for_decoding
from hflax.models import moe
from hflax.models.transformer import positions_from_mask
from hflax.rollout import continuous, routes
from hflax.rollout.decoding import (SamplingParams, decode_segments, grow, kernel_attends,
                                    outputs, pick, prefill, segment_ends)


def length_bucket(length: int, minimum: int = 8) -> int:
  """The width a `length`-token prompt is padded to: the smallest power of two or three
  quarters of one (..., 32, 48, 64, 96, 128, ...) that holds it, at least `minimum`.

  Why the three-quarter steps: every padded column is prefilled and read by every decode
  step. SmolLM2's 45-token chat prompts went to 64 columns with powers of two alone, and
  a generate call runs faster at 48. The cost: up to twice as many widths to compile."""
  power = 1 << max(0, length - 1).bit_length()
  three_quarters = power // 4 * 3
  return max(minimum, three_quarters if power % 4 == 0 and length <= three_quarters else power)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, width: int | None = None):
  """Left-pads token lists to `width` (default: the length_bucket of the longest)."""
  if not prompts:
    raise ValueError("no prompts to generate from")
  longest = max(len(p) for p in prompts)
  for i, p in enumerate(prompts):
    if not len(p):
      raise ValueError(f"prompt {i} is empty")
  width = width or length_bucket(longest)
  if longest > width:
    raise ValueError(f"prompt of {longest} tokens does not fit width {width}")
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  mask = np.zeros((len(prompts), width), bool)
  for i, p in enumerate(prompts):
    tokens[i, width - len(p):] = p
    mask[i, width - len(p):] = True
  return tokens, mask


@functools.partial(jax.jit, static_argnames=("graphdef", "params", "segments", "mesh", "slots",
                                             "shared"))
def _generate(graphdef, state, prompts_BxP, prompt_mask_BxP, rng, params: SamplingParams,
              segments: int = 1, live_B=None, mesh: Mesh | None = None, first_row=0,
              slots: int = 0, shared: int = 0):
  """slots (optional): continuous batching, each device decoding at most that many rows
  at once and giving a finished row's slot to the next (hflax.rollout.continuous);
  0 decodes all of its rows together until the last ends.

  shared (optional): the first `shared` real tokens of every prompt row are the same
  (shared_prefix_length), prefilled once (decoding.prefill).

  live_B (optional, bool [B]): False marks padding rows, born finished so that they
  never keep the decode loop running.

  first_row: the index of prompt row 0 in a larger batch generated in waves; rows draw
  their samples by that index (see decoding.pick), so waves draw what one call would have (given
  the same logits, which a different batch shape can change in the last bits).

  mesh (optional): when its "data" axis has more than one device, the rows split over it
  and each device runs its own decode loop on its rows (shard_map), stopping when they
  are done, with no collective per step; other axes (tensor) stay with the compiler.
  """
  B = prompts_BxP.shape[0]
  live_B = jnp.ones((B,), bool) if live_B is None else live_B.astype(bool)
  args = (state, prompts_BxP, prompt_mask_BxP.astype(bool), rng, live_B,
          first_row + jnp.arange(B))
  if slots and params.record_routes:
    raise ValueError("record_routes: continuous batching (slots) does not record routes yet; "
                     "use waves (slots=0)")
  if slots:
    decode = functools.partial(continuous.decode_slots, graphdef, params=params,
                               segments=segments, slots=slots, shared=shared)
  else:
    decode = functools.partial(_decode, graphdef, params=params, segments=segments,
                               shared=shared)
  if mesh is None or mesh.shape.get("data", 1) == 1:
    return decode(*args)
  if B % mesh.shape["data"]:
    raise ValueError(f"{B} prompt rows do not split over the mesh's {mesh.shape['data']} data "
                     "devices: pad them first (generate(devices=...) does)")
  rows, whole = PartitionSpec("data"), PartitionSpec()
  return jax.shard_map(decode, mesh=mesh, in_specs=(whole, rows, rows, whole, rows, rows),
                       out_specs=rows, axis_names={"data"}, check_vma=False)(*args)


def _decode(graphdef, state, prompts_BxP, prompt_mask_BxP, rng, live_B, rows_B, *,
            params: SamplingParams, segments: int, shared: int = 0):
  """Prefill and decode loop for one device's rows (rows_B: their indices in the batch);
  shared: decoding.prefill's."""
  model = nnx.merge(graphdef, state)
  routes.check(model.cfg, params)
  B, P = prompts_BxP.shape
  N, n, R = params.max_new_tokens, params.n, B * params.n
  rows_R = (rows_B[:, None] * n + jnp.arange(n)).reshape(R)  # sample j of prompt i: i*n + j
  prompt_pos_BxP = positions_from_mask(prompt_mask_BxP)

  # The n samples of a prompt share one prefill; the cache is copied after it.
  with moe.recording() as record:
    last_BxD, cache, kv_valid = prefill(model, prompts_BxP, prompt_mask_BxP, shared)
  widen = lambda x: jnp.repeat(x, n, axis=0)  # noqa: E731
  # Routing replay's record: the prompts' routes, then one response column a step.
  recorded = ((widen(routes.of_call(record, prompt_mask_BxP)), routes.unrecorded(R, N, model.cfg))
              if params.record_routes else ())
  cache, kv_valid, logits = jax.tree.map(widen, (cache, kv_valid, model.step_logits(last_BxD)))

  eos = jnp.asarray(params.eos_ids or (-1,), jnp.int32)
  tok, logp = pick(logits, jax.random.fold_in(rng, 0), params, rows_R)
  out_tokens = jnp.full((R, N), params.pad_id, jnp.int32).at[:, 0].set(tok)
  out_logp = jnp.zeros((R, N), jnp.float32).at[:, 0].set(logp)
  out_mask = jnp.zeros((R, N), bool).at[:, 0].set(True)
  done = jnp.isin(tok, eos) | ~widen(live_B)
  pos = widen(prompt_pos_BxP[:, -1] + 1)

  def body(carry):
    step, cache, kv_valid, tok, pos, done, out_tokens, out_logp, out_mask, *recorded = carry
    slot = P + step - 1  # where the previous token's K/V go
    kv_valid = jax.lax.dynamic_update_slice(kv_valid, jnp.ones((R, 1), bool), (0, slot))
    with moe.recording() as record:
      hidden, cache = model(tok[:, None], pos[:, None], kv_valid, cache=cache, slot0=slot)
    if recorded:  # the routes of the token just fed: response column step - 1
      recorded = [recorded[0], jax.lax.dynamic_update_slice(
          recorded[1], routes.of_call(record, ~done[:, None]), (0, step - 1, 0, 0))]
    tok, logp = pick(model.step_logits(hidden[:, 0]), jax.random.fold_in(rng, step), params,
                      rows_R)
    tok = jnp.where(done, params.pad_id, tok)
    write = lambda out, x: jax.lax.dynamic_update_slice(out, x[:, None], (0, step))  # noqa: E731
    out_tokens = write(out_tokens, tok)
    out_logp = write(out_logp, jnp.where(done, 0.0, logp))
    out_mask = write(out_mask, ~done)
    done = done | jnp.isin(tok, eos)
    return (step + 1, cache, kv_valid, tok, pos + 1, done, out_tokens, out_logp, out_mask,
            *recorded)

  # The cache grows between segments of the decode loop, so early steps do not read (and
  # mask) slots that cannot hold anything yet; each segment is its own compiled loop.
  # Where the kernel attends (it skips the unfilled tail) one loop over the whole cache.
  carry = (jnp.int32(1), cache, kv_valid, tok, pos, done, out_tokens, out_logp, out_mask,
           *recorded)
  for end in segment_ends(N, 1 if kernel_attends(model) else segments):
    step, cache, kv_valid, *rest = carry
    cache, kv_valid = grow(cache, kv_valid, P + end)
    cond = lambda c, end=end: (c[0] < end) & ~jnp.all(c[5])  # noqa: E731
    carry = jax.lax.while_loop(cond, body, (step, cache, kv_valid, *rest))
  out_tokens, out_logp, out_mask, *recorded = carry[6:]

  return outputs(widen(prompts_BxP), widen(prompt_mask_BxP), out_tokens, out_logp, out_mask,
                 recorded or None)


def _partly_elsewhere(x) -> bool:
  """Whether x is a jax array that other processes hold part of (not readable here)."""
  return isinstance(x, jax.Array) and not x.is_fully_addressable


def _check_left_padded(mask):
  """The first token is sampled after the last column: a right-padded row would continue
  from a pad position, silently."""
  if _partly_elsewhere(mask):
    return  # another process holds part of it (the workers pad through the data loader)
  mask = np.asarray(mask, bool)
  if mask.ndim != 2:
    raise ValueError(f"prompts: the mask must be [batch, prompt_len], got shape {mask.shape}")
  # Left-padded: no real token before a pad, and the last column real (a non-empty prompt).
  bad = ~mask[:, -1] | np.any(mask[:, :-1] & ~mask[:, 1:], axis=1)
  if bad.any():
    raise ValueError(f"prompts: mask row {int(np.argmax(bad))} is not left-padded (pads must "
                     "come first and the prompt must end at the last column; see left_pad)")


def generate(graphdef, state, prompts, params: SamplingParams, *, rng=None, devices=None,
             slots: int = 0):
  """Samples continuations.

  Args:
    graphdef, state: an hflax causal LM (`hflax.models.create` or `load_checkpoint`).
    prompts: a list of token-id lists, or a (tokens [B, P], mask [B, P]) pair already
      left-padded.
    params: the SamplingParams (static: each distinct value compiles once per shape).
    rng: a jax PRNG key (needed unless greedy).
    devices: generate data-parallel over these devices: the prompt rows are split over
      them (padded with finished copies when they do not divide) and the weights are
      replicated on each; `replicate(state, devices)` places them once, so that calls do
      not copy them. On a CPU host, one device per core (`jax_num_cpu_devices`) puts
      every core to work on large batches. Default: wherever the inputs are.
    slots: continuous batching with this many decode slots per device (0: off); the
      result is the same, rows of very different lengths are done sooner.
  Returns:
    A dict of arrays with B * n rows: prompts/prompt_mask [., P], responses/response_mask
    and rollout_log_probs [., max_new_tokens], input_ids/attention_mask/position_ids
    [., P + max_new_tokens], response_length [.]. response_mask covers the end token.
  """
  if isinstance(prompts, tuple):
    tokens, mask = prompts
    _check_left_padded(mask)
  else:
    tokens, mask = left_pad(prompts, params.pad_id)
  if rng is None:
    if not params.greedy:
      raise ValueError("sampling with temperature > 0 needs an rng key")
    rng = jax.random.key(0)
  _check_slots(slots)
  if devices is None or len(devices) == 1:
    tokens, mask, cut = without_shared_padding(tokens, mask)
    # A shared prefix is prefilled for one row: its routes would need spreading out.
    shared = 0 if params.record_routes else shared_prefix_length(tokens, mask)
    if devices:
      state = placed(state, jax.sharding.SingleDeviceSharding(devices[0]))
      tokens, mask = jax.device_put((tokens, mask), devices[0])
    graphdef, state = for_decoding(graphdef, state)
    out = _generate(graphdef, state, jnp.asarray(tokens, jnp.int32), jnp.asarray(mask, bool),
                    rng, params=params, segments=decode_segments(params.max_new_tokens),
                    slots=_waiting_slots(slots, len(tokens) * params.n),
                    shared=shared)
    return with_columns_back(out, cut, params.n)
  mesh = _rows_mesh(devices)
  return generate_over_rows(graphdef, replicate(state, devices), np.asarray(tokens, np.int32),
                            np.asarray(mask, bool), rng, params, mesh, slots=slots)


def shared_padding_cut(mask_BxT, prompt_width: int | None = None) -> int:
  """How many leading columns of left-padded prompts (the first `prompt_width` columns,
  default all) every row pads, less those that keep the longest prompt's length_bucket
  (a few widths compile, not one per batch). 0 for a mask another process holds
  part of: the processes holding it must pick one width."""
  if _partly_elsewhere(mask_BxT):
    return 0
  P = mask_BxT.shape[1] if prompt_width is None else prompt_width
  used = np.asarray(mask_BxT, bool)[:, :P].any(axis=0)
  first = int(np.argmax(used)) if used.any() else P
  return P - min(P, length_bucket(P - first))


SHARED_PREFIX_STEP = 8


def shared_prefix_length(tokens_BxP, mask_BxP, step: int = SHARED_PREFIX_STEP) -> int:
  """How many first real tokens every left-padded prompt row has in common, less any
  that would leave a row with none after them, rounded down to a multiple of `step` (a
  few widths compile, not one per batch): what decoding.prefill computes once. 0 for one
  row, or for a mask another process holds part of (its processes must agree)."""
  if _partly_elsewhere(tokens_BxP) or _partly_elsewhere(mask_BxP) or len(mask_BxP) < 2:
    return 0
  tokens, mask = np.asarray(tokens_BxP), np.asarray(mask_BxP, bool)
  P = tokens.shape[1]
  lengths = mask.sum(axis=1)
  shortest = int(lengths.min())
  if shortest < 2:
    return 0
  # Each row's first `shortest` real tokens, side by side: row i's start at P - len_i.
  firsts = np.take_along_axis(tokens, (P - lengths)[:, None] + np.arange(shortest), axis=1)
  differs = np.any(firsts != firsts[:1], axis=0)
  common = int(np.argmax(differs)) if differs.any() else shortest
  return min(common, shortest - 1) // step * step


def without_shared_padding(tokens_BxP, mask_BxP):
  """The prompts less their leading columns that are padding in every row
  (`shared_padding_cut`): prompts padded to a config's max_prompt_length would otherwise
  be prefilled over those columns, and every decode step would read (and mask) their
  cache slots. Exact: no row attends to a pad column and positions count real tokens
  only. Returns the trimmed tokens and mask, and the columns cut (None when none are;
  given back by with_columns_back)."""
  cut = shared_padding_cut(mask_BxP)
  if cut == 0:
    return tokens_BxP, mask_BxP, None
  return tokens_BxP[:, cut:], mask_BxP[:, cut:], tokens_BxP[:, :cut]


def with_columns_back(out: dict, cut_BxC, n: int) -> dict:
  """The sampler's result at the caller's prompt width: the cut columns (padding in every
  row) put back in front of each sample's prompt fields, as if generated untrimmed."""
  if cut_BxC is None:
    return out
  head = np.repeat(np.asarray(cut_BxC, np.int32), n, axis=0)  # sample j of prompt i: i*n + j
  none = np.zeros(head.shape, bool)
  front = {"prompts": head, "input_ids": head, "prompt_mask": none, "attention_mask": none,
           "position_ids": np.zeros(head.shape, np.int32)}
  if "routes" in out:
    front["routes"] = np.full(head.shape + out["routes"].shape[2:], routes.UNRECORDED, np.int32)
  return {k: jnp.concatenate([front[k], v], axis=1) if k in front else v
          for k, v in out.items()}


def _waiting_slots(slots: int, rows: int) -> int:
  """slots, or 0 when a device's rows all fit in them: with no row ever waiting for a
  slot, the wave program decodes the same tokens without the per-row bookkeeping."""
  return int(slots) if slots < rows else 0


def _check_slots(slots):
  if not isinstance(slots, (int, np.integer)) or isinstance(slots, bool) or slots < 0:
    raise ValueError(f"slots must be an integer >= 0 (0: no continuous batching), got {slots!r}")


def generate_over_rows(graphdef, state, tokens_BxP, mask_BxP, rng, params: SamplingParams,
                       mesh: Mesh, wave_rows: int = 0, collect=None, slots: int = 0) -> dict:
  """Generation split over the rows of `mesh`'s "data" axis (state already placed on it),
  in waves of `wave_rows` prompt rows (0: one wave of all of them); with `slots`, each
  device decodes its rows of a wave continuously in that many slots (sequences, n per
  prompt), the actor's max_num_seqs, so one wave of all rows is then the natural choice.

  The prompts are padded to a whole number of waves, each a multiple of the data width,
  with finished copies of real rows (never empty, so no NaN); each wave's KV cache is
  freed when its program ends, and `collect` (e.g. a device_put to the controller's
  home) takes its rows as they come. Rows draw by their index in the whole batch, so the
  waves draw what one call would have. Returns B * n rows, the padding's dropped.
  """
  _check_slots(slots)
  graphdef, state = for_decoding(graphdef, state)
  tokens_BxP, mask_BxP, cut = without_shared_padding(tokens_BxP, mask_BxP)
  count = tokens_BxP.shape[0]
  size = wave_rows or count
  size += -size % mesh.shape["data"]
  pad = -count % size
  take = np.arange(count + pad) % count  # padding rows repeat real ones
  live = np.arange(count + pad) < count
  rows = NamedSharding(mesh, PartitionSpec("data"))
  slots = _waiting_slots(slots, size // mesh.shape["data"] * params.n)
  segments = decode_segments(params.max_new_tokens)
  shared = 0 if params.record_routes else shared_prefix_length(tokens_BxP, mask_BxP)
  collect = collect or (lambda x: x)
  waves = []
  for start in range(0, count + pad, size):
    pick = take[start:start + size]
    tokens, mask, live_B = jax.device_put(
        (tokens_BxP[pick], mask_BxP[pick], live[start:start + size]), rows)
    waves.append(collect(_generate(graphdef, state, tokens, mask, rng, params=params,
                                   segments=segments, live_B=live_B, mesh=mesh,
                                   first_row=start, slots=slots, shared=shared)))
  out = {k: jnp.concatenate([w[k] for w in waves]) if len(waves) > 1 else waves[0][k]
         for k in waves[0]}
  out = {k: v[:count * params.n] for k, v in out.items()} if pad else out
  return with_columns_back(out, cut, params.n)


def _rows_mesh(devices) -> Mesh:
  devices = list(devices)
  if len(set(devices)) != len(devices):
    raise ValueError(f"generate: devices has repeats: {devices}")
  return Mesh(np.asarray(devices), ("data",))


def replicate(state, devices):
  """The model state with a full copy on each of `devices` (a no-op when it already is)."""
  return placed(state, NamedSharding(_rows_mesh(devices), PartitionSpec()))


def placed(state, sharding):
  """state laid out as `sharding`, its arrays already so kept as the same objects: a
  device_put returns new ones, and the decoding copy kept for the last weights
  (hflax.platforms.decoding) is found by the arrays' identity."""
  def put(x):
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
      return x
    return jax.device_put(x, sharding)
  return jax.tree.map(put, state)


def compiled_variants() -> int:
  """How many programs the sampler has compiled so far (one per shape and params)."""
  return _generate._cache_size()
