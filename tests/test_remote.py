"""Remote safetensors over HTTP and from the Hub (issue 17, first part), against a real
HTTP server on 127.0.0.1 that honours Range, counts what it serves, and fails on demand."""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import treecli
from tests.conftest import assert_clean_error, publish_sharded, small_model as _model, without_file


class Server(http.server.ThreadingHTTPServer):
    """Files by URL path; ``Range: bytes=A-B`` answered with 206; every request and byte counted."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.files: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []  # (path, Range header)
        self.bytes_served = 0
        self.latency = 0.0
        self.ignore_range = False
        self.short_by = 0  # promise this many bytes more than sent
        self.status: dict[str, int] = {}  # path -> error status
        self.token = None  # when set, requests without "Authorization: Bearer TOKEN" get 401
        self.redirects: dict[str, str] = {}  # path -> a Location on another origin (a 302)
        self.authorizations: list[tuple[str, str | None]] = []  # (path, Authorization header) of every request
        self.validators = True  # send an ETag
        self.drip = 0.0  # when set, send a body a byte at a time, this many seconds apart
        self.drip_paths = ""  # ... only of paths that contain this
        self.on_request = None  # called with the request's number (from 1) before it is answered
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request, client_address):
        """A client that hung up (a cancelled read, a closed reader) is no server error."""
        import sys

        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        server: Server = self.server
        with server.lock:
            server.requests.append((self.path, self.headers.get("Range", "")))
            server.authorizations.append((self.path, self.headers.get("Authorization")))
            number = len(server.requests)
        if server.on_request:
            server.on_request(number)
        if self.path in server.redirects:
            self.send_response(302)
            self.send_header("Location", server.redirects[self.path])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        time.sleep(server.latency)
        unauthorized = server.token and self.headers.get("Authorization") != f"Bearer {server.token}"
        if self.path in server.status or unauthorized:
            code = server.status.get(self.path, 401)
            self.send_response(code)
            if 300 <= code < 400:
                self.send_header("Location", self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = server.files.get(self.path)
        if body is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        etag = f'"{hash(body) & 0xFFFFFFFF:x}"'
        spec = self.headers.get("Range")
        if spec and not server.ignore_range:
            first, last = spec.removeprefix("bytes=").split("-")
            if not first:  # a suffix: the last N bytes
                start, end = max(0, len(body) - int(last)), len(body) - 1
            else:
                start, end = int(first), int(last) if last else len(body) - 1
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            end = min(end, len(body) - 1)
            chunk = body[start : end + 1]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(body)}")
        else:
            chunk = body
            self.send_response(200)
        if server.validators:
            self.send_header("ETag", etag)
        self.send_header("Content-Length", str(len(chunk)))
        self.end_headers()
        sent = chunk[: len(chunk) - server.short_by] if server.short_by else chunk
        with server.lock:
            server.bytes_served += len(sent)
        try:
            if server.drip and server.drip_paths in self.path:
                for i in range(len(sent)):
                    self.wfile.write(sent[i : i + 1])
                    self.wfile.flush()
                    time.sleep(server.drip)
            else:
                self.wfile.write(sent)
        except (BrokenPipeError, ConnectionResetError):
            pass
        if server.short_by:
            self.close_connection = True


@pytest.fixture
def server(monkeypatch):
    srv = Server()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", srv.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    for proxy in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    yield srv
    srv.shutdown()
    srv.server_close()


def _publish(server: Server, path: str, tensors: dict, tmp_path: Path) -> Path:
    local = tmp_path / path.strip("/").replace("/", "_")
    save_file(tensors, str(local))
    server.files[path] = local.read_bytes()
    return local


def _publish_sharded(server: Server, prefix: str, shards: int, tmp_path: Path) -> Path:
    """An HF sharded repository, served under ``prefix`` and kept locally in a directory."""
    return publish_sharded(server.files.__setitem__, prefix, shards, tmp_path / "local_repo")


def test_show_of_a_remote_file_is_the_local_show_in_at_most_two_requests(server, tmp_path, cli):
    local = _publish(server, "/m.safetensors", _model(), tmp_path)
    remote = cli("show", f"{server.url}/m.safetensors", "--json")
    assert remote.code == 0, remote.stderr
    assert len(server.requests) <= 2
    assert server.bytes_served < 70_000  # the header, not the 150 KB of data
    here = cli("show", local, "--json")
    assert {k: v for k, v in remote.json.items() if k != "file"} == {k: v for k, v in here.json.items() if k != "file"}


def test_hub_repository_with_shards_reads_headers_concurrently(server, tmp_path, cli):
    _publish_sharded(server, "/org/model/resolve/main", 8, tmp_path)
    server.latency = 0.1
    start = time.perf_counter()
    result = cli("show", "hf://org/model", "--flat")
    elapsed = time.perf_counter() - start
    assert result.code == 0, result.stderr
    assert "model.layers.15.w" in result.stdout
    # the index, one read per shard header, and the repository's config.json (show names its model)
    assert len(server.requests) == 1 + 8 + 1
    assert elapsed < 0.8, elapsed  # one shard after another would take 8 x 0.1 s on top of the index


def test_get_and_slice_move_only_what_they_need(server, tmp_path, cli):
    tensors = {"big": np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024), "other": np.ones(1 << 18, np.float32),
               "small": np.arange(8, dtype=np.float32)}
    _publish(server, "/s.safetensors", tensors, tmp_path)
    url = f"{server.url}/s.safetensors"
    got = cli("get", url, "small", "--json")
    assert got.code == 0, got.stderr
    assert got.json["value"] == list(range(8))
    assert server.bytes_served < 70_000 + 4096  # the first read and that leaf's bytes, not 5 MB
    server.bytes_served = 0
    out = tmp_path / "row.safetensors"
    sliced = cli("slice", url, "--index", "big=:16", "-o", out)
    assert sliced.code == 0, sliced.stderr
    written = treecli.load(out)
    np.testing.assert_array_equal(np.asarray(written["big"]), tensors["big"][:16])
    # the header again, then the 64 KiB of rows and the 1 MiB "other" leaf passed through
    assert server.bytes_served <= 1.1 * (16 * 1024 * 4 + tensors["other"].nbytes) + 70_000


def test_convert_and_average_of_remote_inputs_are_bit_exact(server, tmp_path, cli):
    a, b = _model(0), _model(1)
    _publish(server, "/a.safetensors", a, tmp_path)
    _publish(server, "/b.safetensors", b, tmp_path)
    out = tmp_path / "copy.safetensors"
    converted = cli("convert", f"{server.url}/a.safetensors", out)
    assert converted.code == 0, converted.stderr
    back = treecli.load(out)
    for name, value in a.items():
        node = back
        for key in name.split("."):
            node = node[key]
        assert np.asarray(node).tobytes() == value.tobytes()
    record = json.loads(treecli.open(out).metadata["treecli.record"])  # (issue 44: every leaf copied, none read twice)
    assert record["inputs"] == [{"name": f"{server.url}/a.safetensors", "root": treecli.hash(out).root}]
    served = server.bytes_served
    averaged = cli("average", f"{server.url}/a.safetensors", f"{server.url}/b.safetensors", "-o",
                   tmp_path / "avg.safetensors")
    assert averaged.code == 0, averaged.stderr
    record = cli("show", tmp_path / "avg.safetensors", "--json").json["record"]
    assert [i["root"] for i in record["inputs"]] == [None, None]  # (its root not taken: not downloaded twice)
    assert server.bytes_served - served < 1.2 * sum(v.nbytes for v in (*a.values(), *b.values())) + 200_000
    averaged = cli("average", f"{server.url}/a.safetensors", f"{server.url}/b.safetensors", "-o", tmp_path / "avg.npz")
    assert averaged.code == 0, averaged.stderr
    soup = np.load(tmp_path / "avg.npz")
    np.testing.assert_array_equal(soup["model/embed/weight"],
                                  ((a["model.embed.weight"].astype(np.float64) + b["model.embed.weight"]) / 2
                                   ).astype(np.float32))


def test_remote_diff_against_local_is_equal(server, tmp_path, cli):
    local = _publish_sharded(server, "/org/repo/resolve/v1", 3, tmp_path)
    result = cli("diff", "hf://org/repo@v1", local)
    assert result.code == 0, result.stdout + result.stderr


def test_python_api_loads_urls(server, tmp_path):
    tensors = _model()
    _publish(server, "/m.safetensors", tensors, tmp_path)
    tree = treecli.load(f"{server.url}/m.safetensors")
    np.testing.assert_array_equal(tree["model"]["layers"]["2"]["w"][5], tensors["model.layers.2.w"][5])


@pytest.mark.parametrize("setup, fragment", [
    (lambda s: None, "not found (HTTP 404)"),
    (lambda s: s.status.update({"/m.safetensors": 403}), "access denied (HTTP 403)"),
    (lambda s: s.status.update({"/m.safetensors": 302}), "redirect"),
    (lambda s: setattr(s, "ignore_range", True), "ignores Range"),
    (lambda s: setattr(s, "short_by", 10), "failed 5 times"),
    (lambda s: s.status.update({"/m.safetensors": 503}), "failed 5 times"),
])
def test_failures_are_one_line_naming_the_url(setup, fragment, server, tmp_path, cli, monkeypatch):
    from treecli._bytes import http

    monkeypatch.setattr(http.time, "sleep", lambda s: None)  # the backoff, not what is tested
    if "404" not in fragment:
        _publish(server, "/m.safetensors", _model(), tmp_path)
    setup(server)
    url = f"{server.url}/m.safetensors"
    result = cli("show", url)
    assert_clean_error(result, url, fragment)


def test_hub_403_names_the_token_variable(server, cli):
    server.status["/org/gated/resolve/main/model.safetensors.index.json"] = 403
    assert_clean_error(cli("show", "hf://org/gated"), "HF_TOKEN")


def test_a_file_replaced_on_the_server_mid_read_is_an_error(server, tmp_path, cli):
    _publish(server, "/m.safetensors", {"a": np.zeros(40_000, np.float32), "b": np.ones(40_000, np.float32)},
             tmp_path)
    tree = treecli.load(f"{server.url}/m.safetensors")
    np.testing.assert_array_equal(np.asarray(tree["a"])[:10], 0)  # in the first read, of the first version
    _publish(server, "/m.safetensors", {"a": np.ones(40_000, np.float32), "b": np.zeros(40_000, np.float32)},
             tmp_path)  # same size, new ETag
    with pytest.raises(treecli.FormatError, match="changed on the server"):
        np.asarray(tree["b"])


def test_in_place_on_a_url_is_refused(server, tmp_path, cli):
    _publish(server, "/m.safetensors", _model(), tmp_path)
    result = cli("edit", f"{server.url}/m.safetensors", "--scale", "model.embed.weight=2", "--in-place")
    assert_clean_error(result, "-o")


def test_a_long_read_goes_as_ranges_in_flight_at_once(server, tmp_path, cli):
    """A 4 MiB chunk is fetched as 1 MiB ranges on several connections, landing bit-exact."""
    big = np.random.default_rng(7).standard_normal(3 << 20).astype(np.float32)  # 12 MiB: three chunks
    _publish(server, "/big.safetensors", {"big": big}, tmp_path)
    server.latency = 0.05
    start = time.perf_counter()
    got = treecli.load(f"{server.url}/big.safetensors")["big"]
    data = np.asarray(got)
    elapsed = time.perf_counter() - start
    assert data.tobytes() == big.tobytes()
    ranges = [r for path, r in server.requests if path == "/big.safetensors" and r != "bytes=0-65535"]
    assert len(ranges) == 12 and all(r for r in ranges)  # 1 MiB each
    assert elapsed < 12 * 0.05  # one after another would take 12 round trips


def test_ranges_in_flight_all_land_or_the_first_failure_is_raised():
    from treecli._bytes import stream

    done = []
    stream.in_flight([lambda i=i: (time.sleep(0.01), done.append(i)) for i in range(10)])
    assert sorted(done) == list(range(10))  # queued behind busy workers, none dropped

    running = []

    def part(i):
        def call():
            running.append(i)
            time.sleep(0.02)
            if i == 5:
                raise OSError("reset")
            running.remove(i)
        return call

    with pytest.raises(OSError, match="reset"):
        stream.in_flight([part(i) for i in range(10)])
    assert running == [5]  # when it returns, nothing is still writing into the caller's buffer


def test_a_shard_index_answered_503_is_retried(server, tmp_path, cli, monkeypatch):
    from treecli._bytes import http

    monkeypatch.setattr(http.time, "sleep", lambda s: None)
    _publish_sharded(server, "/org/flaky/resolve/main", 2, tmp_path)
    failures = iter([503, 503])
    original = Handler.do_GET

    def flaky(self):
        if self.path.endswith(".index.json"):
            code = next(failures, None)
            if code:
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        original(self)

    monkeypatch.setattr(Handler, "do_GET", flaky)
    result = cli("show", "hf://org/flaky", "--flat")
    assert result.code == 0, result.stderr
    assert "model.layers.3.w" in result.stdout


# --- Orbax over HTTP and from the Hub, through TensorStore's http kvstore --------------------


def _serve_tree(server: Server, local: Path, prefix: str) -> None:
    for path in sorted(local.rglob("*")):
        if path.is_file():
            server.files[f"{prefix}/{path.relative_to(local).as_posix()}"] = path.read_bytes()


def test_an_orbax_step_on_the_hub_reads_as_its_local_copy(orbax_run, server, cli):
    _serve_tree(server, orbax_run / "run", "/org/run/resolve/main")
    remote = cli("show", "hf://org/run", "--step", "10", "--json")
    assert remote.code == 0, remote.stderr
    here = without_file(cli("show", orbax_run / "run", "--step", "10", "--json"))
    assert here.pop("steps") == [10, 20] and "steps" not in remote.json  # an HTTP directory cannot be listed
    assert without_file(remote) == here
    step = cli("show", f"{server.url}/org/run/resolve/main/20", "--json")  # a step directory by URL
    assert step.code == 0, step.stderr
    assert without_file(step) == without_file(cli("show", orbax_run / "run" / "20", "--json"))
    got = cli("get", "hf://org/run", "state.params.w", "--step", "20", "--json")
    assert got.code == 0, got.stderr
    assert got.json["value"] == [[20.0] * 3] * 4
    assert_clean_error(cli("show", "hf://org/run"), "cannot be listed", "--step")
    assert_clean_error(cli("show", "hf://org/run", "--step", "15"), "15")


def test_an_orbax_checkpoint_without_ocdbt_over_http_converts(orbax_run, server, tmp_path, cli):
    _serve_tree(server, orbax_run / "plain", "/ckpts/plain")
    out = tmp_path / "w.safetensors"
    result = cli("convert", f"{server.url}/ckpts/plain", out)
    assert result.code == 0, result.stderr
    assert np.asarray(treecli.load(out)["w"]).tolist() == list(range(6))


def test_orbax_reads_from_the_hub_carry_the_token(orbax_run, server, cli, monkeypatch):
    _serve_tree(server, orbax_run / "run", "/org/private/resolve/main")
    server.token = "secret"
    assert_clean_error(cli("show", "hf://org/private", "--step", "10"), "HF_TOKEN")
    monkeypatch.setenv("HF_TOKEN", "secret")
    result = cli("show", "hf://org/private", "--step", "10", "--flat")
    assert result.code == 0, result.stderr
    assert "state.params.w" in result.stdout


@pytest.fixture
def cdn(server):
    """A second server on another port: where the Hub's redirects send its files."""
    other = Server()
    threading.Thread(target=other.serve_forever, daemon=True).start()
    yield other
    other.shutdown()
    other.server_close()


@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_the_hub_token_never_follows_a_redirect_to_another_origin(server, cdn, tmp_path, cli, monkeypatch, layout):
    monkeypatch.setenv("HF_TOKEN", "secret")
    prefix = "/org/model/resolve/main"
    if layout == "file":
        _publish(cdn, "/blob/model.safetensors", _model(), tmp_path)
        names = ["model.safetensors"]
    else:
        _publish_sharded(cdn, "/blob", 2, tmp_path)
        names = ["model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name in names:
        server.redirects[f"{prefix}/{name}"] = f"{cdn.url}/blob/{name}"
    result = cli("convert", "hf://org/model", tmp_path / "out.safetensors")
    assert result.code == 0, result.stderr
    assert any(auth == "Bearer secret" for _, auth in server.authorizations)  # the Hub gets it
    assert cdn.requests and all(auth is None for _, auth in cdn.authorizations), cdn.authorizations


def test_the_token_stays_when_a_redirect_keeps_the_origin(server, tmp_path, cli, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret")
    _publish(server, "/blob/model.safetensors", _model(), tmp_path)
    server.status["/org/m/resolve/main/model.safetensors.index.json"] = 404
    server.redirects["/org/m/resolve/main/model.safetensors"] = f"{server.url}/blob/model.safetensors"
    assert cli("show", "hf://org/m").code == 0
    assert all(auth == "Bearer secret" for _, auth in server.authorizations)


def test_a_dripping_server_is_one_line_within_the_deadline(server, tmp_path, cli, monkeypatch):
    monkeypatch.setenv("TREECLI_HTTP_DEADLINE", "1.5")
    _publish(server, "/m.safetensors", _model(), tmp_path)
    server.drip = 0.05  # well under the per-recv timeout, far under any useful rate
    start = time.perf_counter()
    result = cli("convert", f"{server.url}/m.safetensors", tmp_path / "out.safetensors")
    elapsed = time.perf_counter() - start
    assert_clean_error(result, f"{server.url}/m.safetensors", "TREECLI_HTTP_DEADLINE")
    assert elapsed < 1.5 * 6, elapsed  # one deadline per try at most, never hours
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors"]


def test_a_server_without_validators_that_swaps_the_file_is_never_mixed(server, tmp_path, cli, monkeypatch):
    """Without an ETag or Last-Modified a same-size swap cannot be seen between two range
    requests: such a file is refused beyond its first request, unless the user says to read it."""
    first = {"a": np.zeros(40_000, np.float32), "b": np.ones(40_000, np.float32)}
    second = {"a": np.ones(40_000, np.float32), "b": np.zeros(40_000, np.float32)}  # same size, same header
    _publish(server, "/m.safetensors", first, tmp_path)
    _publish(server, "/new.safetensors", second, tmp_path)
    server.validators = False
    body = server.files.pop("/new.safetensors")
    server.on_request = lambda n: n == 1 and server.files.__setitem__("/m.safetensors", body)  # after the first
    result = cli("convert", f"{server.url}/m.safetensors", tmp_path / "out.safetensors")
    assert_clean_error(result, f"{server.url}/m.safetensors", "TREECLI_HTTP_UNVALIDATED")
    assert not (tmp_path / "out.safetensors").exists()
    assert cli("show", f"{server.url}/m.safetensors").code == 0  # the header alone: one request


def test_a_server_without_validators_is_read_when_the_user_says_so(server, tmp_path, cli, monkeypatch):
    tensors = {"a": np.zeros(40_000, np.float32), "b": np.arange(40_000, dtype=np.float32)}
    _publish(server, "/m.safetensors", tensors, tmp_path)
    server.validators = False
    monkeypatch.setenv("TREECLI_HTTP_UNVALIDATED", "1")
    result = cli("convert", f"{server.url}/m.safetensors", tmp_path / "out.safetensors")
    assert result.code == 0, result.stderr
    assert np.asarray(treecli.load(tmp_path / "out.safetensors")["b"]).tolist() == tensors["b"].tolist()


def test_show_of_an_orbax_checkpoint_over_http_fetches_each_object_once(orbax_run, server, cli):
    _serve_tree(server, orbax_run / "run", "/org/run/resolve/main")
    result = cli("get", "hf://org/run", "state.params.w", "--step", "20", "--json")
    assert result.code == 0, result.stderr
    fetched = server.requests  # (path, Range): an OCDBT data file's arrays are ranges of one object
    repeated = {request: fetched.count(request) for request in fetched if fetched.count(request) > 1}
    assert not repeated, repeated


def test_an_orbax_checkpoint_read_through_redirects_keeps_the_token_at_the_hub(orbax_run, server, cdn, cli,
                                                                                 monkeypatch):
    """Its metadata files go through treecli's GET, its arrays through TensorStore's HTTP
    driver (which does not follow redirects: a clean error, noted in docs/remote.md); neither
    sends the token to the other origin."""
    monkeypatch.setenv("HF_TOKEN", "secret")
    _serve_tree(cdn, orbax_run / "run" / "20", "/blob")
    for path in list(cdn.files):
        server.redirects[f"/org/run/resolve/main/20{path[len('/blob'):]}"] = f"{cdn.url}{path}"
    result = cli("get", "hf://org/run/20", "state.params.w", "--json")
    assert cdn.requests and all(auth is None for _, auth in cdn.authorizations), cdn.authorizations
    assert any(auth == "Bearer secret" for _, auth in server.authorizations)
    assert result.code == 0 or (result.code == 2 and result.stderr.startswith("treecli: error: ")), result.stderr


DRIPPING_ORBAX = """
import sys, threading
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from tests.test_remote import Server, _serve_tree
server = Server()
threading.Thread(target=server.serve_forever, daemon=True).start()
_serve_tree(server, Path(sys.argv[2]), "/ckpt")
server.drip, server.drip_paths = 0.05, "/d/"  # the arrays' data files only
from treecli.cli import main
sys.exit(main(["get", f"{server.url}/ckpt/20/state", "params.w", "--json"]))
"""


def test_orbax_arrays_from_a_dripping_server_end_within_the_deadline(orbax_run, tmp_path):
    """The arrays are read by TensorStore's HTTP transport, held to TREECLI_HTTP_DEADLINE too."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TREECLI_HTTP_DEADLINE": "2", "no_proxy": "127.0.0.1"}
    env = {k: v for k, v in env.items() if not k.startswith("TENSORSTORE_CURL")}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", DRIPPING_ORBAX, str(Path(__file__).parent.parent),
                             str(orbax_run / "run")], capture_output=True, text=True, env=env, timeout=120)
    elapsed = time.perf_counter() - start
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("treecli: error: ") and "Traceback" not in result.stderr
    assert elapsed < 40, elapsed  # a few deadlines (TensorStore retries too), never a quarter of an hour


def test_pytorch_and_gguf_files_read_over_http_by_byte_ranges(server, tmp_path, cli):
    torch = pytest.importorskip("torch")
    gguf = pytest.importorskip("gguf")
    state = {f"model.layers.{i}.weight": torch.randn(64, 256) for i in range(8)}  # 512 KiB of data
    torch.save(state, tmp_path / "pytorch_model.bin")
    server.files["/org/m/resolve/main/pytorch_model.bin"] = (tmp_path / "pytorch_model.bin").read_bytes()
    writer = gguf.GGUFWriter(str(tmp_path / "model.gguf"), "llama")
    for i in range(8):
        writer.add_tensor(f"blk.{i}.w", np.random.default_rng(i).standard_normal((64, 256)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    server.files["/model.gguf"] = (tmp_path / "model.gguf").read_bytes()
    for remote, local in (("hf://org/m/pytorch_model.bin", tmp_path / "pytorch_model.bin"),
                          (f"{server.url}/model.gguf", tmp_path / "model.gguf")):
        server.bytes_served = 0
        shown = cli("show", remote, "--json")
        assert shown.code == 0, shown.stderr
        assert server.bytes_served < 200_000, (remote, server.bytes_served)  # the header, not the data
        assert without_file(shown) == without_file(cli("show", local, "--json"))
        out = tmp_path / f"{local.stem}.safetensors"
        assert cli("convert", remote, out).code == 0
        assert cli("diff", out, local).code == 0


def test_a_hub_repository_of_bin_shards_reads_as_its_local_copy(server, tmp_path, cli):
    torch = pytest.importorskip("torch")
    import json

    local = tmp_path / "repo"
    local.mkdir()
    shards = {"pytorch_model-00001-of-00002.bin": {"model.embed.weight": torch.randn(512, 256)},
              "pytorch_model-00002-of-00002.bin": {"model.norm.weight": torch.ones(256), "lm_head.weight":
                                                   torch.randn(512, 256)}}
    for name, state in shards.items():
        torch.save(state, local / name)
    index = {"weight_map": {k: name for name, state in shards.items() for k in state}}
    (local / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    for path in local.iterdir():
        server.files[f"/org/bins/resolve/main/{path.name}"] = path.read_bytes()
    torch.save({"w": torch.randn(4, 4)}, tmp_path / "pytorch_model.bin")
    server.files["/org/single/resolve/main/pytorch_model.bin"] = (tmp_path / "pytorch_model.bin").read_bytes()
    server.bytes_served = 0
    shown = cli("show", "hf://org/bins", "--json")
    assert shown.code == 0, shown.stderr
    assert server.bytes_served < 300_000  # each shard's first 64 KiB and zip directory: not the 1 MiB of data
    assert without_file(shown) == without_file(cli("show", local, "--json"))
    assert cli("diff", "hf://org/bins", local).code == 0
    single = cli("show", "hf://org/single", "--json")
    assert single.code == 0 and [row["keypath"] for row in single.json["leaves"]] == ["w"], single.stderr


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_distributed_checkpoint_on_the_hub_reads_as_its_local_copy(server, tmp_path, cli):
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    dcp.save({"model": {"w": torch.randn(256, 256), "b": torch.ones(256)}, "step": 7}, checkpoint_id=tmp_path / "c")
    for path in (tmp_path / "c").iterdir():
        server.files[f"/org/run/resolve/main/step-7/{path.name}"] = path.read_bytes()
    server.bytes_served = 0
    shown = cli("show", "hf://org/run/step-7", "--json")
    assert shown.code == 0, shown.stderr
    assert server.bytes_served < 200_000  # .metadata and the chunks' first bytes, not the 257 KB of data
    assert without_file(shown) == without_file(cli("show", tmp_path / "c", "--json"))
    assert cli("diff", "hf://org/run/step-7", tmp_path / "c").code == 0


def test_a_format_plugged_in_through_the_contract_reads_over_http_from_the_same_module(server, tmp_path, cli,
                                                                                        monkeypatch):
    """CONTRIBUTING's recipe for a format: tests/toy_format.py declares its
    ``remote_extensions`` and opens from a folder; a URL naming its file reads as the
    local file does, with no other change."""
    from treecli import formats

    monkeypatch.setitem(formats.FORMATS, "toy", "tests.toy_format:ToyFormat")
    formats.get.cache_clear()
    try:
        local = tmp_path / "m.toy"
        treecli.save({"model.w": np.arange(6, dtype=np.float32).reshape(2, 3)}, local)
        server.files["/org/toys/resolve/main/m.toy"] = local.read_bytes()
        remote = cli("show", "hf://org/toys/m.toy", "--json")
        assert remote.code == 0 and remote.json["format"] == "toy", remote.stderr
        assert without_file(remote) == without_file(cli("show", local, "--json"))
        assert cli("diff", "hf://org/toys/m.toy", local).code == 0
    finally:
        formats.get.cache_clear()


def test_a_hub_repository_names_its_model_as_its_local_copy_and_only_show_asks(server, tmp_path, cli):
    """config.json is read through the repository's folder as a local directory's is, and
    only by show: a command that does not name the model never asks for it."""
    local = _publish_sharded(server, "/org/named/resolve/main", 2, tmp_path)
    import json

    config = {"model_type": "qwen2", "num_hidden_layers": 16, "vocab_size": 32}
    (local / "config.json").write_text(json.dumps(config))
    server.files["/org/named/resolve/main/config.json"] = (local / "config.json").read_bytes()
    remote = cli("show", "hf://org/named", "--json")
    assert remote.code == 0, remote.stderr
    assert remote.json["model"] == cli("show", local, "--json").json["model"] == {
        "architecture": "qwen2", "layers": 16, "vocab": 32}
    server.requests.clear()
    assert cli("get", "hf://org/named", "model.layers.0.w", "--json").code == 0
    assert not [path for path, _ in server.requests if path.endswith("config.json")]
