"""LoRA: the adapted model against PEFT, merged weights, training the adapters alone, the
reference policy from the frozen base, sharded against unsharded, and a run end to end."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppo_step import CFG, SAMPLING, actor_loss, prompts_batch
from hflax.controller.batch import Batch
from hflax.controller.training import OptimConfig, UpdateConfig
from hflax.controller.actor import ActorRolloutWorker
from hflax.controller.workers import ReferenceWorker
from hflax.models import create, hf
from hflax.models.lora import (add_adapters, export_adapter, init_adapters, lora_config,
                               lora_targets, merge_adapters, split_adapters)
from hflax.models.transformer import logits_fn
from hflax.sharding.placement import build_placement, colocated

LORA_CFG = lora_config(CFG, 4, 8.0, "all-linear")


def _randomised(state, seed=0, scale=0.05):
  """Adapters with a random B as well (fresh ones have B = 0, where any adapter is a no-op)."""
  adapters, base = split_adapters(state)
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  return nnx.merge_state(base, jax.tree.unflatten(tree, leaves))


def _tokens(rows=2, length=10, vocab=64, seed=0):
  tokens = np.random.RandomState(seed).randint(3, vocab, (rows, length))
  return tokens, np.ones_like(tokens)


def test_fresh_adapters_are_the_base_model_and_merging_is_exact():
  graphdef, state = create(CFG, seed=0)
  lora_graphdef, lora_state = add_adapters(LORA_CFG, state, seed=1)
  tokens, mask = _tokens()
  base = logits_fn(graphdef, state, tokens, mask)
  np.testing.assert_array_equal(logits_fn(lora_graphdef, lora_state, tokens, mask), base)
  adapted = _randomised(lora_state)
  lora_logits = logits_fn(lora_graphdef, adapted, tokens, mask)
  assert float(jnp.abs(lora_logits - base).max()) > 1e-2  # the adapters do something
  merged = merge_adapters(LORA_CFG, adapted)
  assert not split_adapters(merged)[0]  # base-shaped: the base graph runs it
  np.testing.assert_allclose(logits_fn(graphdef, merged, tokens, mask), lora_logits, atol=1e-5)
  # LoRA's A draws from a stream of its own: a model built with adapters has the weights
  # of the one built without, and its adapters are those init_adapters makes alone.
  _, built = create(LORA_CFG, seed=0)
  for got, want in zip(jax.tree.leaves(split_adapters(built)[1]), jax.tree.leaves(state),
                       strict=True):
    np.testing.assert_array_equal(got, want)
  for got, want in zip(jax.tree.leaves(split_adapters(built)[0]),
                       jax.tree.leaves(init_adapters(LORA_CFG, 0)), strict=True):
    np.testing.assert_array_equal(got, want)
  b = [x for p, x in nnx.to_flat_state(built) if p[-1] == "lora_b"]
  assert b and all(not np.asarray(x[...]).any() for x in b)


def test_targets_parse_like_peft_and_bad_ones_are_named():
  assert lora_targets("all-linear") == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj")
  assert lora_targets("q_proj, v_proj,q_proj") == ("q_proj", "v_proj")
  with pytest.raises(ValueError, match="unknown: \\['qkv_proj'\\]"):
    lora_targets("q_proj,qkv_proj")
  only_q = lora_config(CFG, 2, 4.0, "q_proj")
  adapted = {p[:-1] for p, _ in nnx.to_flat_state(init_adapters(only_q, 0))}
  assert adapted == {("layers", i, "attn", "q") for i in range(CFG.num_layers)}
  from hflax.launch.config import base_config, validate
  for field, value, message in (("lora_rank", -1, "config.model.lora_rank: must be an integer"),
                                ("lora_alpha", 0.0, "config.model.lora_alpha: must be > 0"),
                                ("target_modules", "q_proj,mlp", "config.model.target_modules")):
    c = base_config()
    c.model.lora_rank = 4
    c.model[field] = value
    with pytest.raises(ValueError, match=message):
      validate(c)


def test_adapted_forward_and_both_exports_match_peft(tmp_path):
  import peft
  import torch
  import transformers
  from hf_models import tiny_hf_model
  model = tiny_hf_model("qwen2")  # qkv biases, tied embeddings
  model.save_pretrained(tmp_path / "base")
  cfg, _, state = hf.load_checkpoint(str(tmp_path / "base"))
  lcfg = lora_config(cfg, 4, 8.0, "q_proj,v_proj,o_proj,down_proj")
  graphdef, adapted = add_adapters(lcfg, state, seed=3)
  adapted = _randomised(adapted, scale=0.1)
  export_adapter(str(tmp_path / "adapter"), lcfg, adapted, base_model=str(tmp_path / "base"))
  tokens, mask = _tokens(vocab=128)
  with torch.no_grad():
    plain = model(torch.tensor(tokens)).logits.numpy()
    reference = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    want = reference(torch.tensor(tokens)).logits.numpy()
  assert np.abs(want - plain).max() > 1e-2  # PEFT read the adapters
  ours = np.asarray(logits_fn(graphdef, adapted, tokens, mask))
  np.testing.assert_allclose(ours, want, atol=2e-4)
  hf.export_checkpoint(str(tmp_path / "merged"), cfg, merge_adapters(lcfg, adapted))
  merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
  with torch.no_grad():
    np.testing.assert_allclose(merged(torch.tensor(tokens)).logits.numpy(), want, atol=2e-4)


def _lora_actor_round(spec):
  """Adapters made non-trivial, one rollout, the actor's reference log-probs, two updates."""
  placed = build_placement(spec)
  home = jax.sharding.SingleDeviceSharding(placed["actor"].pool.devices[0])
  base = create(CFG, seed=0)
  graphdef, state = add_adapters(LORA_CFG, base[1], seed=0)
  actor = ActorRolloutWorker(placed["actor"], graphdef, _randomised(state), sampling=SAMPLING,
                             loss_fn=actor_loss, optim=OptimConfig(lr=1e-2),
                             update=UpdateConfig(mini_batch_size=16, micro_batch_size=8),
                             home=home)
  ref = ReferenceWorker(placed["ref"], *base, home=home)
  before = jax.tree.map(np.asarray, actor.params)
  batch = actor.generate_sequences(prompts_batch())
  batch = batch.union(actor.compute_log_prob(batch))
  out = {"responses": np.asarray(batch["responses"]),
         "rollout_log_probs": np.asarray(batch["rollout_log_probs"]),
         "old_log_probs": np.asarray(batch["old_log_probs"]),
         "actor_ref": np.asarray(actor.compute_ref_log_prob(batch)["ref_log_prob"]),
         "ref": np.asarray(ref.compute_ref_log_prob(batch)["ref_log_prob"])}
  advantages = np.random.RandomState(0).randn(*out["old_log_probs"].shape).astype(np.float32)
  batch = batch.union(Batch({"advantages": jnp.asarray(advantages)}))
  for _ in range(2):
    metrics = actor.update_actor(batch).meta["metrics"]
  return actor, before, out, metrics


@pytest.fixture(scope="module")
def one_device():
  return _lora_actor_round(colocated(["actor", "ref"], 1))


def test_actor_trains_only_the_adapters_and_serves_the_reference(one_device):
  actor, before, out, metrics = one_device
  mask = out["responses"] != SAMPLING.pad_id
  # Generation ran the merged weights: its log-probs are the adapted model's teacher-forced
  # ones, not the base model's.
  np.testing.assert_allclose(out["rollout_log_probs"] * mask, out["old_log_probs"] * mask,
                             atol=2e-5)
  assert np.abs((out["old_log_probs"] - out["ref"]) * mask).max() > 1e-3
  # The actor's reference log-probs are those of a separate reference worker on the base.
  np.testing.assert_allclose(out["actor_ref"], out["ref"], atol=1e-6)
  adapters_before, base_before = split_adapters(before)
  adapters_after, base_after = split_adapters(actor.params)
  for a, b in zip(jax.tree.leaves(base_before), jax.tree.leaves(base_after), strict=True):
    np.testing.assert_array_equal(a, np.asarray(b))
  moved = [float(np.abs(a - np.asarray(b)).max())
           for a, b in zip(jax.tree.leaves(adapters_before), jax.tree.leaves(adapters_after))]
  assert min(moved) > 0
  # Optimizer state for the adapters alone: Adam's two moments, and scalar counts.
  adapter_elements = sum(x.size for x in jax.tree.leaves(adapters_after))
  state_elements = sum(x.size for x in jax.tree.leaves(actor.opt_state) if x.ndim)
  assert state_elements == 2 * adapter_elements
  assert float(metrics["actor/grad_norm"]) > 0


def test_sharded_lora_actor_matches_one_device(one_device):
  _, _, want, _ = one_device
  spec = {"pools": {"policy": 4, "scoring": 2},
          "roles": {"actor": {"pool": "policy", "mesh": {"fsdp": 2, "tensor": 2},
                              "generate_tensor": 2},
                    "ref": {"pool": "scoring", "mesh": {"fsdp": 2}}}}
  actor, _, got, _ = _lora_actor_round(spec)
  assert actor.engine.mesh.shape["tensor"] == 2
  np.testing.assert_array_equal(got["responses"], want["responses"])
  for key in ("rollout_log_probs", "old_log_probs", "actor_ref", "ref"):
    np.testing.assert_allclose(got[key], want[key], atol=2e-5, err_msg=key)
  for a, b in zip(jax.tree.leaves(actor.params), jax.tree.leaves(one_device[0].params),
                  strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


def test_an_adapter_peft_saved_loads_and_runs_as_peft_runs_it(tmp_path):
  import peft
  import torch
  from hf_models import tiny_hf_model
  from hflax.launch.config import base_config
  from hflax.launch.roles import check_adapter
  from hflax.models.lora import load_adapter, read_adapter_config
  model = tiny_hf_model("llama")
  model.save_pretrained(tmp_path / "base")
  # init_lora_weights=False: B random too, so the adapter changes the model.
  adapted = peft.get_peft_model(model, peft.LoraConfig(
      r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "gate_proj"],
      init_lora_weights=False)).eval()
  adapted.save_pretrained(tmp_path / "adapter")
  tokens, mask = _tokens(vocab=128)
  with torch.no_grad():
    want = adapted(torch.tensor(tokens)).logits.numpy()
  found = read_adapter_config(str(tmp_path / "adapter"))
  assert (found["rank"], found["alpha"]) == (4, 8.0)
  assert set(found["targets"]) == {"q_proj", "k_proj", "gate_proj"}
  cfg, _, state = hf.load_checkpoint(str(tmp_path / "base"))
  lcfg = lora_config(cfg, 4, 8.0, found["targets"])
  graphdef, fresh = add_adapters(lcfg, state, seed=0)
  loaded = nnx.merge_state(split_adapters(fresh)[1], load_adapter(str(tmp_path / "adapter"), lcfg))
  np.testing.assert_allclose(logits_fn(graphdef, loaded, tokens, mask), want, atol=2e-4)
  # Our export of what we loaded reads back bit for bit.
  export_adapter(str(tmp_path / "again"), lcfg, loaded)
  for a, b in zip(jax.tree.leaves(load_adapter(str(tmp_path / "again"), lcfg)),
                  jax.tree.leaves(split_adapters(loaded)[0]), strict=True):
    np.testing.assert_array_equal(a, b)
  # A config that does not describe the adapter is refused before anything runs, saying
  # what would.
  c = base_config()
  c.model.update(lora_rank=8, lora_alpha=8.0, target_modules="q_proj,k_proj,gate_proj",
                 lora_adapter_path=str(tmp_path / "adapter"))
  with pytest.raises(ValueError, match="has r=4, lora_alpha=8, .* set model.lora_rank=4"):
    check_adapter(c)
  c.model.lora_rank = 4
  check_adapter(c)
  with pytest.raises(ValueError, match="no tensor .*layers.0.self_attn.v_proj.lora_A.weight"):
    load_adapter(str(tmp_path / "adapter"), lora_config(cfg, 4, 8.0, "q_proj,v_proj"))


def test_with_lora_a_pool_only_the_reference_used_is_not_built():
  import importlib.util
  from hflax.launch.roles import needed_roles, placement_spec
  spec = importlib.util.spec_from_file_location("grpo_cfg", "hflax/configs/grpo.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()  # actor and reference on pools of their own
  assert placement_spec(c, needed_roles(c), 2)["pools"] == {"policy": 1, "reference": 1}
  c.model.lora_rank = 8
  assert needed_roles(c) == ["actor"]
  assert placement_spec(c, needed_roles(c), 2) == {
      "pools": {"policy": 1}, "roles": {"actor": {"pool": "policy", "generate_tensor": 1}}}


def test_critic_lora_trains_its_adapters_and_value_head_only():
  from ppo_step import critic_loss
  from hflax.controller.workers import CriticWorker
  from hflax.launch.config import base_config
  from hflax.controller.build import value_model
  from hflax.launch.roles import lora_plan
  c = base_config()
  c.critic.update(lora_rank=4, lora_alpha=8.0, target_modules="q_proj,down_proj")
  policy = (CFG, *create(CFG, seed=0))
  plain = value_model("", policy, seed=1)
  graphdef, state = value_model("", policy, seed=1, lora=lora_plan(c.critic))
  placed = build_placement(colocated(["critic"], 2))
  critic = CriticWorker(placed["critic"], graphdef, state, loss_fn=critic_loss,
                        optim=OptimConfig(lr=1e-2), update=UpdateConfig(mini_batch_size=8))
  rs = np.random.RandomState(0)
  tokens = rs.randint(3, 64, (8, 12))
  batch = Batch({"input_ids": jnp.asarray(tokens), "attention_mask": jnp.ones((8, 12), jnp.int32),
                 "responses": jnp.asarray(tokens[:, -4:]),
                 "response_mask": jnp.ones((8, 4), jnp.float32),
                 "returns": jnp.asarray(rs.randn(8, 4), jnp.float32)})
  values = critic.compute_values(batch)["values"]
  # Fresh adapters: the values of the same critic without them.
  from hflax.models.forwards import values_fn as _values_fn
  np.testing.assert_allclose(values, _values_fn(plain[0], 4)(plain[1], batch.arrays), atol=1e-6)
  before = dict(nnx.to_flat_state(jax.tree.map(np.asarray, critic.params)))
  for _ in range(2):  # the first moves B alone (A's gradient is 0 while B = 0)
    critic.update_critic(batch.union(Batch({"values": values})))
  after = dict(nnx.to_flat_state(critic.params))
  changed = {p for p in before if not np.array_equal(before[p][...], np.asarray(after[p][...]))}
  trainable = {p for p in before if p[-1] in ("lora_a", "lora_b") or p[0] == "score"}
  assert changed == trainable
  assert {p[-1] for p in trainable} == {"lora_a", "lora_b", "kernel", "bias"}
  state_elements = sum(x.size for x in jax.tree.leaves(critic.opt_state) if x.ndim)
  assert state_elements == 2 * sum(before[p][...].size for p in trainable)


def test_the_auto_mapper_sees_both_lora_models():
  from hflax.launch.config import base_config
  from hflax.launch.plan import workload
  c = base_config()  # PPO, colocated, no KL: actor and critic
  c.model.update(lora_rank=8, target_modules="q_proj")
  c.critic.update(lora_rank=4, target_modules="all-linear")
  wl = workload(c, CFG)
  assert (wl.models["actor"].lora_rank, wl.models["actor"].lora_targets) == (8, ("q_proj",))
  assert wl.models["critic"].lora_rank == 4 and not wl.reference_in_actor
  c.actor.use_kl_loss = True
  wl = workload(c, CFG)
  assert "ref" not in wl.models and wl.reference_in_actor
