"""A Hugging Face tokenizer as llama.cpp's GGUF holds it (``tokenizer.ggml.*``), and back.

Into GGUF: a SentencePiece ``tokenizer.model`` (llama.cpp's ``llama`` tokenizer: pieces,
scores, types, read by a small protobuf reader of its own) or a byte-level BPE
``tokenizer.json`` (``gpt2``: tokens, types, merges, the pre-tokenizer by its regex),
as ``convert_hf_to_gguf.py`` prefers them; the special tokens, whether to add BOS/EOS,
and the chat template by the ``gguf`` package's own ``SpecialVocab``. The
``tokenizer.json`` text is kept whole in ``tokenizer.huggingface.json`` so that the way
back gives the same file.

Back to HF: ``tokenizer.json`` from that key (or, for a GGUF written elsewhere, a
byte-level BPE one built from the tokens and merges), and a ``tokenizer_config.json``
naming the special tokens and the chat template.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from treecli._errors import UsageError
from treecli._mergeconfig import shown as _shown  # (a value from a file, bounded however it was built)

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # gguf.TokenType (SentencePiece's too)
MAX_TOKENS = 1 << 24  # the largest vocabularies have a few hundred thousand

# Byte-level BPE pre-tokenizers llama.cpp knows by name (``tokenizer.ggml.pre``), by the
# regex of their ``Split`` step. (llama.cpp's converter tells them by hashing a text the
# tokenizer encodes, which needs the tokenizer run; these are their published regexes.)
PRE_TOKENIZERS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
             r"\s*[\r\n]+|\s+(?!\S)|\s+",
}


def to_gguf(directory: Path, vocab_size: int, writer: Any) -> list[str]:
    """Add the tokenizer in ``directory`` to ``writer`` (a ``gguf.GGUFWriter``), its
    token list padded to ``vocab_size`` as llama.cpp's converter pads it. Returns warnings.

    Raises:
        UsageError: no tokenizer llama.cpp can take, or one larger than the embeddings.
    """
    from gguf import SpecialVocab

    if vocab_size > MAX_TOKENS:  # (refused before a token list of that length is made)
        raise UsageError(f"the embeddings have {vocab_size:,} rows; no vocabulary has more than {MAX_TOKENS:,} "
                         "tokens", file=str(directory))
    warnings: list[str] = []
    if (directory / "tokenizer.model").is_file():
        tokens, scores, types = _sentencepiece(directory / "tokenizer.model")
        tokens, scores, types = _with_added(directory, tokens, scores, types)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        merges = False
    elif (directory / "tokenizer.json").is_file():
        text = (directory / "tokenizer.json").read_text(encoding="utf-8")
        tokens, types, pre = _byte_level_bpe(text)
        scores = None
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre or "default")
        if pre is None:
            warnings.append("tokenizer.json's pre-tokenizer is none llama.cpp names: written as 'default', which "
                            "may split text differently than the original")
        writer.add_string("tokenizer.huggingface.json", text)
        merges = True
    else:
        raise UsageError("llama.cpp needs the model's tokenizer, and there is neither a tokenizer.model nor a "
                         "tokenizer.json beside the weights", file=str(directory))
    if len(tokens) > vocab_size:
        raise UsageError(f"the tokenizer has {len(tokens)} tokens and the embeddings {vocab_size} rows",
                         file=str(directory))
    for i in range(len(tokens), vocab_size):  # (as llama.cpp's converter: rows no token uses)
        tokens.append(f"[PAD{i}]")
        types.append(UNUSED)
        if scores is not None:
            scores.append(-1000.0)
    writer.add_token_list(tokens)
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_token_types(types)
    try:
        special = SpecialVocab(directory, load_merges=merges, n_vocab=len(tokens))
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:  # (the gguf package's reading)
        raise UsageError(f"the tokenizer's special tokens cannot be read: {type(e).__name__}: {str(e)[:120]}",
                         file=str(directory)) from None
    special.add_to_gguf(writer, quiet=True)
    return warnings


def _byte_level_bpe(text: str) -> tuple[list[str], list[int], str | None]:
    """The tokens (by id), their types and the pre-tokenizer's llama.cpp name of a
    byte-level BPE ``tokenizer.json``."""
    try:
        data = json.loads(text)
        model = data["model"]
        vocab = model["vocab"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise UsageError("tokenizer.json is no tokenizer (no model.vocab)") from None
    if model.get("type") != "BPE" or model.get("byte_fallback") or not isinstance(vocab, dict):
        raise UsageError("tokenizer.json is not a byte-level BPE tokenizer, and there is no tokenizer.model: "
                         "llama.cpp's 'llama' tokenizer is read from tokenizer.model")
    by_id: dict[int, tuple[str, int]] = {}
    for token, index in vocab.items():
        if type(index) is not int or not 0 <= index < MAX_TOKENS:
            raise UsageError(f"tokenizer.json has a token id that is no whole number below {MAX_TOKENS:,}")
        if index in by_id:
            raise UsageError(f"tokenizer.json gives token id {_shown(index)} twice ({_shown(by_id[index][0])} and "
                             f"{_shown(token)})")
        by_id[index] = (token, NORMAL)
    for added in data.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("id"), int) and isinstance(added.get("content"), str):
            index, text = added["id"], added["content"]
            if not 0 <= index < MAX_TOKENS:
                raise UsageError(f"tokenizer.json has a token id that is no whole number below {MAX_TOKENS:,}")
            if index in by_id and by_id[index][0] != text:  # (an added token may repeat its vocabulary entry)
                raise UsageError(f"tokenizer.json gives token id {index} twice ({_shown(by_id[index][0])} and "
                                 f"{_shown(text)})")
            by_id[index] = (text, CONTROL if added.get("special") else USER_DEFINED)
    size = max(by_id) + 1 if by_id else 0
    tokens = [by_id.get(i, (f"[PAD{i}]", UNUSED))[0] for i in range(size)]
    types = [by_id.get(i, ("", UNUSED))[1] for i in range(size)]
    return tokens, types, _pre_tokenizer(data.get("pre_tokenizer"))


def _pre_tokenizer(spec: Any) -> str | None:
    """llama.cpp's name of a pre-tokenizer: by its Split step's regex, or ``gpt-2`` for
    byte-level's own regex alone; None for any other."""
    steps = spec.get("pretokenizers", [spec]) if isinstance(spec, dict) else []
    for step in steps:
        if isinstance(step, dict) and step.get("type") == "Split" and isinstance(step.get("pattern"), dict):
            regex = step["pattern"].get("Regex")
            return next((name for name, known in PRE_TOKENIZERS.items() if known == regex), None)
    if len(steps) == 1 and isinstance(steps[0], dict) and steps[0].get("type") == "ByteLevel" and \
            steps[0].get("use_regex", True):
        return "gpt-2"
    return None


def _with_added(directory: Path, tokens: list, scores: list, types: list) -> tuple[list, list, list]:
    """SentencePiece's pieces, and the tokens ``tokenizer.json`` adds after them."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return tokens, scores, types
    try:
        added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens") or []
    except (ValueError, AttributeError, RecursionError):
        return tokens, scores, types
    for entry in sorted((a for a in added if isinstance(a, dict) and isinstance(a.get("id"), int)
                         and isinstance(a.get("content"), str)), key=lambda a: a["id"]):
        if entry["id"] == len(tokens):
            tokens.append(entry["content"])
            scores.append(-1000.0)
            types.append(CONTROL if entry.get("special") else USER_DEFINED)
    return tokens, scores, types


# --- SentencePiece's model file: a protobuf ModelProto, of which the pieces are read ----------


def _sentencepiece(path: Path) -> tuple[list[str], list[float], list[int]]:
    """Each piece's text, score and type (``ModelProto.pieces``: field 1, each a message of
    piece (1), score (2), type (3))."""
    data = path.read_bytes()
    tokens, scores, types = [], [], []
    for field, value in _fields(data, str(path)):
        if field != 1:
            continue
        piece, score, kind = "", 0.0, NORMAL
        if not isinstance(value, bytes):
            raise UsageError("tokenizer.model is no SentencePiece model (a piece that is a number)", file=str(path))
        for inner, item in _fields(value, str(path)):
            wanted = {1: bytes, 2: bytes, 3: int}.get(inner)
            if wanted is not None and (not isinstance(item, wanted) or (inner == 2 and len(item) != 4)):
                raise UsageError(f"tokenizer.model is no SentencePiece model (a piece's field {inner})",
                                 file=str(path))
            if inner == 1:
                piece = item.decode("utf-8", errors="replace")
            elif inner == 2:
                score = struct.unpack("<f", item)[0]
            elif inner == 3:
                kind = item
        tokens.append(piece)
        scores.append(score)
        types.append(kind if kind in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE) else NORMAL)
    if not tokens:
        raise UsageError("tokenizer.model holds no pieces", file=str(path))
    return tokens, scores, types


def _fields(data: bytes, file: str):
    """A protobuf message's (field number, value): varints as ints, 32-bit values as 4
    bytes, length-delimited ones as bytes (every length checked)."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at, file)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at, file)
        elif wire == 1:
            value, at = data[at : at + 8], at + 8
        elif wire == 2:
            size, at = _varint(data, at, file)
            value, at = data[at : at + size], at + size
        elif wire == 5:
            value, at = data[at : at + 4], at + 4
        else:
            raise UsageError(f"tokenizer.model is no SentencePiece model (wire type {wire})", file=file)
        if at > len(data):
            raise UsageError("tokenizer.model ends inside a field", file=file)
        yield field, value


def _varint(data: bytes, at: int, file: str) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise UsageError("tokenizer.model ends inside a number", file=file)
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def _sentencepiece_model(tokens: list[str], scores: list[float], types: list[int], special: dict[str, Any],
                         space_prefix: bool) -> bytes:
    """A SentencePiece model file (``ModelProto``) of llama.cpp's ``llama`` tokens: the
    pieces with their scores and types, a BPE trainer spec (byte fallback where there
    are byte pieces; the special tokens' ids), and the normalizer llama.cpp tokenizes
    with: none, a space before the text (unless the GGUF says not), runs of spaces kept."""
    def ids(kind: str, field: int) -> bytes:
        index = special.get(kind)
        return _varint_field(field, index & 0xFFFFFFFFFFFFFFFF) if type(index) is int else b""

    pieces = b"".join(_bytes_field(1, _bytes_field(1, str(token).encode("utf-8")) + struct.pack("<Bf", 0x15, score)
                                   + _varint_field(3, kind)) for token, score, kind in zip(tokens, scores, types))
    trainer = _varint_field(3, 2) + _varint_field(4, len(tokens)) + _varint_field(35, int(BYTE in types)) + \
        ids("unk", 40) + ids("bos", 41) + ids("eos", 42) + ids("pad", 43)
    normalizer = _bytes_field(1, b"identity") + _varint_field(3, int(space_prefix)) + _varint_field(4, 0) + \
        _varint_field(5, 1)
    return pieces + _bytes_field(2, trainer) + _bytes_field(3, normalizer)


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _varint_field(field: int, value: int) -> bytes:
    return _varint_bytes(field << 3) + _varint_bytes(value)


def _bytes_field(field: int, data: bytes) -> bytes:
    return _varint_bytes(field << 3 | 2) + _varint_bytes(len(data)) + data


# --- back to Hugging Face ---------------------------------------------------------------------


def to_hf(metadata: dict[str, Any]) -> tuple[dict[str, bytes], list[str]]:
    """The tokenizer files a GGUF file's metadata make (name -> bytes), and warnings."""
    def value(key: str) -> Any:
        found = metadata.get(key)
        return getattr(found, "value", None)

    def array(key: str) -> list:
        found = value(key)
        return list(found[1]) if isinstance(found, tuple) else []

    model = value("tokenizer.ggml.model")
    tokens = array("tokenizer.ggml.tokens")
    types = array("tokenizer.ggml.token_type")
    types = [t if type(t) is int else NORMAL for t in types[: len(tokens)]] + [NORMAL] * (len(tokens) - len(types))
    files, warnings = {}, []
    original = value("tokenizer.huggingface.json")
    if isinstance(original, str):
        files["tokenizer.json"] = original.encode("utf-8")
        tokenizer_class = "PreTrainedTokenizerFast"
    elif model == "gpt2" and tokens:
        files["tokenizer.json"] = _bpe_json(tokens, types, array("tokenizer.ggml.merges"), value("tokenizer.ggml.pre"))
        tokenizer_class = "PreTrainedTokenizerFast"
    elif model == "llama" and tokens:
        scores = array("tokenizer.ggml.scores")
        scores = [float(s) if type(s) in (int, float) else 0.0 for s in scores[: len(tokens)]] + \
            [0.0] * (len(tokens) - len(scores))
        special = {kind: value(f"tokenizer.ggml.{kind}_token_id") for kind in ("unk", "bos", "eos", "pad")}
        files["tokenizer.model"] = _sentencepiece_model(tokens, scores, types, special,
                                                        value("tokenizer.ggml.add_space_prefix") is not False)
        tokenizer_class = "LlamaTokenizer"
    else:
        warnings.append(f"no tokenizer written: a {model or 'missing'} tokenizer.ggml.model is rebuilt only as "
                        "gpt2 (byte-level BPE) or llama (SentencePiece)")
        return files, warnings
    config: dict[str, Any] = {"tokenizer_class": tokenizer_class}
    for kind in ("bos", "eos", "unk", "pad"):
        index = value(f"tokenizer.ggml.{kind}_token_id")
        if isinstance(index, int) and tokens and 0 <= index < len(tokens):
            config[f"{kind}_token"] = tokens[index]
        add = value(f"tokenizer.ggml.add_{kind}_token")
        if isinstance(add, bool):
            config[f"add_{kind}_token"] = add
    template = value("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    files["tokenizer_config.json"] = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    return files, warnings


def _bpe_json(tokens: list[str], types: list[int], merges: list[str], pre: Any) -> bytes:
    """A byte-level BPE ``tokenizer.json`` of llama.cpp's tokens and merges."""
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": kind == CONTROL} for i, (t, kind) in enumerate(zip(tokens, types))
             if kind in (CONTROL, USER_DEFINED)]
    split = [{"type": "Split", "pattern": {"Regex": PRE_TOKENIZERS[pre]}, "behavior": "Isolated", "invert": False}] \
        if pre in PRE_TOKENIZERS else []
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": not split}
    document = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": split + [byte_level]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind in (NORMAL, BYTE)},
                  "merges": list(merges)},
    }
    return (json.dumps(document, ensure_ascii=False) + "\n").encode("utf-8")
