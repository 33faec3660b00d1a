"""The package's shape, as issue 22 fixed it: one module owns the choice of backend, no
import cycle, no module's underscore name used by another, no function longer than about
120 lines of code, and no module-level switch that a trace reads (experiments are fields
of ``MosaicOptions``, in the jit key)."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "pallas_prefill"
MAX_FUNCTION_LINES = 120


def _modules() -> dict[str, ast.Module]:
  """Module name (pallas_prefill.x.y) -> its syntax tree."""
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out[name] = ast.parse(path.read_text(), str(path))
  return out


MODULES = _modules()


def _package_of(name: str) -> str:
  is_package = (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists()
  return name if is_package else name.rpartition(".")[0]


def _imports(name: str, tree: ast.Module) -> set[str]:
  """The pallas_prefill modules `name` imports at its top level (``from pkg import mod``
  counts as importing ``pkg.mod`` where that is a module)."""
  found = set()
  for node in tree.body:
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith("pallas_prefill"))
    elif isinstance(node, ast.ImportFrom) and node.module:
      base = node.module
      if node.level:
        base = ".".join(_package_of(name).split(".")[:len(_package_of(name).split(".")) -
                                                       node.level + 1] + [node.module])
      if not base.startswith("pallas_prefill"):
        continue
      for alias in node.names:
        sub = f"{base}.{alias.name}"
        found.add(sub if sub in MODULES else base)
  return found - {name}


def test_there_is_no_import_cycle():
  graph = {name: _imports(name, tree) for name, tree in MODULES.items()}
  state = {}

  def visit(node, path):
    state[node] = "open"
    for nxt in sorted(graph.get(node, ())):
      # A package's __init__ importing its own submodules is no cycle of the layers.
      if nxt.startswith(node + "."):
        continue
      if state.get(nxt) == "open":
        pytest.fail("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
      elif nxt not in state:
        visit(nxt, path + [nxt])
    state[node] = "done"

  for name in sorted(graph):
    if name not in state:
      visit(name, [name])


def test_only_dispatch_imports_the_backends():
  """The backends import nothing above them: only ``dispatch`` (and the backends'
  own modules) import ``pallas_prefill.triton`` and ``pallas_prefill.mosaic_gpu``."""
  for name, tree in MODULES.items():
    for target in _imports(name, tree):
      for backend in ("pallas_prefill.triton", "pallas_prefill.mosaic_gpu"):
        if target == backend or target.startswith(backend + "."):
          assert name == "pallas_prefill.dispatch" or name.startswith(backend), (
              f"{name} imports {target}")


def test_no_module_uses_another_modules_private_names():
  for name, tree in MODULES.items():
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
          "pallas_prefill"):
        private = [a.name for a in node.names if a.name.startswith("_")]
        assert not private, f"{name} imports {private} from {node.module}"
    imported = {a.asname or a.name.rpartition(".")[2] for node in ast.walk(tree)
                if isinstance(node, (ast.Import, ast.ImportFrom)) and (
                    getattr(node, "module", None) or "").startswith("pallas_prefill")
                for a in node.names}
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in imported and node.attr.startswith("_")
          and not node.attr.startswith("__")):
        pytest.fail(f"{name}:{node.lineno} uses {node.value.id}.{node.attr}")


def _code_lines(source: list[str], node) -> int:
  """Lines of code of a function: neither blank, comment nor docstring (its own and its
  nested functions' and classes')."""
  lines = set(range(node.lineno, node.end_lineno + 1))
  for inner in ast.walk(node):
    if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and (
        inner.body and isinstance(inner.body[0], ast.Expr)
        and isinstance(inner.body[0].value, ast.Constant)
        and isinstance(inner.body[0].value.value, str)):
      lines -= set(range(inner.body[0].lineno, inner.body[0].end_lineno + 1))
  return sum(1 for i in lines if source[i - 1].strip()
             and not source[i - 1].strip().startswith("#"))


def test_no_function_is_longer_than_about_120_lines_of_code():
  long = []
  for path in sorted(PACKAGE.rglob("*.py")):
    source = path.read_text().splitlines()
    for node in ast.walk(ast.parse("\n".join(source))):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = _code_lines(source, node)
        if n > MAX_FUNCTION_LINES:
          long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {n}")
  assert not long, long


def test_no_module_level_switches():
  """Module constants are numbers, strings, tuples or tables, never a bool or None that
  code could flip to change a trace (an A/B switch): those are ``MosaicOptions``."""
  for name, tree in MODULES.items():
    for node in tree.body:
      if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(
          node.value, ast.Constant) and (node.value.value is None
                                         or isinstance(node.value.value, bool)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        pytest.fail(f"{name}:{node.lineno} module-level switch "
                    f"{[ast.unparse(t) for t in targets]} = {node.value.value!r}")


def test_the_checks_see_what_they_look_for():
  """The length and switch checks can fail: a long function and a switch are found."""
  body = "\n".join(f"  x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
  source = f"def f():\n  '''doc'''\n{body}\n".splitlines()
  [fn] = ast.parse("\n".join(source)).body
  assert _code_lines(source, fn) == MAX_FUNCTION_LINES + 2  # the def line too
  tree = ast.parse("FLAG = True\n")
  assert isinstance(tree.body[0].value.value, bool)
