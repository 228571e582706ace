"""Issue 44, items 1, 2 and 4: digests of the weights themselves. The same weights give the
same digests in every format treecli reads, however sharded or ordered; a flipped bit
anywhere changes its leaf's digest and the root; verify finds leaves that differ, are
missing or extra, against a manifest or another checkpoint."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import treecli

from .conftest import assert_clean_error
from .test_remote import server  # noqa: F401  (the HTTP server fixture)


def _weights():
    rng = np.random.default_rng(0)
    return {"model.embed.weight": rng.standard_normal((16, 8)).astype(np.float32),
            "model.layers.0.w": rng.standard_normal((8, 8)).astype(ml_dtypes.bfloat16),
            "model.layers.1.w": rng.standard_normal((8, 8)).astype(np.float32),
            "model.steps": np.arange(6, dtype=np.int64).reshape(2, 3)}


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(_weights(), str(path))
    return path


@pytest.mark.parametrize("target, options", [
    ("m.npz", []), ("m.msgpack", []), ("m.pt", []), ("orbax_dir", ["--format", "orbax"]),
    ("sharded", ["--format", "safetensors", "--max-shard-size", "300"]),
])
def test_the_same_weights_have_the_same_digests_in_every_format(cli, model, tmp_path, target, options):
    assert cli("convert", model, tmp_path / target, *options).code == 0
    expected, found = treecli.hash(model), treecli.hash(tmp_path / target)
    assert found.leaves == expected.leaves and found.root == expected.root
    result = cli("hash", tmp_path / target)
    assert result.code == 0 and result.stdout.split()[0] == expected.root


def test_a_gguf_and_its_split_shards_hash_as_the_float_file_they_hold(cli, tmp_path):
    weights = {k: v for k, v in _weights().items() if v.dtype != np.int64}
    save_file(weights, str(tmp_path / "m.safetensors"))
    assert cli("convert", tmp_path / "m.safetensors", tmp_path / "m.gguf").code == 0
    assert cli("convert", tmp_path / "m.gguf", tmp_path / "split", "--format", "gguf",
               "--max-shard-size", "300").code == 0
    roots = {treecli.hash(tmp_path / p).root for p in ("m.safetensors", "m.gguf", "split")}
    assert len(roots) == 1


def test_tensor_order_does_not_change_the_root_and_a_quantized_tensor_hashes_its_blocks(cli, tmp_path):
    weights = _weights()
    save_file(weights, str(tmp_path / "a.safetensors"))
    save_file(dict(reversed(list(weights.items()))), str(tmp_path / "b.safetensors"))
    assert treecli.hash(tmp_path / "a.safetensors").root == treecli.hash(tmp_path / "b.safetensors").root
    wide = {"blk.0.ffn_up.weight": np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)}
    save_file(wide, str(tmp_path / "w.safetensors"))
    assert cli("convert", tmp_path / "w.safetensors", tmp_path / "q.gguf", "--dtype", "q4_k").code == 0
    assert cli("convert", tmp_path / "q.gguf", tmp_path / "copy.gguf").code == 0
    quantized, copied = treecli.hash(tmp_path / "q.gguf"), treecli.hash(tmp_path / "copy.gguf")
    assert quantized.root == copied.root  # (the blocks, under Q4_K)
    assert cli("convert", tmp_path / "q.gguf", tmp_path / "f32.gguf", "--dtype", "float32").code == 0
    dequantized = treecli.hash(tmp_path / "f32.gguf")  # (the float32 values the blocks hold)
    values = np.asarray(treecli.load(tmp_path / "q.gguf")["blk"]["0"]["ffn_up"]["weight"])
    assert dequantized.root != quantized.root
    assert dequantized.root == treecli.hash({"blk": {"0": {"ffn_up": {"weight": values}}}}).root


def _data_start(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def test_every_flipped_bit_changes_its_leaf_s_digest_and_the_root(model, tmp_path):
    before = treecli.hash(model)
    start, header = _data_start(model)
    rng = np.random.default_rng(2)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        for _ in range(3):
            at = start + int(rng.integers(begin, end))
            bit = 1 << int(rng.integers(0, 8))
            data = bytearray(model.read_bytes())
            data[at] ^= bit
            flipped = tmp_path / "flipped.safetensors"
            flipped.write_bytes(bytes(data))
            after = treecli.hash(flipped)
            assert after.root != before.root
            assert [k for k in before.leaves if after.leaves[k] != before.leaves[k]] == [name]


def test_verify_against_a_manifest_finds_what_differs_is_missing_or_extra(cli, model, tmp_path):
    manifest = tmp_path / "weights.json"
    written = cli("hash", model, "-o", manifest)
    assert written.code == 0 and manifest.exists(), written.stderr
    assert cli("verify", model, manifest).code == 0
    weights = _weights()
    weights["model.layers.1.w"] = weights["model.layers.1.w"] * 2
    del weights["model.steps"]
    weights["model.extra"] = np.zeros(3, np.float32)
    save_file(weights, str(tmp_path / "other.safetensors"))
    result = cli("verify", tmp_path / "other.safetensors", manifest)
    assert result.code == 1, result.stderr
    assert "~ model.layers.1.w" in result.stdout and "- model.steps" in result.stdout
    assert "+ model.extra" in result.stdout
    report = json.loads(cli("verify", tmp_path / "other.safetensors", manifest, "--json").stdout)
    assert report == {**report, "equal": False, "differ": ["model.layers.1.w"], "missing": ["model.steps"],
                      "extra": ["model.extra"]}
    assert cli("verify", tmp_path / "other.safetensors", manifest, "--where", "model.embed.**").code == 0
    assert cli("verify", tmp_path / "other.safetensors", model).code == 1  # (against a checkpoint)


def test_a_changed_manifest_and_a_bad_output_are_refused_in_one_line(cli, model, tmp_path):
    manifest = tmp_path / "weights.json"
    assert cli("hash", model, "-o", manifest).code == 0
    data = json.loads(manifest.read_text())
    name = next(iter(data["leaves"]))
    data["leaves"][name] = "blake3:" + "0" * 64  # (the root no longer the one its leaves give)
    manifest.write_text(json.dumps(data))
    assert_clean_error(cli("verify", model, manifest), "was changed")
    good = json.loads(json.dumps({**data, "leaves": treecli.hash(model).leaves, "root": treecli.hash(model).root}))
    text = json.dumps(good)
    for hostile, why in [('{"algorithm": "blake3", "x": ' + "[" * 200_000, "nested too deep"),
                         (text[:-1] + ', "leaves": {}}', "the key 'leaves' is given twice"),  # (which would count?)
                         ('{"algorithm": "blake3", "leaves": {', "not JSON")]:
        manifest.write_text(hostile)
        assert_clean_error(cli("verify", model, manifest), "not a treecli digest manifest", why)
    manifest.write_text(text)
    assert cli("verify", model, manifest).code == 0
    assert_clean_error(cli("hash", model, "-o", manifest), "--force")
    assert_clean_error(cli("hash", model, "-o", model, "--force"), "is the input")
    # a shard of the directory being hashed is an input too: never replaced by the manifest
    assert cli("convert", model, tmp_path / "sharded", "--max-shard-size", "300").code == 0
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[0]
    before = shard.read_bytes()
    assert_clean_error(cli("hash", tmp_path / "sharded", "-o", shard, "--force"), "is the input")
    assert shard.read_bytes() == before
    assert_clean_error(cli("verify", model), "give AGAINST")


def test_a_truncated_shard_is_an_error_and_a_swapped_one_a_difference(cli, tmp_path):
    weights = _weights()
    save_file(weights, str(tmp_path / "m.safetensors"))
    assert cli("convert", tmp_path / "m.safetensors", tmp_path / "a", "--max-shard-size", "300").code == 0
    assert cli("hash", tmp_path / "a", "-o", tmp_path / "a.json").code == 0
    weights["model.layers.1.w"] = weights["model.layers.1.w"] + 1
    save_file(weights, str(tmp_path / "n.safetensors"))
    assert cli("convert", tmp_path / "n.safetensors", tmp_path / "b", "--max-shard-size", "300").code == 0
    shards = sorted(p.name for p in (tmp_path / "a").glob("model-*.safetensors"))
    swapped = next(s for s in shards if treecli.hash(tmp_path / "a" / s).root != treecli.hash(tmp_path / "b" / s).root)
    (tmp_path / "a" / swapped).write_bytes((tmp_path / "b" / swapped).read_bytes())
    assert cli("verify", tmp_path / "a", tmp_path / "a.json").code == 1
    shard = tmp_path / "a" / shards[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    result = cli("verify", tmp_path / "a", tmp_path / "a.json")
    assert_clean_error(result)


def test_the_api_hashes_in_memory_and_sharded_jax_arrays_as_whole_arrays(model):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    weights = _weights()
    in_memory = {"model": {"embed": {"weight": jnp.asarray(weights["model.embed.weight"])}}}
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    sharded = jax.device_put(weights["model.embed.weight"], NamedSharding(mesh, PartitionSpec("x")))
    from_file = treecli.hash(model, where="model.embed.**")
    assert treecli.hash(in_memory).root == from_file.root
    assert treecli.hash({"model": {"embed": {"weight": sharded}}}).root == from_file.root
    assert treecli.verify(model, from_file, where="model.embed.**").equal


def test_a_remote_checkpoint_hashes_as_its_local_copy(cli, model, tmp_path, server):  # noqa: F811
    """Over HTTP and from the Hub (the fixture's local server): the same digests as the file's."""
    server.files["/m.safetensors"] = model.read_bytes()
    server.files["/org/repo/resolve/main/model.safetensors"] = model.read_bytes()
    expected = treecli.hash(model).root
    assert cli("hash", f"{server.url}/m.safetensors").stdout.split()[0] == expected
    assert treecli.hash("hf://org/repo").root == expected


def test_verify_checks_a_hub_repository_s_files_against_the_hub_s_own_digests(cli, model, tmp_path,
                                                                              server):  # noqa: F811
    """Item 2: each file of an hf:// checkpoint, read whole, against the SHA-256 the Hub lists
    for it (an LFS file's; a file outside LFS, its git blob SHA-1)."""
    import hashlib

    data = model.read_bytes()
    server.files["/org/repo/resolve/main/model.safetensors"] = data
    api = "/api/models/org/repo/revision/main?blobs=true"

    def publish(entry):
        server.files[api] = json.dumps({"siblings": [{"rfilename": "model.safetensors", **entry}]}).encode()

    publish({"lfs": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}})
    result = cli("verify", "hf://org/repo", model)
    assert result.code == 0 and "1 file the Hub's SHA-256" in result.stderr, result.stderr
    publish({"blobId": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()})
    assert cli("verify", "hf://org/repo", model).code == 0
    publish({"lfs": {"sha256": "0" * 64, "size": len(data)}})  # (the Hub's file is not the one read)
    result = cli("verify", "hf://org/repo", model)
    assert result.code == 1
    assert "! hf://org/repo/model.safetensors: its SHA-256 is not the one the Hub publishes" in result.stdout
    del server.files[api]  # (no list from the Hub: said, not passed over)
    result = cli("verify", "hf://org/repo", model)
    assert result.code == 1 and "the Hub publishes no digest of it" in result.stdout


def test_the_corpus_hashes_alike_in_every_format_it_converts_to(cli, tmp_path):
    """Checkpoints written by the real libraries (../shared/corpus, where this checkout has
    it): a copy in each format treecli writes holds the same digests."""
    from pathlib import Path

    corpus = Path(__file__).resolve().parents[2] / "shared" / "corpus"
    if not corpus.is_dir():
        pytest.skip("no ../shared/corpus beside this checkout")
    for source, target, options in [
        (corpus / "safetensors" / "hf_tiny_llama", "llama.npz", []),
        (corpus / "safetensors" / "hf_tiny_llama_bf16", "llama_bf16", ["--format", "orbax"]),
        (corpus / "orbax" / "flax_linen_trainstate", "state.safetensors", []),
        (corpus / "safetensors" / "dtype_zoo_with_metadata.safetensors", "zoo.npz", []),
    ]:
        assert cli("convert", source, tmp_path / target, *options).code == 0, source
        result = cli("verify", tmp_path / target, source)
        assert result.code == 0, (source, result.stdout, result.stderr)
