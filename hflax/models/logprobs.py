"""Per-token log-probs and entropy under a model, never holding [B, T, V] float32 at once.

The vocabulary projection runs over sequence chunks (hflax/models/chunked_head.py: a loop
over the live chunks whose backward pass recomputes each chunk's logits, or on CPU reads
the forward's while they fit chunked_head.KEPT_LOGITS_BYTES), so the forward pass and its
gradient keep one chunk's [B, chunk, V] logits alive, not the whole sequence's, or on CPU
at most that many bytes of them. A chunk holds about chunked_head.BLOCK_TOKENS tokens (B x chunk) unless the
caller sets `chunk`, its width in columns.
"""
from __future__ import annotations

import jax.numpy as jnp

from hflax import platforms
from hflax.models.chunked_head import chunk_columns, chunked_log_probs
from hflax.models.transformer import DecoderLM, forward

# Pieces a chunk is cut into past the whole chunks a count fills (chunked_log_probs): a
# packed micro-batch scores a data-dependent number of tokens, and its last chunk of 512
# computed every row, on average half of them past the count. SmolLM2-135M, bf16: see
# bench/README.md.
COUNT_PIECES = 4


def hidden_log_probs(model, hidden_BxTxD, targets_BxT, *, temperature: float = 1.0,
                     chunk: int | None = None, count=None):
  """Log-probs of `targets` given hidden states, projected to the vocabulary chunk by chunk.

  count (an int or a traced scalar): only the first `count` positions are needed; chunks
  wholly past it are skipped (forward and backward) and read 0, and so are the pieces
  (a COUNT_PIECES-th of a chunk) of the last chunk it reaches into that lie past it. A
  packed pass sizes its positions for the most response tokens a micro-batch could hold,
  and usually holds far fewer: the LM head over 49k ids is most of the cost of a
  position."""
  fused = maybe_hidden_log_probs(model, hidden_BxTxD, targets_BxT, temperature)
  if fused is not None:  # the fused GPU kernel (hflax.platforms.gpu); never on CPU unless forced
    return fused
  B, T, D = hidden_BxTxD.shape
  chunk = chunk_columns(B, T, chunk)
  pad = -T % chunk
  hidden = jnp.pad(hidden_BxTxD, ((0, 0), (0, pad), (0, 0)))
  targets = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
  n = (T + pad) // chunk
  hidden_NxBxCxD = hidden.reshape(B, n, chunk, D).swapaxes(0, 1)
  targets_NxBxC = targets.reshape(B, n, chunk).swapaxes(0, 1)

  # With a count, the last live chunk runs piece by piece, as far as the count reaches.
  pieces = COUNT_PIECES if count is not None and chunk % COUNT_PIECES == 0 else 1
  width = chunk // pieces
  live = n * pieces if count is None else (count + width - 1) // width
  # The head's weights are made ready (cast) once, outside the chunk loop.
  logp, ent = chunked_log_probs(model.logits_projection(), hidden_NxBxCxD, targets_NxBxC,
                                live, temperature, pieces)
  unchunk = lambda x: x.swapaxes(0, 1).reshape(B, n * chunk)[:, :T]  # noqa: E731
  return unchunk(logp), unchunk(ent)


def sequence_log_probs(graphdef, state, tokens_BxT, mask_BxT, *, temperature: float = 1.0,
                       chunk: int | None = None, last: int | None = None, compute_kernels=None,
                       routes_BxTxLxK=None):
  """Teacher-forced log p(tokens[:, t] | tokens[:, :t]) and entropy at t, shape [B, T].

  Column 0 (no context) and masked positions are 0. Response log-probs of a rollout with
  prompt width P are `log_probs[:, P:]`, or, cheaper, `last=T - P`: then only the last
  `last` columns ([B, last]) are projected onto the vocabulary, which a prompt-heavy batch
  would otherwise spend most of its LM-head matmuls and log-softmax on. compute_kernels:
  see transformer.compute_kernels. routes_BxTxLxK: a mixture of experts' routes to replay
  (transformer.forward).
  """
  model, hidden = forward(graphdef, state, tokens_BxT, mask_BxT, compute_kernels=compute_kernels,
                          routes_BxTxLxK=routes_BxTxLxK)
  T = tokens_BxT.shape[1]
  whole = last is None or last >= T
  start = 1 if whole else T - last  # the first column scored
  logp, ent = hidden_log_probs(model, hidden[:, start - 1:-1], tokens_BxT[:, start:],
                               temperature=temperature, chunk=chunk)
  keep = mask_BxT[:, start:].astype(bool) & mask_BxT[:, start - 1:-1].astype(bool)
  logp, ent = jnp.where(keep, logp, 0.0), jnp.where(keep, ent, 0.0)
  if not whole:
    return logp, ent
  zero = jnp.zeros_like(logp[:, :1])
  return jnp.concatenate([zero, logp], axis=1), jnp.concatenate([zero, ent], axis=1)


def packed_log_probs(graphdef, state, tokens_RxL, segment_ids_RxL, response_index_BxW,
                     response_valid_BxW, *, temperature: float = 1.0, chunk: int | None = None,
                     positions_RxL=None, prefix_ids_RxL=None, before_index_BxW=None,
                     compute_kernels=None):
  """sequence_log_probs(..., last=W) of sequences packed into rows (hflax.controller.packing).

  tokens/segment ids [R, L] are the packed rows; response_index [B, W] is the flat packed
  index (r * L + l) of each response token. Only response tokens are projected onto the
  vocabulary, from the hidden state of the token before each: before_index [B, W] (a
  response packed after a shared prompt, prefix_ids, is predicted from the prompt's last
  token), by default the one before it in its packed row. Returns [B, W], 0 where
  response_valid is False. compute_kernels: see transformer.compute_kernels.
  """
  model, hidden = forward(graphdef, state, tokens_RxL, segment_ids_RxL > 0,
                          segment_ids_BxT=segment_ids_RxL, positions_BxT=positions_RxL,
                          prefix_ids_BxT=prefix_ids_RxL, compute_kernels=compute_kernels)
  flat_hidden = hidden.reshape(-1, hidden.shape[-1])
  before = (jnp.maximum(response_index_BxW - 1, 0) if before_index_BxW is None
            else before_index_BxW)
  # Only the valid response tokens go through the LM head: [B, W] is padded to the longest
  # response (a batch of short answers and one 128-token ramble is mostly padding), while
  # every valid token sits in the packed rows, so R * L bounds their count statically.
  B, W = response_index_BxW.shape
  (scored,) = jnp.nonzero(response_valid_BxW.reshape(-1), size=min(B * W, tokens_RxL.size),
                          fill_value=B * W)  # fill: past the end, dropped below
  at = jnp.minimum(scored, B * W - 1)
  logp, ent = hidden_log_probs(
      model, jnp.take(flat_hidden, before.reshape(-1)[at], axis=0)[None],
      jnp.take(tokens_RxL.reshape(-1), response_index_BxW.reshape(-1)[at], axis=0)[None],
      temperature=temperature, chunk=chunk, count=jnp.count_nonzero(response_valid_BxW))
  scatter = lambda x: jnp.zeros(B * W, x.dtype).at[scored].set(x[0], mode="drop").reshape(B, W)  # noqa: E731
  return scatter(logp), scatter(ent)


def _kernel_projection(model):
  """(W, transposed, compute dtype, logits dtype) exactly as DecoderLM.logits uses them."""
  if not isinstance(model, DecoderLM) or model.head != "lm":
    return None
  if model.lm_head is None:  # tied: embed [V, D] in hidden's dtype, f32 logits
    return model.embed[...], True, None, "float32"
  if model.lm_head.bias is not None or getattr(model.lm_head, "packed", False):
    return None  # a packed decoding copy's head: Dense computes it (the CPU kernel)
  dtype = model.lm_head.dtype  # Dense computes and returns its dtype; logits() upcasts
  # A decoding copy stores the head [V, D], as the tied table is.
  return model.lm_head.kernel[...], getattr(model.lm_head, "out_in", False), dtype, dtype


def model_log_probs(model, hidden_BxTxD, targets_BxT, temperature: float = 1.0, **config):
  """hidden_log_probs through the fused kernel, or None where it does not apply."""
  head = _kernel_projection(model)
  if head is None or not isinstance(temperature, (int, float)):
    return None  # a traced temperature stays on the fallback: the kernel bakes it in
  w, transposed, dtype, logits_dtype = head
  B, T, D = hidden_BxTxD.shape
  dtype = dtype or hidden_BxTxD.dtype
  logp, ent = platforms.fused_log_probs(
      hidden_BxTxD.reshape(B * T, D).astype(dtype), w.astype(dtype), targets_BxT.reshape(B * T),
      temperature=temperature, transposed=transposed, logits_dtype=logits_dtype, **config)
  return logp.reshape(B, T), ent.reshape(B, T)


def maybe_hidden_log_probs(model, hidden_BxTxD, targets_BxT, temperature: float = 1.0):
  """The kernel's (log-probs, entropy) when HFLAX_LOGPROB_KERNEL's mode selects it, else None."""
  mode = platforms.fused_log_probs_mode()
  if mode is None:
    return None
  return model_log_probs(model, hidden_BxTxD, targets_BxT, temperature,
                         interpret=mode == "interpret")
