"""The cache folder (``$LLMPLATFORM_CACHE``, else ``~/.cache/llmplatform``), kept private.

What lives there is loaded as code or weights: compiled kernel libraries (``kernels/``, opened
with ctypes, so a planted one runs inside the worker) and converted models (``gguf/``). Anyone
who can write to the folder can therefore run code as the serving user or change what the model
says. So:

- the folder and every subfolder are created 0700 (:func:`private_dir`);
- a folder found owned by the current user but more open than 0700 (an earlier version made them
  0755) is tightened to 0700, with a log line; one that is group- or world-writable, or owned by
  someone else, is refused: its contents may already have been replaced;
- a file is loaded only once :func:`check_private_file` has seen that it and its folder belong to
  the current user and that nobody else can write to either.

A refusal is an :class:`UnsafeCacheError` whose message names the path and the command that fixes
it. This module is deliberately below every other package (kernels and llm both use it) and
imports nothing of ours.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

logger = logging.getLogger("llmplatform.cache")

CACHE_ENV = "LLMPLATFORM_CACHE"
PRIVATE_DIR_MODE = 0o700
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


class UnsafeCacheError(PermissionError):
    """A cache folder or file that others could have written; the message says what to fix."""


def cache_dir() -> Path:
    """``$LLMPLATFORM_CACHE``, else ``~/.cache/llmplatform`` (not created: see :func:`private_dir`)."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llmplatform"


def private_dir(*parts: str) -> Path:
    """``cache_dir()/parts...``, every level created 0700 or checked (and tightened) if present."""
    path = cache_dir()
    ensure_private_dir(path)
    for part in parts:
        path = path / part
        ensure_private_dir(path)
    return path


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` (one level) 0700, or check an existing one: ours, writable by us alone."""
    try:
        os.mkdir(path, PRIVATE_DIR_MODE)
    except FileExistsError:
        pass
    else:
        os.chmod(path, PRIVATE_DIR_MODE)  # mkdir's mode is filtered by the umask
        return
    info = _checked_stat(path, want_dir=True)
    if stat.S_IMODE(info.st_mode) & _WRITABLE_BY_OTHERS:
        raise UnsafeCacheError(
            f"refusing the cache folder {path}: it is writable by other users (mode "
            f"{stat.S_IMODE(info.st_mode):o}), so what it holds may have been planted; remove what "
            f"you did not put there (or all of it: `rm -rf {path}`), then `chmod 700 {path}`")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, PRIVATE_DIR_MODE)
        logger.warning("cache folder %s was mode %o; tightened to 700 (only its owner may read "
                       "or change what is loaded from it)", path, stat.S_IMODE(info.st_mode))


def check_private_file(path: Path) -> None:
    """Refuse to load ``path`` unless it and its folder are ours and writable by no one else."""
    folder = _checked_stat(path.parent, want_dir=True)
    if stat.S_IMODE(folder.st_mode) & _WRITABLE_BY_OTHERS:
        raise UnsafeCacheError(
            f"refusing to load {path}: its folder {path.parent} is writable by other users (mode "
            f"{stat.S_IMODE(folder.st_mode):o}); remove the file (`rm {path}`) and "
            f"`chmod 700 {path.parent}`")
    info = _checked_stat(path, want_dir=False)
    if stat.S_IMODE(info.st_mode) & _WRITABLE_BY_OTHERS:
        raise UnsafeCacheError(
            f"refusing to load {path}: it is writable by other users (mode "
            f"{stat.S_IMODE(info.st_mode):o}) and may have been altered; remove it (`rm {path}`): "
            "it is rebuilt on the next start")


def check_private_tree(path: Path) -> None:
    """:func:`check_private_file` for every file in the folder ``path`` (and ``path`` itself)."""
    ensure_private_dir(path)
    for entry in sorted(path.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            check_private_tree(entry)
        else:
            check_private_file(entry)


def _checked_stat(path: Path, *, want_dir: bool) -> os.stat_result:
    """The stat of ``path`` after checking that it (and, for a symlink, the link) is ours."""
    uid = os.getuid()
    link = os.lstat(path)
    if link.st_uid != uid:
        raise UnsafeCacheError(_not_ours(path, link.st_uid, want_dir))
    info = os.stat(path) if stat.S_ISLNK(link.st_mode) else link
    if info.st_uid != uid:
        raise UnsafeCacheError(_not_ours(path, info.st_uid, want_dir))
    if want_dir and not stat.S_ISDIR(info.st_mode):
        raise UnsafeCacheError(f"refusing the cache folder {path}: it is not a folder; remove it "
                               f"(`rm {path}`)")
    if not want_dir and not stat.S_ISREG(info.st_mode):
        raise UnsafeCacheError(f"refusing to load {path}: it is not a regular file; remove it "
                               f"(`rm -r {path}`)")
    return info


def _not_ours(path: Path, owner_uid: int, is_dir: bool) -> str:
    what = "the cache folder" if is_dir else "to load"
    fix = (f"remove it (`rm -rf {path}`) or point ${CACHE_ENV} at a folder of your own" if is_dir
           else f"remove it (`rm {path}`)")
    return (f"refusing {what} {path}: it belongs to uid {owner_uid}, not to this user "
            f"(uid {os.getuid()}), who could have put anything there; {fix}")
