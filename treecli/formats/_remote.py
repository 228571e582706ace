"""Checkpoints where they live: a URL (HTTP(S), the Hugging Face Hub, S3 and GCS) turned
into a ``Folder``, and the name of the file it names, if any. Everything else is the
road every place takes: the registry recognises a directory's format in one order
wherever it lies, and each format opens from the folder, its files read by byte ranges
through a source of ``treecli._bytes`` (``HttpReader`` for HTTP and the Hub,
``KvstoreReader`` for buckets).

``hf://ORG/REPO[@REVISION][/PATH]`` resolves to the Hub's
``{HF_ENDPOINT}/ORG/REPO/resolve/REVISION/PATH``. ``HF_TOKEN`` is sent to the Hub
only; other HTTP servers are read anonymously.
"""

from __future__ import annotations

import os
import urllib.parse

from treecli._bytes import kvstore
from treecli._errors import UsageError
from treecli.formats._folder import Folder


# --- the Hub -----------------------------------------------------------------------------------


def _hub(url: str) -> tuple[str, str]:
    """``hf://ORG/REPO[@REV][/PATH]`` -> (the resolve URL of the repository, PATH or "")."""
    endpoint, repository, revision, path = _repository(url)
    return f"{endpoint}/{repository}/resolve/{revision}/", path


def _repository(url: str) -> tuple[str, str, str, str]:
    """``hf://ORG/REPO[@REV][/PATH]`` -> (``HF_ENDPOINT``, ORG/REPO, REV, PATH or ""), quoted."""
    parts = url[len("hf://"):].split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise UsageError("write a Hub checkpoint as hf://ORG/REPO[@REVISION][/PATH]", file=url)
    repo, _, revision = parts[1].partition("@")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    quote = urllib.parse.quote
    return (endpoint, f"{quote(parts[0])}/{quote(repo)}", quote(revision or "main", safe=""),
            "/".join(quote(p) for p in parts[2:] if p))


def _headers(url: str) -> dict[str, str]:
    headers = {"User-Agent": "treecli", "Accept-Encoding": "identity"}
    token = os.environ.get("HF_TOKEN")
    if url.startswith("hf://") and token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


# --- a URL as a folder --------------------------------------------------------------------------

def locate(url: str, files: tuple[str, ...], format: str | None = None,
           step: int | None = None) -> tuple[Folder, str | None]:
    """The folder a URL names, or the folder of the file it names and that file's name.
    A name that ends as one of ``files`` (the formats' ``remote_extensions``) is a file,
    unless Orbax is asked for (``--format orbax``, ``--step``): a directory."""
    from treecli.formats._folder import BucketFolder, HttpFolder

    names_a_file = format != "orbax" and step is None
    if url.startswith(kvstore.SCHEMES):
        store, key = kvstore.open_store(url)
        if not (key.endswith(files) and names_a_file):
            return BucketFolder.open(url, store), None
        parent, _, name = key.rpartition("/")
        return BucketFolder.unlisted(url.rsplit("/", 1)[0], store, parent + "/" if parent else ""), name
    headers = _headers(url)
    if url.startswith("hf://"):
        base, inner = _hub(url)
    else:
        parts = urllib.parse.urlsplit(url)
        base = urllib.parse.urlunsplit(parts._replace(path="/", query="", fragment=""))
        inner = parts.path.lstrip("/")
    parent, _, name = inner.rstrip("/").rpartition("/")
    if not (name.endswith(files) and names_a_file):
        directory = base + inner.rstrip("/") + "/" if inner.strip("/") else base
        return HttpFolder(url, directory, headers), None
    exact = {} if url.startswith("hf://") else {urllib.parse.unquote(name): url}  # a query string and all
    return HttpFolder(url.rsplit("/", 1)[0], base + (parent + "/" if parent else ""), headers,
                      files=exact), urllib.parse.unquote(name)


# --- the Hub's own digests of a repository's files ---------------------------------------------

_API_BYTES = 64 << 20  # the Hub's answer for a repository of thousands of files
_READ = 8 << 20


def hub_mismatches(files: list[str]) -> list[str]:
    """For ``files`` (``hf://ORG/REPO[@REV]/PATH`` names), each whole file read (by ranges, one
    version of it) and its SHA-256 compared with the one the Hub publishes for it (an LFS
    file's; a small file's git blob SHA-1 where it is not in LFS): each repository's list
    asked for once. Returns one line for each file that differs, or that the Hub gives no
    digest for."""
    import hashlib

    from treecli._bytes import http

    problems = []
    by_repository: dict[str, list[str]] = {}
    for file in files:
        by_repository.setdefault("/".join(file.split("/", 4)[:4]), []).append(file)  # (hf://ORG/REPO[@REV])
    for repository, names in by_repository.items():
        published = _published(repository)
        base, _ = _hub(repository)
        for file in names:
            name = file[len(repository) + 1:]
            expected = published.get(name)
            if expected is None:
                problems.append(f"{file}: the Hub publishes no digest of it")
                continue
            kind, value = expected
            reader = http.HttpReader(base + urllib.parse.quote(name), _headers(repository), file)
            try:
                reader.start()
                digest = hashlib.sha256() if kind == "SHA-256" else hashlib.sha1(b"blob %d\0" % reader.size)
                for start in range(0, reader.size, _READ):
                    digest.update(reader.read(start, min(_READ, reader.size - start)))
            finally:
                reader.close()
            if digest.hexdigest() != value:
                problems.append(f"{file}: its {kind} is not the one the Hub publishes")
    return problems


def _published(repository: str) -> dict[str, tuple[str, str]]:
    """The digest the Hub lists for each file of ``hf://ORG/REPO[@REV]``: ("SHA-256", hex) of an
    LFS file, ("git blob SHA-1", hex) of another; none where the Hub does not answer."""
    import json

    from treecli._bytes import http

    endpoint, name, revision, _ = _repository(repository)
    api = f"{endpoint}/api/models/{name}/revision/{revision}?blobs=true"
    body = http.get_small(api, _headers(repository), f"{repository} (the Hub's file list)", _API_BYTES)
    published: dict[str, tuple[str, str]] = {}
    try:
        entries = json.loads(body or b"{}").get("siblings") or []
    except (ValueError, AttributeError):
        return published
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("rfilename"), str):
            continue
        lfs = entry.get("lfs") if isinstance(entry.get("lfs"), dict) else {}
        if isinstance(lfs.get("sha256"), str):
            published[entry["rfilename"]] = ("SHA-256", lfs["sha256"])
        elif isinstance(entry.get("blobId"), str):
            published[entry["rfilename"]] = ("git blob SHA-1", entry["blobId"])
    return published
