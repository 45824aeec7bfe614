"""Imports point down the layers (DESIGN.md, "A layout that shows it"), checked from the source.

worker -> llm -> engine -> models -> kernels, and all of them -> sampling -> protocol/errors. The
modules are parsed, not imported, so the check sees every import (function-level and
``TYPE_CHECKING`` ones included) and runs none of their side effects.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import llmplatform

PACKAGE_DIR = Path(llmplatform.__file__).parent

SERVING = ("llm", "model_worker", "openai_api", "controller", "webui", "serve")
# package -> the packages it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "engine": SERVING,
    "models": SERVING + ("engine",),
    "kernels": SERVING + ("engine", "models"),
    "sampling": SERVING + ("engine", "models", "kernels"),
    "protocol": SERVING + ("engine", "models", "kernels", "sampling"),
    "routing": SERVING + ("engine", "models", "kernels"),
}


def imported_modules(path: Path, package_dir: Path) -> list[tuple[int, list[str]]]:
    """Per import statement in the file: its line and the absolute module names it may bring in
    (``from llmplatform import llm`` names a package through the imported name), relative
    imports resolved against the file's own package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = list(path.relative_to(package_dir.parent).parent.parts)
    found: list[tuple[int, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, [alias.name]) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, [module] + [f"{module}.{a.name}" for a in node.names]))
    return found


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "llmplatform" else None


def violations(package_dir: Path = PACKAGE_DIR) -> list[str]:
    found = []
    for layer, forbidden in FORBIDDEN.items():
        for path in sorted((package_dir / layer).rglob("*.py")):
            for line, modules in imported_modules(path, package_dir):
                bad = [m for m in modules if layer_of(m) in forbidden]
                if bad:
                    found.append(f"{path.relative_to(package_dir)}:{line} imports {bad[0]}")
    return found


def test_every_layer_exists():
    for layer in FORBIDDEN:
        assert list((PACKAGE_DIR / layer).glob("*.py")), f"no modules under llmplatform/{layer}"


def test_imports_point_down_the_layers():
    assert violations() == []


@pytest.mark.parametrize(("layer", "source", "expected"), [
    ("engine", "from llmplatform.llm.base import GenerateChunk\n", "llmplatform.llm.base"),
    ("engine", "def f():\n    import llmplatform.model_worker.app\n", "llmplatform.model_worker.app"),
    ("sampling", "from ..llm import base\n", "llmplatform.llm"),
    ("models", "from llmplatform import engine\n", "llmplatform.engine"),
    ("kernels", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from llmplatform.openai_api.app import create_app\n",
     "llmplatform.openai_api.app"),
])
def test_an_upward_import_is_found(tmp_path, layer, source, expected):
    for name in FORBIDDEN:
        (tmp_path / "llmplatform" / name).mkdir(parents=True)
        (tmp_path / "llmplatform" / name / "__init__.py").write_text("")
    (tmp_path / "llmplatform" / layer / "bad.py").write_text(source)
    found = violations(tmp_path / "llmplatform")
    assert len(found) == 1 and found[0].startswith(f"{layer}/bad.py:")
    assert expected in found[0]


def test_a_downward_import_is_allowed(tmp_path):
    (tmp_path / "llmplatform" / "engine").mkdir(parents=True)
    (tmp_path / "llmplatform" / "engine" / "ok.py").write_text(
        "from llmplatform.sampling.params import SamplingParams\n"
        "from llmplatform.models.loader import load_model\nfrom . import config\n")
    assert violations(tmp_path / "llmplatform") == []
