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
    parts = url[len("hf://"):].split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise UsageError("write a Hub checkpoint as hf://ORG/REPO[@REVISION][/PATH]", file=url)
    repo, _, revision = parts[1].partition("@")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    quote = urllib.parse.quote
    base = f"{endpoint}/{quote(parts[0])}/{quote(repo)}/resolve/{quote(revision or 'main', safe='')}/"
    return base, "/".join(quote(p) for p in parts[2:] if p)


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


def hub_mismatches(url: str, files: list[str]) -> list[str]:
    """For ``files`` (their ``hf://`` names) of the repository ``url`` names: each whole file
    read (by ranges, one version of it) and its SHA-256 compared with the one the Hub
    publishes for it (an LFS file's; a small file's git blob SHA-1 where it is not in LFS).
    Returns one line for each file that differs, or that the Hub gives no digest for."""
    import hashlib
    import json

    from treecli._bytes import http

    parts = url[len("hf://"):].split("/")
    repo, _, revision = parts[1].partition("@")
    prefix = f"hf://{parts[0]}/{parts[1]}/"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    quote = urllib.parse.quote
    api = f"{endpoint}/api/models/{quote(parts[0])}/{quote(repo)}/revision/{quote(revision or 'main', safe='')}" \
          "?blobs=true"
    body = http.get_small(api, _headers(url), f"{prefix} (the Hub's file list)", _API_BYTES)
    try:
        siblings = json.loads(body or b"{}").get("siblings") or []
        published = {entry["rfilename"]: (entry.get("lfs") or {}).get("sha256") or ("git", entry.get("blobId"))
                     for entry in siblings if isinstance(entry, dict) and isinstance(entry.get("rfilename"), str)}
    except (ValueError, AttributeError, TypeError):
        published = {}
    problems = []
    for file in files:
        name = file[len(prefix):] if file.startswith(prefix) else file
        expected = published.get(name)
        if expected is None:
            problems.append(f"{file}: the Hub publishes no digest of it")
            continue
        reader = http.HttpReader(f"{endpoint}/{quote(parts[0])}/{quote(repo)}/resolve/"
                                 f"{quote(revision or 'main', safe='')}/{quote(name)}", _headers(url), file)
        try:
            reader.start()
            digest = hashlib.sha256() if isinstance(expected, str) else hashlib.sha1(b"blob %d\0" % reader.size)
            for start in range(0, reader.size, _READ):
                digest.update(reader.read(start, min(_READ, reader.size - start)))
        finally:
            reader.close()
        if digest.hexdigest() != (expected if isinstance(expected, str) else expected[1]):
            kind = "SHA-256" if isinstance(expected, str) else "git blob SHA-1"
            problems.append(f"{file}: its {kind} is not the one the Hub publishes")
    return problems
