"""dense_dot and tied_logits: bf16 matmuls accumulated in float32, with hand-written gradients."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hflax.controller.training import train_compiler_options
from hflax.models.matmul import (HEAD_LEFT_ROWS, KERNEL_LEFT_ROWS, LOW_LEFT_MIN_ROWS,
                                 _weight_gradient, dense_dot, rows_by_kernel, step_logits,
                                 tied_head, tied_logits)
from hlo_dots import dot_operand_types
from jaxpr_casts import bfloat16_casts


def _float32_training_options() -> dict:
  """The options a float32 CPU training step compiles with; skips where there are none."""
  options = train_compiler_options(jax.devices(), "float32")
  if options is None:
    pytest.skip("no CPU training options here (HFLAX_CPU_YNN=0 or not a CPU backend)")
  return options


@pytest.mark.parametrize("w_shape", [(16, 8), (16, 2, 8)])
def test_bfloat16_dot_and_its_gradient_match_float32_on_rounded_inputs(w_shape):
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (2, 5, 16))
  w = jax.random.normal(k[1], w_shape)
  g = jax.random.normal(k[2], (2, 5) + w_shape[1:])
  rounded = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731

  def loss(dot, x, w):
    return jnp.sum(dot(x, w).astype(jnp.float32) * g)

  low = lambda x, w: dense_dot(x, w, jnp.bfloat16)  # noqa: E731
  ref = lambda x, w: jnp.tensordot(rounded(x), rounded(w), axes=1)  # noqa: E731
  assert low(x, w).dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(low(x, w), np.float32), np.asarray(ref(x, w)),
                             rtol=1e-2, atol=1e-2)  # one bf16 rounding of the result
  (dx, dw), (rx, rw) = (jax.grad(loss, (1, 2))(f, x, w) for f in (low, ref))
  assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32  # master weights' gradient
  scale = lambda a: float(jnp.max(jnp.abs(a)))  # noqa: E731
  assert scale(dx - rx) <= 2e-2 * scale(rx) and scale(dw - rw) <= 2e-2 * scale(rw)


def test_float32_is_a_plain_dot():
  x, w = jnp.ones((3, 4)), jnp.arange(8.0).reshape(4, 2)
  np.testing.assert_array_equal(np.asarray(dense_dot(x, w, "float32")), np.asarray(x @ w))


def test_the_float32_gradient_matches_autodiff_and_both_its_matmuls_go_to_the_library():
  """Autodiff's weight gradient contracts x's rows: XLA:CPU ran it as its generic dot,
  outside the matmul library a float32 training step compiles for (a replayed SmolLM2
  update took 12.26 s that way against 11.84 s)."""
  k = jax.random.split(jax.random.key(3), 3)
  x, w = jax.random.normal(k[0], (448, 576)), jax.random.normal(k[1], (576, 1536))
  g = jax.random.normal(k[2], (448, 1536))
  mine, ref = (jax.jit(jax.grad(lambda x, w, f=f: jnp.sum(f(x, w) * g), (0, 1)))
               for f in (lambda x, w: dense_dot(x, w, jnp.float32), lambda x, w: x @ w))
  for a, b in zip(mine(x, w), ref(x, w)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-3)
  options = _float32_training_options()
  text = mine.lower(x, w).compile(options).as_text()
  dots = re.findall(r"(ROOT )?%[\w.\-]+ = \S+ dot\(", text)
  # Each dot is the root of its own fused computation (the library's); a dot of the
  # program itself is XLA's generic kernel.
  assert len(dots) == 2 and all(dots), dots


def test_every_matmul_of_the_bfloat16_gradient_reads_bfloat16():
  """The weight gradient contracts x's rows; left to XLA, x^T folded into the dot and the
  dot ran widened to float32 (about 10x slower on a CPU with AMX)."""
  x = jnp.ones((448, 576), jnp.bfloat16)
  w, g = jnp.ones((576, 1536)), jnp.ones((448, 1536))
  grad = jax.jit(jax.grad(lambda x, w: jnp.sum(dense_dot(x, w, jnp.bfloat16) * g), (0, 1)))
  reads = dot_operand_types(grad.lower(x, w).compile().as_text())  # dx and dw (the loss
  # value is not asked for: its forward dot is dead code)
  assert len(reads) == 2 and all(r == ("bf16", "bf16") for r in reads), reads


def test_the_bfloat16_gradient_casts_the_kernel_once_and_is_unchanged_by_it():
  """The backward's dx reads the bfloat16 kernel the forward cast: cast again there, an
  update's micro-batch loop converted every float32 kernel twice per micro-batch (XLA
  hoists neither cast out of the loop). The gradients stay those of casting twice."""
  k = jax.random.split(jax.random.key(5), 3)
  x = jax.random.normal(k[0], (24, 16)).astype(jnp.bfloat16)
  w, g = jax.random.normal(k[1], (16, 12)), jax.random.normal(k[2], (24, 12))
  loss = lambda x, w: jnp.sum(dense_dot(x, w, jnp.bfloat16).astype(jnp.float32) * g)  # noqa: E731
  jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w).jaxpr
  assert sum(bfloat16_casts(jaxpr, {w.shape})) == 1

  def twice(x, w):  # the two casts, written out: forward and backward each cast w
    @jax.custom_vjp
    def dot(x, w):
      return jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)

    def backward(saved, ct):  # the backward before the change, the same dots
      x, w = saved
      ct = ct.astype(x.dtype)
      dx = jax.lax.dot_general(ct, w.astype(x.dtype), (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
      return dx.astype(x.dtype), _weight_gradient(x, ct, w.shape, w.dtype)

    dot.defvjp(lambda x, w: (dot(x, w), (x, w)), backward)
    return jnp.sum(dot(x, w).astype(jnp.float32) * g)

  twice_jaxpr = jax.make_jaxpr(jax.grad(twice, (0, 1)))(x, w).jaxpr
  assert sum(bfloat16_casts(twice_jaxpr, {w.shape})) == 2
  for got, want in zip(jax.jit(jax.grad(loss, (0, 1)))(x, w),
                       jax.jit(jax.grad(twice, (0, 1)))(x, w)):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_tied_logits_and_their_gradient_match_float32_on_rounded_inputs(dtype):
  k = jax.random.split(jax.random.key(1), 3)
  h = jax.random.normal(k[0], (2, 7, 32)).astype(dtype)
  embed = jax.random.normal(k[1], (300, 32))
  g = jax.random.normal(k[2], (2, 7, 300))
  rounded = lambda a: a.astype(dtype).astype(jnp.float32)  # noqa: E731

  def loss(fn, h, embed):
    return jnp.sum(fn(h, embed) * g)

  low = lambda h, e: tied_logits(h, e, dtype)  # noqa: E731
  ref = lambda h, e: jnp.einsum("btd,vd->btv", rounded(h), rounded(e))  # noqa: E731
  assert low(h, embed).dtype == jnp.float32  # the log-softmax reads float32 logits
  np.testing.assert_allclose(np.asarray(low(h, embed)), np.asarray(ref(h, embed)),
                             rtol=1e-5, atol=1e-4)
  (dh, de), (rh, re_) = (jax.grad(loss, (1, 2))(f, h, embed) for f in (low, ref))
  assert dh.dtype == dtype and de.dtype == jnp.float32
  # bf16: the cotangent is rounded once to bf16 before both matmuls
  tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
  scale = lambda a: float(jnp.max(jnp.abs(a)))  # noqa: E731
  assert scale(dh.astype(jnp.float32) - rh) <= tol * scale(rh)
  assert scale(de - re_) <= tol * scale(re_)
  if dtype == jnp.bfloat16:
    grad = jax.jit(jax.grad(lambda h, e: loss(low, h, e), (0, 1)))
    reads = dot_operand_types(grad.lower(h, embed).compile().as_text())
    assert len(reads) == 2 and all(r == ("bf16", "bf16") for r in reads), reads


def test_tied_head_casts_once_and_computes_what_tied_logits_does():
  k = jax.random.split(jax.random.key(2), 3)
  h = jax.random.normal(k[0], (2, 7, 32)).astype(jnp.bfloat16)
  embed = jax.random.normal(k[1], (300, 32))
  g = jax.random.normal(k[2], (2, 7, 300))

  def loss(fn, h, embed):
    return jnp.sum(fn(h, embed) * g)

  head = lambda h, e: tied_head(e, jnp.bfloat16)(h)  # noqa: E731
  plain = lambda h, e: tied_logits(h, e, jnp.bfloat16)  # noqa: E731
  np.testing.assert_array_equal(np.asarray(head(h, embed)), np.asarray(plain(h, embed)))
  for got, want in zip(jax.grad(loss, (1, 2))(head, h, embed),
                       jax.grad(loss, (1, 2))(plain, h, embed)):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_the_float32_tied_head_gradient_reads_the_cotangent_as_it_lies():
  """The table's gradient contracts the [R, V] cotangent over its rows. Autodiff's einsum
  wrote it out transposed for the matmul library first; XLA:CPU's generic dot reads it as
  it is (SmolLM2's replayed fp32 update: 10.57 s against 10.92)."""
  k = jax.random.split(jax.random.key(4), 3)
  h, embed = jax.random.normal(k[0], (2, 32, 16)), jax.random.normal(k[1], (300, 16))
  g = jax.random.normal(k[2], (2, 32, 300))
  mine, ref = (jax.jit(jax.grad(lambda h, e, f=f: jnp.sum(f(h, e) * g), (0, 1)))
               for f in (lambda h, e: tied_logits(h, e, jnp.float32),
                         lambda h, e: jnp.einsum("btd,vd->btv", h, e)))
  for a, b in zip(mine(h, embed), ref(h, embed)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  options = _float32_training_options()
  transposed = r"f32\[300,(64|2,32)\]"
  assert re.search(transposed, ref.lower(h, embed).compile(options).as_text())
  assert not re.search(transposed, mine.lower(h, embed).compile(options).as_text())


def _dot_operands(fn, *args):
  """(left operand's shape, right operand's shape) of every dot XLA compiles for fn."""
  text = jax.jit(fn).lower(*args).compile().as_text()
  shapes = dict(re.findall(r"%([\w.\-]+) = \w+\[([\d,]*)\]", text))
  return [(shapes[a], shapes[b]) for a, b in re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", text)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_few_rows_take_the_kernel_on_the_left_on_cpu(dtype):
  """rows_by_kernel computes x w^T; up to KERNEL_LEFT_ROWS rows (bfloat16 from
  LOW_LEFT_MIN_ROWS) XLA:CPU gets the kernel as the dot's left operand (not folded back by
  the transpose after it), else the rows; the result equals the plain product to
  rounding."""
  k = jax.random.split(jax.random.key(0), 2)
  w = jax.random.normal(k[0], (96, 40), dtype)
  pref = jnp.float32 if dtype == "bfloat16" else None
  assert 8 < LOW_LEFT_MIN_ROWS < KERNEL_LEFT_ROWS
  low = dtype == "float32"
  for rows, kernel_left in [(8, low), (LOW_LEFT_MIN_ROWS - 1, low), (LOW_LEFT_MIN_ROWS, True),
                            (KERNEL_LEFT_ROWS, True), (KERNEL_LEFT_ROWS + 8, False)]:
    x = jax.random.normal(k[1], (rows, 40), dtype)
    fn = lambda x, w: rows_by_kernel(x, w, pref) * 2.0  # noqa: E731 (a consumer after it)
    got = fn(x, w)
    assert got.shape == (rows, 96)
    want = 2.0 * jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32).T,
                         precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-5,
                               atol=1e-4)
    operands = _dot_operands(fn, x, w)
    left = kernel_left and jax.default_backend() == "cpu"
    assert operands == [("96,40", f"{rows},40") if left
                        else (f"{rows},40", "96,40")], (rows, operands)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_generation_steps_head_takes_its_table_on_the_left_up_to_its_own_limit(dtype):
  """step_logits is tied_logits' product: with the [V, D] table the dot's left operand up
  to HEAD_LEFT_ROWS rows on CPU (a limit below KERNEL_LEFT_ROWS: the token pick reads the
  [V, R] product through a transposing copy that grows with the rows; bfloat16 from
  LOW_LEFT_MIN_ROWS rows), else the rows on the left (the very same program as
  tied_logits)."""
  assert LOW_LEFT_MIN_ROWS <= HEAD_LEFT_ROWS < KERNEL_LEFT_ROWS
  k = jax.random.split(jax.random.key(1), 2)
  table = jax.random.normal(k[0], (96, 40), jnp.float32)
  for rows in (2, LOW_LEFT_MIN_ROWS - 1, HEAD_LEFT_ROWS, HEAD_LEFT_ROWS + 1):
    hidden = jax.random.normal(k[1], (rows, 40), jnp.float32).astype(dtype)
    fn = lambda h, t: step_logits(h, t, dtype)  # noqa: E731
    got = fn(hidden, table)
    want = tied_logits(hidden, table, dtype)
    assert got.dtype == jnp.float32 and got.shape == (rows, 96)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    left = (rows <= HEAD_LEFT_ROWS and jax.default_backend() == "cpu"
            and (dtype == "float32" or rows >= LOW_LEFT_MIN_ROWS))
    assert _dot_operands(fn, hidden, table) == [("96,40", f"{rows},40") if left
                                                else (f"{rows},40", "96,40")], rows
    if not left:
      lowered = lambda f: jax.jit(f).lower(hidden, table).as_text()  # noqa: E731
      assert lowered(fn) == lowered(lambda h, t: tied_logits(h, t, dtype))
