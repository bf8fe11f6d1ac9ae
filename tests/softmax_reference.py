"""The plain full-vocabulary log-softmax the chunked and fused log-prob paths are checked
against: autodiff of it is the reference gradient."""
import jax
import jax.numpy as jnp


def log_probs_from_logits(logits_BxTxV, targets_BxT, temperature: float = 1.0):
  """log softmax(logits / temperature)[target] and the entropy of that distribution."""
  logits = logits_BxTxV.astype(jnp.float32) / temperature
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets_BxT[..., None], axis=-1)[..., 0]
  probs = jnp.exp(logits - lse[..., None])
  entropy = lse - jnp.sum(probs * logits, axis=-1)
  return picked - lse, entropy
