"""The loopback S3 server (moto, in a process of its own) that the storage, tier, incremental and
coordination benchmarks save to; no torch import, so a parent process that only runs the server
does not pay for one."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

KEY, SECRET = "bench-key", "bench-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    def __init__(self) -> None:
        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the moto server did not start (pip install 'moto[server]')") from None
                time.sleep(0.1)

    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(
            key=KEY, secret=SECRET, endpoint_url=self.endpoint, skip_instance_cache=True, use_listings_cache=False
        )

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
