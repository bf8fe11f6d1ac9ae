"""Model parity with transformers, and HF checkpoint import/export."""
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hf_models import tiny_hf_model
from hflax.models import ModelConfig, create, hf, logical_axes, logits_fn

FAMILIES = ["llama", "qwen2", "qwen3"]
logits_jit = jax.jit(logits_fn, static_argnums=0)


def _batch(vocab=128, seed=0):
  ids = np.random.RandomState(seed).randint(3, vocab, size=(3, 24))
  mask = np.ones_like(ids)
  mask[1, :7] = 0  # left padding
  mask[2, :1] = 0
  return ids, mask


def _hf_logits(model, ids, mask):
  with torch.no_grad():
    return model(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.float().numpy()


def _max_diff_on_tokens(a, b, mask):
  return np.abs(a - b)[mask.astype(bool)].max()


@pytest.fixture(scope="module", params=FAMILIES)
def family_ckpt(request, tmp_path_factory):
  model = tiny_hf_model(request.param)
  path = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(path)
  return request.param, model, str(path)


def test_logits_match_transformers(family_ckpt):
  family, model, path = family_ckpt
  cfg, graphdef, state = hf.load_checkpoint(path)
  assert cfg.family == family
  ids, mask = _batch()
  ours = np.asarray(logits_jit(graphdef, state, jnp.asarray(ids), jnp.asarray(mask)))
  assert _max_diff_on_tokens(ours, _hf_logits(model, ids, mask), mask) <= 1e-4


def test_family_features_are_exercised(family_ckpt):
  family, _, path = family_ckpt
  cfg = hf.read_config(path)
  assert cfg.num_kv_heads < cfg.num_heads  # GQA everywhere
  assert {"llama": cfg.rope_scaling_dict.get("rope_type") == "llama3",
          "qwen2": cfg.qkv_bias and cfg.tie_word_embeddings,
          "qwen3": cfg.qk_norm and cfg.head_dim != cfg.hidden_size // cfg.num_heads}[family]


def test_round_trip_gives_identical_tensors_and_logits(family_ckpt, tmp_path):
  family, model, path = family_ckpt
  cfg, graphdef, state = hf.load_checkpoint(path)
  hf.export_checkpoint(str(tmp_path), cfg, state)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
  original = model.state_dict()
  again = reloaded.state_dict()
  assert set(original) == set(again)
  for name, tensor in original.items():
    assert torch.equal(tensor, again[name]), name
  ids, mask = _batch(seed=1)
  np.testing.assert_array_equal(_hf_logits(reloaded.eval(), ids, mask), _hf_logits(model, ids, mask))


@pytest.mark.parametrize("scaling", [
    dict(rope_type="linear", factor=4.0),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16),
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32, beta_fast=16,
         beta_slow=2, mscale=1.0, mscale_all_dim=0.5),
])
def test_rope_scalings_match_transformers(scaling, tmp_path):
  model = tiny_hf_model("llama", rope_scaling=scaling)
  model.save_pretrained(tmp_path)
  _, graphdef, state = hf.load_checkpoint(str(tmp_path))
  ids, mask = _batch()
  ours = np.asarray(logits_jit(graphdef, state, jnp.asarray(ids), jnp.asarray(mask)))
  assert _max_diff_on_tokens(ours, _hf_logits(model, ids, mask), mask) <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_tables_match_transformers_at_long_positions(family):
  """The tables hold what the reference's rotary embedding computes, far past the 24
  positions of the logit tests, and a position past the table reads NaN, not a wrong
  rotation."""
  from hflax.models import rope
  from hflax.models.rope import rope_tables
  model = tiny_hf_model(family, max_position_embeddings=8192)
  cfg = ModelConfig.from_hf(model.config.to_dict() | {"architectures":
                                                        model.config.architectures})
  positions = np.array([[0, 1, 63, 64, 1000, 4095, 8191]])
  hf_cos, hf_sin = model.model.rotary_emb(torch.zeros(1), torch.tensor(positions))
  cos, sin = rope_tables(cfg, jnp.asarray(positions), 8192)
  # The reference rounds inv_freq in float32 arithmetic, we round it once from float64: one
  # ulp apart, which moves an angle, and so cos and sin, by up to position * 6e-8.
  bound = 1e-6 + 6e-8 * positions[..., None]
  assert (np.abs(np.asarray(cos) - hf_cos.numpy()) <= bound).all()
  assert (np.abs(np.asarray(sin) - hf_sin.numpy()) <= bound).all()
  outside = np.asarray(rope_tables(cfg, jnp.asarray([[3, 16, -1]]), 16)[0])
  assert np.isfinite(outside[0, 0]).all() and np.isnan(outside[0, 1:]).all()
  # Past MAX_TABLE_POSITIONS, cos and sin are computed in the graph: the same values.
  in_graph = rope_tables(cfg, jnp.asarray(positions), rope.MAX_TABLE_POSITIONS + 1)
  for ours, theirs in zip(in_graph, (cos, sin)):
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=0, atol=5e-7)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_gradient_is_the_rotation_adjoint(dtype):
  """apply_rope's hand-written backward pass against autodiff of the rotation written out,
  on tables whose two halves differ (the adjoint must not lean on them being equal)."""
  from hflax.models.rope import apply_rope
  k = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(k[0], (2, 5, 3, 8), dtype)
  cos, sin = jax.random.normal(k[1], (2, 5, 8)), jax.random.normal(k[2], (2, 5, 8))
  g = jax.random.normal(k[3], x.shape, dtype)

  def written_out(x):
    x32, c, s = x.astype(jnp.float32), cos[:, :, None], sin[:, :, None]
    rotated = jnp.concatenate([-x32[..., 4:], x32[..., :4]], axis=-1)
    return (x32 * c + rotated * s).astype(dtype)

  got = jax.vjp(lambda x: apply_rope(x, cos, sin), x)[1](g)[0]
  want = jax.vjp(written_out, x)[1](g)[0]
  assert got.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  np.testing.assert_array_equal(np.asarray(apply_rope(x, cos, sin), np.float32),
                                np.asarray(written_out(x), np.float32))


def _rms_written_out(x, scale, eps=1e-5):
  """The HF reference's RMSNorm: normalised in float32, rounded, then scaled."""
  x32 = x.astype(jnp.float32)
  n = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return scale.astype(x.dtype) * n.astype(x.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_gradient_matches_autodiff(dtype):
  """rms_norm's hand-written backward pass against autodiff of the norm written out:
  float32 to rounding; bf16 within bf16 rounding of the float32 gradients (its scale
  gradient sums in float32 where autodiff's sums bf16 products in bf16)."""
  from hflax.models.norm import rms_norm
  k = jax.random.split(jax.random.key(5), 3)
  x = (3 * jax.random.normal(k[0], (2, 7, 48))).astype(dtype)
  scale = 1 + 0.3 * jax.random.normal(k[1], (48,))
  g = jax.random.normal(k[2], x.shape, dtype)
  np.testing.assert_array_equal(np.asarray(rms_norm(x, scale, 1e-5), np.float32),
                                np.asarray(_rms_written_out(x, scale), np.float32))
  got = jax.vjp(lambda x, s: rms_norm(x, s, 1e-5), x, scale)[1](g)
  x32, g32 = x.astype(jnp.float32), g.astype(jnp.float32)
  want = jax.vjp(_rms_written_out, x32, scale)[1](g32)
  for a, b in zip(got, want):
    assert a.dtype == (dtype if a.shape == x.shape else jnp.float32)
    tol = 2e-6 if dtype == jnp.float32 else 2e-2
    err = float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)))
    assert err <= tol * float(jnp.max(jnp.abs(b))), err


def test_bfloat16_rms_norm_gradient_keeps_its_sums_over_hidden_out_of_the_matmul_library():
  """In a bf16 gradient XLA:CPU sent autodiff's multiply-reduce over hidden to YNNPACK as a
  reduction fusion (a [448, 576] gradient: 0.60 ms against 0.37 for the hand-written
  pass, 2-core Xeon; a replayed SmolLM2 update 5.07 -> 4.79 s). The hand-written pass's
  two sums over hidden are one variadic reduction, which stays in XLA's own fusions."""
  from hflax.models.norm import rms_norm
  rows, hidden = 64, 96
  k = jax.random.split(jax.random.key(6), 2)
  x = jax.random.normal(k[0], (rows, hidden)).astype(jnp.bfloat16)
  w = jax.random.normal(k[1], (rows, hidden)).astype(jnp.bfloat16)
  scale = jnp.ones((hidden,))

  def library_sums_over_hidden(norm):
    loss = lambda x, s: jnp.sum((norm(x, s) * w).astype(jnp.float32))  # noqa: E731
    text = jax.jit(jax.grad(loss, (0, 1))).lower(x, scale).compile().as_text()
    return len(re.findall(rf"= f32\[{rows}(?:,1)?\]\S* fusion\([^\n]*kind=kCustom[^\n]*__ynn",
                          text))

  assert library_sums_over_hidden(_rms_written_out) > 0  # what the test tells apart
  assert library_sums_over_hidden(lambda x, s: rms_norm(x, s, 1e-5)) == 0


def test_value_head_matches_token_classification(tmp_path):
  config = tiny_hf_model("qwen2").config
  config.num_labels = 1
  torch.manual_seed(3)
  ref = transformers.AutoModelForTokenClassification.from_config(config).eval()
  with torch.no_grad():
    ref.score.bias.fill_(0.25)
  ref.save_pretrained(tmp_path)
  cfg, graphdef, state = hf.load_checkpoint(str(tmp_path), head="value")
  ids, mask = _batch()

  @jax.jit
  def values(state, ids, mask):
    from hflax.models import forward
    model, hidden = forward(graphdef, state, ids, mask)
    return model.values(hidden)

  ours = np.asarray(values(state, jnp.asarray(ids), jnp.asarray(mask)))
  with torch.no_grad():
    expected = ref(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits[..., 0].numpy()
  assert _max_diff_on_tokens(ours, expected, mask) <= 1e-4
  export = tmp_path / "export"
  hf.export_checkpoint(str(export), cfg, state, head="value")
  again = transformers.AutoModelForTokenClassification.from_pretrained(export)
  for name, tensor in ref.state_dict().items():
    assert torch.equal(tensor, again.state_dict()[name]), name


def test_critic_from_causal_lm_checkpoint_gets_fresh_score_head(family_ckpt):
  _, model, path = family_ckpt
  _, _, state = hf.load_checkpoint(path, head="value", seed=5)
  np.testing.assert_array_equal(np.asarray(state["embed"][...]),
                                model.model.embed_tokens.weight.detach().numpy())
  assert state["score"]["kernel"][...].shape == (model.config.hidden_size, 1)
  assert float(jnp.abs(state["score"]["kernel"][...]).sum()) > 0


def test_sharded_load_reads_only_each_devices_shard(family_ckpt, tmp_path):
  """Loading onto a mesh puts 1/8 of every sharded tensor on each device; values unchanged."""
  _, model, path = family_ckpt
  cfg, _, state = hf.load_checkpoint(path)
  hf.export_checkpoint(str(tmp_path), cfg, state, max_shard_bytes=40_000)  # several files
  assert (tmp_path / "model.safetensors.index.json").exists()
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("fsdp", "tensor"))
  rules = {"vocab": "tensor", "embed": "fsdp", "mlp": "tensor", "q_heads": "tensor",
           "kv_heads": "tensor"}

  def sharding(axes, shape):
    return NamedSharding(mesh, P(*[rules.get(a) for a in axes]))

  _, graphdef, sharded = hf.load_checkpoint(str(tmp_path), sharding=sharding)
  up = sharded["layers"][0]["mlp"]["up"]["kernel"][...]
  assert up.sharding.spec == P("fsdp", "tensor")
  assert {s.data.shape for s in up.addressable_shards} == {
      (cfg.hidden_size // 4, cfg.intermediate_size // 2)}
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(sharded)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ids, mask = _batch()
  ours = np.asarray(logits_jit(graphdef, sharded, jnp.asarray(ids), jnp.asarray(mask)))
  assert _max_diff_on_tokens(ours, _hf_logits(model, ids, mask), mask) <= 1e-4


def test_bfloat16_export_and_load(family_ckpt, tmp_path):
  _, _, path = family_ckpt
  cfg, _, state = hf.load_checkpoint(path)
  hf.export_checkpoint(str(tmp_path), cfg, state, dtype="bfloat16")
  assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
  _, _, again = hf.load_checkpoint(str(tmp_path), param_dtype="bfloat16")
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(again)):
    assert b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))


def test_every_parameter_has_logical_axes():
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, qkv_bias=True, qk_norm=True)
  _, state = create(cfg)
  axes = logical_axes(state)
  for (path, leaf), names in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                                 jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))):
    assert len(names) == leaf.ndim, path


def _write_config(path, **changes):
  config = json.loads((path / "config.json").read_text())
  config.update(changes)
  (path / "config.json").write_text(json.dumps(config))


def test_clear_errors(family_ckpt, tmp_path):
  _, model, path = family_ckpt
  with pytest.raises(FileNotFoundError, match="no config.json"):
    hf.load_checkpoint(str(tmp_path))
  model.save_pretrained(tmp_path)
  _write_config(tmp_path, architectures=["GPT2LMHeadModel"], model_type="gpt2")
  with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
    hf.load_checkpoint(str(tmp_path))
  model.save_pretrained(tmp_path)
  _write_config(tmp_path, intermediate_size=model.config.intermediate_size * 2)
  with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight.*has shape"):
    hf.load_checkpoint(str(tmp_path))
  model.save_pretrained(tmp_path)
  _write_config(tmp_path, num_hidden_layers=3)
  with pytest.raises(KeyError, match="lacks tensor 'model.layers.2"):
    hf.load_checkpoint(str(tmp_path))
  model.save_pretrained(tmp_path)
  os.remove(tmp_path / "model.safetensors")
  with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
    hf.load_checkpoint(str(tmp_path))
  model.save_pretrained(tmp_path)
  dynamic = dict(rope_type="dynamic", factor=2.0)
  for key in ("rope_scaling", "rope_parameters"):  # the transformers 4 and 5 spellings
    _write_config(tmp_path, **{"rope_scaling": None, "rope_parameters": None, key: dynamic})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'dynamic'"):
      hf.load_checkpoint(str(tmp_path))
  # Options the model does not implement are refused, not run as a different model.
  for changes, message in [(dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
                           (dict(use_sliding_window=True, sliding_window=4),
                            "use_sliding_window=true is not supported")]:
    model.save_pretrained(tmp_path)
    _write_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
      hf.load_checkpoint(str(tmp_path))


def test_export_over_an_earlier_sharded_export_leaves_only_the_new_weights(family_ckpt,
                                                                          tmp_path):
  _, _, path = family_ckpt
  cfg, _, state = hf.load_checkpoint(path)
  hf.export_checkpoint(str(tmp_path), cfg, state, max_shard_bytes=40_000)
  doubled = jax.tree.map(lambda x: x * 2, state)
  hf.export_checkpoint(str(tmp_path), cfg, doubled)  # one file this time
  assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
  _, _, again = hf.load_checkpoint(str(tmp_path))
  for a, b in zip(jax.tree.leaves(doubled), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
