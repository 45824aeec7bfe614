"""Imports point down the picture (DESIGN.md, "Imports point down the picture"), checked from the
source for every package and top-level module of llmplatform.

worker -> llm -> engine -> models -> kernels, and all of them -> sampling -> protocol/errors. The
services (controller, model_worker, openai_api, webui, serve) are siblings that never import each
other; what two of them share (routing, protocol) lives below them; utils and metrics are leaves
that import no service, and no backend either. Each layer lists what it MAY import (besides
itself), so a new dependency is a decision made here, not an accident. The modules are parsed, not
imported, so the check sees every import (function-level and ``TYPE_CHECKING`` ones included)
and runs none of their side effects; a service started by name (``pkgutil.resolve_name``, as
``cli.py`` and ``serve`` do) is not an import.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

import llmplatform

PACKAGE_DIR = Path(llmplatform.__file__).parent

BASE = frozenset({"protocol", "errors", "utils"})
"""What any layer above the contracts may use: messages, typed errors, the leaf utilities."""
BACKEND = BASE | {"sampling"}
ALLOWED: dict[str, frozenset[str]] = {
    # The contracts and the leaves.
    "errors": frozenset(),
    "protocol": frozenset({"errors"}),
    "templates": frozenset(),  # data files (chat templates) read by llm
    "utils": frozenset({"errors", "protocol"}),
    "metrics": BASE | {"sampling"},  # a leaf: no service, no backend (they pass their state in)
    "conversation": frozenset({"errors"}),  # FastChat's conversation templates (gateway, worker)
    # The inference stack, top to bottom.
    "sampling": BASE,
    "kernels": BACKEND,
    "models": BACKEND | {"kernels"},
    "engine": BACKEND | {"models", "kernels"},
    "llm": BACKEND | {"engine", "models", "kernels", "templates", "conversation"},
    # The services: siblings, each above what it uses and beside the others. The worker reaches
    # the engine only through llm (llm/build.py builds its backend).
    "model_worker": BASE | {"llm", "sampling", "metrics", "conversation"},
    "controller": BASE | {"metrics", "routing"},
    "openai_api": BASE | {"metrics", "routing", "sampling", "conversation"},
    "webui": BASE,
    "serve": BASE,
    # The RunPod worker: starts serve's stack (controller, worker, gateway as child processes)
    # and sends jobs to the gateway over HTTP, so it sits above serve and imports no service.
    "serverless": BASE | {"serve"},
    # Dispatch policies, prefix trees, load estimates: pure, below both the gateway and the
    # controller (issue 35).
    "routing": frozenset(),  # imports nothing of ours: pure code, clock injected
    # The entry points.
    "offline": BACKEND | {"llm", "engine"},  # the offline LLM: llm/build.py's engine config
    "cli": BASE,  # starts the services by name
    "__init__": frozenset({"offline", "sampling"}),  # the public offline API, loaded lazily
}
SERVICES = ("controller", "model_worker", "openai_api", "webui", "serve")


class Violation(NamedTuple):
    where: str  # path relative to the package, and line
    layer: str
    imported: str  # the layer imported
    module: str  # the module named by the import

    def __str__(self) -> str:
        return f"{self.where}: {self.layer} imports {self.module}"


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


def layer_of_file(path: Path, package_dir: Path) -> str:
    """``engine/parallel/x.py`` -> ``engine``; a top-level module is its own layer (``cli``)."""
    parts = path.relative_to(package_dir).parts
    return parts[0] if len(parts) > 1 else path.stem


def layers(package_dir: Path) -> set[str]:
    """Every package (a folder with Python files) and top-level module under `package_dir`."""
    found = {p.stem for p in package_dir.glob("*.py")}
    found |= {p.name for p in package_dir.iterdir()
              if p.is_dir() and p.name != "__pycache__" and any(p.rglob("*.py"))}
    return found


def violations(package_dir: Path = PACKAGE_DIR) -> list[Violation]:
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        layer = layer_of_file(path, package_dir)
        allowed = ALLOWED.get(layer, frozenset()) | {layer}
        for line, modules in imported_modules(path, package_dir):
            bad = [(layer_of(m), m) for m in modules
                   if layer_of(m) in ALLOWED and layer_of(m) not in allowed]
            if bad:
                where = f"{path.relative_to(package_dir)}:{line}"
                found.append(Violation(where, layer, *bad[0]))
    return found


def test_every_package_has_a_rule():
    """A new package or top-level module cannot slip by: it needs its line in ALLOWED."""
    assert sorted(layers(PACKAGE_DIR) - set(ALLOWED)) == []


def test_every_rule_names_a_package():
    assert sorted(set(ALLOWED) - layers(PACKAGE_DIR)) == []


def test_imports_point_down_the_layers():
    assert [str(v) for v in violations()] == []


def test_services_are_siblings():
    """No service may import another, whatever else a rule allows."""
    for service in SERVICES:
        assert not ALLOWED[service] & set(SERVICES), service
    for leaf in ("utils", "metrics", "routing"):
        assert not ALLOWED[leaf] & (set(SERVICES) | {"llm", "engine", "models", "kernels"}), leaf


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "llmplatform"
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    return root


@pytest.mark.parametrize(("file", "source", "expected"), [
    ("engine/bad.py", "from llmplatform.llm.base import GenerateChunk\n", "llmplatform.llm.base"),
    ("engine/bad.py", "def f():\n    import llmplatform.model_worker.app\n",
     "llmplatform.model_worker.app"),
    ("sampling/bad.py", "from ..llm import base\n", "llmplatform.llm"),
    ("models/bad.py", "from llmplatform import engine\n", "llmplatform.engine"),
    ("kernels/bad.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                       "    from llmplatform.openai_api.app import create_app\n",
     "llmplatform.openai_api.app"),
    # One service importing another, each way today's tree did.
    ("openai_api/bad.py", "from llmplatform.controller.dispatch import RandomSource\n",
     "llmplatform.controller.dispatch"),
    ("serve/bad.py", "def f():\n    from llmplatform.webui.__main__ import WebUIServiceSettings\n",
     "llmplatform.webui.__main__"),
    ("serve/bad.py", "from llmplatform.llm.resolve import EMBEDDING_MODEL_NAME\n",
     "llmplatform.llm.resolve"),
    # The worker reaches the engine only through llm.
    ("model_worker/bad.py", "from llmplatform.engine.config import EngineConfig\n",
     "llmplatform.engine.config"),
    ("model_worker/deep/bad.py", "from ...models import registry\n", "llmplatform.models"),
    # The leaves.
    ("utils/bad.py", "from llmplatform.model_worker.app import WorkerSettings\n",
     "llmplatform.model_worker.app"),
    ("metrics/bad.py", "from llmplatform.llm.base import LoadStats\n", "llmplatform.llm.base"),
    ("metrics/bad.py", "from ..controller.registry import WorkerRegistry\n",
     "llmplatform.controller.registry"),
    ("routing/bad.py", "from llmplatform.engine import scheduler\n", "llmplatform.engine"),
    # Top-level modules are layers too.
    ("cli.py", "from llmplatform.serve.launcher import main\n", "llmplatform.serve.launcher"),
    ("offline.py", "from llmplatform.models.registry import max_model_len\n",
     "llmplatform.models.registry"),
    ("errors.py", "from . import protocol\n", "llmplatform.protocol"),
])
def test_a_forbidden_import_is_found(tmp_path, file, source, expected):
    found = violations(_tree(tmp_path, {file: source}))
    assert len(found) == 1 and found[0].where.startswith(f"{file}:")
    assert found[0].module == expected


def test_an_allowed_import_is_not_reported(tmp_path):
    root = _tree(tmp_path, {
        "engine/ok.py": "from llmplatform.sampling.params import SamplingParams\n"
                        "from llmplatform.models.loader import load_model\nfrom . import config\n",
        "model_worker/ok.py": "from llmplatform.llm.build import build_backend\n"
                              "from llmplatform.metrics.worker import WorkerMetrics\n",
        "openai_api/ok.py": "from llmplatform.routing import policies\nimport llmplatform\n",
        "controller/ok.py": "from ..routing.prefix_tree import PrefixTree\n",
        "offline.py": "from llmplatform.llm.build import paged_engine_config\n"
                      "from llmplatform.engine.llm_engine import LLMEngine\n",
        "cli.py": "import pkgutil\nRUN = 'llmplatform.serve.launcher:main'\n",
    })
    assert violations(root) == []


def test_every_package_and_top_level_module_is_a_layer(tmp_path):
    root = _tree(tmp_path, {"engine/parallel/tp.py": "", "newpkg/__init__.py": "", "tool.py": "",
                            "templates/x.jinja": "", "empty/README": ""})
    assert layers(root) == {"engine", "newpkg", "tool"}
