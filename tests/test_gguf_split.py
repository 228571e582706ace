"""Issue 43, item 6: split GGUF files (llama-gguf-split's ``NAME-00001-of-00003.gguf``, with
``split.no``, ``split.count`` and ``split.tensors.count``) read as one checkpoint by any
shard, and written into a directory with ``--max-shard-size``. The shards here are written
by gguf-py's own writer, as llama-gguf-split lays them out (the metadata in the first)."""

from __future__ import annotations

import numpy as np
import pytest

from .conftest import assert_clean_error

gguf = pytest.importorskip("gguf")


def _split(directory, parts, *, keys=None, prefix="m"):
    """Shards of ``parts`` (lists of (name, array)), each with the split keys (``keys``: shard ->
    overrides), the first with general.* metadata and a quantized tensor's blocks."""
    directory.mkdir(exist_ok=True)
    total = sum(len(part) for part in parts)
    for index, part in enumerate(parts):
        writer = gguf.GGUFWriter(str(directory / f"{prefix}-{index + 1:05d}-of-{len(parts):05d}.gguf"),
                                 "llama" if index == 0 else None)
        if index == 0:
            writer.add_string("general.name", "tiny")
        values = {"split.no": index, "split.count": len(parts), "split.tensors.count": total,
                  **(keys or {}).get(index, {})}
        writer.add_uint16("split.no", values["split.no"])
        writer.add_uint16("split.count", values["split.count"])
        writer.add_int32("split.tensors.count", values["split.tensors.count"])
        for name, array in part:
            if name.endswith("q8"):
                blocks = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                writer.add_tensor(name, array)
        writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
        writer.close()
    return directory


def _tensors(count=5):
    rng = np.random.default_rng(0)
    return [(f"blk.{i}.{'q8' if i == 1 else 'w'}", rng.standard_normal((4, 64)).astype(np.float32))
            for i in range(count)]


def test_any_shard_opens_the_whole_split_file(cli, tmp_path):
    import treecli
    from treecli import _tree

    tensors = _tensors()
    _split(tmp_path / "s", [tensors[:2], tensors[2:4], tensors[4:]])
    for shard in ("m-00001-of-00003.gguf", "m-00003-of-00003.gguf"):
        result = cli("show", tmp_path / "s" / shard)
        assert result.code == 0 and "3 files" in result.stdout and "Q8_0" in result.stdout, result.stderr
    whole = cli("convert", tmp_path / "s" / "m-00002-of-00003.gguf", tmp_path / "one.gguf")
    assert whole.code == 0, whole.stderr
    reader = gguf.GGUFReader(str(tmp_path / "one.gguf"))
    assert [t.name for t in reader.tensors] == [name for name, _ in tensors]
    assert "split.count" not in reader.fields and reader.fields["general.name"].contents() == "tiny"
    assert reader.tensors[1].tensor_type == gguf.GGMLQuantizationType.Q8_0  # (its blocks, copied)
    loaded = {".".join(map(str, k)): np.asarray(v) for k, v in _tree.flatten(treecli.load(tmp_path / "s"))}
    assert np.array_equal(loaded["blk.4.w"], tensors[4][1])


def test_a_split_written_into_a_directory_is_llama_gguf_split_s_layout(cli, tmp_path):
    tensors = _tensors(6)
    _split(tmp_path / "s", [tensors])
    result = cli("convert", tmp_path / "s" / "m-00001-of-00001.gguf", tmp_path / "out", "--format", "gguf",
                 "--max-shard-size", "2500")
    assert result.code == 0 and "bit-exact" in result.stderr, result.stderr
    shards = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert shards == [f"model-{i:05d}-of-00003.gguf" for i in range(1, 4)]
    readers = [gguf.GGUFReader(str(tmp_path / "out" / name)) for name in shards]
    for index, reader in enumerate(readers):
        assert reader.fields["split.no"].contents() == index and reader.fields["split.count"].contents() == 3
        assert reader.fields["split.tensors.count"].contents() == 6
        assert ("general.name" in reader.fields) == (index == 0)
    # (1,024 bytes a float tensor, 288 the Q8_0's padded to 32, at most 2,500 a shard: llama-gguf-split's count)
    assert [len(r.tensors) for r in readers] == [3, 2, 1]
    assert [t.name for r in readers for t in r.tensors] == [name for name, _ in tensors]
    assert cli("diff", tmp_path / "s" / "m-00001-of-00001.gguf", tmp_path / "out").code == 0


def test_a_gguf_file_output_with_a_shard_size_is_refused(cli, tmp_path):
    _split(tmp_path / "s", [_tensors()])
    result = cli("convert", tmp_path / "s" / "m-00001-of-00001.gguf", tmp_path / "x.gguf", "--max-shard-size", "2KB")
    assert_clean_error(result, "name a directory")
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("damage, message", [
    ("missing", "m-00002-of-00003.gguf"),
    ("count", "split.count"),
    ("number", "split.no"),
    ("total", "split.tensors.count is 9, but the 3 shards hold 5 tensors"),
    ("twice", "two shards hold a tensor of this name"),
    ("renamed", "not named NAME-0000K-of-00003.gguf"),
])
def test_a_damaged_split_is_refused_in_one_line(cli, tmp_path, damage, message):
    tensors = _tensors()
    parts = [tensors[:2], tensors[2:4], tensors[4:]]
    keys = {"count": {1: {"split.count": 4}}, "number": {2: {"split.no": 1}},
            "total": {0: {"split.tensors.count": 9}}}.get(damage)
    if damage == "twice":
        parts[2] = [tensors[0]]
        keys = {i: {"split.tensors.count": 5} for i in range(3)}
    directory = _split(tmp_path / "s", parts, keys=keys)
    first = directory / "m-00001-of-00003.gguf"
    if damage == "missing":
        (directory / "m-00002-of-00003.gguf").unlink()
    if damage == "renamed":
        first = first.rename(directory / "model.gguf")
    result = cli("show", first)
    assert_clean_error(result)
    assert message in result.stderr.splitlines()[0], result.stderr
