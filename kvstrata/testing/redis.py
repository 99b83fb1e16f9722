"""Real ``redis-server`` processes for tests and benchmarks: loopback, a free port, a temporary
directory, stopped by whoever started them (context managers).

``RedisServer`` is one standalone server (``stop()`` / ``start()`` again on the same port:
a restart); ``RedisClusterServers`` is a cluster of primaries made with ``redis-cli --cluster
create``. Both need Debian's ``redis-server`` / ``redis-tools`` (``scripts/setup.sh`` installs
them).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A loopback port free now (and, for a cluster node, its bus port ``port + 10000``)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster_bus:
            return port
        if port + 10000 < 65536 and _free(port + 10000):
            return port
    raise RuntimeError("no free loopback port pair found")


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed; run scripts/setup.sh (it installs Debian's "
                           f"redis-server)")
    return path


def _ping(port: int) -> str:
    r = subprocess.run([_binary("redis-cli"), "-p", str(port), "ping"], capture_output=True,
                       text=True, timeout=5)
    return r.stdout.strip()


class RedisServer:
    """One ``redis-server`` on ``127.0.0.1:port``; extra ``redis.conf`` lines via ``config``."""

    def __init__(self, directory: str | os.PathLike | None = None, port: int | None = None,
                 config: dict[str, str] | None = None, cluster: bool = False):
        self._tmp = None if directory is not None else tempfile.TemporaryDirectory(
            prefix="kvstrata-redis-")
        self.dir = Path(directory if directory is not None else self._tmp.name)
        self.port = port if port is not None else free_port(cluster)
        self.config = {"maxmemory": "512mb", "maxmemory-policy": "allkeys-lru", **(config or {})}
        self.cluster = cluster
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        args = [_binary("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--logfile", str(self.dir / f"redis-{self.port}.log")]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file",
                     f"nodes-{self.port}.conf", "--cluster-node-timeout", "3000"]
        for k, v in self.config.items():
            args += [f"--{k}", v]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while _ping(self.port) != "PONG":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log = self.dir / f"redis-{self.port}.log"
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        """Kill the server (SIGKILL: as abrupt as a crash) and wait for it."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "RedisServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.close()


class RedisClusterServers:
    """``n`` cluster-enabled primaries joined with ``redis-cli --cluster create``."""

    def __init__(self, n: int = 3):
        self._tmp = tempfile.TemporaryDirectory(prefix="kvstrata-redis-cluster-")
        self.nodes = [RedisServer(self._tmp.name, cluster=True) for _ in range(n)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self, timeout_s: float = 30.0) -> "RedisClusterServers":
        try:
            for node in self.nodes:
                node.start()
            addrs = [f"127.0.0.1:{n.port}" for n in self.nodes]
            r = subprocess.run([_binary("redis-cli"), "--cluster", "create", *addrs,
                                "--cluster-replicas", "0", "--cluster-yes"],
                               capture_output=True, text=True, timeout=timeout_s)
            if r.returncode:
                raise RuntimeError(f"redis-cli --cluster create failed:\n{r.stdout}{r.stderr}")
            deadline = time.monotonic() + timeout_s
            for node in self.nodes:
                while True:
                    out = subprocess.run([_binary("redis-cli"), "-p", str(node.port), "cluster",
                                          "info"], capture_output=True, text=True,
                                         timeout=5).stdout
                    if "cluster_state:ok" in out:
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"cluster node {node.port} not ok:\n{out}")
                    time.sleep(0.1)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
        self._tmp.cleanup()

    def __enter__(self) -> "RedisClusterServers":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
