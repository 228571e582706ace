"""Adding a format is one module and one registry line: a toy format, known to treecli
through the Format contract alone, works with every command (CONTRIBUTING.md)."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import treecli
from treecli import formats

from .conftest import bits


@pytest.fixture
def toy(monkeypatch, tmp_path):
    monkeypatch.setitem(formats.FORMATS, "toy", "tests.toy_format:ToyFormat")
    formats.get.cache_clear()
    rng = np.random.default_rng(0)
    tensors = {"model.w": rng.standard_normal((4, 3)).astype(np.float32), "model.b": np.arange(3, dtype=np.int64)}
    path = tmp_path / "m.toy"
    treecli.save(tensors, path)
    yield path, tensors
    formats.get.cache_clear()


def test_every_command_works_with_a_format_plugged_in_through_the_contract(cli, toy, tmp_path):
    path, tensors = toy
    assert path.read_text().startswith('{"toy": 1')
    shown = cli("show", path, "--json")
    assert shown.code == 0 and shown.json["format"] == "toy"
    assert {leaf["keypath"] for leaf in shown.json["leaves"]} == {"model.w", "model.b"}
    assert cli("get", path, "model.b", "--json").json["value"] == [0, 1, 2]
    for args in (["slice", path, "--index", "model.w=:2", "-o", tmp_path / "s.toy"],
                 ["average", path, path, "-o", tmp_path / "a.toy"],
                 ["merge", path, path, "--method", "linear", "-o", tmp_path / "mg.toy"],
                 ["edit", path, "--scale", "model.w=2", "-o", tmp_path / "e.toy"],
                 ["convert", path, tmp_path / "c.safetensors"],
                 ["convert", tmp_path / "c.safetensors", tmp_path / "back.toy"]):
        result = cli(*args)
        assert result.code == 0, (args, result.stderr)
    assert bits(load_file(str(tmp_path / "c.safetensors"))["model.w"]) == bits(tensors["model.w"])
    assert cli("diff", path, tmp_path / "back.toy").code == 0
    assert cli("diff", path, tmp_path / "a.toy").code == 0  # the mean of a model and itself
    assert np.asarray(treecli.load(tmp_path / "s.toy")["model"]["w"]).shape == (2, 3)
    assert np.array_equal(np.asarray(treecli.load(tmp_path / "e.toy")["model"]["w"]), tensors["model.w"] * 2)
    assert cli("edit", path, "--in-place", "--scale", "model.w=3").code == 0
    assert np.array_equal(np.asarray(treecli.load(path)["model"]["w"]), tensors["model.w"] * 3)


def test_a_format_that_does_not_write_says_so(cli, toy, tmp_path, monkeypatch):
    path, _ = toy
    from tests.toy_format import ToyFormat

    monkeypatch.setattr(ToyFormat, "writable", False)
    formats.get.cache_clear()
    result = cli("convert", tmp_path / "m.toy", tmp_path / "x.toy", "--format", "toy")
    assert result.code == 2 and "cannot write toy files" in result.stderr
    save_file({"w": np.ones(1, np.float32)}, str(tmp_path / "w.safetensors"))
    assert cli("convert", tmp_path / "w.safetensors", tmp_path / "y.toy").code == 2


def test_every_place_is_a_folder_and_every_format_of_directories_opens_from_one(tmp_path):
    """A local directory, a bucket prefix and an HTTP directory are each a ``Folder`` (the
    typed protocol formats read through); every format the registry tries on directories
    answers ``in_folder`` and opens from a folder, local or remote alike."""
    from treecli import formats
    from treecli.formats._base import Format
    from treecli.formats._folder import BucketFolder, Folder, HttpFolder, LocalFolder

    places = [LocalFolder(tmp_path), HttpFolder("https://example.invalid/run", "https://example.invalid/run/", {}),
              BucketFolder("s3://bucket/run", None, {"driver": "s3", "bucket": "bucket", "path": "run/"},
                           frozenset({"a.txt"}))]
    for place in places:
        assert isinstance(place, Folder), type(place).__name__
        assert isinstance(place.child("x"), Folder)
    assert [place.local_path for place in places] == [tmp_path, None, None]
    for name in formats.DIRECTORIES:
        fmt = formats.get(name)
        assert type(fmt).in_folder is not Format.in_folder and type(fmt).open_folder is not Format.open_folder, name
        assert isinstance(fmt.in_folder(LocalFolder(tmp_path)), str)  # an empty directory holds none of them
    with pytest.raises(treecli.FormatError, match="no checkpoint here"):
        formats.open_folder(LocalFolder(tmp_path))
