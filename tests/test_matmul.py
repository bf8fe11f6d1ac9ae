"""dense_dot: bf16 matmuls accumulated in float32, with a hand-written gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hflax.models.matmul import dense_dot


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
