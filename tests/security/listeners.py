"""Which TCP sockets a process tree listens on, read from /proc (what `ss -ltnp` shows, without
needing `ss` or its permission to see other users' processes: a test owns what it starts).

A socket belongs to a process when one of its file descriptors is `socket:[inode]`; the inode's
row in /proc/net/tcp or tcp6 (state 0A, LISTEN) gives the local address. Addresses there are
hex, in host byte order per 32-bit word.
"""

from __future__ import annotations

import ipaddress
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

_LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    pid: int
    address: str  # the bound address: 0.0.0.0 and :: mean every interface
    port: int

    @property
    def loopback(self) -> bool:
        address = ipaddress.ip_address(self.address)
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return address.is_loopback

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"pid {self.pid} ({comm(self.pid)}) listens on {host}:{self.port}"


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def process_tree(root: int) -> list[int]:
    """`root` and every descendant alive now (one pass over /proc, then a walk)."""
    parent_of: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent_of[int(entry.name)] = int(fields[1])
    tree, frontier = [root], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parent_of.items() if ppid == parent]
        tree.extend(children)
        frontier.extend(children)
    return tree


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = fd.readlink().name
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _decode(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    # The kernel prints each 32-bit word of the address as the number it is in host byte order:
    # packing that number back in host order gives the address's bytes.
    packed = b"".join(struct.pack("=I", int(host[i:i + 8], 16)) for i in range(0, len(host), 8))
    return str(ipaddress.ip_address(packed)), int(port, 16)


def _listening_by_inode() -> dict[str, tuple[str, int]]:
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN:
                found[fields[9]] = _decode(fields[1])
    return found


def listeners(root: int) -> list[Listener]:
    """Every listening TCP socket held by `root` or a descendant."""
    table = _listening_by_inode()
    found = []
    for pid in process_tree(root):
        for inode in _socket_inodes(pid):
            if inode in table:
                address, port = table[inode]
                found.append(Listener(pid, address, port))
    return sorted(set(found), key=lambda item: (item.pid, item.port))


def ss_lines(pids: list[int]) -> list[str]:
    """`ss -ltnp` rows naming one of `pids` (for the failure message and the report)."""
    if shutil.which("ss") is None:
        return ["(no ss on this machine)"]
    output = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True, timeout=10).stdout
    marks = [f"pid={pid}," for pid in pids]
    return [line for line in output.splitlines() if any(mark in line for mark in marks)]
