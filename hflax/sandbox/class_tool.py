"""A user's tool class (named by `class_name` in a tool config file) run in worker
processes of hflax.sandbox's ProcessPool, the mechanism reward functions and the Python
tool run in: the class is imported and constructed in a worker, never in the trainer, and
the trainer holds a PooledTool with the instance's `schema` and an `execute` that calls
into the worker.

Whatever the class does (os._exit, a segfault, a hang past its time limit, unbounded
memory, a raise) ends or fails a call in a worker: the model reads it as the tool's error,
the worker is replaced when it died or was killed, and the trainer steps on. A class that
cannot be imported or constructed is refused at start-up in one line.

Imports nothing heavy, so a worker starts in a moment.
"""
from __future__ import annotations

import importlib
import json

# -- in a pool worker -----------------------------------------------------------------------
# One instance per class, config and schema, built at the worker's first call (a worker
# that replaces a dead one builds its own), so a tool with state keeps it between calls.
_instances: dict[str, object] = {}


def _key(class_name: str, config: dict, tool_schema: dict | None) -> str:
  return json.dumps([class_name, config, tool_schema], sort_keys=True, default=repr)


def _instance(class_name: str, config: dict, tool_schema: dict | None):
  key = _key(class_name, config, tool_schema)
  if key not in _instances:
    module, _, attr = class_name.rpartition(".")
    cls = getattr(importlib.import_module(module), attr)
    _instances[key] = cls(config=config, tool_schema=tool_schema)
  return _instances[key]


def check_in_worker(class_name: str, config: dict, tool_schema: dict | None) -> tuple:
  """("ok", the instance's schema) or ("refused", why): imports the class's module and
  builds the instance (their own exceptions propagate, as the pool reports them)."""
  module, _, attr = class_name.rpartition(".")
  if not module:
    return "refused", f"class_name {class_name!r} is not a dotted module.Class path"
  try:
    getattr(importlib.import_module(module), attr)
  except (ImportError, AttributeError) as e:
    return "refused", f"cannot import class_name {class_name!r} ({' '.join(str(e).split())})"
  tool = _instance(class_name, config, tool_schema)
  schema = getattr(tool, "schema", None)
  if not callable(getattr(tool, "execute", None)) or not isinstance(schema, dict) \
      or not isinstance(schema.get("function", {}).get("name"), str):
    return "refused", f"{class_name} has no schema (with function.name) and execute(arguments)"
  return "ok", json.loads(json.dumps(schema))  # plain data, whatever mapping it was


def execute_in_worker(class_name: str, config: dict, tool_schema: dict | None,
                      arguments: dict) -> str:
  return str(_instance(class_name, config, tool_schema).execute(arguments))


# -- in the trainer -------------------------------------------------------------------------
class ToolFailed(RuntimeError):
  """A pooled tool's call that raised, or whose worker died: the model reads the message."""


class ToolTimedOut(TimeoutError):
  """A pooled tool's call that ran past its limit; its worker was killed."""


class PooledTool:
  """The trainer's side of a user's tool class (module docstring). timeout_s: a call's
  limit, its worker killed at it (start-up gets at least a minute: imports can be slow);
  memory_limit_bytes: each worker's address space; workers: calls that run at once."""
  limits_itself = True  # the environment need not time it on a thread of its own

  def __init__(self, class_name: str, config: dict | None = None,
               tool_schema: dict | None = None, *, timeout_s: float = 30.0,
               memory_limit_bytes: int | None = None, workers: int = 2):
    from hflax.sandbox.pool import checked_pool
    self.class_name, self.config, self.tool_schema = class_name, dict(config or {}), tool_schema
    self.timeout_s = timeout_s
    self.pool, self.schema = checked_pool(
        check_in_worker, class_name, self.config, tool_schema, workers=workers,
        memory_limit_bytes=memory_limit_bytes, timeout_s=max(60.0, timeout_s),
        failed=lambda out: (f"importing and constructing class_name {class_name!r} in a "
                            f"worker process {out.describe()}"))

  @property
  def name(self) -> str:
    return self.schema["function"]["name"]

  def execute(self, arguments: dict) -> str:
    out = self.pool.call(execute_in_worker, self.class_name, self.config, self.tool_schema,
                         arguments, timeout_s=self.timeout_s)
    if out.ok:
      return out.value
    if out.kind == "timed_out":
      raise ToolTimedOut(f"tool {self.name!r} ran past its limit of {self.timeout_s:g} s "
                         "(its worker process was killed)")
    raise ToolFailed(f"tool {self.name!r} {out.describe()}")

  def close(self):
    self.pool.close()


def close_tools(tools) -> None:
  """Ends the worker processes of every pooled tool in `tools` (others are left alone)."""
  for tool in tools:
    if isinstance(tool, PooledTool):
      tool.close()
