"""The code as docs/architecture.md describes it: every module named there, imports that
point only to the same or a lower layer, and no import loop at module level."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "exactlogp"
DOC = (ROOT / "docs" / "architecture.md").read_text()


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _layers() -> dict[str, int]:
    """Module -> layer, from the doc's table rows `| N name | `path` | ... |`."""
    layers = {}
    for number, path in re.findall(r"^\| (\d+) [^|]*\| `([\w/]+\.py)` \|", DOC, re.M):
        parts = ("exactlogp", *Path(path).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        layers[name] = int(number)
    return layers


def _imports(name: str, *, module_level_only: bool) -> set[str]:
    """The package modules `name` imports (`from . import x` counts as the module x)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = ".".join(base[: len(base) - node.level + 1])
                module = f"{parent}.{node.module}" if node.module else parent
            else:
                module = node.module or ""
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module
                       for a in node.names]  # fmt: skip
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


def test_the_doc_names_every_module_once_with_a_layer():
    layers = _layers()
    missing = sorted(set(MODULES) - set(layers))
    assert not missing, f"docs/architecture.md does not name {missing}"
    stale = sorted(set(layers) - set(MODULES))
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"


def test_no_import_points_to_a_higher_layer():
    layers = _layers()
    upward = [
        f"{name} (layer {layers[name]}) imports {target} (layer {layers[target]})"
        for name in MODULES
        for target in sorted(_imports(name, module_level_only=False))
        if layers[target] > layers[name]
    ]
    assert not upward, "\n".join(upward)


@pytest.mark.parametrize("module_level_only", [True, False], ids=["module level", "any level"])
def test_no_import_loop(module_level_only):
    """No loop among the package's imports: at module level (an import would fail), and
    counting the imports inside functions too (two modules that reach for each other)."""
    graph = {name: _imports(name, module_level_only=module_level_only) for name in MODULES}
    # a package imports its own submodules when it is imported: that edge is no loop
    graph = {n: {t for t in ts if not n.startswith(t + ".")} for n, ts in graph.items()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state:
                loop = visit(nxt, path + [node])
                if loop:
                    return loop
        state[node] = 2
        return None

    for name in MODULES:
        if name not in state:
            loop = visit(name, [])
            assert loop is None, " -> ".join(loop)


def test_every_host_is_one_row_of_the_table_with_its_adapter():
    """The hosts table (`_exactlogp_autopatch/hosts.py`) is what EXACTLOGP_PATCH, the
    start-up hook and the plugins read: each row's adapter module has patch_from_env, and
    a host without a start-up trigger has a plugin entry point that reaches it."""
    from _exactlogp_autopatch import hosts
    from exactlogp.integrations import autopatch

    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    plugins = {ep for group in entry_points.values() for ep in group.values()}
    for host in hosts.TABLE:
        assert f"exactlogp.integrations.{host.adapter}" in MODULES, host
        tree = ast.parse(MODULES[f"exactlogp.integrations.{host.adapter}"].read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert "patch_from_env" in defined, host
        if host.trigger is None:
            entry = f"exactlogp.integrations.autopatch:{host.name}_plugin"
            assert entry in plugins and callable(getattr(autopatch, f"{host.name}_plugin")), host
    assert autopatch.HOSTS == hosts.HOSTS == tuple(h.name for h in hosts.TABLE)
