"""python -m hflax.launch --config ppo.py [--config.actor.optim.lr=1e-5 ...]

A bare config name resolves to the configs shipped in hflax/configs; a path works too.
On CPU, HFLAX_CPU_DEVICES (default 2) simulated devices give each role its own mesh.
Bad input is one line and exit status 2; HFLAX_DEBUG=1 adds the traceback. Ctrl-C and
SIGTERM end the run with one line and exit status 130 / 143; the same command resumes it.
One run holds a run_dir at a time. Reward functions from files run in worker processes,
reward.timeout_s seconds a batch at most, in reward.memory_limit_gb of address space.
"""
import os
import sys
import traceback

from hflax.platforms import configure_cpu

try:
  configure_cpu()  # before JAX starts: simulated CPU devices for per-model meshes
except ValueError as e:
  print(f"error: {e}", file=sys.stderr)
  sys.exit(2)

from hflax.launch import interrupts  # noqa: E402
from hflax.launch.cli import BAD_INPUT, UsageError, load_config, one_line, print_help, \
    resolve_config_arg  # noqa: E402  (after configure_cpu)


def cli(argv: list[str], stderr=None) -> int:
  """Runs the main job; any bad input becomes one line on stderr and exit status 2."""
  stderr = stderr or sys.stderr
  if any(a in ("-h", "--help", "--helpshort") for a in argv):
    try:
      print_help(resolve_config_arg(argv), __doc__)
    except UsageError as e:
      print(f"error: {e}", file=stderr)
      return 2
    return 0
  from absl import logging
  logging.set_verbosity(logging.WARNING)  # orbax reports every file it writes at INFO
  cfg = None
  try:
    cfg = load_config(argv)
    from hflax.launch.config import validate
    from hflax.launch.run_lock import holding_run_dir
    validate(cfg)  # run_dir's own faults are named before it is created and locked
    with holding_run_dir(cfg.trainer.run_dir):  # one run per run_dir, before any device work
      from hflax.launch.trainer import run as run_job
      run_job(cfg)
      interrupts.raise_pending()  # a signal kept during the run's last part still ends it
  except BAD_INPUT as e:
    if os.environ.get("HFLAX_DEBUG") == "1":
      traceback.print_exc(file=stderr)
    print(f"error: {one_line(e)}", file=stderr)
    return 2
  except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: a choice, not a fault
    from hflax.launch.run_lock import resume_hint
    interrupts.clear()
    term = isinstance(e, interrupts.Terminated)
    print(f"{'terminated (SIGTERM)' if term else 'interrupted'}: {resume_hint(cfg)}",
          file=stderr)
    return 143 if term else 130  # as shells report a death by SIGTERM or SIGINT
  return 0


def main():
  interrupts.install()
  code = cli(sys.argv[1:])
  if code in (130, 143):
    # Leave now: a checkpoint write still running on orbax's threads would print their
    # tracebacks as the interpreter shuts them down. The write is discarded (its temporary
    # directory is never a checkpoint; the next run removes it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  sys.exit(code)


if __name__ == "__main__":
  main()
