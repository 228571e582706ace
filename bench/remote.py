"""Benchmark: remote safetensors through a loopback HTTP server that injects latency,
against the same commands on the same files locally, in the same run.

  1. `show` of an 8-shard, 70B-shaped repository (Llama-70B's 723 tensors in bf16,
     140 GB as sparse files: only headers are ever read), as hf://, at 0, 20 and
     100 ms per request; the reference is the local `show` plus two round trips
     (the index, then every shard header at once). Target: <= 1.5x that.
  2. `slice --index 0` of a stacked 1 GiB checkpoint: bytes the server sent against
     the bytes of the output. Target: <= 1.1x.
  3. `average` of 3 x 1 GiB fp32 from the server (0 ms) against the same local
     files: throughput ratio (target >= 0.5x) and peak RSS (flat).

    python bench/remote.py [--runs 3] [--gib 1]

Wall times are medians of --runs, each command in a fresh interpreter; page cache
warm. The server is Python's ThreadingHTTPServer answering Range with os.sendfile.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Made in a child process: ru_maxrss survives exec, so arrays made here would count
# in every measured command's peak RSS.
MAKE = r'''
import sys
import numpy as np
from safetensors.numpy import save_file
kind, directory, gib = sys.argv[1], sys.argv[2], float(sys.argv[3])
if kind == "stacked":
    layers = max(2, int(gib * 16))
    save_file({"layers.w": np.ones((layers, 4096, 4096), np.float32)}, f"{directory}/stacked.safetensors")
else:
    rows = int(gib * 2**30) // 32 // 4 // 4096
    for i in range(3):
        rng = np.random.default_rng(i)
        save_file({f"layers.{k}.w": rng.standard_normal((rows, 4096), dtype=np.float32) for k in range(32)},
                  f"{directory}/in{i}.safetensors")
'''

# The floor of any remote average here: the same byte ranges fetched and dropped.
TRANSFER = r'''
import http.client, sys, threading, time, urllib.parse
urls = sys.argv[1:]
part = 1 << 20
jobs = []
for url in urls:
    u = urllib.parse.urlsplit(url)
    c = http.client.HTTPConnection(u.netloc)
    c.request("GET", u.path, headers={"Range": "bytes=0-0"})
    r = c.getresponse()
    r.read()
    size = int(r.getheader("Content-Range").rsplit("/", 1)[1])
    c.close()
    jobs += [(u.netloc, u.path, o, min(part, size - o)) for o in range(0, size, part)]
jobs = iter(jobs)
lock = threading.Lock()
def worker():
    connections, buffer = {}, memoryview(bytearray(part))
    while True:
        with lock:
            job = next(jobs, None)
        if job is None:
            return
        netloc, path, offset, n = job
        c = connections.setdefault(netloc, http.client.HTTPConnection(netloc))
        c.request("GET", path, headers={"Range": f"bytes={offset}-{offset + n - 1}"})
        r = c.getresponse()
        got = 0
        while got < n:
            got += r.readinto(buffer[got:n])
        r.close()
start = time.perf_counter()
threads = [threading.Thread(target=worker) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(time.perf_counter() - start)
'''

CHILD = r'''
import json, resource, sys, time
from treecli.cli import main
start = time.perf_counter()
code = main(sys.argv[1:] + ["--quiet"] if sys.argv[1] != "show" else sys.argv[1:])
elapsed = time.perf_counter() - start
assert code == 0, code
print(json.dumps({"seconds": elapsed, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def setup(self):
        super().setup()
        # Headers then sendfile are two sends: without NODELAY the body waited on a delayed ACK.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_GET(self):
        server = self.server
        time.sleep(server.latency)
        repo, _, name = self.path.partition("/resolve/main/")  # /ORG/REPO/resolve/main/FILE -> root/REPO/FILE
        path = server.root / (f"{repo.rsplit('/', 1)[-1]}/{name}" if name else self.path.lstrip("/"))
        if not path.is_file():
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = path.stat().st_size
        spec = self.headers.get("Range")
        start, end = (0, size - 1) if not spec else (int(x) for x in spec.removeprefix("bytes=").split("-"))
        end = min(end, size - 1)
        self.send_response(206 if spec else 200)
        if spec:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("ETag", f'"{path.stat().st_mtime_ns}"')
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        with open(path, "rb") as f:  # sendfile, as nginx or an object store serves: no copy through Python
            offset = start
            while offset <= end:
                offset += os.sendfile(self.connection.fileno(), f.fileno(), offset, end + 1 - offset)
        with server.lock:
            server.bytes_sent += end - start + 1


def serve(root: Path) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    server.root, server.latency, server.bytes_sent, server.lock = root, 0.0, 0, threading.Lock()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def run(args: list[str], env: dict[str, str]) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True,
                            env={**os.environ, **env})
    if result.returncode:
        sys.exit(f"{args} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def sparse_safetensors(path: Path, tensors: dict[str, tuple[list[int], str]]) -> None:
    """A valid safetensors file whose data region is a hole: its header is all that is stored."""
    itemsize = {"BF16": 2, "F32": 4}
    header, offset = {}, 0
    for name, (shape, dtype) in tensors.items():
        nbytes = itemsize[dtype]
        for d in shape:
            nbytes *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def llama70b(directory: Path) -> None:
    hidden, inner, vocab, layers, shards = 8192, 28672, 128256, 80, 8
    names = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden],
             "lm_head.weight": [vocab, hidden]}
    for i in range(layers):
        p = f"model.layers.{i}."
        names.update({p + "self_attn.q_proj.weight": [hidden, hidden], p + "self_attn.k_proj.weight": [1024, hidden],
                      p + "self_attn.v_proj.weight": [1024, hidden], p + "self_attn.o_proj.weight": [hidden, hidden],
                      p + "mlp.gate_proj.weight": [inner, hidden], p + "mlp.up_proj.weight": [inner, hidden],
                      p + "mlp.down_proj.weight": [hidden, inner], p + "input_layernorm.weight": [hidden],
                      p + "post_attention_layernorm.weight": [hidden]})
    ordered = list(names)
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = ordered[s * len(ordered) // shards:(s + 1) * len(ordered) // shards]
        sparse_safetensors(directory / shard, {n: (names[n], "BF16") for n in part})
        weight_map.update(dict.fromkeys(part, shard))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gib", type=float, default=1.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent) as tmp:
        root = Path(tmp)
        server = serve(root)
        env = {"HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}", "no_proxy": "127.0.0.1"}

        (root / "repo").mkdir()
        llama70b(root / "repo")
        local = statistics.median([run(["show", str(root / "repo"), "--json"], env)["seconds"]
                                   for _ in range(args.runs)])
        print(f"show, 8-shard 70B-shaped repo: local {local:.3f} s")
        for latency in (0.0, 0.02, 0.1):
            server.latency = latency
            remote = statistics.median([run(["show", "hf://bench/repo", "--json"], env)["seconds"]
                                        for _ in range(args.runs)])
            floor = local + 2 * latency
            print(f"  hf:// at {latency * 1000:>3.0f} ms/request: {remote:.3f} s; local + 2 round trips "
                  f"{floor:.3f} s; ratio {remote / floor:.2f}x (target <= 1.5x)")
        server.latency = 0.0

        subprocess.run([sys.executable, "-c", MAKE, "stacked", str(root), str(args.gib)], check=True)
        layers = max(2, int(args.gib * 16))
        server.bytes_sent = 0
        out = root / "slice0.safetensors"
        run(["slice", f"{env['HF_ENDPOINT']}/stacked.safetensors", "--index", "0", "-o", str(out)], env)
        ratio = server.bytes_sent / out.stat().st_size
        print(f"slice --index 0 of {layers} x 64 MiB: server sent {server.bytes_sent / 2**20:.1f} MiB for "
              f"{out.stat().st_size / 2**20:.1f} MiB written: {ratio:.3f}x (target <= 1.1x)")
        (root / "stacked.safetensors").unlink()

        subprocess.run([sys.executable, "-c", MAKE, "inputs", str(root), str(args.gib)], check=True)
        nbytes = (root / "in0.safetensors").stat().st_size
        results = {"local": [], "remote": []}
        for _ in range(args.runs):
            for mode in results:
                inputs = [str(root / f"in{i}.safetensors") if mode == "local"
                          else f"{env['HF_ENDPOINT']}/in{i}.safetensors" for i in range(3)]
                out = root / f"avg_{mode}.safetensors"
                out.unlink(missing_ok=True)
                os.sync()
                results[mode].append(run(["average", *inputs, "-o", str(out)], env))
        for mode, runs in results.items():
            seconds = statistics.median([r["seconds"] for r in runs])
            print(f"average 3 x {nbytes / 2**30:.2f} GiB {mode}: {seconds:.2f} s "
                  f"({3 * nbytes / seconds / 2**20:.0f} MiB/s in), peak RSS {max(r['rss_mb'] for r in runs):.0f} MB")
        local_s, remote_s = (statistics.median([r["seconds"] for r in results[m]]) for m in ("local", "remote"))
        print(f"  remote throughput / local: {local_s / remote_s:.2f}x (target >= 0.5x)")
        urls = [f"{env['HF_ENDPOINT']}/in{i}.safetensors" for i in range(3)]
        bare = statistics.median([float(subprocess.run([sys.executable, "-c", TRANSFER, *urls], check=True,
                                                       capture_output=True, text=True).stdout)
                                  for _ in range(args.runs)])
        print(f"  the transfer alone (a bare client, 4 connections, no arithmetic): {bare:.2f} s "
              f"({3 * nbytes / bare / 2**20:.0f} MiB/s): {local_s / bare:.2f}x the local average's throughput")
        server.shutdown()


if __name__ == "__main__":
    main()
