"""The package's layers (docs/design.md section 7): nothing imports upward. Read from the source
with ``ast`` (every import, lazy ones inside functions included), so a new import that breaks a
rule fails here rather than in a review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "offgraph_export"

#: package folder -> the project folders/modules it must never import
FORBIDDEN = {
    "runtime": ("passes", "lowering", "frontends", "pipeline", "check", "generate", "cli"),
    "specs": ("runtime", "passes", "lowering", "frontends", "reference", "ops", "pipeline", "check", "cli"),
    "lowering": ("runtime", "passes", "frontends", "pipeline", "check", "cli"),
    "passes": ("runtime", "frontends", "pipeline", "check", "cli"),
    "reference": ("runtime", "passes", "lowering", "frontends", "pipeline", "check", "cli"),
}


def _imports(path: Path) -> list[str]:
    """The package's top-level modules/folders ``path`` imports: absolute (``offgraph_export.x``,
    ``from offgraph_export import x``) and relative (``from ..x import y``, ``from .. import x``)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]  # ("offgraph_export", folder)
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = [*base, *(node.module.split(".") if node.module else [])]
            if module == ["offgraph_export"]:  # from offgraph_export import x / from .. import x
                names.extend(f"offgraph_export.{alias.name}" for alias in node.names)
            else:
                names.append(".".join(module))
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    return [n.split(".")[1] for n in names if n.startswith("offgraph_export.")]


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_nothing_imports_upward(folder):
    found = [
        f"{path.relative_to(PACKAGE.parent)} imports offgraph_export.{target}"
        for path in sorted((PACKAGE / folder).glob("*.py"))
        for target in _imports(path)
        if target in FORBIDDEN[folder]
    ]
    assert found == []


def test_specs_import_no_torch_at_module_level():
    for path in sorted((PACKAGE / "specs").glob("*.py")):
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        modules = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        modules += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [m for m in modules if m == "torch" or m.startswith(("torch.", "executorch"))], path.name
