"""How `pytest -n N` hands the suite to its workers: the longest runs first, and the modules
with costly module-scoped fixtures whole to one worker.

xdist's default (`--dist load`) deals single tests out in collection order. A module whose
tests land in both workers builds its module-scoped fixtures in each: a GGUF export and its
transformers reference (tests/test_gguf.py), the automapper's paper tables
(tests/test_automap_paper.py), a Ray session (tests/test_ray_backend.py), the uninterrupted
reference run (tests/test_interrupt_resume.py). Those modules (KEEP_TOGETHER) go out as one
unit each. Every other test stays a unit of its own, so the workers stay balanced.

The queue starts with the tests of the modules that hold the suite's longest runs (measured
in CI profiles, SLOWEST_FIRST, longest first), then the rest in collection order: a long
test dealt out last would leave the other worker idle until it ends. A module missing from
the lists only loses its place in the queue or runs split; every test runs either way.
"""
import pytest
from xdist.scheduler import LoadScopeScheduling

KEEP_TOGETHER = ("test_gguf.py", "test_automap_paper.py", "test_ray_backend.py",
                 "test_interrupt_resume.py")

# Launcher and Ray subprocesses, real-model numerics, bench smoke runs, costly fixtures.
SLOWEST_FIRST = (
    "test_ray_failures.py", "test_ray_backend.py", "test_notebook.py", "test_bench_smoke.py",
    "test_automap_paper.py", "test_rollout_agents.py", "test_gguf.py", "test_bad_input.py",
    "test_platforms_cpu_attention.py", "test_async_kill.py", "test_compile_cache.py",
    "test_interrupt_resume.py", "test_launch.py", "test_bench_learning.py",
    "test_verl_parity.py", "test_platforms_cpu_matmul.py", "test_packing.py",
    "test_controller.py", "test_continuous.py", "test_moe_expert_parallel.py",
    "test_automap_search.py", "test_accelerator_bench.py", "test_moe_routing_replay.py",
)


def _file(nodeid: str) -> str:
  return nodeid.split("::", 1)[0].rsplit("/", 1)[-1]


def unit_of(nodeid: str) -> str:
  """The scheduling unit: the module for KEEP_TOGETHER's modules, else the test itself."""
  if _file(nodeid) in KEEP_TOGETHER:
    return nodeid.split("::", 1)[0]
  return nodeid


def queue_order(nodeids) -> list[str]:
  """The units of `nodeids`: those of SLOWEST_FIRST's modules in its order, then the rest,
  each group in collection order."""
  rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
  units: dict[str, int] = {}
  for i, nodeid in enumerate(nodeids):
    units.setdefault(unit_of(nodeid), i)
  return sorted(units, key=lambda u: (rank.get(_file(u), len(rank)), units[u]))


class SlowFirstScheduling(LoadScopeScheduling):
  """xdist's scope scheduling with unit_of's units, queued in queue_order's order."""

  def _split_scope(self, nodeid: str) -> str:
    return unit_of(nodeid)

  def schedule(self) -> None:
    collections = list(self.registered_collections.values())
    if (self.collection is None and self.collection_is_completed
        and all(c == collections[0] for c in collections)):
      # LoadScopeScheduling fills its queue in collection order (test count order when told
      # to reorder); a key already in the OrderedDict keeps its place when it is filled,
      # so placing the units first queues them in queue_order's order.
      self.config.option.loadscopereorder = False
      for unit in queue_order(collections[0]):
        self.workqueue[unit] = {}
    super().schedule()


def make_scheduler(config: pytest.Config, log):
  """SlowFirstScheduling for xdist's default distribution (`-n N` without `--dist`)."""
  if config.getvalue("dist") != "load":
    return None
  return SlowFirstScheduling(config, log)
