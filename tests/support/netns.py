"""Several "hosts" on one machine: Linux network namespaces, each with its own address, joined by veth links to a
bridge that lives in a namespace of its own (nothing is added to the host's network but one veth end in the root
namespace, for the test process itself; deleting the namespaces removes everything). Needs root and iproute2.

    hosts = Hosts(["redis", "w0", "w1"]).up()
    subprocess.Popen([*hosts.wrap("w0"), sys.executable, "-m", "services.worker", ...])   # runs "on" w0
    hosts.addr("w0")                                                                     # its address
    hosts.down()
"""
from __future__ import annotations

import random
import shutil
import subprocess
import uuid


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    name = f"sschk{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip() or made.stdout.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class Hosts:
    """Namespaces ``names`` on a private /24; the test process (root namespace) is on the same link as ``.1``."""

    def __init__(self, names: list[str]) -> None:
        self.tag = uuid.uuid4().hex[:5]
        self.names = list(names)
        self.net = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
        self._ns = {n: f"ss{self.tag}{n}" for n in self.names}
        self._switch = f"ss{self.tag}sw"
        self._made: list[str] = []

    def addr(self, name: str) -> str:
        return f"{self.net}.{10 + self.names.index(name)}" if name != "root" else f"{self.net}.1"

    def wrap(self, name: str) -> tuple[str, ...]:
        """The command prefix that runs a program "on" host ``name``."""
        return ("ip", "netns", "exec", self._ns[name])

    def up(self) -> "Hosts":
        try:
            _ip("netns", "add", self._switch)
            self._made.append(self._switch)
            _ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self._switch, "link", "set", "br0", "up")
            for i, name in enumerate(["root", *self.names]):
                a, b = f"v{self.tag}{i}a", f"v{self.tag}{i}b"  # a: the host's end, b: the switch's end
                _ip("link", "add", a, "type", "veth", "peer", "name", b)
                _ip("link", "set", b, "netns", self._switch)
                _ip("-n", self._switch, "link", "set", b, "master", "br0")
                _ip("-n", self._switch, "link", "set", b, "up")
                if name == "root":
                    _ip("addr", "add", f"{self.addr(name)}/24", "dev", a)
                    _ip("link", "set", a, "up")
                    continue
                ns = self._ns[name]
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("link", "set", a, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{self.addr(name)}/24", "dev", a)
                _ip("-n", ns, "link", "set", a, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Delete every namespace made here (their veth links, and the root end's peers, go with them)."""
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        _ip("link", "del", f"v{self.tag}0a", check=False)  # normally gone with its peer already
