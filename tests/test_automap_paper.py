"""The paper's placement findings (HybridFlow Sec. 8.3), replayed on the simulator."""
import fcntl
import pickle

import pytest

from hflax.sharding.automap import Overheads, paper

# One search per cell; the fixture shares them across the tests.
SIZES, GPUS = ("7b", "13b", "34b"), (16, 32, 64, 96, 128)
# 7B is asserted on up to 64 GPUs only: its 96- and 128-GPU searches (a third of the
# fixture's time) are left out; the table shows them as any cell without plans.
SEARCHED = {"7b": (16, 32, 64), "13b": GPUS, "34b": GPUS}


def search_cells():
  out = {}
  for size, gpus in SEARCHED.items():
    out.update(paper.winners(sizes=(size,), gpus=gpus))
  return out


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
  """The cells, searched once per test session: under xdist the first worker to get here
  searches them and the others read its pickle (pytest-xdist's documented pattern for
  session-wide data: a file under the run's shared temporary directory, behind a lock)."""
  if not hasattr(request.config, "workerinput"):  # one process: nothing to share
    return search_cells()
  shared = tmp_path_factory.getbasetemp().parent / "automap_paper_cells.pickle"
  with open(f"{shared}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if shared.exists():
      return pickle.loads(shared.read_bytes())
    out = search_cells()
    shared.write_bytes(pickle.dumps(out))
    return out


def winner(results, size, n):
  plans = results[(size, n)]
  assert plans, f"nothing fits for {size} on {n} GPUs"
  return paper.family(plans[0])


@pytest.mark.parametrize("size", ["7b", "13b"])
@pytest.mark.parametrize("n", [16, 32, 64])
def test_colocate_wins_from_16_to_64_gpus(results, size, n):
  assert winner(results, size, n) == "colocate"


def test_34b_colocates_where_it_fits_up_to_64(results):
  assert not results[("34b", 16)]  # four 34B models do not fit on 16 A100s
  assert winner(results, "34b", 32) == winner(results, "34b", 64) == "colocate"


@pytest.mark.parametrize("size, n", [("34b", 96), ("34b", 128), ("13b", 96)])
def test_split_wins_for_34b_at_96_to_128_and_13b_at_96(results, size, n):
  assert winner(results, size, n) == "split"


def test_96_gpus_split_into_pools_of_48(results):
  # 48 GPUs split 1024 sequences over a data-parallel width with a factor 3: the runtime
  # pads the batch (controller/protocol.py), and the simulator charges the padded rows.
  for size in ("13b", "34b"):
    assert results[(size, 96)][0].devices == (48, 48)


STANDALONE = ("not reproduced: with four models of one size, standalone leaves each trained "
              "model a third of the GPUs or less; split wins (see paper.py)")


@pytest.mark.xfail(strict=True, reason=STANDALONE)
def test_standalone_wins_for_13b_at_128(results):
  assert winner(results, "13b", 128) == "standalone"


def test_13b_at_128_splits_actor_from_critic(results):
  # What does hold where the paper's exact placement does not: the winner splits the
  # actor (with ref) from the critic, so the two train concurrently.
  plan = results[("13b", 128)][0]
  actor_pool = next(g for g in plan.placement if "actor" in g)
  assert "ref" in actor_pool and "critic" not in actor_pool


def test_without_the_fitted_overhead_colocate_wins_at_128():
  # Honesty check: hardware limits alone favour colocating; the fitted per-device call
  # overhead is what makes split win at 128 GPUs.
  plans = paper.winners(sizes=("34b",), gpus=(128,), overheads=Overheads.roofline())
  assert paper.family(plans[("34b", 128)][0]) == "colocate"


def test_table_prints(results, capsys):
  text = paper.table(results, sizes=SIZES, gpus=GPUS)
  assert text.splitlines()[0].split()[0] == "size" and len(text.splitlines()) == 4
  assert "colocate" in text and "split" in text


def test_standalone_at_13b_128_costs_other_cells():
  # The sweep's finding (paper.py --sweep): standalone takes 13B at 128 only at 10x the
  # fitted per-device call cost, and then 13B at 64 no longer colocates.
  _, differs = paper._sweep_point((0.2, 1.0, 1))
  assert "13b@128" not in differs and "13b@64" in differs
