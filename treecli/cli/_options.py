"""Options shared by several commands, declared once."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from treecli.cli._complete import choices, complete_dtypes, complete_formats, complete_keypaths

# Checkpoints are text, not Path: a Path would fold https://host into https:/host.
CheckpointArg = Annotated[
    str,
    typer.Argument(help="Checkpoint: a file, an HF sharded directory or index JSON, an Orbax directory, a "
                   "remote safetensors file or repository (https://..., hf://ORG/REPO), or any of these in a "
                   "bucket (s3://BUCKET/KEY, gs://BUCKET/KEY).",
                   show_default=False, metavar="CHECKPOINT"),
]
# The registry's names (formats.FORMATS), spelled out so that --help imports no format
# (tests/test_newuser.py holds them to the registry).
READ_FORMATS = "safetensors, npz, msgpack, npy, eqx, orbax, torch, gguf or dcp"
WRITTEN_FORMATS = "safetensors, npz, msgpack, npy, eqx, orbax, torch or gguf"
FormatOpt = Annotated[
    Optional[str],
    typer.Option("--format", "-f", help=f"Format of the input: {READ_FORMATS} (default: detected from its bytes "
                 "or layout).", autocompletion=complete_formats, show_default=False),
]
OutputFormatOpt = Annotated[
    Optional[str],
    typer.Option("--format", "-f", help=f"Format of the output: {WRITTEN_FORMATS} (default: from the -o name, "
                 "else the input's). Orbax's writer holds the whole output in memory (about 4x its size); the "
                 "others stream.", autocompletion=complete_formats, show_default=False),
]
InputFormatOpt = Annotated[
    Optional[str],
    typer.Option("--input-format", help=f"Format of the input: {READ_FORMATS} (default: detected from its bytes "
                 "or layout).", autocompletion=complete_formats, show_default=False),
]
StepOpt = Annotated[
    Optional[int],
    typer.Option("--step", help="Step of a CheckpointManager root (default: the latest).", show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="One JSON document on stdout, for scripts.")]
WhereOpt = Annotated[
    Optional[list[str]],
    typer.Option("--where", "-w", help="Only the subtrees matching this key-path pattern (repeatable).",
                 autocompletion=complete_keypaths, show_default=False),
]
OutputOpt = Annotated[
    str,  # not Path, which would fold the // of s3://
    typer.Option("--output", "-o", help="Output file or directory, or an s3:// or gs:// URL; the format follows "
                 "its extension.",
                 show_default=False),
]
def patterns(flag: str, help: str, complete: Any = complete_keypaths) -> Any:
    """A repeatable key-path option (``PATTERN=VALUE`` and the like) whose key paths
    complete from the checkpoint on the command line."""
    return Annotated[Optional[list[str]], typer.Option(flag, help=help, autocompletion=complete,
                                                       show_default=False)]


def dtype_option(help: str) -> Any:
    """``--dtype NAME``, completed from the dtypes treecli knows."""
    return Annotated[Optional[str], typer.Option("--dtype", help=help, autocompletion=complete_dtypes,
                                                 show_default=False)]


LikeOpt = Annotated[
    Optional[str],
    typer.Option("--like", help="MODULE:ATTR of your model (a function returning it, or the object), built "
                 "without allocating: names the leaves of an .eqx file and orders an .eqx output. Imports and "
                 "runs that code of yours; nothing from the checkpoint is ever run.", show_default=False,
                 metavar="MODULE:ATTR"),
]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing output.")]
NonFloatOpt = Annotated[str, typer.Option("--non-float", help="Integer, bool and non-array leaves that differ "
                                          "between inputs (step counters, optax counts, JSON items): 'last' copies "
                                          "the last input's (the newest, listing steps in order), 'first' the "
                                          "first's, 'error' refuses. A note names them.",
                                          autocompletion=choices("last", "first", "error"))]
MaxShardOpt = Annotated[
    Optional[str],
    typer.Option("--max-shard-size", help="Shard a safetensors directory output (e.g. 5GB, 500MiB).",
                 show_default=False),
]
VerifyOpt = Annotated[bool, typer.Option(
    "--verify", help="Read the output back and check every leaf bit for bit before it replaces anything (a local "
                     "output; convert always does).")]
VERIFIED = "verified: every leaf is bit-exact"  # the note of a verified output
NoRecordOpt = Annotated[bool, typer.Option(
    "--no-record", help="Leave out the record of where the output came from, which safetensors, GGUF and Orbax "
                        "outputs keep in their metadata (its root digest, this command, each input's root digest "
                        "and history; treecli show prints it, treecli verify checks it). Taking it reads the "
                        "inputs' leaves the output does not copy as they are.")]


def quantized_note(errors: dict[str, tuple[int, float, float]], verified: bool) -> str:
    """The note of an output some of whose tensors were quantized (``formats.quantization_errors``):
    how far from their input they are; verified, every other leaf bit-exact."""
    from treecli._errors import counted

    parts = [f"{counted(count, 'tensor')} quantized to {kind} {'is' if count == 1 else 'are'} within {steps:.2f} "
             f"of a quantization step of {'its' if count == 1 else 'their'} input (largest error {value:.3g})"
             for kind, (count, steps, value) in errors.items()]
    return ("verified: " if verified else "") + "; ".join(parts) + (
        "; every other leaf is bit-exact" if verified else "")
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar or notes on stderr.")]
DropUnsupportedOpt = Annotated[
    bool, typer.Option("--drop-unsupported", help="Drop leaves the output format cannot hold, with a warning."),
]
