"""A trainer hook that stops a run in-process at a given step, as a kill would (the tests
of resume: everything the checkpoint before that step holds must carry the run on)."""


class Killed(Exception):
  pass


def kill_at(step):
  """A hook raising Killed when the trainer reaches `step`, before it runs."""
  def hook(info):
    if info.step == step:
      raise Killed
  return hook
