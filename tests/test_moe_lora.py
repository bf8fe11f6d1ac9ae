"""LoRA on a mixture of experts' stacked experts: one (A, B) pair an expert and projection,
the function of W_e + scale A_e B_e in every dispatch mode (against kernels merged by hand
in numpy), its gradients, expert parallelism, PEFT's per-expert names, and a GRPO run."""
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from hflax.models import create, forward, hf, moe
from hflax.models.config import ModelConfig
from hflax.models.lora import (add_adapters, export_adapter, load_adapter, lora_config,
                               merge_adapters, split_adapters, trainable_filter)
from hflax.models.transformer import create_abstract, logits_fn
from hflax.sharding.layouts import TRAIN_RULES, batch_sharding, state_shardings, train_mesh
from moe_models import tiny_moe
from test_lora import _randomised as random_adapters

# Qwen3-MoE's shape, tiny: layer 0 sparse, layer 1 dense (mlp_only_layers).
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8, family="qwen3_moe", qk_norm=True, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
            mlp_only_layers=(1,))
PROJ = ("gate", "up", "down")


def _built(cfg, seed=0):
  """(graphdef, state) of a random model, its initialisation one compiled program."""
  return create_abstract(cfg)[0], jax.jit(lambda: create(cfg, seed=seed)[1])()


@functools.lru_cache(maxsize=None)  # one traced program a graphdef for the whole module
def _logits(graphdef):
  return jax.jit(lambda state, tokens, mask: logits_fn(graphdef, state, tokens, mask))


# Adapters with a random B (test_lora.py's), compiled once for the MoE's many expert leaves.
_randomised = jax.jit(lambda state: random_adapters(state, scale=0.1))


def _tokens(rows=2, length=12, vocab=64, seed=0):
  tokens = np.random.RandomState(seed).randint(3, vocab, (rows, length))
  return jnp.asarray(tokens), jnp.ones((rows, length), jnp.int32)


def _merged_by_hand(cfg, state):
  """The base model's state with every adapted kernel replaced, in numpy, by W + s A B
  (an expert stack's W_e + s A_e B_e, expert by expert)."""
  flat = {tuple(p): np.asarray(v[...], np.float64) for p, v in nnx.to_flat_state(state)}
  out = []
  for path, var in nnx.to_flat_state(split_adapters(state)[1]):
    path, w = tuple(path), np.asarray(var[...], np.float64)
    module, name = path[:-1], path[-1]
    prefix = "" if name == "kernel" else name + "_"
    if module + (prefix + "lora_a",) in flat:
      a, b = flat[module + (prefix + "lora_a",)], flat[module + (prefix + "lora_b",)]
      if w.ndim == 3:
        w = w + cfg.lora_scale * np.stack([a[e] @ b[e] for e in range(w.shape[0])])
      else:
        w = w + cfg.lora_scale * a @ b
    out.append((path, var.replace(value=jnp.asarray(w, jnp.float32))))
  return nnx.from_flat_state(out)


def _loss(graphdef, mesh=None):
  """A token NLL plus the load-balancing term (the router's both gradient paths)."""
  def loss(params, tokens, mask):
    context = (jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh is not None
               else contextlib.nullcontext())
    with context, moe.recording() as record:
      model, hidden = forward(graphdef, params, tokens, mask)
      aux = moe.load_balancing_loss(moe.stacked(record)[1], 2, mask)
    logp = jax.nn.log_softmax(model.logits(hidden)[:, :-1], axis=-1)
    token_logp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return -token_logp.mean() + 0.01 * aux
  return loss


ALL_AND_ROUTER = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,gate"


@pytest.mark.parametrize("family,dispatch,grads,targets", [
    ("qwen3_moe", "dense", True, "all-linear"), ("qwen3_moe", "sorted", True, "all-linear"),
    ("qwen2_moe", "sorted", False, ALL_AND_ROUTER)])
def test_expert_adapters_are_the_hand_merged_kernels(family, dispatch, grads, targets):
  """all_to_all is "sorted" outside an expert mesh: test_expert_parallel_lora_step below.
  "all-linear" leaves the router alone; "gate" names it (HF's mlp.gate)."""
  extra = (dict(qk_norm=False, qkv_bias=True, shared_expert_intermediate_size=20,
                norm_topk_prob=False) if family == "qwen2_moe" else {})
  cfg = ModelConfig(**{**TINY, **extra, "family": family, "moe_dispatch": dispatch})
  lcfg = lora_config(cfg, 4, 8.0, targets)
  graphdef, state = _built(cfg)
  lora_graphdef, lora_state = add_adapters(lcfg, state, seed=1)
  base_logits, lora_logits = _logits(graphdef), _logits(lora_graphdef)
  adapters = {tuple(p): v for p, v in nnx.to_flat_state(split_adapters(lora_state)[0])}
  # One pair an expert and projection, on the expert axis; the router never adapted; the
  # shared expert adapted as a dense MLP; B zero.
  for proj, (din, dout) in zip(PROJ, ((32, 24), (32, 24), (24, 32))):
    a = adapters[("layers", 0, "mlp", f"{proj}_lora_a")]
    b = adapters[("layers", 0, "mlp", f"{proj}_lora_b")]
    assert a.get_value().shape == (4, din, 4) and b.get_value().shape == (4, 4, dout)
    assert a.get_metadata()["axes"][0] == b.get_metadata()["axes"][0] == "expert"
    assert not np.asarray(b[...]).any()
  router = "gate" in lcfg.lora_targets
  names = {p[3] for p in adapters if p[:3] == ("layers", 0, "mlp")}
  assert names == {f"{proj}_lora_{w}" for proj in PROJ + ("router",) * router for w in "ab"} | (
      {"shared_expert"} if family == "qwen2_moe" else set())
  shared = {p for p in adapters if "shared_expert" in p}
  assert len(shared) == (6 if family == "qwen2_moe" else 0)  # 3 projections x A, B
  if router:
    assert adapters[("layers", 0, "mlp", "router_lora_b")].get_value().shape == (4, 4)
  assert sum(v.get_value().size for v in adapters.values()) == lcfg.num_lora_params
  tokens, mask = _tokens()
  base = base_logits(state, tokens, mask)
  np.testing.assert_array_equal(lora_logits(lora_state, tokens, mask), base)

  adapted = _randomised(lora_state)
  got = lora_logits(adapted, tokens, mask)
  assert float(jnp.abs(got - base).max()) > 1e-2
  by_hand = _merged_by_hand(lcfg, adapted)
  np.testing.assert_allclose(got, base_logits(by_hand, tokens, mask), atol=1e-5, rtol=0)
  merged = jax.jit(lambda s: merge_adapters(lcfg, s))(adapted)  # what generation runs
  np.testing.assert_allclose(base_logits(merged, tokens, mask), got, atol=1e-5, rtol=0)
  if grads:
    _assert_expert_grads_are_the_merged_ones(lcfg, graphdef, state, lora_graphdef, adapted,
                                             by_hand, tokens, mask)


def _assert_expert_grads_are_the_merged_ones(lcfg, graphdef, state, lora_graphdef, adapted,
                                             by_hand, tokens, mask):
  """The gradient w.r.t. layer 0's expert adapters is jax.grad of the same loss on the
  merged formulation, W_e + s A_e B_e put into the base model's graph."""
  trained, frozen = nnx.split_state(adapted, trainable_filter(lcfg, "lm"), ...)
  grads = jax.jit(jax.grad(
      lambda t: _loss(lora_graphdef)(nnx.merge_state(frozen, t), tokens, mask)))(trained)
  grads = {tuple(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(grads)}
  kernels = {tuple(p): v[...] for p, v in nnx.to_flat_state(state)}
  layer = ("layers", 0, "mlp")

  def merged_loss(pairs):
    flat = []
    for path, var in nnx.to_flat_state(by_hand):
      if tuple(path[:3]) == layer and path[3] in pairs:
        a, b = pairs[path[3]]
        var = var.replace(value=kernels[tuple(path)] + lcfg.lora_scale * jnp.matmul(a, b))
      flat.append((path, var))
    return _loss(graphdef)(nnx.from_flat_state(flat), tokens, mask)
  pairs = {proj: tuple(adapted["layers"][0]["mlp"][f"{proj}_{w}"][...]
                      for w in ("lora_a", "lora_b"))
           for proj in PROJ}
  want = jax.jit(jax.grad(merged_loss))(pairs)
  for proj in PROJ:
    for i, which in enumerate(("lora_a", "lora_b")):
      g = grads[layer + (f"{proj}_{which}",)]
      assert np.abs(g).max() > 1e-6, (proj, which)
      np.testing.assert_allclose(g, np.asarray(want[proj][i]), atol=1e-6, rtol=1e-4,
                                 err_msg=f"{proj}_{which}")


def test_expert_parallel_lora_step_equals_one_device():
  """all_to_all dispatch on fsdp 2 x expert 4 (8 simulated devices, one expert a device):
  the adapters split over the expert axis with their stacks, and the LoRA forward, its
  gradients and one optimizer update of the adapters alone equal one device's; the
  logits are those of the experts merged by hand."""
  mesh = train_mesh(jax.devices(), fsdp=2, expert=4)
  cfg = ModelConfig(**{**TINY, "moe_dispatch": "all_to_all"})
  lcfg = lora_config(cfg, 4, 8.0, "all-linear")
  graphdef, state = add_adapters(lcfg, _built(cfg)[1], seed=1)
  state = _randomised(state)
  sharded = jax.device_put(state, state_shardings(state, mesh, TRAIN_RULES))
  a = sharded["layers"][0]["mlp"]["down_lora_a"][...]
  assert a.sharding.spec[0] == "expert" and {s.data.shape[0] for s in a.addressable_shards} == {1}
  opt = optax.adamw(1e-2, eps=1e-4)  # eps above float32's rounding of the gradients
  filt = trainable_filter(lcfg, "lm")

  def stepper(mesh):
    def step(params, opt_state, tokens, mask):
      trained, frozen = nnx.split_state(params, filt, ...)
      loss, grads = jax.value_and_grad(
          lambda t: _loss(graphdef, mesh)(nnx.merge_state(frozen, t), tokens, mask))(trained)
      updates, opt_state = opt.update(grads, opt_state, trained)
      context = (jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh is not None
                 else contextlib.nullcontext())
      with context:
        logits = logits_fn(graphdef, params, tokens, mask)
      return loss, logits, grads, optax.apply_updates(trained, updates)
    return jax.jit(step)

  tokens, mask = _tokens(rows=8, length=10)
  traced = []
  from hflax.models import experts
  exchange = experts._exchange
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(experts, "_exchange", lambda *a, **kw: traced.append(a[6]) or exchange(*a, **kw))
    rows = batch_sharding(mesh)
    trained = nnx.split_state(sharded, filt, ...)[0]
    got = stepper(mesh)(sharded, opt.init(trained), jax.device_put(tokens, rows),
                        jax.device_put(mask, rows))
  # The exchange ran each device's own experts with their own adapters (1 expert a device).
  assert traced and {a.shape[0] for a, _ in traced[0].values()} == {1}
  assert got[3]["layers"][0]["mlp"]["gate_lora_b"][...].sharding.spec[0] == "expert"
  one = jax.devices()[0]
  single = jax.device_put(state, one)
  want = stepper(None)(single, opt.init(nnx.split_state(single, filt, ...)[0]), tokens, mask)
  for name, x, y in zip(["loss", "logits", "grads", "adapters"], got, want):
    for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
      np.testing.assert_allclose(np.asarray(u), np.asarray(v), atol=1e-5, rtol=1e-5, err_msg=name)
  by_hand = _merged_by_hand(lcfg, state)
  np.testing.assert_allclose(np.asarray(got[1]), _logits(create_abstract(cfg)[0])(
      by_hand, tokens, mask), atol=1e-5, rtol=0)
  before, after = (s["layers"][0]["mlp"]["up_lora_a"][...] for s in (state, want[3]))
  assert float(jnp.abs(after - before).max()) > 1e-3


def test_peft_names_the_expert_adapters_as_transformers_names_the_experts(tmp_path):
  """The export's tensor names are the module names of transformers' Qwen3-MoE checkpoints
  (mlp.experts.{e}.gate_proj, mlp.gate for the router; read from one it saved) plus
  PEFT's lora_A / lora_B; it loads back bit for bit, and PEFT (which fuses per-expert
  adapters as transformers 5 fuses the experts) runs it as hflax does."""
  import torch
  from safetensors import safe_open
  model = tiny_moe(seed=1, mlp_only_layers=[])  # every layer sparse (see docs/models.md)
  model.save_pretrained(tmp_path / "base")
  cfg, _, state = hf.load_checkpoint(str(tmp_path / "base"))
  lcfg = lora_config(cfg, 4, 8.0, ALL_AND_ROUTER)
  graphdef, adapted = add_adapters(lcfg, state, seed=3)
  adapted = _randomised(adapted)
  export_adapter(str(tmp_path / "adapter"), lcfg, adapted, base_model=str(tmp_path / "base"))
  with safe_open(str(tmp_path / "base" / "model.safetensors"), "np") as f:
    weights = {k: f.get_slice(k).get_shape() for k in f.keys()}
  targets = {f".{t}.weight" for t in lcfg.lora_targets}
  want = {}
  for name, (out, din) in ((k, s) for k, s in weights.items() if k.endswith(tuple(targets))):
    module = "base_model.model." + name.removesuffix(".weight")
    want[module + ".lora_A.weight"], want[module + ".lora_B.weight"] = [4, din], [out, 4]
  assert any(".mlp.experts.7.down_proj." in k for k in want)
  assert "base_model.model.model.layers.2.mlp.gate.lora_B.weight" in want  # the router
  with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "np") as f:
    assert {k: f.get_slice(k).get_shape() for k in f.keys()} == want
  loaded = load_adapter(str(tmp_path / "adapter"), lcfg)
  for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(split_adapters(adapted)[0]),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  peft = pytest.importorskip("peft")  # the names above are checked without it
  tokens, mask = _tokens(vocab=128)
  with torch.no_grad():
    plain = model(torch.tensor(np.asarray(tokens))).logits.numpy()
    reference = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    want_logits = reference(torch.tensor(np.asarray(tokens))).logits.numpy()
  assert np.abs(want_logits - plain).max() > 1e-2  # PEFT read the adapters
  ours = np.asarray(_logits(graphdef)(adapted, tokens, mask))
  np.testing.assert_allclose(ours, want_logits, atol=2e-4)


def test_shared_expert_gate_adapters_are_the_hand_merged_gate():
  """Qwen2-MoE's shared expert gate ([hidden, 1]) is an nn.Linear, which PEFT's all-linear
  adapts: hflax's all-linear does too on a model with a shared expert, A [D, r] and B
  [r, 1] in each sparse layer. The adapted logits are those of the gate merged by hand,
  and the adapters' gradients jax.grad of the merged formulation."""
  cfg = ModelConfig(**{**TINY, "family": "qwen2_moe", "qk_norm": False, "qkv_bias": True,
                       "shared_expert_intermediate_size": 20, "norm_topk_prob": False,
                       "moe_dispatch": "sorted"})
  lcfg = lora_config(cfg, 4, 8.0, "all-linear")
  assert lcfg.lora_targets[-1] == "shared_expert_gate"
  assert "shared_expert_gate" not in lora_config(ModelConfig(**TINY), 4, 8.0,
                                                 "all-linear").lora_targets
  graphdef, state = _built(cfg)
  lora_graphdef, lora_state = add_adapters(lcfg, state, seed=1)
  gate = lora_state["layers"][0]["mlp"]["shared_expert_gate"]
  assert gate["lora_a"].get_value().shape == (32, 4) and gate["lora_b"].get_value().shape == (4, 1)
  assert "shared_expert_gate" not in lora_state["layers"][1]["mlp"]  # layer 1 is dense
  adapters = jax.tree.leaves(split_adapters(lora_state)[0])
  assert sum(a.size for a in adapters) == lcfg.num_lora_params
  # Only the gate's adapters non-zero: what they change is the gate's alone.
  only_gate = jax.tree_util.tree_map_with_path(
      lambda p, x: x if "shared_expert_gate" in jax.tree_util.keystr(p) else jnp.zeros_like(x),
      random_adapters(lora_state, scale=1.0))
  only_gate = nnx.merge_state(state, split_adapters(only_gate)[0])
  tokens, mask = _tokens()
  got = _logits(lora_graphdef)(only_gate, tokens, mask)
  base = _logits(graphdef)(state, tokens, mask)
  assert float(jnp.abs(got - base).max()) > 1e-3
  by_hand = _merged_by_hand(lcfg, only_gate)
  np.testing.assert_allclose(got, _logits(graphdef)(by_hand, tokens, mask), atol=1e-5, rtol=0)

  trained, frozen = nnx.split_state(only_gate, trainable_filter(lcfg, "lm"), ...)
  grads = jax.jit(jax.grad(
      lambda t: _loss(lora_graphdef)(nnx.merge_state(frozen, t), tokens, mask)))(trained)
  kernel = ("layers", 0, "mlp", "shared_expert_gate", "kernel")

  def merged_loss(a, b):
    flat = [(p, v.replace(value=v[...] + lcfg.lora_scale * a @ b) if tuple(p) == kernel
             else v) for p, v in nnx.to_flat_state(state)]
    return _loss(graphdef)(nnx.from_flat_state(flat), tokens, mask)
  pair = only_gate["layers"][0]["mlp"]["shared_expert_gate"]
  want = jax.jit(jax.grad(merged_loss, argnums=(0, 1)))(pair["lora_a"][...], pair["lora_b"][...])
  for i, which in enumerate(("lora_a", "lora_b")):
    g = np.asarray(grads["layers"][0]["mlp"]["shared_expert_gate"][which][...])
    assert np.abs(g).max() > 1e-6, which
    np.testing.assert_allclose(g, np.asarray(want[i]), atol=1e-6, rtol=1e-4, err_msg=which)


def test_peft_adapts_the_shared_expert_gate_and_hflax_runs_its_adapter(tmp_path):
  """PEFT's all-linear (transformers 5, PEFT 0.21) adapts Qwen2-MoE's shared_expert_gate;
  an adapter PEFT saved on the gate (and q_proj) runs in hflax as in PEFT."""
  import peft
  import torch
  from hflax.models.lora import load_adapter, read_adapter_config
  from moe_models import tiny_qwen2_moe
  model = tiny_qwen2_moe(seed=2, mlp_only_layers=[])
  everything = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                          target_modules="all-linear"))
  adapted_by_peft = {n for n, _ in everything.named_modules() if n.endswith(".lora_A")}
  assert "base_model.model.model.layers.0.mlp.shared_expert_gate.lora_A" in adapted_by_peft
  model = everything.unload()  # the base model again, its modules unwrapped
  model.save_pretrained(tmp_path / "base")
  peft_model = peft.get_peft_model(model, peft.LoraConfig(
      r=4, lora_alpha=8, target_modules=["q_proj", "shared_expert_gate"],
      init_lora_weights=False)).eval()  # B random too
  peft_model.save_pretrained(tmp_path / "adapter")
  tokens, mask = _tokens(vocab=128)
  with torch.no_grad():
    want = peft_model(torch.tensor(np.asarray(tokens))).logits.numpy()
    peft_model.base_model.model.model.layers[0].mlp.shared_expert_gate.lora_B["default"] \
        .weight.zero_()
    without_gate = peft_model(torch.tensor(np.asarray(tokens))).logits.numpy()
  assert np.abs(want - without_gate).max() > 1e-3  # the gate's adapter matters
  found = read_adapter_config(str(tmp_path / "adapter"))
  assert set(found["targets"]) == {"q_proj", "shared_expert_gate"}
  cfg, _, state = hf.load_checkpoint(str(tmp_path / "base"))
  lcfg = lora_config(cfg, found["rank"], found["alpha"], found["targets"])
  loaded = nnx.merge_state(state, load_adapter(str(tmp_path / "adapter"), lcfg))
  ours = np.asarray(_logits(create_abstract(lcfg)[0])(loaded, tokens, mask))
  np.testing.assert_allclose(ours, want, atol=2e-4)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_peft_target_parameters_on_fused_experts_load_and_run_as_peft(family, tmp_path,
                                                                    monkeypatch):
  """PEFT 0.21's LoRA on transformers 5's fused expert tensors (target_parameters
  mlp.experts.gate_up_proj [E, 2I, D] and down_proj [E, D, I], its ParamWrapper): each
  expert has its own rank-r pair, gate_up's A shared by the gate and up rows, so hflax
  reads it as gate_proj, up_proj and down_proj adapters, one pair an expert, and runs the
  logits PEFT runs (random A and B, every layer sparse)."""
  import peft
  import torch
  from peft.utils import transformers_weight_conversion
  from hflax.models.lora import load_adapter, read_adapter_config
  from moe_models import tiny_qwen2_moe
  # PEFT copies transformers' table of converted MoE architectures when it is first
  # imported, and whether that copy names qwen2_moe depends on what the process loaded
  # before; where it does, PEFT reads the shared expert's gate_proj / up_proj targets as
  # transformers 4's expert names and fuses them into one rank-2r gate_up pair (which
  # hflax refuses in one line: its gate and up adapters have rank r each). The adapter
  # tested here is the one PEFT makes without that conversion.
  monkeypatch.delitem(transformers_weight_conversion._MODEL_TO_CONVERSION_PATTERN,
                      "qwen2_moe", raising=False)
  model = (tiny_moe if family == "qwen3_moe" else tiny_qwen2_moe)(seed=3, mlp_only_layers=[])
  model.save_pretrained(tmp_path / "base")
  peft_model = peft.get_peft_model(model, peft.LoraConfig(
      r=4, lora_alpha=8, target_modules=["q_proj"] + (
          ["gate_proj", "up_proj", "down_proj"] if family == "qwen2_moe" else []),
      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
      init_lora_weights=False)).eval()  # B random too
  peft_model.save_pretrained(tmp_path / "adapter")
  tokens, mask = _tokens(vocab=128)
  with torch.no_grad():
    want = peft_model(torch.tensor(np.asarray(tokens))).logits.numpy()
    peft_model.disable_adapter_layers()
    plain = peft_model(torch.tensor(np.asarray(tokens))).logits.numpy()
  assert np.abs(want - plain).max() > 1e-2  # PEFT's adapters change the model
  found = read_adapter_config(str(tmp_path / "adapter"))
  assert set(found["targets"]) == {"q_proj", "gate_proj", "up_proj", "down_proj"}
  cfg, _, state = hf.load_checkpoint(str(tmp_path / "base"))
  lcfg = lora_config(cfg, found["rank"], found["alpha"], found["targets"])
  adapters = load_adapter(str(tmp_path / "adapter"), lcfg)
  mlp = adapters["layers"][0]["mlp"]
  np.testing.assert_array_equal(mlp["gate_lora_a"][...], mlp["up_lora_a"][...])  # shared A
  loaded = nnx.merge_state(state, adapters)
  ours = np.asarray(_logits(create_abstract(lcfg)[0])(loaded, tokens, mask))
  np.testing.assert_allclose(ours, want, atol=2e-4)


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,down_proj"])
def test_fused_export_is_peft_target_parameters_and_reads_back(targets, tmp_path):
  """export_adapter(fused_experts=True) writes transformers 5's format: target_parameters
  on the fused experts, gate and up as one rank-2r pair (A stacked, B block-diagonal,
  rank_pattern / alpha_pattern 2r / 2 alpha for gate_up_proj alone). PEFT loads it and
  runs hflax's logits; hflax reads it back bit for bit. gate_proj without up_proj (or the
  reverse) is refused in one line: PEFT adapts gate_up_proj whole."""
  import json

  import peft
  import torch
  from hflax.models.lora import load_adapter, read_adapter_config
  model = tiny_moe(seed=4, mlp_only_layers=[], num_hidden_layers=2)  # both layers sparse
  model.save_pretrained(tmp_path / "base")
  cfg, _, state = hf.load_checkpoint(str(tmp_path / "base"))
  lcfg = lora_config(cfg, 4, 8.0, targets)
  graphdef, adapted = add_adapters(lcfg, state, seed=5)
  adapted = _randomised(adapted)
  export_adapter(str(tmp_path / "adapter"), lcfg, adapted, fused_experts=True)
  written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  both = targets == "all-linear"
  assert written["target_parameters"] == (
      ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"] if both
      else ["mlp.experts.down_proj"])
  assert written["rank_pattern"] == ({"experts.gate_up_proj": 8} if both else {})
  tokens, mask = _tokens(vocab=128)
  with torch.no_grad():
    reference = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
    want = reference(torch.tensor(np.asarray(tokens))).logits.numpy()
  ours = np.asarray(_logits(graphdef)(adapted, tokens, mask))
  np.testing.assert_allclose(ours, want, atol=2e-4)
  assert set(read_adapter_config(str(tmp_path / "adapter"))["targets"]) == set(lcfg.lora_targets)
  back = load_adapter(str(tmp_path / "adapter"), lcfg)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(split_adapters(adapted)[0]),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  if both:  # a rank-2r pair whose B mixes gate and up is no pair of hflax's: refused
    from safetensors.numpy import load_file, save_file
    file = str(tmp_path / "adapter" / "adapter_model.safetensors")
    tensors = load_file(file)
    key = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight"
    tensors[key][0, -1] = 1.0  # gate row 0, rank 7 (up's half), expert E - 1
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"rank-8 pair mixes gate and up rows \(not block-"
                                         r"diagonal\); hflax's gate and up adapters have rank 4"):
      load_adapter(str(tmp_path / "adapter"), lcfg)
  else:
    gate_only = lora_config(cfg, 4, 8.0, "gate_proj")
    with pytest.raises(ValueError, match=r"^fused_experts: .* adapt one of gate_proj and "
                                         r"up_proj; transformers 5 fuses them") as e:
      export_adapter(str(tmp_path / "gate"), gate_only, add_adapters(gate_only, state, 0)[1],
                     fused_experts=True)
    assert "\n" not in str(e.value) and not (tmp_path / "gate").exists()


def test_target_parameters_hflax_cannot_run_are_refused_in_one_line(tmp_path):
  import json
  from hflax.models.lora import read_adapter_config
  base = dict(peft_type="LORA", r=4, lora_alpha=8, target_modules=["q_proj"])
  for extra, message in (
      (dict(target_parameters=["self_attn.q_proj.weight"]),
       "target_parameters 'self_attn.q_proj.weight': hflax reads LoRA on the fused experts'"),
      (dict(target_parameters=["mlp.experts.down_proj"], rank_pattern={"q_proj": 8}),
       "rank_pattern={'q_proj': 8}, alpha_pattern={} is not supported"),
      (dict(target_parameters=["mlp.experts.gate_up_proj"],
            rank_pattern={"experts.gate_up_proj": 8}),  # 2r without 2 alpha: another scale
       "only gate_up_proj at 2r=8 with alpha 16")):
    (tmp_path / "adapter_config.json").write_text(json.dumps({**base, **extra}))
    with pytest.raises(ValueError, match=message) as e:
      read_adapter_config(str(tmp_path))
    assert "\n" not in str(e.value)


def test_grpo_run_trains_the_expert_adapters_and_generates_with_them_merged(tmp_path):
  """The tiny GRPO job on the tiny MoE with model.lora_rank=4 on the experts alone: the
  first rollout samples with the base model's log-probs (B = 0: the reference's, the frozen
  base's) and the second with the adapted model's (generation runs the merged experts: its
  log-probs are the adapted model's teacher-forced ones, not the base's); the adapters
  moved, the base stayed."""
  from hflax.models.tokenizer import ByteTokenizer
  from tiny_config import fit, get_config
  path = tmp_path / "moe"
  # Two layers, both sparse: every expert projection adapted in each, at two thirds of
  # tiny_moe's three layers' compile.
  tiny_moe(vocab_size=ByteTokenizer().vocab_size, bos_token_id=None, eos_token_id=None,
           pad_token_id=None, mlp_only_layers=[], num_hidden_layers=2).save_pretrained(path)

  def run(name, steps, **lora):
    c = get_config()
    c.model.update(path=str(path), tokenizer="byte", **lora)
    # entropy_coeff: a gradient for the adapters while a random model's rewards are all 0.
    c.actor.update(recompute_log_prob=True, entropy_coeff=0.1)
    c.actor.optim.lr = 1e-2
    c.data.max_response_length = 8
    c.trainer.update(total_steps=steps, save_every=steps, run_dir=str(tmp_path / name),
                     export_hf=False, compile_cache_dir="")
    batches = []
    return fit(c, lambda info: batches.append(info.batch.to_host())), batches

  trainer, batches = run("lora", 2, lora_rank=4, lora_alpha=8.0,
                         target_modules="gate_proj,up_proj,down_proj")
  for step, b in enumerate(batches):
    m = np.asarray(b["response_mask"], bool)
    rollout, old, ref = (np.asarray(b[k])[m] for k in
                         ("rollout_log_probs", "old_log_probs", "ref_log_prob"))
    np.testing.assert_allclose(rollout, old, atol=1e-5)
    assert np.abs(rollout - ref).max() > 1e-2 if step else np.abs(rollout - ref).max() < 1e-5
  _, _, state = hf.load_checkpoint(str(path))
  adapters, base = split_adapters(trainer.roles.actor.params)
  assert {p[-1] for p, _ in nnx.to_flat_state(adapters)} == {
      f"{proj}_lora_{w}" for proj in PROJ for w in "ab"}
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(state), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert all(np.asarray(b).any() for p, b in nnx.to_flat_state(adapters) if p[-1].endswith("b"))


def test_the_router_target_needs_a_mixture_of_experts():
  from hflax.launch.models import read_model_configs
  from tiny_config import get_config
  dense = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                      num_heads=4, num_kv_heads=2)
  with pytest.raises(ValueError, match="'gate' names a mixture of experts' router; this llama"):
    lora_config(dense, 4, 8.0, "q_proj,gate")
  with pytest.raises(ValueError, match="'shared_expert_gate' names Qwen2-MoE's shared expert "
                                       "gate; this qwen3_moe model has no shared expert"):
    lora_config(ModelConfig(**TINY), 4, 8.0, "shared_expert_gate")
  c = get_config()  # the built-in model: dense
  c.model.update(lora_rank=4, target_modules="q_proj,gate")
  with pytest.raises(ValueError, match="^config.model.target_modules: 'gate' names a mixture"):
    read_model_configs(c)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_peft_all_linear_adapter_leaves_the_routed_experts_out_in_hflax_too(family, tmp_path,
                                                                           monkeypatch):
  """PEFT's all-linear where transformers 5's routed experts are fused parameters adapts
  nn.Linear modules only: attention, the dense layer's MLP and (Qwen2-MoE) the shared
  expert and its gate; not the routed experts, not the router. Its target_modules still
  name gate_proj, up_proj and down_proj, so hflax reads from the adapter's tensors that
  the routed experts are left out (lora_experts=False): it loads with PEFT's logits, has
  no routed-expert adapters to train, and exports an adapter PEFT loads to hflax's
  logits, its experts unadapted whether or not PEFT converts transformers 4's expert
  names. An adapter adapting some routed experts, or missing a tensor, is refused in one
  line."""
  import json

  import peft
  import torch
  import transformers
  from peft.utils import transformers_weight_conversion
  from safetensors.numpy import load_file, save_file
  from hflax.controller.build import with_lora
  from hflax.controller.plan import LoraPlan
  from hflax.models.lora import adapter_adapts_experts, read_adapter_config
  from moe_models import tiny_qwen2_moe
  # PEFT's copy of transformers' conversion table (see the target_parameters test above)
  # maps both families to qwen2_moe, whose conversion reads all-linear as the fused experts
  # and router too; without it PEFT adapts nn.Linear modules alone, the adapter tested here.
  table = transformers_weight_conversion._MODEL_TO_CONVERSION_PATTERN
  for name in ("qwen2_moe", "qwen3_moe"):
    monkeypatch.delitem(table, name, raising=False)
  make = tiny_qwen2_moe if family == "qwen2_moe" else tiny_moe
  make(seed=5).save_pretrained(tmp_path / "base")  # layers 0 and 2 sparse, 1 dense

  def base():
    return transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", attn_implementation="eager").eval()
  peft_model = peft.get_peft_model(base(), peft.LoraConfig(
      r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)).eval()
  adapted = {n for n, _ in peft_model.named_modules() if n.endswith(".lora_A")}
  assert not any(".experts" in n or ".mlp.gate." in n for n in adapted)  # experts, router
  assert any(".layers.1.mlp.gate_proj" in n for n in adapted)
  assert any(".shared_expert." in n for n in adapted) == (family == "qwen2_moe")
  peft_model.save_pretrained(tmp_path / "adapter")
  tokens, mask = _tokens(vocab=128)
  with torch.no_grad():
    want = peft_model.merge_and_unload()(torch.tensor(np.asarray(tokens))).logits.numpy()
    plain = base()(torch.tensor(np.asarray(tokens))).logits.numpy()
  assert np.abs(want - plain).max() > 1e-2

  adapter = str(tmp_path / "adapter")
  found = read_adapter_config(adapter)
  assert {"gate_proj", "up_proj", "down_proj"} <= set(found["targets"])
  assert not adapter_adapts_experts(adapter)
  cfg, _, state = hf.load_checkpoint(str(tmp_path / "base"))
  lcfg = with_lora(cfg, LoraPlan(rank=found["rank"], alpha=found["alpha"],
                                 target_modules=",".join(found["targets"]),
                                 adapter_path=adapter))
  assert not lcfg.lora_experts
  adapters = load_adapter(adapter, lcfg)
  layer = adapters["layers"][0]  # sparse: its shared expert's and gate's adapters alone
  assert set(layer["mlp"] if "mlp" in layer else ()) == (
      {"shared_expert", "shared_expert_gate"} if family == "qwen2_moe" else set())
  assert sum(a.size for a in jax.tree.leaves(adapters)) == lcfg.num_lora_params
  graphdef = create_abstract(lcfg)[0]
  ours = np.asarray(_logits(graphdef)(nnx.merge_state(state, adapters), tokens, mask))
  np.testing.assert_allclose(ours, want, atol=2e-4)

  # Export, with adapters moved (as training would): PEFT runs hflax's logits, converting
  # transformers 4's names or not.
  moved = _randomised(nnx.merge_state(state, adapters))
  ours = np.asarray(_logits(graphdef)(moved, tokens, mask))
  export_adapter(str(tmp_path / "export"), lcfg, moved)
  written = json.loads((tmp_path / "export" / "adapter_config.json").read_text())
  assert "gate_proj" not in written["target_modules"]  # named by parent: mlp.gate_proj
  for converted in (False, True):
    if converted:
      monkeypatch.setitem(table, family, "qwen2_moe")
    with torch.no_grad():
      reference = peft.PeftModel.from_pretrained(base(), str(tmp_path / "export")).eval()
      got = reference(torch.tensor(np.asarray(tokens))).logits.numpy()
    assert not any(".experts" in n or ".mlp.gate." in n for n, _ in reference.named_modules()
                   if n.endswith(".lora_A"))
    np.testing.assert_allclose(got, ours, atol=2e-4, err_msg=f"converted={converted}")
  assert not adapter_adapts_experts(str(tmp_path / "export"))
  assert set(read_adapter_config(str(tmp_path / "export"))["targets"]) == set(lcfg.lora_targets)

  # Inconsistent adapters: a tensor missing; one routed expert's pair among none.
  file = tmp_path / "adapter" / "adapter_model.safetensors"
  tensors = load_file(str(file))
  dense = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
  save_file({k: v for k, v in tensors.items() if k != dense}, str(file))
  with pytest.raises(ValueError, match=f"no tensor '{dense}' \\(adapter and model") as e:
    load_adapter(adapter, lcfg)
  assert "\n" not in str(e.value)
  expert = "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_{}.weight"
  save_file({**tensors, expert.format("A"): np.zeros((4, 64), np.float32),
             expert.format("B"): np.zeros((48, 4), np.float32)}, str(file))
  assert adapter_adapts_experts(adapter)
  with pytest.raises(ValueError, match=r"no tensor '.*layers\.0\.mlp\.experts\.0\.(up|down)_"
                                       r"proj\.lora_A\.weight' \(its routed experts are "
                                       r"adapted in part\)") as e:
    load_adapter(adapter, with_lora(cfg, LoraPlan(
        rank=4, alpha=8.0, target_modules=",".join(found["targets"]), adapter_path=adapter)))
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="tensors the model has no place for: .*experts"):
    load_adapter(adapter, lcfg)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_peft_all_linear_read_as_transformers_4_names_adapts_the_experts_and_router(
    family, tmp_path, monkeypatch):
  """Where PEFT converts transformers 4's expert names (its table naming the family: a
  fresh PEFT 0.22 process does), all-linear also adapts the fused experts
  (target_parameters gate_up_proj at rank 2r, down_proj) and the router (gate.weight, a
  pair stored as an nn.Linear's): hflax reads gate.weight as its "gate" target and runs
  PEFT's logits where gate_up's B keeps gate and up apart (block-diagonal: hflax's gate
  and up adapters have rank r each); a B that mixes them is refused in one line."""
  import peft
  import torch
  from peft.utils import transformers_weight_conversion
  from hflax.models.lora import adapter_adapts_experts, read_adapter_config
  from moe_models import tiny_qwen2_moe
  monkeypatch.setitem(transformers_weight_conversion._MODEL_TO_CONVERSION_PATTERN, family,
                      "qwen2_moe")
  model = (tiny_qwen2_moe if family == "qwen2_moe" else tiny_moe)(seed=6)
  model.save_pretrained(tmp_path / "base")
  peft_model = peft.get_peft_model(model, peft.LoraConfig(
      r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)).eval()
  assert set(peft_model.peft_config["default"].target_parameters) == {
      "gate.weight", "gate_up_proj", "down_proj"}
  inner, columns = 48, 4 * 8  # B [2I, 2r E]: rank k of expert e in column k E + e
  mixed = peft_model.base_model.model.model.layers[0].mlp.experts.base_layer
  mixed = mixed.lora_B["default"].weight.detach().clone()
  with torch.no_grad():
    for name, p in peft_model.named_parameters():
      if ".experts.base_layer.lora_B" in name:  # gate_up's pair (it nests once more)
        p[:inner, columns:], p[inner:, :columns] = 0.0, 0.0
  peft_model.save_pretrained(tmp_path / "adapter")
  tokens, mask = _tokens(vocab=128)
  with torch.no_grad():
    want = peft_model(torch.tensor(np.asarray(tokens))).logits.numpy()
    peft_model.base_model.model.model.layers[0].mlp.gate.lora_B["default"].weight.zero_()
    without_router = peft_model(torch.tensor(np.asarray(tokens))).logits.numpy()
  assert np.abs(want - without_router).max() > 1e-3  # the router's adapter matters
  adapter = str(tmp_path / "adapter")
  found = read_adapter_config(adapter)
  assert set(found["targets"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                   "up_proj", "down_proj", "gate"} | (
      {"shared_expert_gate"} if family == "qwen2_moe" else set())
  assert adapter_adapts_experts(adapter)
  cfg, _, state = hf.load_checkpoint(str(tmp_path / "base"))
  lcfg = lora_config(cfg, found["rank"], found["alpha"], found["targets"])
  adapters = load_adapter(adapter, lcfg)
  ours = np.asarray(_logits(create_abstract(lcfg)[0])(nnx.merge_state(state, adapters),
                                                      tokens, mask))
  np.testing.assert_allclose(ours, want, atol=2e-4)

  from safetensors.numpy import load_file, save_file
  file = str(tmp_path / "adapter" / "adapter_model.safetensors")
  tensors = load_file(file)
  tensors["base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight"] = \
      mixed.numpy()  # as PEFT trains it: gate and up rows read every rank
  save_file(tensors, file)
  with pytest.raises(ValueError, match=r"rank-8 pair mixes gate and up rows \(not block-"
                                       r"diagonal\)") as e:
    load_adapter(adapter, lcfg)
  assert "\n" not in str(e.value)


def test_the_launcher_reads_all_linear_as_the_model_does(tmp_path):
  """A PEFT all-linear adapter on Qwen2-MoE names shared_expert_gate among its targets;
  config.model.target_modules="all-linear" describes it on that model (lora_config adds the
  gate), not on one without a shared expert."""
  import json
  from hflax.launch.config import base_config
  from hflax.launch.models import check_adapter
  names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "shared_expert_gate"]
  (tmp_path / "adapter_config.json").write_text(json.dumps(
      dict(peft_type="LORA", r=4, lora_alpha=8, target_modules=names)))
  c = base_config()
  c.model.update(lora_rank=4, lora_alpha=8.0, target_modules="all-linear",
                 lora_adapter_path=str(tmp_path))
  shared = ModelConfig(**TINY, shared_expert_intermediate_size=20)
  check_adapter(c, shared)
  with pytest.raises(ValueError, match="target_modules .*shared_expert_gate"):
    check_adapter(c, ModelConfig(**TINY))
