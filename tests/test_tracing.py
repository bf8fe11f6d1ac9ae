"""A model call traces its layers' shared functions once, not once per layer, and computes
what it computed without that."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from hflax.models import ModelConfig, attention, create, transformer
from hflax.models.transformer import forward

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2)
SHARED = ("attention", "dense_dot", "_apply_rope", "_rms_norm")  # the jits' names


def _calls(jaxpr, found):
  """name -> the jaxprs of the jit calls of that name, anywhere in jaxpr."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("pjit", "jit"):
      found.setdefault(eqn.params["name"], []).append(eqn.params["jaxpr"])
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      _calls(sub, found)
  return found


def _loss(graphdef, state, tokens):
  _, hidden = forward(graphdef, state, tokens, jnp.ones_like(tokens))
  return jnp.sum(hidden.astype(jnp.float32) ** 2)


def test_layers_share_one_trace_per_model_call():
  graphdef, state = create(CFG)
  tokens = jnp.asarray(np.random.RandomState(0).randint(1, 64, (2, 12)), jnp.int32)
  calls = _calls(jax.make_jaxpr(lambda s: _loss(graphdef, s, tokens))(state).jaxpr, {})
  assert len(calls["attention"]) == CFG.num_layers
  assert len(calls["_apply_rope"]) == 2 * CFG.num_layers  # queries and keys
  assert len(calls["_rms_norm"]) == 2 * CFG.num_layers + 1  # two per layer, the final norm
  assert len(calls["dense_dot"]) >= 5 * CFG.num_layers  # q, k, v, o, the MLP's
  # One traced jaxpr per distinct call (shape, static arguments), the same in every layer.
  distinct = {name: len({id(j) for j in calls[name]}) for name in SHARED}
  assert distinct["attention"] == 1 and distinct["_rms_norm"] == 1
  assert distinct["_apply_rope"] == 2  # queries' and keys' head counts differ
  assert distinct["dense_dot"] <= 5  # q and o, k and v, the MLP's pair, down (and tied head)
  # A second call traces afresh (its own jit), so patched helpers and constants apply.
  again = _calls(jax.make_jaxpr(lambda s: _loss(graphdef, s, tokens))(state).jaxpr, {})
  assert {id(j) for j in again["attention"]}.isdisjoint(id(j) for j in calls["attention"])


def test_sharing_changes_no_value_or_gradient(monkeypatch):
  graphdef, state = create(CFG)
  tokens = jnp.asarray(np.random.RandomState(1).randint(1, 64, (2, 12)), jnp.int32)
  shared = jax.jit(jax.value_and_grad(lambda s: _loss(graphdef, s, tokens)))(state)

  monkeypatch.setattr(transformer, "one_trace_per_call", contextlib.nullcontext)
  alone = jax.jit(jax.value_and_grad(lambda s: _loss(graphdef, s, tokens)))(state)
  no_calls = _calls(jax.make_jaxpr(lambda s: _loss(graphdef, s, tokens))(state).jaxpr, {})
  assert not set(SHARED) & set(no_calls)  # the comparison really ran without sharing
  jax.tree.map(np.testing.assert_array_equal, shared, alone)


def test_patched_helper_applies_on_the_next_call(monkeypatch):
  graphdef, state = create(CFG.replace(attention="reference"))
  tokens = jnp.asarray(np.random.RandomState(2).randint(1, 64, (1, 8)), jnp.int32)
  run = lambda: jax.jit(lambda t: forward(graphdef, state, t, jnp.ones_like(t))[1])(tokens)  # noqa: E731
  before = run()
  seen = []
  real = attention.reference
  monkeypatch.setattr(attention, "reference", lambda *a: seen.append(a[0]) or real(*a) * 0)
  after = run()
  assert len(seen) == 1  # traced once for the three layers, with the patched helper
  assert isinstance(seen[0], jax.core.Tracer)
  assert not np.allclose(np.asarray(before), np.asarray(after))
  # An eager call runs op by op as before (no jit compiled per call): once per layer.
  seen.clear()
  forward(graphdef, state, tokens, jnp.ones_like(tokens))
  assert len(seen) == CFG.num_layers and not isinstance(seen[0], jax.core.Tracer)
