"""Helpers the commands share: open inputs, write outputs, parse common values."""

from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path
from typing import Any, Iterator, Sequence

from treecli._errors import KeyPathError, TreecliError, UsageError, counted
from treecli.cli._output import Output
from treecli.formats import WriteOptions, open_checkpoint, save
from treecli.formats._base import Checkpoint


def open_input(out: Output, path: str | Path, format: str | None = None, step: int | None = None,
               like: str | None = None) -> Checkpoint:
    """Open a checkpoint and pass its warnings on to stderr.

    ``like`` (``--like MODULE:ATTR``) names the model whose key paths and leaf
    order the checkpoint follows: an ``.eqx`` file's records get its names, and
    an ``.eqx`` output its order.
    """
    structure = None if like is None else template(like)
    checkpoint = open_checkpoint(path, format, step=step, like=structure)
    if structure is not None:
        checkpoint.like = structure
    for warning in checkpoint.warnings:
        out.warn(f"{path}: {warning}")
    return checkpoint


@contextlib.contextmanager
def about(path: str | Path) -> Iterator[None]:
    """Errors about key paths raised in this block (a pattern that matches nothing, an index
    that does not fit a leaf) name ``path``, the input they are about: ``FILE: KEYPATH:
    what`` (the library, given a tree, knows no file: its words are the rest of the line)."""
    try:
        yield
    except TreecliError as e:
        raise e.with_file(str(path)) if isinstance(e, KeyPathError) or e.keypath else e


@functools.lru_cache(maxsize=None)  # `average a.eqx b.eqx --like ...` builds it once
def template(spec: str) -> Any:
    """The :class:`~treecli._pytree.Structure` of the model ``--like MODULE:ATTR`` names.
    Runs the user's own code, never anything from a checkpoint."""
    from treecli import _pytree

    return _pytree.structure(_pytree.import_template(spec))


def write_output(
    out: Output,
    tree: Any,
    target: str | Path | None,
    *,
    source: Checkpoint,
    inputs: Sequence[Checkpoint],
    format: str | None,
    force: bool = False,
    in_place: bool = False,
    max_shard_size: str | None = None,
    drop_unsupported: bool = False,
    metadata: dict[str, Any] | None = None,
    verify: bool = False,
    decided: tuple[Any, bool] | None = None,
    companions: Sequence[Path] | None = None,
    record: str | None = None,
    inputs_read_whole: bool = True,
) -> str | Path:
    """Write a tree the way every command does: atomically, streaming, with a progress bar;
    with ``verify``, read back and compared bit for bit before it replaces anything (a
    local output; an upload is checked by its checksums).

    ``in_place`` rewrites ``source`` where it lies (``target`` is then None). A directory
    output gets ``companions`` beside its weights, by default ``source``'s. The output's
    format is decided once (``decided``, when the command needed it first: ``output_format``).
    With ``record`` (the command, as :func:`command_line` gives it), a format that keeps
    metadata holds the record of where the output came from (the command, ``inputs``' root
    digests and history: ``formats.Record``); where the command reads ``inputs`` only in part
    (``inputs_read_whole`` false), their roots are not taken (that would read the rest).
    Returns the path or URL written; the command says so last (:func:`report_written`).
    """
    from treecli.formats import Record, block_scaled_written, get, held_by, is_url, output_format

    guessed_directory = None
    if verify and target is not None and is_url(target):
        raise UsageError("--verify reads a local output back; an upload to a bucket is checked by its checksums: "
                         "leave --verify out", file=str(target))
    if target is not None and not is_url(target):
        target = Path(target)
        decided = decided or output_format(target, format, source.format)
        fmt, is_dir = decided
        if is_dir and format is None and max_shard_size is None and not target.exists() and not is_url(source.file) \
                and Path(source.file).is_file():
            guessed_directory = fmt  # a file in, a new directory out: maybe not what was meant; said once written
    holder = decided[0] if target is not None and not is_url(target) else get(source.format) if in_place else None
    if holder is not None and holder.name == "gguf":  # (its quantized tensors' edited values requantized)
        tree = held_by(tree, holder, str(target or source.file))
    block_scaled = block_scaled_written(tree)  # (copied as stored, FP8 requantized, or all written plain)
    tree = block_scaled.tree
    provenance = Record(record, [(display_name(c.file), c.tree if inputs_read_whole else None, c.metadata)
                                 for c in inputs],
                        warn=out.warn) if record is not None else None
    written = _write(out, tree, target, source, inputs, format, force, in_place, max_shard_size, drop_unsupported,
                     metadata, verify, decided, list(source.companions if companions is None else companions),
                     provenance)
    for scheme, count in block_scaled.requantized.items():
        out.note(f"requantized to {scheme}: {counted(count, 'weight')} whose values changed, as transformers' FP8 "
                 "quantizer quantizes (each block's largest magnitude to 448)")
    for scheme, count in block_scaled.plain.items():
        out.note(f"{counted(count, 'weight')} stored {scheme} {'is' if count == 1 else 'are'} written as plain "
                 "values; config.json without its quantization_config")
    if holder is not None and holder.name == "gguf":
        _say_requantized(out, tree)
    if guessed_directory is not None:
        kind = "an HF safetensors directory" if guessed_directory.name == "safetensors" else "an Orbax checkpoint"
        out.note(f"the output's name has no extension, so it is {kind} (for one file, name it "
                 f"{target.name}{guessed_directory.extensions[0]})")
    return written


def _write(out: Output, tree: Any, target: Any, source: Checkpoint, inputs: Sequence[Checkpoint], format: str | None,
           force: bool, in_place: bool, max_shard_size: str | None, drop_unsupported: bool,
           metadata: dict[str, Any] | None, verify: bool, decided: Any, companions: list[Path],
           record: Any) -> str | Path:
    from treecli import _tree
    from treecli.formats import save_in_place
    from treecli._units import parse_size

    total = _tree.array_bytes(tree)
    name = Path(source.file).name if in_place else str(target).rstrip("/").rsplit("/", 1)[-1]
    with out.progress(f"writing {name}", total) as advance:
        options = WriteOptions(
            metadata=dict(source.metadata if metadata is None else metadata),
            max_shard_size=parse_size(max_shard_size) if max_shard_size else None,
            companions=companions,
            drop_unsupported=drop_unsupported,
            like=source.like,
            progress=advance,
            stage=out.progress,
            warn=out.warn,
            source=str(source.file),
            record=record,
        )
        if in_place:
            target = save_in_place(tree, source, format=format, options=options, verify=verify)
        else:
            save(tree, target, format=format, input_format=source.format, options=options, inputs=inputs,
                 force=force, verify=verify, decided=decided)
    return target


# What a record's command leaves out: the output itself (a record travels with it, and the
# same command writes the same bytes wherever it writes them), and the options that change
# how a command runs or reports, not what it writes.
_NOT_RECORDED = {"output", "target", "in_place", "force", "json", "verify", "no_verify", "no_record", "quiet",
                 "debug", "dry_run"}


def command_line(context: Any) -> str:
    """The running command (its ``typer.Context``) in canonical form, as an output's record
    keeps it: ``treecli``, the command, its arguments, then the options given under their
    long names, in alphabetical order, a repeated one's values in the order given; each word
    quoted as a shell takes it back. The output is not named, nor options that only change
    how the command runs or reports (``_NOT_RECORDED``)."""
    import shlex

    arguments, options = [], []
    for param in context.command.params:
        value = context.params.get(param.name)
        if param.name in _NOT_RECORDED or value is None or value == param.default or value in ((), []):
            continue
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if param.param_type_name == "argument":
            arguments += [display_name(v) for v in values]
        elif getattr(param, "is_flag", False) and isinstance(value, bool):
            names = param.opts if value else param.secondary_opts
            options.append((max(names, key=len), []))
        else:
            options += [(max(param.opts, key=len), [display_name(getattr(v, "value", v))]) for v in values]
    options.sort(key=lambda option: option[0])
    words = ["treecli", context.info_name or "", *arguments, *(w for flag, rest in options for w in (flag, *rest))]
    return " ".join(shlex.quote(str(word)) for word in words)


def display_name(value: Any) -> str:
    """An input or value as a record names it: a path as given; a URL without the user,
    password, query or fragment it may carry (a token is never recorded)."""
    import urllib.parse

    text = str(value)
    if "://" not in text:
        return text
    parts = urllib.parse.urlsplit(text)
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def _say_requantized(out: Output, tree: Any) -> None:
    """What a GGUF output did with quantized tensors whose values a command changed: each
    quantized in its own type again, how far from the values asked for; or written F32,
    where treecli does not write that type."""
    from treecli.formats import quantization_errors, unrequantized

    for kind, (count, steps, value) in quantization_errors(tree, requantized=True).items():
        out.note(f"requantized to {kind}: {counted(count, 'tensor')}, within {steps:.2f} of a quantization step of "
                 f"the values asked for (largest error {value:.3g})")
    for (kind, why), count in unrequantized(tree).items():
        out.warn(f"{counted(count, 'tensor')} stored {kind} {'is' if count == 1 else 'are'} written F32: {why}")


def report_written(out: Output, written: str | Path | None, *, notes: Sequence[str] = (),
                   warnings: Sequence[str] = (), json: dict[str, Any] | None = None) -> None:
    """What a writing command says when it is done: its notes and warnings, then "wrote",
    last; with ``--json``, also the command's document on stdout."""
    for line in notes:
        out.note(line)
    for line in warnings:
        out.warn(line)
    if written is not None:
        out.note(f"wrote {written}")
    if json is not None:
        out.json(json)


def written_json(written: str | Path | None, notes: Sequence[str], warnings: Sequence[str],
                 **facts: Any) -> dict[str, Any]:
    """The ``--json`` document of ``average``, ``merge`` and ``convert``: the output, what
    the command was given, and its notes and warnings."""
    return {"output": None if written is None else str(written), **facts, "notes": list(notes),
            "warnings": list(warnings)}


def parse_weights(text: str | None, count: int) -> list[float]:
    """``"1,2,3"`` -> ``[1.0, 2.0, 3.0]``; equal weights when ``None``.

    Raises:
        UsageError: a weight that is not a finite number, or the wrong count.
    """
    if text is None:
        return [1.0] * count
    try:
        weights = [float(w) for w in text.replace(" ", "").split(",")]
    except ValueError:
        raise UsageError(f"--weights {text!r}: write numbers separated by commas, e.g. 1,2,3") from None
    if not all(math.isfinite(w) for w in weights):
        raise UsageError(f"--weights {text!r}: every weight must be a finite number")
    if len(weights) != count:
        raise UsageError(f"--weights has {counted(len(weights), 'value')} for {counted(count, 'input')}")
    return weights


def record_of(checkpoint: Checkpoint) -> tuple[dict, dict | None, str]:
    """The checkpoint's metadata without its record, the record (``formats.parsed_record``),
    and why there is none where there is none and one might be looked for: a format that
    keeps no metadata, or a record treecli cannot read (that one stays among the metadata,
    escaped as any)."""
    from treecli.formats import RECORD_KEY, get, parsed_record

    if RECORD_KEY not in checkpoint.metadata:
        keeps = get(checkpoint.format).keeps_records
        return checkpoint.metadata, None, "" if keeps else f"none ({checkpoint.format} keeps no metadata to hold one)"
    record, why = parsed_record(checkpoint.metadata[RECORD_KEY])
    if record is None:
        return checkpoint.metadata, None, f"{RECORD_KEY} is not a record treecli wrote ({why})"
    return {k: v for k, v in checkpoint.metadata.items() if k != RECORD_KEY}, record, ""


def hashed(out: Output, tree: Any, what: str, shares: dict) -> Any:
    """The digests of ``tree``'s weights (``_digest.digests``), with a progress bar over its
    stored bytes; ``shares``: ``hash_shares``'."""
    from treecli import _leaf, _tree
    from treecli._bytes import digest as _digest

    total = sum(_leaf.as_leaf(leaf).stored_nbytes for leaf in _tree.leaves(tree) if _leaf.is_array(leaf))
    with out.progress(what, total) as advance:
        return _digest.digests(tree, progress=advance, **shares)


def hash_shares(command: str) -> dict:
    """Where several processes run ``command``: each hashes its share of the leaves, and every
    process gets all the digests (through the run's coordinator); else nothing to share."""
    import json

    from treecli import _cluster

    cluster = _cluster.current()
    if cluster is None:
        return {}
    rounds = iter(range(1 << 30))

    def gather(found: dict) -> list:
        turn = next(rounds)  # (verify hashes twice: each exchange has keys of its own)
        cluster.tell(f"{command}/{turn}/{cluster.process_id}", json.dumps(found))
        cluster.agree("hash its share")
        return [json.loads(cluster.hear(f"{command}/{turn}/{i}")) for i in range(cluster.count)]

    return {"part": (cluster.process_id, cluster.count), "gather": gather}
