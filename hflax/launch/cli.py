"""Reading the command line of `python -m hflax.launch` (and of the plan CLI): the config
file and its overrides, the help, and how bad input is reported (one line, exit status 2).

Imports nothing that starts JAX: the entry modules configure the process first.
"""
import os
import sys

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


class UsageError(Exception):
  """A bad command line or config: reported as one line, exit status 2."""


def resolve_config_arg(argv: list[str]) -> list[str]:
  """--config NAME[:arg] -> the file in hflax/configs when NAME is not a path that exists."""
  out = list(argv)
  for i, arg in enumerate(out):
    if arg == "--config" and i + 1 < len(out):
      out[i + 1] = _resolve(out[i + 1])
    elif arg.startswith("--config="):
      out[i] = "--config=" + _resolve(arg.split("=", 1)[1])
  return out


def _shipped() -> list[str]:
  return sorted(f for f in os.listdir(CONFIG_DIR) if f.endswith(".py") and not f.startswith("_"))


def _resolve(spec: str) -> str:
  path, _, extra = spec.partition(":")
  if not os.path.exists(path):
    candidate = os.path.join(CONFIG_DIR, path if path.endswith(".py") else path + ".py")
    if not os.path.exists(candidate):
      known = _shipped()
      raise UsageError(f"--config: {spec!r} is neither a file nor one of {known} in {CONFIG_DIR}")
    path = candidate
  return path + (":" + extra if extra else "")


def print_help(argv: list[str], usage: str) -> None:
  """The usage, then every field of the chosen config (default ppo.py) with its value."""
  print(usage.strip())
  path, _, extra = (_config_spec(argv) or os.path.join(CONFIG_DIR, "ppo.py")).partition(":")
  config = run_config_file(path, extra or None)
  print(f"\nconfigs in {CONFIG_DIR}: {', '.join(_shipped())}")
  print(f"\noptions of {path} (override with --config.<field>=<value>):")

  def walk(node, prefix):
    for key, value in node.items():
      if hasattr(value, "items") and len(value):
        walk(value, f"{prefix}{key}.")
      else:  # an empty ConfigDict's repr ends in a newline
        print(f"  --config.{prefix}{key}=" + ("{}" if hasattr(value, "items") else repr(value)))
  walk(config, "")


def _config_spec(args: list[str]) -> str | None:
  for i, arg in enumerate(args):
    if arg == "--config" and i + 1 < len(args):
      return args[i + 1]
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
  return None


def run_config_file(path: str, extra: str | None = None):
  """The ConfigDict a config file's get_config() returns. A file that does not run, or
  whose get_config() is missing or returns something else, is one line naming the file
  (and line)."""
  import importlib.util
  import ml_collections
  where = f"--config {path}"
  try:
    source = open(path, encoding="utf-8").read()
    code = compile(source, path, "exec")
  except OSError as e:
    raise UsageError(f"{where}: cannot read it ({e.strerror})") from None
  except (SyntaxError, ValueError) as e:
    line = f" line {e.lineno}:" if getattr(e, "lineno", None) else ""
    raise UsageError(f"{where}:{line} {type(e).__name__}: {getattr(e, 'msg', e)}") from None
  module = importlib.util.module_from_spec(
      importlib.util.spec_from_loader("hflax_config_check", loader=None))
  module.__file__ = path
  try:
    exec(code, module.__dict__)  # noqa: S102 - the user's own config file, as absl runs it
    get_config = module.__dict__.get("get_config")
    if not callable(get_config):
      raise UsageError(f"{where}: defines no get_config() function")
    config = get_config() if extra is None else get_config(extra)  # file.py:extra
  except UsageError:
    raise
  except Exception as e:  # noqa: BLE001 - the user's file failed: name it, not our stack
    raise UsageError(f"{where}: running it raised {type(e).__name__}: "
                     f"{' '.join(str(e).split())}") from None
  if not isinstance(config, ml_collections.ConfigDict):
    raise UsageError(f"{where}: get_config() returned {type(config).__name__}, not an "
                     "ml_collections.ConfigDict (start from hflax.launch.config.base_config())")
  return config


def load_config(argv: list[str]):
  """Parses --config and its overrides, --config.<field>=<value> or <field>=<value>, with
  hflax's or verl's names (a fresh flag set, so it can run twice)."""
  from absl import flags
  from ml_collections import config_flags
  from hflax.launch.verl_names import translate_overrides
  fv = flags.FlagValues()
  argv = translate_overrides(argv, log=lambda line: print(line, file=sys.stderr))
  args = ["hflax.launch", *resolve_config_arg(argv)]
  spec = _config_spec(args)
  if spec is not None:  # one-line errors before absl runs the file to apply the overrides
    path, _, extra = spec.partition(":")
    run_config_file(path, extra or None)
  # config_flags learns which --config.* overrides exist from the argv it is given.
  holder = config_flags.DEFINE_config_file(
      "config", None, "config file", flag_values=fv, lock_config=True, sys_argv=args)
  try:
    rest = fv(args)
  except flags.Error as e:
    raise UsageError(" ".join(str(e).split())) from None
  except (AttributeError, KeyError) as e:  # an override of a field the config lacks
    # ml_collections' message: "'lrr'", maybe followed by a line 'Did you mean "lr" ...?'.
    text = e.args[0] if e.args else e
    while isinstance(text, KeyError) and text.args:  # AttributeError(KeyError(...)) too
      text = text.args[0]
    text = str(text)
    missing, _, hint = text.partition("\n")
    missing = missing.strip("'\"")
    field = next((a.split("=")[0] for a in argv if a.startswith("--config.")
                  and missing in a.split("=")[0].split(".")), "a --config.* override")
    hint = f"; {hint.strip()}" if hint.strip() else ""
    raise UsageError(f"{field}: no such config field {missing!r}{hint}") from None
  if len(rest) > 1:
    raise UsageError(f"unexpected arguments {rest[1:]}; options are --config, --config.* "
                     "and <field>=<value>")
  if holder.value is None:
    raise UsageError("--config is required, e.g. --config ppo.py")
  return holder.value


# What bad input raises (config fields, data rows, files, model paths): one line, exit 2.
BAD_INPUT = (UsageError, ValueError, FileNotFoundError, KeyError, TypeError, ImportError, OSError)


def one_line(e: Exception) -> str:
  message = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
  return " ".join(message.split())
