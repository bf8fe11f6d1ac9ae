"""A tiny random Qwen3-MoE built offline with transformers: the reference for MoE tests."""
import torch
import transformers


def tiny_moe(seed: int = 0, router_std: float = 0.5, **overrides):
  """3 layers (the middle one dense, as mlp_only_layers makes it), 8 experts, top-2,
  renormalised weights. The router is drawn wide (std 0.5) so that top-k choices have
  clear margins (a narrow one makes near-ties, which rounding flips), and the norms are
  perturbed so parity exercises them."""
  kwargs = dict(vocab_size=128, hidden_size=64, intermediate_size=160, moe_intermediate_size=48,
                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                rope_theta=1000000.0, max_position_embeddings=256, rms_norm_eps=1e-6,
                router_aux_loss_coef=0.01, bos_token_id=1, eos_token_id=2, pad_token_id=0)
  return _random(transformers.Qwen3MoeConfig(**{**kwargs, **overrides}), seed, router_std,
                 perturbed=("norm",))


def tiny_qwen2_moe(seed: int = 0, router_std: float = 0.5, **overrides):
  """Qwen2-MoE's twin of tiny_moe: q/k/v biases and no q/k norms, a shared expert of width
  40 beside 8 routed experts (top-2, weights not renormalised: Qwen2-MoE's default), the
  middle layer dense; biases, norms and the shared expert's gate perturbed so parity
  exercises them."""
  kwargs = dict(vocab_size=128, hidden_size=64, intermediate_size=160, moe_intermediate_size=48,
                shared_expert_intermediate_size=40, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=False, mlp_only_layers=[1], num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0,
                max_position_embeddings=256, rms_norm_eps=1e-6, router_aux_loss_coef=0.01,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
  return _random(transformers.Qwen2MoeConfig(**{**kwargs, **overrides}), seed, router_std,
                 perturbed=("norm", "bias", "shared_expert_gate"))


def _random(config, seed: int, router_std: float, perturbed: tuple[str, ...]):
  """The model of `config` at torch seed `seed`, eager attention, its routers drawn with
  std `router_std` and the parameters whose names hold one of `perturbed` moved off their
  initial values by 0.1 x N(0, 1)."""
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if any(part in name for part in perturbed):
        p.add_(0.1 * torch.randn_like(p))
      if name.endswith("mlp.gate.weight"):
        p.normal_(0.0, router_std)
  return model.eval()


def assert_greedy_equals_transformers(model, graphdef, state, prompts, max_new_tokens=10):
  """hflax's greedy tokens for `prompts` (one padded batch) are transformers' generate's,
  row by row (eos 2, pad 0)."""
  import numpy as np
  from hflax.rollout.sampler import SamplingParams, generate
  out = generate(graphdef, state, prompts, SamplingParams(
      max_new_tokens=max_new_tokens, temperature=0, eos_ids=(2,), pad_id=0))
  for row, ids in enumerate(prompts):
    with torch.no_grad():
      want = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                            do_sample=False, eos_token_id=2, pad_token_id=0)[0, len(ids):]
    got = np.asarray(out["responses"][row])[np.asarray(out["response_mask"][row], bool)]
    np.testing.assert_array_equal(got, want.numpy())


def assert_export_round_trips(model, cfg, state, directory) -> dict:
  """hflax's export of (cfg, state) loads in transformers with every tensor equal to
  `model`'s, and its config.json reads back to cfg; returns that config.json."""
  import json
  from hflax.models import ModelConfig, hf
  hf.export_checkpoint(str(directory), cfg, state)
  with open(f"{directory}/config.json") as f:
    config = json.load(f)
  again = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager")
  original, reloaded = model.state_dict(), again.state_dict()
  assert set(original) == set(reloaded)
  for name, tensor in original.items():
    assert torch.equal(tensor, reloaded[name]), name
  assert ModelConfig.from_hf(config) == cfg
  return config


def saved_tiny_moe(tmp_path_factory, name: str, seed: int, build=None) -> str:
  """The directory of a tiny_moe(seed) (or `build`(seed=seed)) saved as an HF checkpoint
  (module fixtures' form)."""
  path = tmp_path_factory.mktemp(name)
  (build or tiny_moe)(seed=seed).save_pretrained(path)
  return str(path)


def hf_logits_and_aux(model, ids, mask):
  """transformers' logits [B, T, V] and load-balancing loss for left-padded rows."""
  with torch.no_grad():
    out = model(torch.tensor(ids), attention_mask=torch.tensor(mask), output_router_logits=True)
  return out.logits.float().numpy(), float(out.aux_loss)
