"""The package layering written in the README's development notes, read from the imports.

Every `import hflax...` / `from hflax... import ...` counts, at module level or inside a
function, so a late import does not hide a dependency."""
import ast
import pathlib
import shutil

HFLAX = pathlib.Path(__file__).resolve().parents[1] / "hflax"

# Bottom up: each layer may import the layers below it, never one above.
#   platforms    the hardware: kernels (CPU, GPU, TPU), the attention choice, compiler
#                options, process set-up; no model code
#   models       weights and math, backend-neutral (they ask platforms)
#   platform model families: platform code over the model's modules (the CPU decoding copy
#                and its modules, and the seam choosing a platform's copy)
#   rollout < sharding < controller < algorithms drivers < launch
PLATFORMS = {"hflax.platforms", "hflax.xla_env"}
MODELS = PLATFORMS | {"hflax.models"}
CPU_FAMILY = {"hflax.platforms.cpu.decoding_copy", "hflax.platforms.cpu.copy_modules"}
FAMILIES = MODELS | CPU_FAMILY | {"hflax.platforms.decoding"}
# hflax.sandbox (worker processes for user code and tools) imports no other hflax package.
ROLLOUT = FAMILIES | {"hflax.rollout", "hflax.sandbox"}
SHARDING = ROLLOUT | {"hflax.sharding"}
SIDE = {"hflax.algorithms", "hflax.checkpoint", "hflax.rewards", "hflax.sandbox"}
CONTROLLER = SHARDING | SIDE | {"hflax.controller"}
# Which packages each package may import (besides itself); algorithms import nothing.
ALLOWED = {
    "hflax.platforms": set(),
    "hflax.xla_env": {"hflax.platforms"},  # the CPU set-up's first import path
    "hflax.checkpoint": set(),
    "hflax.sandbox": set(),
    "hflax.algorithms": set(),
    "hflax.models": PLATFORMS,
    "hflax.platforms.cpu.decoding_copy": MODELS | {"hflax.platforms.cpu.copy_modules"},
    "hflax.platforms.cpu.copy_modules": MODELS,
    "hflax.platforms.decoding": MODELS | CPU_FAMILY,
    "hflax.rollout": ROLLOUT - {"hflax.rollout"},
    "hflax.sharding": ROLLOUT,
    "hflax.data": SHARDING,
    "hflax.rewards": SHARDING,
    "hflax.metrics": SHARDING | {"hflax.algorithms"},
    "hflax.controller": CONTROLLER - {"hflax.controller"},
    "hflax.controller.ray_backend": CONTROLLER,
    "hflax.algorithms.drivers": CONTROLLER | {"hflax.metrics"},
    "hflax.launch": None,  # the top: anything
    "hflax.configs": None,  # config files, read by path
}
# Read as packages of their own (the longest match wins).
SUBPACKAGES = ("hflax.algorithms.drivers", "hflax.controller.ray_backend",
               "hflax.platforms.cpu.decoding_copy", "hflax.platforms.cpu.copy_modules",
               "hflax.platforms.decoding")
# A platform's own modules: only hflax.platforms reaches them; everything else asks the
# package's entries (hflax.platforms, .attention, .decoding, .leaf_copy, ...).
PLATFORM_MODULES = ("hflax.platforms.cpu", "hflax.platforms.gpu", "hflax.platforms.tpu")
LAYERS = ("hflax.platforms", "hflax.models", "hflax.platforms.cpu.decoding_copy",
          "hflax.rollout", "hflax.sharding", "hflax.controller", "hflax.algorithms.drivers",
          "hflax.launch")


def package(module: str) -> str:
  for sub in SUBPACKAGES:
    if module == sub or module.startswith(sub + "."):
      return sub
  return ".".join(module.split(".")[:2])


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
  name = ".".join(path.relative_to(root).with_suffix("").parts)
  return name.removesuffix(".__init__")


def imports(root: pathlib.Path) -> dict[str, set[str]]:
  """{module: hflax modules it imports}; `from hflax.x import y` counts hflax.x.y when
  that is a module, else hflax.x."""
  modules = {module_name(root, p): p for p in (root / "hflax").rglob("*.py")}
  out = {}
  for name, path in modules.items():
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        found |= {a.name for a in node.names if a.name.split(".")[0] == "hflax"}
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
          and node.module.split(".")[0] == "hflax":
        for a in node.names:
          sub = f"{node.module}.{a.name}"
          found.add(sub if sub in modules else node.module)
    out[name] = {m for m in found if m != name and m != "hflax"}
  return out


def violations(root: pathlib.Path) -> list[str]:
  bad = []
  for module, targets in sorted(imports(root).items()):
    if module == "hflax":
      continue
    allowed = ALLOWED.get(package(module), set())
    for target in sorted(targets):
      if package(target) == package(module) or allowed is None:
        continue
      if package(target) not in allowed:
        bad.append(f"{module} imports {target}")
  return bad


def platform_reach(root: pathlib.Path) -> list[str]:
  """Imports of a cpu/, gpu/ or tpu/ module from outside hflax/platforms."""
  return [f"{module} imports {target}" for module, targets in sorted(imports(root).items())
          if module != "hflax.platforms" and not module.startswith("hflax.platforms.")
          for target in sorted(targets)
          if any(target == p or target.startswith(p + ".") for p in PLATFORM_MODULES)]


def cycles(root: pathlib.Path) -> list[list[str]]:
  """Strongly connected groups of modules. Importing hflax.a.b runs hflax/a/__init__.py
  first, so an import reaches the target's parent packages too (except one's own parents,
  which Python has already started)."""
  found = imports(root)

  def reached(target):
    parts = target.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & set(found)

  graph = {m: {t for target in ts for t in reached(target) if not m.startswith(t + ".")}
           for m, ts in found.items()}
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        out.append(sorted(group))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_every_package_imports_only_the_layers_below_it():
  assert violations(HFLAX.parent) == []


def test_no_import_cycles():
  assert cycles(HFLAX.parent) == []


def test_a_forbidden_import_is_caught(tmp_path):
  shutil.copytree(HFLAX, tmp_path / "hflax", ignore=shutil.ignore_patterns("__pycache__"))
  assert violations(tmp_path) == []
  worker = tmp_path / "hflax" / "controller" / "workers.py"
  worker.write_text(worker.read_text() + "\n\ndef late():\n  from hflax.launch import config\n")
  (tmp_path / "hflax" / "algorithms" / "kl.py").write_text(
      "import hflax.controller.batch\n" + (HFLAX / "algorithms" / "kl.py").read_text())
  assert violations(tmp_path) == ["hflax.algorithms.kl imports hflax.controller.batch",
                                  "hflax.controller.workers imports hflax.launch.config"]
  assert any("hflax.controller.workers" in group and "hflax.launch.config" in group
             for group in cycles(tmp_path))


def test_the_layers_are_ordered_bottom_up():
  """Each layer may import every layer below it and none above: the order platforms <
  models < rollout < sharding < controller < drivers < launch is the table's."""
  for i, layer in enumerate(LAYERS[:-1]):
    allowed = ALLOWED[layer]
    assert set(LAYERS[:i]) <= allowed, layer
    assert not set(LAYERS[i + 1:]) & allowed, layer


def test_platforms_importing_a_model_is_caught(tmp_path):
  """The hardware layer sits below the models: a kernel module that reached for a model
  (as the CPU kernels once sat in models/ to escape such a cycle) is flagged; the
  decoding copy, the CPU platform's model family, is above them and may."""
  shutil.copytree(HFLAX, tmp_path / "hflax", ignore=shutil.ignore_patterns("__pycache__"))
  kernel = tmp_path / "hflax" / "platforms" / "cpu" / "matmul.py"
  kernel.write_text(kernel.read_text() + "\n\ndef late():\n  from hflax.models import config\n")
  settings = tmp_path / "hflax" / "platforms" / "cpu" / "settings.py"
  settings.write_text(settings.read_text() + "\nfrom hflax.platforms.cpu import decoding_copy\n")
  assert violations(tmp_path) == [
      "hflax.platforms.cpu.matmul imports hflax.models.config",
      "hflax.platforms.cpu.settings imports hflax.platforms.cpu.decoding_copy"]
  assert cycles(tmp_path)


def test_only_the_platforms_reach_a_platforms_modules():
  """Model, rollout, sharding, controller and launch code ask hflax.platforms' entries;
  the hybrid engine imports no kernel module, the model nothing CPU-specific."""
  assert platform_reach(HFLAX.parent) == []
  found = imports(HFLAX.parent)
  for module in ("hflax.sharding.hybrid_engine", "hflax.models.transformer",
                 "hflax.rollout.sampler"):
    assert found[module], module  # read, so the check above saw its imports
    assert not any(t.startswith(PLATFORM_MODULES) for t in found[module]), module


def test_reaching_a_platforms_module_is_caught(tmp_path):
  """An injected import of a CPU or GPU module outside hflax/platforms, at module level or
  late, is flagged; the layering alone would let it pass (platforms are the bottom)."""
  shutil.copytree(HFLAX, tmp_path / "hflax", ignore=shutil.ignore_patterns("__pycache__"))
  engine = tmp_path / "hflax" / "sharding" / "hybrid_engine.py"
  engine.write_text("from hflax.platforms.cpu.decoding_copy import for_decoding\n"
                    + engine.read_text())
  model = tmp_path / "hflax" / "models" / "transformer.py"
  model.write_text(model.read_text() + "\n\ndef late():\n  from hflax.platforms.cpu import matmul\n")
  logprobs = tmp_path / "hflax" / "models" / "logprobs.py"
  logprobs.write_text(logprobs.read_text() + "\nimport hflax.platforms.gpu.logprobs\n")
  assert platform_reach(tmp_path) == [
      "hflax.models.logprobs imports hflax.platforms.gpu.logprobs",
      "hflax.models.transformer imports hflax.platforms.cpu.matmul",
      "hflax.sharding.hybrid_engine imports hflax.platforms.cpu.decoding_copy"]
  assert violations(tmp_path) == []  # the layering allows them: only this check catches
