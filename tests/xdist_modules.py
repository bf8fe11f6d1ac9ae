"""How `pytest -n N` hands the suite to its workers: whole test modules, slowest first.

xdist's default (`--dist load`) deals single tests to whichever worker is free, so most
modules run partly in each worker. Each worker then builds the module's module-scoped
fixtures (a GGUF export, the automapper's paper tables, an uninterrupted reference run, a
Ray session) and traces and compiles, or reads back from the persistent cache, the same
programs the other worker already holds in memory. Sending a module as one unit builds and
compiles each of these once.

Whole modules balance worse than single tests, so the queue starts with the modules that
take longest (measured in CI profiles of the suite, listed in SLOWEST_FIRST) and then the
rest by test count, largest first: the small modules at the end fill whichever worker
finishes early. A module missing from the list only loses its place in the queue.
"""
import pytest
from xdist.scheduler import LoadScopeScheduling

# Test modules holding the suite's longest runs (launcher and Ray subprocesses, real-model
# numerics, bench smoke runs, costly module fixtures), longest first. Their order decides
# only which worker starts them when; every module runs whether listed or not.
SLOWEST_FIRST = (
    "test_ray_failures.py", "test_ray_backend.py", "test_rollout_agents.py",
    "test_bench_smoke.py", "test_automap_paper.py", "test_notebook.py", "test_gguf.py",
    "test_interrupt_resume.py", "test_launch.py", "test_async_kill.py", "test_controller.py",
    "test_packing.py", "test_platforms_cpu_attention.py", "test_platforms_cpu_matmul.py",
    "test_bad_input.py", "test_compile_cache.py", "test_continuous.py", "test_automap_search.py",
    "test_moe_routing_replay.py", "test_moe_expert_parallel.py", "test_bench_learning.py",
    "test_verl_parity.py", "test_accelerator_bench.py",
)


def module_of(nodeid: str) -> str:
  return nodeid.split("::", 1)[0]


def queue_order(nodeids) -> list[str]:
  """The modules of `nodeids`: SLOWEST_FIRST's in its order, then the rest by test count
  (most first, ties in collection order)."""
  counts: dict[str, int] = {}
  for nodeid in nodeids:
    module = module_of(nodeid)
    counts[module] = counts.get(module, 0) + 1
  rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
  position = {module: i for i, module in enumerate(counts)}

  def key(module):
    name = module.rsplit("/", 1)[-1]
    if name in rank:
      return (0, rank[name], 0)
    return (1, -counts[module], position[module])

  return sorted(counts, key=key)


class ModuleScheduling(LoadScopeScheduling):
  """xdist's scope scheduling with a test module as the scope and queue_order's order."""

  def _split_scope(self, nodeid: str) -> str:
    return module_of(nodeid)

  def schedule(self) -> None:
    collections = list(self.registered_collections.values())
    if (self.collection is None and self.collection_is_completed
        and all(c == collections[0] for c in collections)):
      # LoadScopeScheduling fills its queue in collection order (test count order when told
      # to reorder); a key already in the OrderedDict keeps its place when it is filled,
      # so placing the modules first queues them in queue_order's order.
      self.config.option.loadscopereorder = False
      for module in queue_order(collections[0]):
        self.workqueue[module] = {}
    super().schedule()


def make_scheduler(config: pytest.Config, log):
  """ModuleScheduling for xdist's default distribution (`-n N` without `--dist`)."""
  if config.getvalue("dist") != "load":
    return None
  return ModuleScheduling(config, log)
