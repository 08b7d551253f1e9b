"""The import structure of jaxrl_llm: layers point one way, down.

Reads every module of the package with ``ast`` (nothing is imported), collects
its imports of jaxrl_llm modules, module-level and function-level alike, and
checks:

(a) no import cycle between modules, nor between top-level packages;
(b) no import of a private module (``_name``) from outside its package;
(c) every package directory has an ``__init__.py`` that defines ``__all__``;
(d) the layer rule: a top-level package imports only packages of the same or
    a lower layer (``LAYERS``).
"""

import ast
import pathlib
from typing import Iterable, Optional

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "jaxrl_llm"
PACKAGE = "jaxrl_llm"

# Top-level packages and modules of jaxrl_llm by layer, lowest first. A package may import
# packages of its own layer or of a lower one, never one above (and never in a cycle).
# A new package goes into the lowest layer that holds everything it imports: arrays and
# settings with no dependency -> 0; objectives, advantages, models (pure JAX functions) -> 1;
# I/O with the outside world (weights, samplers, tasks, diagnostics) -> 2; the learner and
# the rollout machinery, multi-turn environments over samplers and tasks -> 3; what trains on top of the learner (reward models) -> 4; run
# configuration and launching -> 5; jobs, which wire everything together -> 6.
LAYERS = {
    0: ("types", "reduce", "ops", "settings", "errors"),
    1: ("objectives", "advantages", "models"),
    2: ("bridge", "sampling", "tasks", "diagnostics"),
    3: ("rollout", "learner", "envs"),
    4: ("reward_model",),
    5: ("configuration", "experiments"),
    6: ("jobs",),
}
LAYER_OF = {name: layer for layer, names in LAYERS.items() for name in names}


def module_name(path: pathlib.Path) -> str:
  parts = (PACKAGE,) + path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def package_of(name: str) -> str:
  """The package a module's relative imports resolve against."""
  return name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]


def top_level(name: str) -> Optional[str]:
  """``jaxrl_llm.learner.sft`` -> ``learner``; None for the root package itself."""
  parts = name.split(".")
  return parts[1] if len(parts) > 1 else None


def imports_of(name: str) -> set[str]:
  """The jaxrl_llm modules ``name`` imports anywhere in its source (functions included)."""
  tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package_of(name).split(".")
        base = base[:len(base) - node.level + 1]
        mod = ".".join(base + ([node.module] if node.module else []))
      else:
        mod = node.module or ""
      targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in MODULES else mod for a in node.names]
    else:
      continue
    for target in targets:
      while target and target not in MODULES and target.startswith(PACKAGE + "."):
        target = target.rsplit(".", 1)[0]  # `import jaxrl_llm.x.y` of a name that is no module
      if target in MODULES and target != name:
        out.add(target)
  return out


EDGES = {name: imports_of(name) for name in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one node (Tarjan), each sorted."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v: str) -> None:
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return sorted(found)


def cross_package_edges() -> Iterable[tuple[str, str, str, str]]:
  """``(module, imported module, its top-level package, the imported one's)`` across packages."""
  for a, bs in sorted(EDGES.items()):
    for b in sorted(bs):
      pa, pb = top_level(a), top_level(b)
      if pa and pb and pa != pb:
        yield a, b, pa, pb


def test_the_walk_sees_module_and_function_level_imports():
  assert "jaxrl_llm.learner.sft" in MODULES and "jaxrl_llm.diagnostics.alerts" in MODULES
  assert "jaxrl_llm.models.transformer" in EDGES["jaxrl_llm.models.sharding"]
  # hf_import imports models.sharding inside a function only
  assert "jaxrl_llm.models.sharding" in EDGES["jaxrl_llm.bridge.hf_import"]


def test_no_module_cycles():
  found = cycles(EDGES)
  assert not found, "import cycles between modules (make the dependency point one way):\n" + "\n".join(
      " <-> ".join(c) for c in found)


def test_no_package_cycles():
  graph: dict[str, set[str]] = {}
  for _, _, pa, pb in cross_package_edges():
    graph.setdefault(pa, set()).add(pb)
  found = cycles(graph)
  detail = [f"  {a} -> {b}" for a, b, pa, pb in cross_package_edges()
            if any(pa in c and pb in c for c in found)]
  assert not found, ("import cycles between top-level packages: " + "; ".join(" <-> ".join(c) for c in found)
                     + "\n" + "\n".join(detail))


def test_no_private_module_imported_from_another_package():
  bad = []
  for a, bs in sorted(EDGES.items()):
    for b in sorted(bs):
      parts = b.split(".")
      private = [i for i, part in enumerate(parts) if i and part.startswith("_") and not part.startswith("__")]
      if private:
        owner = ".".join(parts[:private[0]])  # the package that holds the private module
        if not (a == owner or a.startswith(owner + ".")):
          bad.append(f"{a} -> {b}")
  assert not bad, "private modules imported from outside their package (make them public):\n" + "\n".join(bad)


def test_every_package_has_an_init_with_all():
  bad = []
  for directory in sorted({p.parent for p in ROOT.rglob("*.py")}):
    init = directory / "__init__.py"
    where = directory.relative_to(ROOT.parent)
    if not init.exists():
      bad.append(f"{where}: no __init__.py")
      continue
    tree = ast.parse(init.read_text(encoding="utf-8"))
    names = [t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)]
    if "__all__" not in names:
      bad.append(f"{where}/__init__.py: no __all__")
  assert not bad, "packages need an __init__.py with a docstring and __all__:\n" + "\n".join(bad)


def test_every_top_level_package_has_a_layer():
  unknown = sorted({top_level(m) for m in MODULES if top_level(m)} - set(LAYER_OF))
  assert not unknown, (f"{unknown}: not in tests/test_layers.py LAYERS; place each new top-level package "
                       "or module in the lowest layer that holds everything it imports")


def test_layers_point_down():
  upward = [f"{a} (layer {LAYER_OF[pa]}) -> {b} (layer {LAYER_OF[pb]})"
            for a, b, pa, pb in cross_package_edges()
            if pa in LAYER_OF and pb in LAYER_OF and LAYER_OF[pb] > LAYER_OF[pa]]
  assert not upward, "imports of a higher layer (see LAYERS in tests/test_layers.py):\n" + "\n".join(upward)


@pytest.mark.parametrize("graph, want", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set(), "c": {"d"}, "d": {"c"}}, [["c", "d"]]),
    ({"a": {"b"}, "b": {"c"}}, []),
])
def test_cycle_finder(graph, want):
  assert cycles(graph) == want
