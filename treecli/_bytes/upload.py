"""Streaming uploads to S3 and GCS: the remote twin of the atomic rename.

An output object appears only when it is complete: on S3 a multipart upload,
completed after its last part; on GCS a resumable upload, finalized by its last
chunk. Any failure or Ctrl-C aborts the upload (S3's ``AbortMultipartUpload``,
GCS's session cancel), so no partial object and no orphaned upload is left. An
existing object is replaced only when asked (``replace``); GCS enforces that at
the commit too (``ifGenerationMatch=0``).

TensorStore, which reads buckets, writes an object only from one value held
whole in memory; a multi-GB output must stream. So uploads go through each
cloud's own client: boto3 for S3 (its environment and credential chain, as the
AWS CLI), google-auth for GCS (application default credentials, or the
emulator at ``STORAGE_EMULATOR_HOST``). Both come with ``pip install
'treecli[cloud]'`` and are imported only to write to a bucket.
"""

from __future__ import annotations

import contextlib
import math
import os
import urllib.parse
from concurrent.futures import Future
from typing import Any, Iterator

from treecli._bytes import kvstore, stream
from treecli._errors import TreecliError, UsageError

PART_BYTES = 16 << 20  # per request; a multiple of GCS's 256 KiB, over S3's 5 MiB minimum
TIMEOUT_S = 120
_S3_MAX_PARTS = 10_000


@contextlib.contextmanager
def uploading(url: str, size: int, *, replace: bool) -> Iterator["_Upload"]:
    """A writable object at ``url`` for ``size`` bytes; it appears when the block ends
    without an error, and never otherwise."""
    scheme, bucket, key = kvstore.split_url(url)
    if not key or key.endswith("/"):
        raise UsageError("name the object to write (s3://BUCKET/KEY.safetensors)", file=url)
    part = max(PART_BYTES, math.ceil(size / (_S3_MAX_PARTS - 1) / (1 << 20)) << 20)
    upload: _Upload = (_S3Upload if scheme == "s3" else _GcsUpload)(url, bucket, key, part)
    upload.begin(replace)
    try:
        yield upload
        upload.finish()
    except BaseException:
        upload.abort()
        raise


class _Upload:
    """Bytes gathered into parts, each sent on a helper thread while the next fills."""

    def __init__(self, url: str, bucket: str, key: str, part_bytes: int):
        self.url, self.bucket, self.key = url, bucket, key
        self._part_bytes = part_bytes
        self._buffer = bytearray()
        self._sent = 0  # bytes handed to the server so far
        self._pending: Future | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._buffer += view
        while len(self._buffer) >= self._part_bytes:
            part = bytes(self._buffer[: self._part_bytes])
            del self._buffer[: self._part_bytes]
            self._send(part, last=False)
        return len(view)

    def finish(self) -> None:
        self._send(bytes(self._buffer), last=True)
        self._wait()
        self._buffer = bytearray()

    def _send(self, part: bytes, last: bool) -> None:
        self._wait()  # one part in flight: memory stays at two parts
        start, self._sent = self._sent, self._sent + len(part)
        self._pending = stream._pool("upload").submit(self._put, part, start, last)

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def abort(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            with contextlib.suppress(BaseException):
                self._pending.result()
        with contextlib.suppress(Exception):  # the failure being reported matters more
            self._cancel()

    def begin(self, replace: bool) -> None:
        raise NotImplementedError

    def _put(self, part: bytes, start: int, last: bool) -> None:
        raise NotImplementedError

    def _cancel(self) -> None:
        raise NotImplementedError


class _S3Upload(_Upload):
    def begin(self, replace: bool) -> None:
        try:
            import boto3
            import botocore.exceptions
        except ImportError:
            raise UsageError("writing to s3:// needs boto3: pip install 'treecli[cloud]'", file=self.url) from None
        self._errors = botocore.exceptions
        self._client = boto3.client("s3")
        self._parts: list[dict[str, Any]] = []
        if not replace and self._call(self._exists):
            raise UsageError("output exists (add --force to replace it)", file=self.url)
        self._id = self._call(self._client.create_multipart_upload, Bucket=self.bucket, Key=self.key)["UploadId"]

    def _exists(self) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self.key)
            return True
        except self._errors.ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def _put(self, part: bytes, start: int, last: bool) -> None:
        number = len(self._parts) + 1
        answer = self._call(self._client.upload_part, Bucket=self.bucket, Key=self.key, UploadId=self._id,
                            PartNumber=number, Body=part)
        self._parts.append({"PartNumber": number, "ETag": answer["ETag"]})
        if last:
            self._call(self._client.complete_multipart_upload, Bucket=self.bucket, Key=self.key, UploadId=self._id,
                       MultipartUpload={"Parts": self._parts})

    def _cancel(self) -> None:
        if getattr(self, "_id", None):
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self._id)

    def _call(self, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except self._errors.NoCredentialsError:
            raise TreecliError("no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
                               file=self.url) from None
        except self._errors.ClientError as e:
            error = e.response.get("Error", {})
            code = str(error.get("Code", ""))
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise TreecliError("access denied: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
                                   "AWS_ENDPOINT_URL for a non-AWS server)", file=self.url) from None
            if code in ("NoSuchBucket", "404"):
                raise TreecliError(f"no bucket {self.bucket!r}", file=self.url) from None
            raise TreecliError(f"the upload failed: {code} {error.get('Message', '')}".rstrip(),
                               file=self.url) from None
        except self._errors.BotoCoreError as e:
            raise TreecliError(f"the upload failed: {e}", file=self.url) from None


class _GcsUpload(_Upload):
    """GCS's resumable upload protocol over an authorized session."""

    def begin(self, replace: bool) -> None:
        try:
            import google.auth
            import google.auth.credentials
            import google.auth.exceptions
            from google.auth.transport.requests import AuthorizedSession
        except ImportError:
            raise UsageError("writing to gs:// needs google-auth: pip install 'treecli[cloud]'",
                             file=self.url) from None
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if emulator:  # the emulator takes no credentials
            credentials: Any = google.auth.credentials.AnonymousCredentials()
            self._base = emulator if "://" in emulator else f"http://{emulator}"
        else:
            try:
                credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
            except google.auth.exceptions.DefaultCredentialsError:
                raise TreecliError("no Google credentials: set GOOGLE_APPLICATION_CREDENTIALS, or run gcloud auth "
                                   "application-default login", file=self.url) from None
            self._base = "https://storage.googleapis.com"
        self._session = AuthorizedSession(credentials)
        self._session_url: str | None = None
        name = urllib.parse.quote(self.key, safe="")
        if not replace:
            found = self._request("GET", f"{self._base}/storage/v1/b/{self.bucket}/o/{name}", ok=(200, 404))
            if found.status_code == 200:
                raise UsageError("output exists (add --force to replace it)", file=self.url)
        condition = "" if replace else "&ifGenerationMatch=0"
        started = self._request("POST", f"{self._base}/upload/storage/v1/b/{self.bucket}/o?uploadType=resumable"
                                f"&name={name}{condition}", ok=(200, 201), json={})
        self._session_url = started.headers.get("Location")
        if not self._session_url:
            raise TreecliError("the server started no resumable upload (no Location header)", file=self.url)

    def _put(self, part: bytes, start: int, last: bool) -> None:
        total = str(start + len(part)) if last else "*"
        span = f"bytes {start}-{start + len(part) - 1}/{total}" if part else f"bytes */{total}"
        self._request("PUT", self._session_url, ok=(200, 201) if last else (308,), data=part,
                      headers={"Content-Range": span})

    def _cancel(self) -> None:
        if self._session_url:
            self._session.request("DELETE", self._session_url, timeout=TIMEOUT_S)

    def _request(self, method: str, url: str, ok: tuple[int, ...], **kwargs: Any) -> Any:
        import requests

        try:
            response = self._session.request(method, url, timeout=TIMEOUT_S, **kwargs)
        except requests.RequestException as e:
            raise TreecliError(f"the upload failed: {type(e).__name__}: {e}", file=self.url) from None
        if response.status_code in ok:
            return response
        if response.status_code in (401, 403):
            raise TreecliError("access denied: set GOOGLE_APPLICATION_CREDENTIALS, or run gcloud auth "
                               "application-default login", file=self.url)
        if response.status_code == 412:
            raise UsageError("output exists (add --force to replace it)", file=self.url)
        if response.status_code == 404:
            raise TreecliError(f"no bucket {self.bucket!r}", file=self.url)
        raise TreecliError(f"the upload failed: HTTP {response.status_code} {response.text[:200]}", file=self.url)
