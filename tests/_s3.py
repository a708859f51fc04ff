"""A real S3 protocol endpoint for tests: moto's threaded server on loopback, spoken to over HTTP
by s3fs (the same client stack as production). One server per test session; one bucket per test.
"""

from __future__ import annotations

import itertools
import logging
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

KEY_ID = "AKIATESTKEYID000001"
SECRET = "test-secret-value-do-not-print-0123456789"
_BUCKETS = itertools.count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class S3Server:
    """moto's ``ThreadedMotoServer`` on a fixed loopback port, so that it can be stopped (to inject
    upload failures) and started again on the same address, with its objects kept (moto's
    backend lives in this process)."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.running = False

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        if self.running:
            return
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        for _ in range(50):  # the port may sit in TIME_WAIT for a moment after stop()
            try:
                self._server.start()
                break
            except OSError:
                time.sleep(0.1)
        self.running = True

    def stop(self) -> None:
        if self.running:
            self._server.stop()
            self.running = False

    def client_fs(self) -> Any:
        """A plain s3fs client (test-side checks, bypassing the engine)."""
        return client_fs(self.endpoint)


class S3ServerProcess:
    """moto's server in a process of its own: a second object store with its own objects (two
    servers in one process share moto's backend, so they would be one store)."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.running = False
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self.running:
            return
        code = (
            "import sys; from moto.server import ThreadedMotoServer; "
            f"ThreadedMotoServer(ip_address='127.0.0.1', port={self.port}, verbose=False).start(); "
            "sys.stdin.read()"  # until the parent closes the pipe
        )
        self._proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
        while self._proc.poll() is None:  # bounded by the process: it either listens or exits
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    self.running = True
                    return
            time.sleep(0.05)
        raise RuntimeError(f"the moto server process exited with {self._proc.returncode}")

    def stop(self) -> None:
        if self._proc is not None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc, self.running = None, False

    def client_fs(self) -> Any:
        """A plain s3fs client (test-side checks, bypassing the engine)."""
        return client_fs(self.endpoint)


def client_fs(endpoint: str) -> Any:
    """A plain s3fs client of the server at ``endpoint``."""
    import s3fs

    return s3fs.S3FileSystem(
        key=KEY_ID,
        secret=SECRET,
        endpoint_url=endpoint,
        client_kwargs={"region_name": "us-east-1"},
        skip_instance_cache=True,
        use_listings_cache=False,
    )


@dataclass
class Bucket:
    server: S3Server | S3ServerProcess
    name: str
    #: ``storage`` options of an engine config that reach this server.
    storage: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"s3://{self.name}/run"

    def fs(self) -> Any:
        return self.server.client_fs()

    def objects(self, prefix: str = "") -> list[str]:
        """Every object key under ``s3://bucket/run/<prefix>``, relative to ``run/``, sorted."""
        fs = self.fs()
        root = f"{self.name}/run/"
        return sorted(k[len(root) :] for k in fs.find(root + prefix))


def new_bucket(server: S3Server) -> Bucket:
    name = f"ckpt-test-{next(_BUCKETS)}"
    server.client_fs().call_s3("create_bucket", Bucket=name)
    storage = {
        "endpoint_url": server.endpoint,
        "access_key_id": KEY_ID,
        "secret_access_key": SECRET,
        "region": "us-east-1",
        "retries": 2,
        "retry_backoff_s": 0.05,
    }
    return Bucket(server, name, storage)
