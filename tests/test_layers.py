"""The package's layers, read from docs/design.md section 7's diagram: nothing imports upward or
sideways. Imports are read from the source with ``ast`` (lazy ones inside functions included), so a
new import that breaks a rule fails here rather than in a review."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "offgraph_export"

DESIGN = PACKAGE.parent / "docs" / "design.md"
#: the package's entry points, above every layer
TOP = {"__init__", "__main__"}
_NAME = re.compile(r"^([a-z_]+)(?:/|\.py),?$")


def _diagram() -> tuple[dict[str, int], dict[str, set[str]]]:
    """From docs/design.md section 7's diagram: each unit's level (0 at the top) and, for a line
    with ``->``, the units it may import."""
    text = DESIGN.read_text()
    block = text[text.index("## 7. Package layers"):].split("```")[1]
    levels: dict[str, int] = {}
    allowed: dict[str, set[str]] = {}
    for line in block.splitlines():
        if not line.strip() or line[0].isspace():
            continue  # a description's continuation
        fields = re.split(r"\s{2,}", line.strip())
        names = [m.group(1) for f in fields if (m := _NAME.match(f))]
        names = names[: next((i for i, f in enumerate(fields) if not _NAME.match(f)), len(fields))]
        level = len(set(levels.values()))
        for name in names:
            levels[name] = level
        rest = " ".join(fields[len(names):])
        if rest.startswith("->"):
            targets = []
            for token in rest[2:].split():
                match = _NAME.match(token)
                if not match:
                    break
                targets.append(match.group(1))
            for name in names:
                allowed[name] = set(targets)
    return levels, allowed


LEVELS, ALLOWED = _diagram()


def _unit(path: Path) -> str:
    """``runtime`` for ``runtime/session.py``, ``check`` for ``check.py``."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


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


def test_the_diagram_is_read():
    """The parse itself: the diagram's top, bottom and arrows as docs/design.md draws them."""
    assert LEVELS["cli"] == 0 and LEVELS["errors"] == max(LEVELS.values())
    assert LEVELS["pipeline"] == LEVELS["check"] == LEVELS["generate"] == 1
    assert LEVELS["lowering"] == LEVELS["reference"] < LEVELS["compat"] < LEVELS["specs"]
    assert ALLOWED["runtime"] == {"specs"} and ALLOWED["ops"] == {"reference"}
    assert ALLOWED["passes"] == {"kernels", "ops", "compat", "specs", "reference"}
    assert ALLOWED["kernels"] == {"options", "specs", "reference"}


def test_every_module_has_a_place_in_the_diagram():
    units = {_unit(p) for p in PACKAGE.rglob("*.py")}
    assert units - TOP - set(LEVELS) == set()


def _violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        unit = _unit(path)
        if unit in TOP:
            continue
        for target in _imports(path):
            if target == unit or target == "errors" and unit != "errors":
                continue
            ok = LEVELS.get(target, -1) > LEVELS[unit] and (unit not in ALLOWED or target in ALLOWED[unit])
            if not ok:
                found.append(f"{path.relative_to(PACKAGE.parent)} imports offgraph_export.{target}")
    return found


def test_nothing_imports_upward_or_sideways():
    assert _violations() == []


def test_the_rule_catches_what_it_should(monkeypatch):
    """The check is live: an upward, a sideways and an off-arrow import are each reported."""
    real = _imports

    def planted(path: Path) -> list[str]:
        extra = {"specs": ["compat"], "lowering": ["reference"], "runtime": ["lowering"], "models": ["frontends"]}
        return real(path) + extra.get(_unit(path), [])

    monkeypatch.setitem(globals(), "_imports", planted)
    found = " ".join(_violations())
    for fragment in ("specs/", "imports offgraph_export.compat", "lowering/", "imports offgraph_export.reference",
                     "runtime/", "imports offgraph_export.lowering", "models.py imports offgraph_export.frontends"):
        assert fragment in found, (fragment, found)


def test_specs_import_no_torch_at_module_level():
    for path in sorted((PACKAGE / "specs").glob("*.py")):
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        modules = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        modules += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        assert not [m for m in modules if m == "torch" or m.startswith(("torch.", "executorch"))], path.name
