"""python -m hflax.launch.plan --config ppo.py [--profile calibrate|a100-80gb|...] [--devices N]

Prints the auto-mapper's ranked plans for a config's models and workload: placement,
devices per pool, mesh shapes, predicted step time per stage and peak memory, and the
placement fragment that runs the best one. `--config.placement.kind=auto` in the main job
runs that plan directly. For trainer.mode one_step_off or async (the config's, or --mode)
the pick also weighs a rollout pool of its own against those plans (automap.split), and
says which wins and why. With distill.teacher_path the teacher is planned with its
checkpoint's shape, and the explanation says where it went and why.
"""
from __future__ import annotations

import argparse
import sys

from hflax.platforms import configure_cpu

configure_cpu()  # before JAX starts


def workload(cfg, policy_cfg):
  """The auto-mapper's Workload for a config (every model has the policy's shape unless a
  checkpoint says otherwise; a distillation teacher has its checkpoint's)."""
  from hflax.launch.models import (actor_config, needed_roles, reference_in_actor,
                                   remove_padding, teacher_config, token_budgets, with_lora)
  from hflax.models import hf
  from hflax.sharding import automap
  models = {}
  for role in needed_roles(cfg):
    path = {"critic": cfg.critic.model_path, "reward": cfg.reward.model_path,
            "cost": cfg.cost.model_path}.get(role, "")
    models[role] = hf.read_config(path) if path else policy_cfg
  models["actor"] = actor_config(cfg, policy_cfg)
  if "teacher" in models:
    models["teacher"] = teacher_config(cfg, policy_cfg)
  if "critic" in models:
    models["critic"] = with_lora(models["critic"], cfg.critic)
  micro = cfg.actor.ppo_micro_batch_size or cfg.actor.ppo_mini_batch_size * cfg.rollout.n
  budget, forward_budget = token_budgets(cfg.actor)
  return automap.Workload(
      models=models, prompts_per_step=cfg.data.train_batch_size, samples_per_prompt=cfg.rollout.n,
      prompt_len=cfg.data.max_prompt_length, response_len=cfg.data.max_response_length,
      mini_batch_size=cfg.actor.ppo_mini_batch_size, ppo_epochs=cfg.actor.ppo_epochs,
      micro_batch_size=micro, reference_in_actor=reference_in_actor(cfg),
      max_num_seqs=cfg.rollout.max_num_seqs, val_samples_per_prompt=cfg.rollout.val_n,
      # What the runtime will do: slots refilled as rows end, passes on packed rows.
      continuous_batching=bool(cfg.rollout.get("continuous_batching", False)),
      packed=remove_padding(cfg.model), token_budget=budget, forward_token_budget=forward_budget,
      share_prompts=bool(cfg.model.get("share_prompts", True)))


def profile(name: str, devices):
  from hflax.sharding import automap
  return automap.calibrate(devices) if name == "calibrate" else automap.get_profile(name)


def picked_plan(cfg, policy_cfg, devices, profile_name: str = "calibrate", mode: str = ""):
  """The auto-mapper's pick for a run of trainer.mode `mode` (default: the config's): for
  one_step_off and async it weighs a rollout split against the sync search's best."""
  from hflax.sharding import automap
  mode = mode or cfg.trainer.get("mode", "sync")
  try:
    return automap.pick(workload(cfg, policy_cfg), profile(profile_name, devices), len(devices),
                        mode)
  except ValueError as e:
    raise ValueError(f"config.placement: {e} (profile {profile_name!r})") from None


def ranked_plans(cfg, policy_cfg, devices, profile_name: str = "calibrate", top: int = 10):
  from hflax.sharding import automap
  plans = automap.search(workload(cfg, policy_cfg), profile(profile_name, devices), len(devices),
                         top_k=top)
  if not plans:
    raise ValueError(f"config.placement: no feasible plan for {len(devices)} devices "
                     f"(profile {profile_name!r})")
  return plans


def main(argv=None):
  from hflax.sharding.automap.profile import PRESETS
  parser = argparse.ArgumentParser(
      prog="python -m hflax.launch.plan", description=__doc__.split("\n\n")[1],
      epilog="Any --config.<field>=<value> override of the main job applies here too.")
  parser.add_argument("--config", default="ppo.py")
  parser.add_argument("--profile", default="calibrate",
                      help="'calibrate' (measure these devices, cached) or a preset: "
                      + ", ".join(sorted(PRESETS)))
  parser.add_argument("--devices", type=int, default=0, help="plan for this many devices "
                      "(default: the devices here; with a preset, any number)")
  parser.add_argument("--top", type=int, default=10)
  parser.add_argument("--mode", default="", choices=("", "sync", "one_step_off", "async"),
                      help="plan for this trainer.mode (default: the config's); one_step_off "
                      "and async also weigh a rollout pool of its own against the sync plans")
  parser.add_argument("--infeasible", action="store_true",
                      help="also list each placement that cannot run, with the reason")
  args, overrides = parser.parse_known_args(argv)
  from hflax.launch.cli import BAD_INPUT, one_line
  try:
    return show_plans(args, overrides)
  except BAD_INPUT as e:
    print(f"error: {one_line(e)}", file=sys.stderr)
    return 2


def show_plans(args, overrides) -> int:
  import jax

  from hflax.launch.cli import load_config
  from hflax.launch.config import tokenizer_spec
  from hflax.launch.models import builtin_config
  from hflax.models.tokenizer import load_tokenizer
  from hflax.sharding import automap
  cfg = load_config(["--config", args.config, *overrides])
  if cfg.model.path:  # the checkpoint's shapes; no tokenizer needed
    from hflax.models import hf
    policy_cfg = hf.read_config(cfg.model.path)
  else:
    tokenizer = load_tokenizer(tokenizer_spec(cfg))
    policy_cfg = builtin_config(cfg, tokenizer.vocab_size, tokenizer)
  devices = jax.devices()
  count = args.devices or len(devices)
  if args.profile == "calibrate" and count != len(devices):
    raise ValueError("--devices other than the local count needs a preset --profile")
  prof = profile(args.profile, devices)
  found = automap.search(workload(cfg, policy_cfg), prof, count, top_k=args.top,
                         include_infeasible=True)
  plans = [p for p in found if p.feasible]
  print(f"{len(plans)} best plans for {count} devices ({args.profile}); predicted step time, "
        "pools, meshes, stage times, peak memory per pool:")
  for i, plan in enumerate(plans):
    print(f"{i + 1:3d}. {plan.describe()}")
  if args.infeasible or not plans:
    print("\nplacements that cannot run:")
    rejected = found[len(plans):]
    for plan in rejected:
      print(f"  {plan.label:<28} {plan.reason}")
    if not rejected:
      print("  (none)")
  if not plans:
    print(f"error: no placement of these models fits on {count} devices ({args.profile})",
          file=sys.stderr)
    return 1
  mode = args.mode or cfg.trainer.get("mode", "sync")
  chosen = automap.pick(workload(cfg, policy_cfg), prof, count, mode)
  if chosen.split is not None:
    print(f"\nbest rollout split ({mode}):\n     {chosen.split.describe()}")
  print(f"\n{chosen.explanation}")
  spec = chosen.plan.to_config()
  where = ("or --config.placement.kind=auto, which plans again on these devices"
           if args.profile == "calibrate" else f"on {count} {args.profile} devices")
  print(f"\nbest placement, as lines of a config file ({where}):")
  print('  c.placement.kind = "custom"')
  for field in ("pools", "roles"):
    print(f"  c.placement.{field} = {spec[field]!r}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
