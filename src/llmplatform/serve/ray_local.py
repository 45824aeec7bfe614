"""How ``serve --ray`` starts (or joins) Ray without opening it to the network or to other users.

A local instance (bare ``--ray``) gets:
- **a folder of ours**: Ray's temp root (sessions, logs, sockets, the object store's spill files)
  is a fresh ``0700`` directory, not ``/tmp/ray``. Ray makes every folder it creates ``0777``
  (``try_make_directory_shared``, for machines where several users share ``/tmp/ray``); inside
  our directory no other user can reach them, and they are tightened to ``0700`` once Ray is up
  and again once the services run (a folder Ray adds later is still behind ours);
- **its own token**, 32 random bytes in a ``0600`` file in that folder (``RAY_AUTH_TOKEN_PATH``;
  Ray turns token authentication on by default for a new local cluster), instead of Ray writing ``~/.ray/auth_token`` with the umask's mode
  (``0644``). An operator's ``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN``/``RAY_AUTH_TOKEN_PATH`` stand;
- **loopback ports** when ``--host`` is loopback: Ray's gRPC servers (GCS, raylet, object
  manager, every worker) bind 127.0.0.1 only when the node's IP is 127.0.0.1, and Ray refuses
  that IP on Linux unless clusters are off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, what it does
  by default on macOS and Windows): we turn clusters off, which is what a loopback deployment is.
  With another ``--host``, Ray's node IP is that address, but its gRPC servers still bind every
  interface: Ray has no option for one address (docs/security.md says so);
- no dashboard.

Joining a running cluster (``--ray auto|HOST:PORT``) changes nothing in it: that cluster's binds
are its operator's (``ray start --node-ip-address``). Only the token file it uses is tightened to
``0600`` when it is ours and readable by others.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import stat
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger("llmplatform.serve")

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::")
LOCAL_OBJECT_STORE_BYTES = 128 * 2**20
"""The services pass nothing through Ray's object store: the minimum-sized one is plenty."""
TOKEN_BYTES = 32
DEFAULT_TOKEN_PATH = Path("~/.ray/auth_token")


def _token_mode_wanted() -> bool:
    """Whether Ray will want a token: its default for a new local cluster, unless opted out."""
    return os.environ.get("RAY_AUTH_MODE", "token").lower() == "token"


class LocalRay:
    """A Ray instance for one run of serve: ``start`` before the services, ``close`` after
    ``ray.shutdown``. ``directory`` is the 0700 root of everything Ray writes."""

    def __init__(self, host: str) -> None:
        self.host = host
        # A short name: Ray's Unix sockets live under it (sun_path holds 107 bytes).
        self.directory = Path(tempfile.mkdtemp(prefix="llmp-ray-"))
        self.token_path: Path | None = None

    def start(self, num_cpus: int) -> None:
        if self.host in LOOPBACK_HOSTS:
            if "ray" in sys.modules:
                # Ray reads the cluster switch at import; serve imports it only after this.
                logger.warning("Ray was imported before serve configured it: its ports may bind "
                               "every interface")
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        if _token_mode_wanted() and not (os.environ.get("RAY_AUTH_TOKEN")
                                         or os.environ.get("RAY_AUTH_TOKEN_PATH")):
            self.token_path = self.directory / "auth_token"
            descriptor = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as out:
                out.write(secrets.token_hex(TOKEN_BYTES))
            # Ray's own processes (GCS, raylet, workers) inherit it from our environment. The
            # mode is left to Ray: unset, ray.init turns tokens on for a new local cluster and
            # refreshes its cached config (setting it here would not reach a cached config).
            os.environ["RAY_AUTH_TOKEN_PATH"] = str(self.token_path)
        else:
            tighten_token_file()
        import ray

        options = {}
        if self.host not in WILDCARD_HOSTS:
            options["_node_ip_address"] = ("127.0.0.1" if self.host in LOOPBACK_HOSTS
                                           else self.host)
        ray.init(address="local", include_dashboard=False, num_cpus=num_cpus,
                 object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                 _temp_dir=str(self.directory / "ray"), **options)
        self.tighten()
        where = ("its ports on loopback" if self.host in LOOPBACK_HOSTS
                 else "its ports on every interface (Ray cannot bind one address)")
        print(f"llmplatform serve: local Ray started: its files in {self.directory} (0700), "
              f"{where}", flush=True)

    def tighten(self) -> None:
        """Every folder Ray made world-writable under ours becomes 0700 (files keep their mode:
        our root already hides them)."""
        for folder in [self.directory, *self.directory.rglob("*")]:
            try:
                info = folder.lstat()
                if stat.S_ISDIR(info.st_mode) and info.st_mode & 0o077:
                    folder.chmod(0o700)
            except OSError:  # a folder Ray removed meanwhile
                continue

    def close(self) -> None:
        """After ray.shutdown: the folder goes, token, logs, spilled objects and all (the
        services' own output is in serve's terminal or --log-dir)."""
        shutil.rmtree(self.directory, ignore_errors=True)


def tighten_token_file() -> None:
    """The token file Ray will read (``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``), made
    0600 when it is ours and others can read it (Ray writes it with the umask's mode)."""
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or DEFAULT_TOKEN_PATH).expanduser()
    try:
        info = path.stat()
    except OSError:
        return
    if info.st_uid == os.getuid() and info.st_mode & 0o077:
        path.chmod(0o600)
        logger.warning("Ray's token file %s was readable by other users (mode %o): now 0600",
                       path, info.st_mode & 0o777)
