"""Throwaway local services for the pipeline's tests and `posttrain bench docs`: Debian's redis-server
and PostgreSQL, and moto's S3 server, each started on 127.0.0.1 on a free port in a temporary folder
and stopped (folder removed) on exit. `ServiceUnavailable` says which binary is missing.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


class ServiceUnavailable(RuntimeError):
    """The service's binary is not installed (the message names the Debian package)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before listening on {port}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Yields redis://127.0.0.1:PORT/0 of a fresh, unpersisted redis-server."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ServiceUnavailable("redis-server is not installed (Debian package redis-server)")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="posttrain-redis-") as d:
        proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                d,
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_port(port, proc, "redis-server")
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            _stop(proc)


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}")) or (
        [shutil.which(name)] if shutil.which(name) else []
    )
    if not found:
        raise ServiceUnavailable(f"PostgreSQL's {name} is not installed (Debian package postgresql)")
    return found[-1]


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Yields postgresql://postgres@127.0.0.1:PORT/postgres of a fresh cluster (trust auth, loopback).
    As root the server runs as the `postgres` user, which PostgreSQL requires."""
    initdb, postgres = _pg_bin("initdb"), _pg_bin("postgres")
    port = free_port()
    as_user: list[str] = []
    d = tempfile.mkdtemp(prefix="posttrain-pg-")
    try:
        if os.geteuid() == 0:
            import pwd

            pw = pwd.getpwnam("postgres")
            os.chown(d, pw.pw_uid, pw.pw_gid)
            as_user = ["runuser", "-u", "postgres", "--"]
        data = Path(d) / "data"
        subprocess.run(
            [*as_user, initdb, "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        proc = subprocess.Popen(
            [
                *as_user,
                postgres,
                "-D",
                str(data),
                "-p",
                str(port),
                "-k",
                d,
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_port(port, proc, "postgres")
            yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
        finally:
            _stop(proc)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def moto_s3(bucket: str = "reports") -> Iterator[str]:
    """Yields the endpoint URL of moto's S3 server (it speaks the S3 HTTP API; it stands in for a real
    bucket) with `bucket` created; credentials are set to dummies in the environment."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        raise ServiceUnavailable("moto[server] is not installed: pip install 'posttrain[docs]'") from None
    for k, v in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
    ):
        os.environ.setdefault(k, v)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()
