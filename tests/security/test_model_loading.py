"""Model loading: weights from safetensors only, code shipped with a checkpoint runs only with
--trust-remote-code, and no pickle anywhere on the serving path (nothing unpickles what came over
a socket, nor a checkpoint).
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import llmplatform
from llmplatform.llm.build import BackendConfig, build_backend

EVIL_CONFIG = '''
from pathlib import Path
Path({marker!r}).write_text("remote code ran")
from transformers import LlamaConfig


class EvilConfig(LlamaConfig):
    model_type = "evil-llama"
'''


@pytest.fixture
def remote_code_model(tiny_model_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The tiny model, plus a config that names Python code shipped in the directory; that code
    leaves a marker file when it is imported."""
    model_dir = tmp_path / "remote-code-model"
    shutil.copytree(tiny_model_dir, model_dir)
    marker = tmp_path / "REMOTE_CODE_RAN"
    (model_dir / "configuration_evil.py").write_text(EVIL_CONFIG.format(marker=str(marker)))
    (model_dir / "modeling_evil.py").write_text(EVIL_CONFIG.format(marker=str(marker)))
    config = json.loads((model_dir / "config.json").read_text())
    config["model_type"] = "evil-llama"
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir, marker


@pytest.mark.parametrize("backend", ["auto", "hf", "paged"])
def test_checkpoint_code_does_not_run_by_default(remote_code_model: tuple[Path, Path], backend: str) -> None:
    model_dir, marker = remote_code_model
    with pytest.raises((ValueError, OSError)) as info:
        build_backend(BackendConfig(model_path=str(model_dir), backend=backend, device="cpu", dtype="float32"))
    assert "trust_remote_code" in str(info.value) or "evil-llama" in str(info.value)
    assert not marker.exists(), "code shipped with the checkpoint was executed"


class _Stop(Exception):
    pass


def test_trust_remote_code_reaches_transformers_only_when_asked(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every transformers loader of the hf backend is told trust_remote_code explicitly (False
    unless --trust-remote-code), so the choice never falls to transformers' default or prompt;
    and model weights are asked for as safetensors."""
    import transformers

    calls: list[tuple[str, dict[str, Any]]] = []

    def recorder(name: str, real: Any) -> Any:
        def record(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, kwargs))
            if name == "model":
                raise _Stop  # enough: the tokenizer and config were loaded, the model asked for
            return real(*args, **kwargs)

        return record

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        recorder("tokenizer", transformers.AutoTokenizer.from_pretrained))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        recorder("model", transformers.AutoModelForCausalLM.from_pretrained))
    for trust in (False, True):
        calls.clear()
        with pytest.raises(_Stop):
            build_backend(BackendConfig(model_path=str(tiny_model_dir), backend="hf", device="cpu",
                                    dtype="float32", trust_remote_code=trust))
        assert [name for name, _ in calls] == ["tokenizer", "model"]
        assert all(kwargs.get("trust_remote_code") is trust for _, kwargs in calls), calls
        assert calls[-1][1].get("use_safetensors") is True


def test_the_worker_flag() -> None:
    from llmplatform.model_worker.settings import WorkerServiceSettings

    assert WorkerServiceSettings.parse([]).backend_config.trust_remote_code is False
    assert WorkerServiceSettings.parse(["--trust-remote-code"]).backend_config.trust_remote_code is True


@pytest.fixture
def pickle_only_model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """The tiny model with its weights as a pickled pytorch_model.bin and no safetensors."""
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "pickle-model"
    shutil.copytree(tiny_model_dir, model_dir)
    for path in model_dir.glob("*.safetensors*"):
        path.unlink()
    import torch

    # transformers 5 no longer writes pickles itself; torch.save is how such checkpoints come to be.
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    torch.save(model.state_dict(), model_dir / "pytorch_model.bin")
    assert (model_dir / "pytorch_model.bin").is_file() and not list(model_dir.glob("*.safetensors"))
    return model_dir


@pytest.mark.parametrize("backend", ["hf", "paged", "auto"])
def test_pickled_weights_are_refused_unread(pickle_only_model: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import pickle

    import torch

    unpickled: list[Any] = []
    real_load = torch.load

    def recording_load(*args: Any, **kwargs: Any) -> Any:
        unpickled.append(args[:1])
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    monkeypatch.setattr(pickle, "load", lambda *a, **k: unpickled.append(a[:1]))
    with pytest.raises((OSError, FileNotFoundError, ValueError)) as info:
        build_backend(BackendConfig(model_path=str(pickle_only_model), backend=backend, device="cpu", dtype="float32"))
    assert "safetensors" in str(info.value)
    assert unpickled == [], "a pickled checkpoint was opened"


_PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}

_OWN_PROCESS_PIPES = {"engine/parallel/ranks.py"}
"""Modules allowed to pickle, and why: a tensor-parallel worker sends each step to the rank
processes it spawned over the pipes (socketpairs) it made for them before spawning them, so only
the worker and its own children hold either end (multiprocessing pickles over them too). Nothing
from a listening socket, a client or a file."""


def test_no_pickle_on_the_serving_path() -> None:
    """No module of the package imports a pickle library or calls torch.load / numpy.load: nothing
    that arrives over a network socket, nor any checkpoint, is ever unpickled (the one exception,
    the worker's pipes to its own tensor-parallel rank processes, is listed above)."""
    root = Path(llmplatform.__file__).parent
    offenders: list[str] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            exempt = str(path.relative_to(root)) in _OWN_PROCESS_PIPES
            if any(name in _PICKLE_MODULES for name in names) and not exempt:
                offenders.append(f"{path.relative_to(root)}:{node.lineno} imports {names}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
                owner = node.func.value
                if isinstance(owner, ast.Name) and owner.id in ("torch", "np", "numpy", "pickle"):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno} calls {owner.id}.load")
    assert offenders == []
