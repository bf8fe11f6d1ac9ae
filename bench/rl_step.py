#!/usr/bin/env python
"""Side-by-side GRPO step benchmark: hflax vs TRL's GRPOTrainer, same workload, one process.

One run builds a random Llama-style model with hflax (about 10.5M parameters, byte-level
vocabulary of 261 ids), saves it once as a Hugging Face directory together with a
`tokenizers` tokenizer over the same 261 ids and a ChatML template, and then trains it
with GRPO twice from that same directory:

  * hflax: `hflax.launch.trainer.Trainer` with `model.path` and `model.tokenizer` set to
    the directory, one device, colocated placement, stepped with the GRPO driver and
    `timed_roles` exactly as `Trainer.fit` does (validation, checkpoints and logging off);
  * TRL: `GRPOTrainer` on the model and tokenizer loaded from the directory (torch CPU,
    fp32, no gradient checkpointing, plain `transformers` generation).

Both see the same prompts per step (2-digit arithmetic questions, all exactly the same
length), samples per prompt, maximum response length, temperature 1.0, reward function
(the fraction of digit characters in the response), learning rate, AdamW (betas 0.9 /
0.999, no weight decay, grad-norm clip 1.0), token-mean clipped policy loss (clip 0.2),
no KL term (beta 0), and one optimizer step per RL step over the whole batch.

The frameworks alternate inside one `trainer.train()` call: a TRL callback runs a block
of hflax steps after every block of TRL steps, after warm-up steps of each (hflax
compiles on its first step). tokens/s = (prompt + response tokens of the step's batch) /
wall time of the step; the medians over the timed steps are compared.

  python bench/rl_step.py            # full run (a few minutes on 2 cores)
  python bench/rl_step.py --quick    # smoke run

Exit status is 0 whether or not the target is met.
"""
from __future__ import annotations

import os

# Nothing may reach the network: every model and tokenizer here is built locally.
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
             "HF_HUB_DISABLE_TELEMETRY"):
  os.environ.setdefault(_var, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch's OpenMP threads spin-wait by default; on a shared machine (other processes on the
# same cores) that makes its 2-thread matmuls 10-40x slower, which would flatter hflax.
# Passive waiting gives TRL its best times there (set OMP_WAIT_POLICY to override).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# TRL runs on torch's CPU backend (use_cpu=True): JAX on an accelerator would compare
# different hardware, so hflax is held to the CPU too.
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGET_RATIO = 2.0  # hflax tokens/s over TRL tokens/s
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>")  # ids 256..260
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PAD_ID, EOS_ID = 256, 260


# ----------------------------------------------------------------------------- the reward

def digit_fraction(text: str) -> float:
  """Share of the response's characters that are digits: length-independent, in [0, 1]."""
  return sum(c.isdigit() for c in text) / len(text) if text else 0.0


def hflax_reward(response_text, ground_truth, extra_info):
  """hflax's custom reward signature (config.reward.custom_fn)."""
  return digit_fraction(response_text)


def trl_reward(prompts, completions, **kwargs):
  """TRL's reward signature: conversational completions are lists of messages."""
  return [digit_fraction(c[-1]["content"] if isinstance(c, list) else c) for c in completions]


# ----------------------------------------------------------------------------- shared files

def byte_to_char() -> dict[int, str]:
  """A reversible byte -> printable unicode character table, as byte-level BPE uses."""
  keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
          *range(ord("\u00ae"), ord("\u00ff") + 1)]
  table, extra = {b: chr(b) for b in keep}, 0
  for b in range(256):
    if b not in table:
      table[b] = chr(256 + extra)
      extra += 1
  return table


def save_tokenizer(directory: str):
  """Byte ids 0..255 (one token per UTF-8 byte, no merges) + the 5 special tokens 256..260."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  vocab = {ch: b for b, ch in byte_to_char().items()}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t in SPECIAL_TOKENS])
  ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
  if ids != list(range(256, 261)):
    raise RuntimeError(f"special tokens got ids {ids}, expected 256..260")
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<|im_end|>",
                                 pad_token="<pad>", chat_template=CHAT_TEMPLATE)
  fast.save_pretrained(directory)


def build_shared_checkpoint(directory: str, args):
  """Random weights built by hflax, written as an HF checkpoint + tokenizer (both load it)."""
  from hflax.models import ModelConfig, create
  from hflax.models.hf import export_checkpoint

  cfg = ModelConfig(family="llama", vocab_size=261, hidden_size=args.hidden,
                    intermediate_size=args.intermediate, num_layers=args.layers,
                    num_heads=args.heads, num_kv_heads=args.kv_heads, dtype="float32",
                    param_dtype="float32", eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                    bos_token_id=257, tie_word_embeddings=False)
  _, state = create(cfg, seed=0)
  export_checkpoint(directory, cfg, state)
  save_tokenizer(directory)
  return cfg


def prompt_rows(count: int, seed: int = 0) -> list[dict]:
  """verl-schema rows: 2-digit +/- questions, so every prompt has the same token count."""
  from hflax.data import arithmetic_task
  train, _ = arithmetic_task(count, 0, seed=seed, digits=2, ops="+-")
  return list(train)


# ----------------------------------------------------------------------------- hflax side

def hflax_config(args, ckpt: str, data_file: str, run_dir: str, prompt_len: int):
  from hflax.launch.config import base_config
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = "grpo", "grpo"
  c.algorithm.norm_adv_by_std_in_grpo = True
  c.data.train_files = c.data.val_files = data_file
  c.data.train_batch_size = args.prompts
  c.data.max_prompt_length = prompt_len  # every prompt has exactly this length: no padding
  c.data.max_response_length = args.response_len
  c.model.path = c.model.tokenizer = ckpt
  c.actor.optim.update(lr=args.lr, weight_decay=0.0, b1=0.9, b2=0.999, grad_clip=1.0)
  c.actor.ppo_mini_batch_size = args.prompts  # one optimizer step per RL step
  c.critic.ppo_mini_batch_size = args.prompts  # GRPO has no critic; validation still checks it
  c.actor.ppo_micro_batch_size = 0  # the whole batch in one pass, like TRL's single micro-batch
  c.actor.ppo_epochs = 1
  c.actor.use_kl_loss, c.actor.entropy_coeff = False, 0.0
  c.actor.clip_ratio, c.actor.loss_agg_mode = 0.2, "token-mean"
  c.rollout.n, c.rollout.temperature = args.n, 1.0
  c.reward.custom_fn.update(path=os.path.abspath(__file__), name="hflax_reward")
  c.placement.kind = "colocated"
  c.trainer.update(devices=1, run_dir=run_dir, val_before_train=False, val_every=0, log=(),
                   export_hf=False, seed=0, stage_timing=True, total_steps=10**6)
  return c


class _BlockingActor:
  """The actor, except that update_actor waits for the new parameters and its metrics.

  timed_roles blocks on a stage's returned arrays, but update_actor returns only metrics
  in meta, so without this its time would land in whatever blocks next.
  """

  def __init__(self, worker):
    self._worker = worker

  def __getattr__(self, name):
    return getattr(self._worker, name)

  def update_actor(self, batch):
    import jax
    out = self._worker.update_actor(batch)
    jax.block_until_ready((out.meta.get("metrics"), self._worker.params))
    return out


class HflaxRunner:
  """Steps hflax's GRPO exactly as Trainer.fit does, minus validation/checkpoints/logging."""

  def __init__(self, cfg):
    import dataclasses
    from hflax.algorithms.drivers import get_algorithm
    from hflax.launch.trainer import Trainer
    self.cfg = cfg
    self.trainer = Trainer(cfg, log=lambda *a, **k: None)
    self.roles = dataclasses.replace(self.trainer.roles,
                                     actor=_BlockingActor(self.trainer.roles.actor))
    self.driver = get_algorithm("grpo").step
    self.prompts = self.trainer.prompt_batches()

  def step(self) -> dict:
    import jax
    import numpy as np
    from hflax.algorithms.drivers.common import step_metrics, timed_roles
    from hflax.launch.roles import step_config
    metrics: dict = {}
    roles = timed_roles(self.roles, metrics, block=self.cfg.trainer.stage_timing)
    began = time.perf_counter()
    batch = self.driver(roles, next(self.prompts), step_config(self.cfg), self.trainer.state)
    metrics.update(batch.meta.get("metrics", {}))
    metrics.update(step_metrics(batch, self.cfg.data.max_response_length))
    jax.block_until_ready(metrics)
    elapsed = time.perf_counter() - began
    self.trainer.state.step += 1
    prompt_tokens = float(np.asarray(batch["prompt_mask"]).sum())
    tokens = float(np.asarray(batch["attention_mask"]).sum())
    stages = {k.split("/", 1)[1]: float(v) for k, v in metrics.items() if k.startswith("timing_s/")}
    return dict(time=elapsed, tokens=tokens, prompt_tokens=prompt_tokens,
                response_tokens=tokens - prompt_tokens, stages=stages,
                score=float(metrics["critic/score/mean"]))


# ----------------------------------------------------------------------------- TRL side

def make_trl_trainer(args, ckpt: str, rows: list[dict], out_dir: str, max_steps: int, callback):
  import torch
  from datasets import Dataset
  from transformers import AutoModelForCausalLM, AutoTokenizer
  from trl import GRPOConfig, GRPOTrainer

  model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
  tokenizer = AutoTokenizer.from_pretrained(ckpt)
  dataset = Dataset.from_list([{"prompt": r["prompt"],
                                "ground_truth": r["reward_model"]["ground_truth"]} for r in rows])
  config = GRPOConfig(
      output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
      per_device_train_batch_size=args.prompts * args.n, gradient_accumulation_steps=1,
      steps_per_generation=1, num_iterations=1, num_generations=args.n,
      max_completion_length=args.response_len, temperature=1.0, top_p=1.0, top_k=0,
      learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
      adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
      beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
      max_steps=max_steps, logging_steps=10**6, save_strategy="no", eval_strategy="no",
      report_to="none", disable_tqdm=True, seed=0, dataloader_num_workers=0,
      log_completions=False)
  trainer = GRPOTrainer(model=model, reward_funcs=[trl_reward], args=config,
                        train_dataset=dataset, processing_class=tokenizer, callbacks=[callback])
  return trainer


def instrument_trl(trainer, record: dict):
  """Wraps the trainer's stage methods (on the instance) to time them; fills `record`."""

  def timed(name, fn, after=None):
    def call(*a, **k):
      t0 = time.perf_counter()
      out = fn(*a, **k)
      record[name] = record.get(name, 0.0) + time.perf_counter() - t0
      if after is not None:
        after(out)
      return out
    return call

  def count_tokens(out):
    record["prompt_tokens"] = float(out["prompt_mask"].sum())
    record["response_tokens"] = float(out["completion_mask"].sum())

  trainer._generate = timed("gen", trainer._generate)
  def reward_mean(out):
    record["reward_mean"] = float(out.nanmean())

  trainer._calculate_rewards = timed("reward", trainer._calculate_rewards, reward_mean)
  trainer._generate_and_score_completions = timed(
      "gen_and_score", trainer._generate_and_score_completions, count_tokens)
  original_training_step = trainer.training_step

  def training_step(*a, **k):
    out = timed("training_step", original_training_step)(*a, **k)
    record["training_step_end"] = time.perf_counter()
    return out
  trainer.training_step = training_step


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="smoke run: tiny batch, 1 round")
  parser.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8)")
  parser.add_argument("--n", type=int, default=None, help="samples per prompt (default 8)")
  parser.add_argument("--response-len", type=int, default=None,
                      help="max response tokens (default 64)")
  parser.add_argument("--lr", type=float, default=1e-5)
  parser.add_argument("--rounds", type=int, default=None,
                      help="alternating rounds after warm-up (default 3)")
  parser.add_argument("--steps-per-round", type=int, default=None,
                      help="RL steps per framework per round (default 2)")
  parser.add_argument("--hidden", type=int, default=384)
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--heads", type=int, default=6)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--intermediate", type=int, default=1152)
  parser.add_argument("--json", default="", help="also write the raw per-step records here")
  args = parser.parse_args(argv)
  q = args.quick
  args.prompts = args.prompts or (2 if q else 8)
  args.n = args.n or (4 if q else 8)
  args.response_len = args.response_len or (16 if q else 64)
  args.rounds = args.rounds or (1 if q else 3)
  args.steps_per_round = args.steps_per_round or (1 if q else 2)
  trl_warmup, hflax_warmup = 1, 2

  from hflax.xla_env import configure_cpu, keep_freed_memory
  configure_cpu(devices=1)  # hflax runs on one device here
  import jax
  print(f"XLA_FLAGS={os.environ['XLA_FLAGS']}")
  print(f"glibc malloc keeps freed memory, one arena (hflax's CPU setting; it applies to both "
        f"frameworks in this process; HFLAX_CPU_MALLOC=0 turns it off): {keep_freed_memory()}")
  if "xla_force_host_platform_device_count=1" not in os.environ["XLA_FLAGS"]:
    print("WARNING: XLA_FLAGS simulates several host devices; hflax uses 1 of them here, "
          "but timings will not be representative")
  jax.devices()  # fix the backend (and its device count) before hflax modules load
  import warnings
  warnings.filterwarnings("ignore", category=FutureWarning)  # transformers v6 renames
  import torch
  import transformers
  import trl
  from transformers import TrainerCallback

  torch.set_num_threads(os.cpu_count() or 1)
  transformers.utils.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  try:
    import datasets
    datasets.disable_progress_bars()
  except Exception:  # noqa: BLE001 - progress bars are cosmetic
    pass
  print(f"jax {jax.__version__} devices: {jax.devices()} (hflax uses 1, colocated)")
  print(f"torch {torch.__version__} threads: {torch.get_num_threads()}  transformers "
        f"{transformers.__version__}  trl {trl.__version__}  os.cpu_count(): {os.cpu_count()}")
  load_start = os.getloadavg()
  print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
  print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}")

  tmp = tempfile.TemporaryDirectory(prefix="hflax_rl_bench_")
  ckpt = os.path.join(tmp.name, "model")
  model_cfg = build_shared_checkpoint(ckpt, args)
  rows = prompt_rows(max(256, 4 * args.prompts))
  data_file = os.path.join(tmp.name, "prompts.jsonl")
  with open(data_file, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")

  # Both frameworks must read identical prompt ids: check against the byte tokenizer too.
  from hflax.models.tokenizer import ByteTokenizer, load_tokenizer
  hx_tok = load_tokenizer(ckpt)
  hf_tok = transformers.AutoTokenizer.from_pretrained(ckpt)
  lengths = set()
  for r in rows[:32]:
    ours = hx_tok.encode_chat(r["prompt"])
    theirs = list(hf_tok.apply_chat_template([r["prompt"]], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"][0])
    byte = ByteTokenizer().encode_chat(r["prompt"])
    if not ours == theirs == byte:
      raise RuntimeError(f"tokenizers disagree on {r['prompt']}: {ours} / {theirs} / {byte}")
    lengths.add(len(ours))
  lengths |= {len(hx_tok.encode_chat(r["prompt"])) for r in rows}
  if len(lengths) != 1:
    raise RuntimeError(f"prompts should all have one length, got {sorted(lengths)}")
  prompt_len = lengths.pop()
  print(f"model: llama, {model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}, heads "
        f"{model_cfg.num_heads}/{model_cfg.num_kv_heads} kv, intermediate "
        f"{model_cfg.intermediate_size}, vocab {model_cfg.vocab_size}, untied, fp32: "
        f"{model_cfg.num_params:,} params (random, seed 0), one HF directory loaded by both")
  print(f"workload: {args.prompts} prompts x {args.n} samples = {args.prompts * args.n} rows/step, "
        f"prompt {prompt_len} tokens (all equal), max response {args.response_len}, temperature "
        f"1.0, eos id {EOS_ID}; reward = fraction of digits; AdamW lr {args.lr:g}, clip-norm "
        f"1.0, token-mean clipped loss (0.2), beta 0, 1 optimizer step per RL step")

  print("building hflax trainer ...", flush=True)
  cfg = hflax_config(args, ckpt, data_file, os.path.join(tmp.name, "hflax_run"), prompt_len)
  hflax = HflaxRunner(cfg)

  hx_steps: list[dict] = []
  trl_steps: list[dict] = []
  trl_record: dict = {}
  total_trl = trl_warmup + args.rounds * args.steps_per_round
  order: list[str] = []

  class Alternate(TrainerCallback):
    """After TRL's warm-up and after every block of TRL steps, runs a block of hflax steps."""

    def __init__(self):
      self.mark = None

    def on_step_begin(self, a, state, control, **kw):
      if self.mark is None:
        self.mark = time.perf_counter()

    def on_step_end(self, a, state, control, **kw):
      now = time.perf_counter()
      r = dict(trl_record)
      trl_record.clear()
      update = r["training_step"] - r["gen_and_score"] + (now - r["training_step_end"])
      stages = {"gen": r["gen"], "reward": r["reward"],
                "prep": r["gen_and_score"] - r["gen"] - r["reward"], "update_actor": update}
      tokens = r["prompt_tokens"] + r["response_tokens"]
      step = dict(time=now - self.mark, tokens=tokens, prompt_tokens=r["prompt_tokens"],
                  response_tokens=r["response_tokens"], stages=stages, score=r["reward_mean"],
                  warmup=state.global_step <= trl_warmup)
      trl_steps.append(step)
      order.append("T" if not step["warmup"] else "t")
      print(f"  TRL   step {state.global_step:>2}: {step['time']:6.2f} s, {tokens:6.0f} tokens, "
            f"reward {step['score']:.3f}"
            f"{' (warm-up)' if step['warmup'] else ''}", flush=True)
      done = state.global_step - trl_warmup
      if done == 0 or (done > 0 and done % args.steps_per_round == 0):
        count = hflax_warmup if done == 0 else args.steps_per_round
        for _ in range(count):
          s = hflax.step()
          s["warmup"] = done == 0
          hx_steps.append(s)
          order.append("h" if s["warmup"] else "H")
          print(f"  hflax step {len(hx_steps):>2}: {s['time']:6.2f} s, {s['tokens']:6.0f} tokens, "
                f"reward {s['score']:.3f}"
                f"{' (warm-up, compiles)' if s['warmup'] and len(hx_steps) == 1 else ''}"
                f"{' (warm-up)' if s['warmup'] and len(hx_steps) > 1 else ''}", flush=True)
      self.mark = time.perf_counter()

  print("building TRL trainer ...", flush=True)
  trainer = make_trl_trainer(args, ckpt, rows, os.path.join(tmp.name, "trl_run"), total_trl,
                             Alternate())
  instrument_trl(trainer, trl_record)
  from transformers.trainer_callback import PrinterCallback
  trainer.remove_callback(PrinterCallback)  # it prints TRL's end-of-training summary dict
  print(f"TRL optimizer: {getattr(trainer.args.optim, 'value', trainer.args.optim)}; attention: "
        f"{trainer.model.config._attn_implementation}", flush=True)
  began = time.perf_counter()
  trainer.train()
  wall = time.perf_counter() - began
  load_end = os.getloadavg()

  # ---------------------------------------------------------------- report
  def timed(steps):
    return [s for s in steps if not s["warmup"]]

  def med(steps, key):
    return statistics.median(s[key] for s in steps)

  def med_stage(steps, name):
    values = [s["stages"].get(name) for s in steps]
    return statistics.median(values) if all(v is not None for v in values) else None

  hx, tr = timed(hx_steps), timed(trl_steps)
  for s in hx + tr:
    s["tps"] = s["tokens"] / s["time"]
  hx_tps, tr_tps = med(hx, "tps"), med(tr, "tps")
  ratio = hx_tps / tr_tps
  print()
  print(f"GRPO step, {args.prompts} prompts x {args.n} samples, prompt {prompt_len} + response <= "
        f"{args.response_len} tokens, {model_cfg.num_params / 1e6:.1f}M-param Llama, fp32, "
        f"median of {len(hx)} hflax / {len(tr)} TRL steps, alternating ({''.join(order)}: "
        f"lower case = warm-up)")
  header = (f"{'framework':>9} | {'tokens/s':>8} | {'step s':>6} | {'tokens/step':>11} | "
            f"{'resp tokens':>11} | {'gen s':>6} | {'reward s':>8} | {'old_logp s':>10} | "
            f"{'update s':>8} | {'other s':>7}")
  print(header)
  print("-" * len(header))
  for name, steps in (("hflax", hx), ("TRL", tr)):
    step_t = med(steps, "time")
    gen, reward = med_stage(steps, "gen"), med_stage(steps, "reward")
    old = med_stage(steps, "old_log_prob")
    update = med_stage(steps, "update_actor")
    others = [s["time"] - sum(s["stages"].get(k, 0.0) for k in ("gen", "reward", "old_log_prob",
                                                                  "update_actor"))
              for s in steps]
    fmt = lambda v, w: f"{v:>{w}.2f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
    print(f"{name:>9} | {med(steps, 'tps'):>8.0f} | {step_t:>6.2f} | {med(steps, 'tokens'):>11.0f} | "
          f"{med(steps, 'response_tokens'):>11.0f} | {fmt(gen, 6)} | {fmt(reward, 8)} | "
          f"{fmt(old, 10)} | {fmt(update, 8)} | {statistics.median(others):>7.2f}")
  stage_ratio = {k: med_stage(tr, k) / max(med_stage(hx, k), 1e-9) for k in ("gen", "update_actor")}
  print(f"stage time ratios TRL/hflax: gen {stage_ratio['gen']:.2f}x, update "
        f"{stage_ratio['update_actor']:.2f}x; old_logp: neither recomputes it (hflax reuses the "
        f"sampler's exact log-probs; TRL detaches the loss forward's when steps are aligned)")
  verdict = "PASS" if ratio >= TARGET_RATIO else "MISS"
  print(f"ratio hflax/TRL tokens/s: {ratio:.2f}x (target >= {TARGET_RATIO:g}x: {verdict})")
  print(f"hflax compile step: {hx_steps[0]['time']:.1f} s; per-step times hflax "
        f"{[round(s['time'], 2) for s in hx]}, TRL {[round(s['time'], 2) for s in tr]}")
  print(f"load average: start {load_start[0]:.2f}, end {load_end[0]:.2f} {load_end[1]:.2f} "
        f"{load_end[2]:.2f} (1/5/15 min) on {os.cpu_count()} cores; alternating run took "
        f"{wall:.0f} s")
  print("stages: gen = sampling (TRL: transformers generate + decode); update = loss forward + "
        "backward + clip + AdamW; other = the rest of the step (TRL: padding, advantages, "
        "data loading; hflax: advantages, batch plumbing, step metrics)")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "hflax": hx_steps, "trl": trl_steps, "ratio": ratio,
                 "load_start": load_start, "load_end": load_end}, f, indent=1)
  tmp.cleanup()
  return 0


if __name__ == "__main__":
  sys.exit(main())
