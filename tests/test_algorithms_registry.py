"""The estimator / policy-loss registries: built-ins under verl's names, user additions."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hflax import algorithms as A

MASK = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], np.float32)
GROUP_IDS = np.array([0, 0, 1, 1], np.int32)


def _batch():
  rng = np.random.default_rng(0)
  rewards = np.zeros(MASK.shape, np.float32)
  for b, length in enumerate(MASK.sum(-1).astype(int)):
    rewards[b, length - 1] = [1.0, 0.0, 0.5, 1.0][b]
  logp = rng.normal(-1.0, 0.3, size=MASK.shape).astype(np.float32)
  return {"token_level_rewards": rewards, "response_mask": MASK, "group_ids": GROUP_IDS,
          "values": rng.normal(size=MASK.shape).astype(np.float32),
          "reward_baselines": np.array([0.5, 0.5, 0.0, 1.0], np.float32),
          "log_probs": logp, "old_log_probs": logp + 0.1 * rng.normal(size=MASK.shape),
          "advantages": rng.normal(size=MASK.shape).astype(np.float32)}


def test_builtin_names():
  assert {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
          "remax"} <= set(A.advantage_estimator_names())
  assert {"vanilla", "ppo", "dual_clip", "clip_higher", "gspo"} <= set(A.policy_loss_names())


def test_registered_estimators_match_direct_calls_under_jit():
  batch = _batch()
  scores = batch["token_level_rewards"].sum(-1)
  cfg = {"gamma": 0.99, "lam": 0.95, "num_groups": 2}
  direct = {
      "gae": A.gae_advantage(batch["token_level_rewards"], batch["values"], MASK, 0.99, 0.95),
      "grpo": A.grpo_advantage(scores, MASK, GROUP_IDS, 2),
      "rloo": A.rloo_advantage(scores, MASK, GROUP_IDS, 2),
      "reinforce_plus_plus": A.reinforce_plus_plus_advantage(
          batch["token_level_rewards"], MASK, 0.99),
      "reinforce_plus_plus_baseline": A.reinforce_plus_plus_baseline_advantage(
          scores, MASK, GROUP_IDS, 2),
      "remax": A.remax_advantage(batch["token_level_rewards"], batch["reward_baselines"], MASK),
  }
  for name, want in direct.items():
    got = jax.jit(lambda b, name=name: A.get_advantage_estimator(name)(b, cfg))(batch)
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, atol=1e-5, err_msg=name)
  dr_grpo = A.get_advantage_estimator("grpo")(batch, {"norm_adv_by_std_in_grpo": False})
  np.testing.assert_allclose(dr_grpo[0], A.grpo_advantage(scores, MASK, GROUP_IDS,
                                                          norm_by_std=False)[0])


def test_registered_policy_losses_defaults():
  batch = _batch()
  args = [batch[k] for k in ("log_probs", "old_log_probs", "advantages", "response_mask")]
  expected = {
      "vanilla": A.ppo_clip_loss(*args, clip_ratio_c=3.0),
      "ppo": A.ppo_clip_loss(*args, clip_ratio_c=3.0),
      "clip_higher": A.ppo_clip_loss(*args, clip_ratio_high=0.28, clip_ratio_c=3.0),
      "gspo": A.gspo_loss(*args),
  }
  for name, (want_loss, want_metrics) in expected.items():
    loss, metrics = jax.jit(lambda b, name=name: A.get_policy_loss(name)(b, {}))(batch)
    np.testing.assert_allclose(loss, want_loss, atol=1e-6, err_msg=name)
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
  no_dual = A.get_policy_loss("ppo")(batch, {"clip_ratio": 0.1, "clip_ratio_c": None})
  np.testing.assert_allclose(no_dual[0], A.ppo_clip_loss(*args, clip_ratio=0.1)[0])


@pytest.mark.parametrize("name, low, high", [("clip_higher", 0.2, 0.28),
                                              ("gspo", 3e-4, 4e-4)])
def test_policy_loss_defaults_hold_under_the_launch_config(name, low, high):
  # The config leaves clip_ratio_low/high unset (None): each loss's own defaults apply.
  from hflax.launch.config import base_config
  mask = np.ones((1, 1), np.float32)
  for ratio, adv in ((1.5, 1.0), (0.5, -1.0)):  # past the upper and the lower clip
    batch = {"log_probs": np.log([[ratio]]).astype(np.float32),
             "old_log_probs": np.zeros((1, 1), np.float32),
             "advantages": np.array([[adv]], np.float32), "response_mask": mask}
    loss, _ = A.get_policy_loss(name)(batch, base_config().actor)
    bound = 1 + high if adv > 0 else 1 - low
    np.testing.assert_allclose(loss, [[-adv * bound]], rtol=1e-6, err_msg=f"{name} {ratio}")


def test_unknown_names_list_valid_ones():
  with pytest.raises(ValueError, match="grpo"):
    A.get_advantage_estimator("no_such_estimator")
  with pytest.raises(ValueError, match="vanilla"):
    A.get_policy_loss("no_such_loss")


def test_missing_batch_field_names_it():
  batch = _batch()
  del batch["values"]
  with pytest.raises(KeyError, match="values"):
    A.get_advantage_estimator("gae")(batch, {})


def test_user_registers_their_own():
  # What a research module does: decorate, then select by name from a config.
  @A.register_advantage_estimator("test_algorithms_mean_baseline")
  def mean_baseline(batch, cfg):
    scores = A.sequence_scores(batch["token_level_rewards"], batch["response_mask"])
    adv = (scores - jnp.mean(scores))[:, None] * batch["response_mask"]
    return adv, adv

  @A.register_policy_loss("test_algorithms_reinforce")
  def reinforce(batch, cfg):
    loss = -batch["advantages"] * batch["log_probs"] * batch["response_mask"]
    return loss, {}

  batch = _batch()
  adv, _ = A.get_advantage_estimator("test_algorithms_mean_baseline")(batch, {})
  np.testing.assert_allclose(adv[:, 0], [0.375, -0.625, -0.125, 0.375], atol=1e-6)
  assert A.get_policy_loss("test_algorithms_reinforce") is reinforce
  assert "test_algorithms_mean_baseline" in A.advantage_estimator_names()
  with pytest.raises(ValueError, match="already registered"):
    A.register_advantage_estimator("grpo")(mean_baseline)
  A.register_policy_loss("test_algorithms_reinforce", override=True)(reinforce)


def test_advantage_fn_compiles_a_builtin_once_and_runs_host_code_eagerly():
  from hflax.algorithms import registry
  jax.clear_caches()  # the compiled estimator is shared: other tests may have called it
  batch = _batch()
  cfg = {"gamma": 0.99, "lam": 0.95, "num_groups": 4, "kl_ctrl": {"type": "fixed"}}
  gae = A.advantage_fn("gae", cfg)
  assert A.advantage_fn("gae", dict(cfg)) is gae  # one compiled function per config
  for _ in range(3):
    got = gae(batch)
  assert gae._cache_size() == 1  # traced and compiled once, not on every call
  want = A.gae_advantage(batch["token_level_rewards"], batch["values"], MASK, 0.99, 0.95)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=1e-6)
  assert A.advantage_fn("gae", {**cfg, "lam": 0.9}) is not gae

  @A.register_advantage_estimator("test_algorithms_numpy_baseline")
  def numpy_baseline(fields, cfg):  # host code: fine without jit=True
    scores = np.asarray(fields["token_level_rewards"]).sum(-1)
    adv = (scores - np.median(scores))[:, None] * fields["response_mask"]
    return adv, adv

  adv, _ = A.advantage_fn("test_algorithms_numpy_baseline", cfg)(batch)
  np.testing.assert_allclose(adv[:, 0], [0.25, -0.75, -0.25, 0.25])
  assert numpy_baseline not in registry._JITTABLE
