"""A real S3-compatible server for the object-storage tests: moto's server mode on 127.0.0.1.

``moto.server.ThreadedMotoServer`` serves the S3 REST API over HTTP (the same requests
tensorstore's ``s3`` kvstore driver sends to AWS: signed PUT/GET/HEAD/DELETE, list,
conditional writes with ``If-Match``/``If-None-Match``). The fixture starts one server
per test module, creates a bucket, and sets dummy AWS credentials in the environment
(before any process is spawned, so gloo ranks and JAX subprocesses inherit them).

Usage in a test module::

    @pytest.fixture(scope="module")
    def s3():
        yield from s3_server.serve()

    def test_x(s3):
        spec = s3.spec("ckpt/a")   # {"driver": "s3", "bucket": ..., "path": "ckpt/a/", "endpoint": ...}
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

REGION = "us-east-1"


@dataclass
class S3:
    """The running server: its endpoint and bucket, and kvstore specs inside it."""

    endpoint: str
    bucket: str
    server: Any

    def spec(self, path: str) -> dict[str, Any]:
        """A tensorstore kvstore spec for ``path`` in the bucket (a checkpoint location)."""
        return {
            "driver": "s3",
            "bucket": self.bucket,
            "path": path.strip("/") + "/",
            "endpoint": self.endpoint,
            "aws_region": REGION,
        }

    def fresh(self, prefix: str = "ckpt") -> dict[str, Any]:
        """A spec for a new, empty location."""
        return self.spec(f"{prefix}-{uuid.uuid4().hex[:12]}")

    def keys(self, spec: dict[str, Any]) -> list[str]:
        """Every object key under a location (what the server holds)."""
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION)
        out: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=spec["path"]):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out


def serve() -> Iterator[S3]:
    """Start the server and a bucket; yields an :class:`S3`; stops the server after."""
    pytest.importorskip("moto.server")
    import boto3
    from moto.server import ThreadedMotoServer

    saved_env = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                                                "AWS_DEFAULT_REGION", "AWS_REGION")}
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_SESSION_TOKEN="testing",
        AWS_DEFAULT_REGION=REGION,
        AWS_REGION=REGION,
    )
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    bucket = "xckpt-tests"
    boto3.client("s3", endpoint_url=endpoint, region_name=REGION).create_bucket(Bucket=bucket)
    try:
        yield S3(endpoint=endpoint, bucket=bucket, server=server)
    finally:
        server.stop()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
