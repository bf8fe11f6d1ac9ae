"""hflax.platforms.decoding: the one seam the sampler and the hybrid engine ask for a
model's decoding copy, whatever the hardware."""
import types

import jax
import numpy as np
from flax import nnx

from hflax.models import ModelConfig, create
from hflax.platforms import decoding
from hflax.platforms.cpu import copy_modules, decoding_copy

CFG = dict(vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=1, num_heads=4,
           num_kv_heads=2, dtype="float32", param_dtype="float32")


def _split():
  return create(ModelConfig(**CFG), seed=3)


def test_cpu_devices_get_the_cpu_copy_and_the_rest_the_plain_path():
  assert decoding.decoding(jax.devices()[:2]) is decoding_copy
  gpu = types.SimpleNamespace(platform="gpu")
  assert decoding.decoding([gpu]) is decoding.PLAIN
  assert decoding.decoding([jax.devices()[0], gpu]) is decoding.PLAIN  # not every one a CPU
  assert decoding.decoding([]) is decoding.PLAIN


def test_the_plain_path_decodes_from_the_weights_as_stored():
  graphdef, state = _split()
  plain = decoding.PLAIN
  assert plain.for_decoding(graphdef, state) == (graphdef, state)
  assert plain.leafwise_plan(graphdef, state, jax.devices()[:1], 1) is None
  assert plain.fits_in_memory(2**62)


def test_for_decoding_picks_by_the_weights_devices():
  graphdef, state = _split()
  copy_graphdef, copy = decoding.for_decoding(graphdef, state)  # jax arrays on a CPU device
  model = nnx.merge(copy_graphdef, copy)
  assert isinstance(model.layers[0].mlp.down, copy_modules.CopyDense)
  kernel = nnx.merge(graphdef, state).layers[0].mlp.down.kernel[...]
  np.testing.assert_array_equal(model.layers[0].mlp.down.kernel[...], kernel.T)
  # numpy leaves live on no device: nothing to copy for
  host = jax.tree.map(np.asarray, state)
  assert decoding.for_decoding(graphdef, host)[1] is host
