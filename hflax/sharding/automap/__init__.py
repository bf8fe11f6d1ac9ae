"""The auto-mapper: which roles share devices, how many each pool gets, and how each
role's model is laid out, chosen by simulating every stage of an RL step.

  from hflax.sharding import automap
  workload = automap.Workload.ppo(automap.llama2_config("13b"))
  plans = automap.search(workload, automap.get_profile("a100-80gb"), 64)
  plans[0].describe(); plans[0].to_config()  # the placement dict the controller runs
  # trainer.mode one_step_off / async: also a rollout pool of its own (split.py)
  chosen = automap.pick(workload, automap.get_profile("a100-80gb"), 64, "one_step_off")
  print(chosen.explanation); chosen.plan.to_config()

Profiles come from a named preset or from calibrate() on the devices at hand.
"""
from hflax.sharding.automap.calibration import calibrate
from hflax.sharding.automap.cost import Overheads, Simulator
from hflax.sharding.automap.llama import (LLAMA2_SIZES, codellama_34b, llama2_7b, llama2_13b,
                                          llama2_70b, llama2_config)
from hflax.sharding.automap.mesh import MeshShape
from hflax.sharding.automap.placements import device_counts, label, placements, set_partitions
from hflax.sharding.automap.plan import Plan
from hflax.sharding.automap.profile import PRESETS, DeviceProfile, get_profile
from hflax.sharding.automap.search import Planner, search
from hflax.sharding.automap.split import Pick, SplitPlan, SplitPlanner, pick
from hflax.sharding.automap.workload import STAGES, Workload

__all__ = ["LLAMA2_SIZES", "PRESETS", "STAGES", "DeviceProfile", "MeshShape", "Overheads", "Pick",
           "Plan", "Planner", "Simulator", "SplitPlan", "SplitPlanner", "Workload", "calibrate",
           "codellama_34b", "device_counts", "get_profile", "label", "llama2_13b", "llama2_70b",
           "llama2_7b", "llama2_config", "pick", "placements", "search", "set_partitions"]
