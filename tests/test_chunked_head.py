"""The LM head's chunk loop (hflax/models/chunked_head.py): values and the hand-written
gradient against autodiff of a full log-softmax over the unchunked logits."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hflax.models import chunked_head
from hflax.models.chunked_head import BLOCK_TOKENS, chunk_columns, chunked_log_probs
from hflax.models.matmul import tied_head
from hlo_dots import dot_operand_types
from softmax_reference import log_probs_from_logits

N, B, C, D, V = 3, 2, 4, 16, 96


def inputs(dtype=jnp.float32):
  k = jax.random.split(jax.random.key(0), 5)
  hidden = jax.random.normal(k[0], (N, B, C, D), dtype)
  targets = jax.random.randint(k[1], (N, B, C), 0, V)
  embed = jax.random.normal(k[2], (V, D)) * 0.3
  bias = jax.random.normal(k[3], (V,))
  # Cotangents on both outputs: the entropy bonus trains through the entropy too.
  weights = jax.random.normal(k[4], (2, N, B, C))
  return hidden, targets, embed, bias, weights


def untied(embed, bias):  # an untied head with a bias: two arrays the closure holds
  return lambda h: h @ embed.T + bias


def objective(logp, ent, weights):
  return jnp.sum(weights[0] * logp) + jnp.sum(weights[1] * ent)


def assert_matches_the_full_softmax(chunked, keep, temperature):
  """chunked(hidden, embed, bias) -> objective over inputs(): its value and gradients
  against autodiff of the full log-softmax of the untied head, read 0 where keep [N, 1, C]
  is False. Returns the gradients."""
  hidden, targets, embed, bias, weights = inputs()

  def reference(h, e, b):
    logp, ent = log_probs_from_logits(untied(e, b)(h), targets, temperature)
    return objective(jnp.where(keep, logp, 0.0), jnp.where(keep, ent, 0.0), weights)

  got, grads = jax.jit(jax.value_and_grad(chunked, (0, 1, 2)))(hidden, embed, bias)
  want, ref_grads = jax.value_and_grad(reference, (0, 1, 2))(hidden, embed, bias)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
  return grads


@pytest.mark.parametrize("live", [3, 2, 0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_autodiff_of_the_full_softmax(live, temperature):
  _, targets, _, _, weights = inputs()

  def chunked(h, e, b):
    return objective(*chunked_log_probs(untied(e, b), h, targets, live, temperature), weights)

  keep = (jnp.arange(N) < live)[:, None, None]  # chunks past `live` read 0
  grads = assert_matches_the_full_softmax(chunked, keep, temperature)
  if live < N:  # dead chunks take no gradient
    assert not np.any(np.asarray(grads[0][live:]))


def test_live_can_be_traced_and_outputs_past_it_are_zero():
  hidden, targets, embed, bias, _ = inputs()
  fn = jax.jit(lambda h, n: chunked_log_probs(untied(embed, bias), h, targets, n, 1.0))
  logp, ent = fn(hidden, jnp.int32(1))
  full_logp, full_ent = log_probs_from_logits(untied(embed, bias)(hidden), targets)
  np.testing.assert_allclose(logp[0], full_logp[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ent[0], full_ent[0], rtol=1e-5, atol=1e-6)
  assert not np.any(np.asarray(logp[1:])) and not np.any(np.asarray(ent[1:]))


def test_bfloat16_tied_head_matches_float32_on_rounded_inputs():
  hidden, targets, embed, _, weights = inputs(jnp.bfloat16)
  embed = embed.astype(jnp.bfloat16).astype(jnp.float32)  # exactly representable

  def loss(dtype):
    def fn(h, e):
      return objective(*chunked_log_probs(tied_head(e, dtype), h.astype(dtype), targets, N,
                                          1.0), weights)
    return jax.jit(jax.value_and_grad(fn, (0, 1)))

  (low, (dh, de)), (high, (dh32, de32)) = loss(jnp.bfloat16)(hidden, embed), \
      loss(jnp.float32)(hidden.astype(jnp.float32), embed)
  np.testing.assert_allclose(low, high, rtol=2e-2)
  for g, r in ((dh, dh32), (de, de32)):
    err = np.abs(np.asarray(g, np.float32) - np.asarray(r)).max()
    assert err <= 0.05 * np.abs(np.asarray(r)).max()


def test_the_softmax_sums_stay_off_the_matmul_library():
  # On a real vocabulary XLA:CPU hands reductions to its matmul library (YNNPACK), which
  # ran sum(exp(z - max) * z) 30x slower than an XLA reduction (66 ms against about 2 for a
  # 128-token chunk of 49152 ids). The head's two sums go as one variadic reduction that
  # stays in XLA; of the [B, C] results only the max may go to the library.
  hidden, targets, _, _, weights = inputs()
  embed, bias = jnp.ones((49152, D)) * 0.01, jnp.zeros(49152)
  fn = jax.jit(jax.grad(lambda h, e: objective(
      *chunked_log_probs(untied(e, bias), h, targets, N, 1.0), weights), (0, 1)))
  text = fn.lower(hidden, embed).compile().as_text()
  library = re.findall(r"= (\w+\[[\d,]*\])\S* fusion\([^)]*\), kind=kCustom", text)
  assert library.count(f"f32[{B},{C}]") <= 1, library
  assert len(dot_operand_types(text)) == 4  # float32: logits, recomputed logits, two gradients


@pytest.mark.parametrize("dtype,kept_dots", [(jnp.bfloat16, 3), (jnp.float32, 4)])
def test_kept_logits_give_the_recomputed_gradients_bit_for_bit(monkeypatch, dtype, kept_dots):
  # On CPU in bf16 the forward keeps the chunks' logits (KEPT_LOGITS_BYTES) and the backward
  # reads them instead of recomputing: one matmul fewer per chunk, the same numbers.
  # float32 recomputes (it measured slower keeping them).
  hidden, targets, embed, _, weights = inputs(dtype)

  def run(h, e):  # 2 of the N = 3 chunks live: the third is never written nor read
    return objective(*chunked_log_probs(tied_head(e, dtype), h, targets, 2, 0.7), weights)

  def compiled():
    fn = jax.jit(jax.value_and_grad(run, (0, 1)))
    return fn, len(dot_operand_types(fn.lower(hidden, embed).compile().as_text()))

  kept, kept_dots_found = compiled()
  monkeypatch.setattr(chunked_head, "KEPT_LOGITS_BYTES", 0)  # too small: recompute
  recomputed, recomputed_dots = compiled()
  assert (kept_dots_found, recomputed_dots) == (kept_dots, 4)
  for a, b in zip(jax.tree.leaves(kept(hidden, embed)),
                  jax.tree.leaves(recomputed(hidden, embed))):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_a_chunk_holds_a_block_of_tokens_whatever_the_rows():
  # The head's backward matmuls contract over a chunk's tokens (rows x columns), so the
  # chunk's width follows the rows: one packed row gets BLOCK_TOKENS columns, 16 rows 1/16.
  assert chunk_columns(1, 10_000) == BLOCK_TOKENS
  assert chunk_columns(16, 10_000) == BLOCK_TOKENS // 16
  assert chunk_columns(1, 100) == 100  # never wider than the positions
  assert chunk_columns(4 * BLOCK_TOKENS, 100) == 1  # at least one column
  assert chunk_columns(16, 10_000, chunk=5) == 5  # the caller's width wins


@pytest.mark.parametrize("pieces,live", [(2, 0), (2, 3), (2, 6), (4, 5), (4, 12), (1, 2)])
def test_the_last_chunk_runs_piece_by_piece_as_far_as_live_reaches(pieces, live):
  # A packed pass scores a data-dependent count of tokens: its last live chunk projects
  # only the pieces of C // pieces columns the count reaches, at that width; every live
  # column's values and the gradients are those of the whole softmax.
  hidden, targets, embed, bias, weights = inputs()
  width = C // pieces
  widths = set()

  def recording(e, b):
    def head(h):
      widths.add(h.shape[1])  # at trace time: the widths the head is called at
      return untied(e, b)(h)
    return head

  def chunked(h, e, b):
    return objective(*chunked_log_probs(recording(e, b), h, targets, live, 0.7, pieces),
                     weights)

  keep = jnp.arange(N * C).reshape(N, 1, C) < live * width  # the columns live reaches
  assert_matches_the_full_softmax(chunked, keep, 0.7)
  assert widths == {C, width}
  head = recording(embed, bias)
  logp, _ = jax.jit(lambda h: chunked_log_probs(head, h, targets, live, 0.7, pieces))(hidden)
  past = np.arange(N * C).reshape(N, 1, C).repeat(B, 1) >= live * width
  assert not np.any(np.asarray(logp)[past])  # never computed past the live pieces
  with pytest.raises(ValueError, match="pieces=3 must divide"):
    chunked_log_probs(head, hidden, targets, 1, 1.0, 3)
