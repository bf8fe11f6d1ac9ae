"""The package layering written in the README's development notes, read from the imports.

Every `import hflax...` / `from hflax... import ...` counts, at module level or inside a
function, so a late import does not hide a dependency."""
import ast
import pathlib
import shutil

HFLAX = pathlib.Path(__file__).resolve().parents[1] / "hflax"

CORE = {"hflax.models", "hflax.kernels", "hflax.sharding", "hflax.rollout"}
# Which packages each package may import (besides itself). Lower layers never import
# higher ones: controller knows nothing of drivers or launch, algorithms nothing at all.
ALLOWED = {
    "hflax.xla_env": set(),
    "hflax.checkpoint": set(),
    "hflax.algorithms": set(),
    **{p: CORE for p in CORE},
    "hflax.data": CORE,
    "hflax.rewards": CORE,
    "hflax.metrics": CORE | {"hflax.algorithms"},
    "hflax.controller": CORE | {"hflax.algorithms", "hflax.checkpoint", "hflax.rewards"},
    "hflax.controller.ray_backend": CORE | {"hflax.algorithms", "hflax.checkpoint",
                                            "hflax.rewards", "hflax.controller",
                                            "hflax.xla_env"},
    "hflax.algorithms.drivers": CORE | {"hflax.algorithms", "hflax.controller", "hflax.metrics"},
    "hflax.launch": None,  # the top: anything
    "hflax.configs": None,  # config files, read by path
}
SUBPACKAGES = ("hflax.algorithms.drivers", "hflax.controller.ray_backend")


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
