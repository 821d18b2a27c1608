"""DESIGN.md's dependency direction: the core (``secure_vfl``) never imports ``protocols`` or
``attacks``, but for its composition root, the CLI; nothing imports ``examples`` or
``benchmarks``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPOSITION_ROOT = ROOT / "secure_vfl" / "cli.py"


def _imported(path: Path) -> set[str]:
    """The top-level packages ``path`` imports, at module level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_core_imports_neither_the_privacy_layer_nor_the_attacks_but_from_the_cli() -> None:
    offending = {
        str(path.relative_to(ROOT)): sorted(_imported(path) & {"protocols", "attacks"})
        for path in sorted((ROOT / "secure_vfl").rglob("*.py"))
        if path != COMPOSITION_ROOT
    }
    assert {path: names for path, names in offending.items() if names} == {}
    assert {"protocols", "attacks"} <= _imported(COMPOSITION_ROOT)  # the check sees imports


def test_nothing_imports_the_examples_or_the_benchmarks() -> None:
    packages = ("secure_vfl", "protocols", "attacks")
    offending = {
        str(path.relative_to(ROOT)): sorted(_imported(path) & {"examples", "benchmarks"})
        for package in packages
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {path: names for path, names in offending.items() if names} == {}
