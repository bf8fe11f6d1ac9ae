"""python -m hflax.launch --config ppo.py [--config.actor.optim.lr=1e-5 ...]

A bare config name resolves to the project's configs/ directory; a path works too.
On CPU, HFLAX_CPU_DEVICES (default 2) simulated devices give each role its own mesh.
"""
import os
import sys

# Before JAX starts: simulated CPU devices, so per-model meshes exist on a plain CPU.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                             f"device_count={os.environ.get('HFLAX_CPU_DEVICES', '2')}").strip()

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs")


def resolve_config_arg(argv: list[str]) -> list[str]:
  """--config NAME[:arg] -> the file under configs/ when NAME is not a path that exists."""
  out = list(argv)
  for i, arg in enumerate(out):
    if arg == "--config" and i + 1 < len(out):
      out[i + 1] = _resolve(out[i + 1])
    elif arg.startswith("--config="):
      out[i] = "--config=" + _resolve(arg.split("=", 1)[1])
  return out


def _resolve(spec: str) -> str:
  path, _, extra = spec.partition(":")
  if not os.path.exists(path):
    candidate = os.path.join(CONFIG_DIR, path if path.endswith(".py") else path + ".py")
    if os.path.exists(candidate):
      path = candidate
    else:
      known = sorted(f for f in os.listdir(CONFIG_DIR)) if os.path.isdir(CONFIG_DIR) else []
      sys.exit(f"--config: {spec!r} is neither a file nor one of {known} in {CONFIG_DIR}")
  return path + (":" + extra if extra else "")


def print_help(argv: list[str]) -> None:
  """The usage, then every field of the chosen config (default ppo.py) with its value."""
  import importlib.util
  print(__doc__.strip())
  path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  if path is None and "--config" in argv and argv.index("--config") + 1 < len(argv):
    path = argv[argv.index("--config") + 1]
  path = (path or os.path.join(CONFIG_DIR, "ppo.py")).partition(":")[0]
  spec = importlib.util.spec_from_file_location("hflax_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  print(f"\nconfigs in {CONFIG_DIR}: {', '.join(sorted(os.listdir(CONFIG_DIR)))}")
  print(f"\noptions of {path} (override with --config.<field>=<value>):")

  def walk(node, prefix):
    for key, value in node.items():
      if hasattr(value, "items") and len(value):
        walk(value, f"{prefix}{key}.")
      else:
        print(f"  --config.{prefix}{key}={value!r}")
  walk(module.get_config(), "")


def main():
  if any(a in ("-h", "--help", "--helpshort") for a in sys.argv[1:]):
    print_help(resolve_config_arg(sys.argv[1:]))
    return
  from absl import app, flags
  from ml_collections import config_flags

  config = config_flags.DEFINE_config_file(
      "config", None, "Config file (ppo.py, grpo.py, ... from configs/, or a path); override "
      "any field with --config.<path>=<value>.", lock_config=True)

  def run(_argv):
    from absl import logging
    logging.set_verbosity(logging.WARNING)  # orbax reports every file it writes at INFO
    from hflax.launch.trainer import run as run_job
    if config.value is None:
      sys.exit("--config is required, e.g. --config ppo.py")
    try:
      run_job(config.value)
    except (ValueError, FileNotFoundError, KeyError) as e:
      sys.exit(f"error: {e}")

  del flags
  app.run(run, argv=resolve_config_arg(sys.argv))


if __name__ == "__main__":
  main()
