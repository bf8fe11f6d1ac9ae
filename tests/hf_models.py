"""Tiny random Hugging Face models built offline: the references for parity tests."""
import torch
import transformers

FAMILIES = {
    # Llama with GQA and Llama 3 rope scaling.
    "llama": (transformers.LlamaConfig, dict(
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64))),
    # Qwen2 has qkv bias; tiny Qwen2.5 models tie their embeddings.
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True, rope_theta=1000000.0)),
    # Qwen3 has q/k RMSNorm and an explicit head_dim.
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, rope_theta=1000000.0)),
}


def tiny_hf_model(family: str, seed: int = 0, **overrides):
  config_cls, extra = FAMILIES[family]
  kwargs = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
  kwargs.update(extra)
  kwargs.update(overrides)
  config = config_cls(**kwargs)
  config._attn_implementation = "eager"
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config)
  with torch.no_grad():  # random biases and norms, so parity tests exercise them
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  return model.eval()


def loaded_pair(family: str, path, seed: int = 0):
  """(transformers model, hflax graphdef, state): a tiny model saved to `path` and loaded
  back by hflax, for tests that compare the two."""
  from hflax.models import hf
  model = tiny_hf_model(family, seed=seed)
  model.save_pretrained(path)
  _, graphdef, state = hf.load_checkpoint(str(path))
  return model, graphdef, state
