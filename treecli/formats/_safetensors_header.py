"""The safetensors header parser: a header validated before anything is allocated.

Its length against the file and the 100 MB limit of the reference, strict UTF-8 JSON
with duplicate keys, NaN, Infinity, ``-0`` and lone surrogates refused, known dtypes,
offsets that tile the data region exactly, and shape x itemsize equal to each byte
range (Python integers, so no overflow). Two paths give the same answers: headers of
32 KiB and more are decoded typed, in C, by msgspec wherever it provably reads them as
the exact parser does (no escapes, no key given twice, no ``-0``); anything else goes
through ``json`` with every object's pairs kept, which names each error. Shard indexes
go through the same strict JSON.
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
from typing import Annotated, Any, Callable, Literal

from treecli import _dtypes, _gc
from treecli._errors import FormatError
from treecli._index import MAX_NDIM  # NumPy's limit: every leaf becomes a NumPy array

MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit
_USIZE = 1 << 64  # the reference reads shapes and offsets as 64-bit unsigned integers
# A "-0" number token (the reference reads it as a float and refuses it); found in
# strings too, where it only sends the header down the slower exact check.
_MINUS_ZERO = re.compile(r"[\[,:\s]-0(?![.eE0-9])")
# A JSON escape of a UTF-16 surrogate: paired ones are fine, a lone one is not UTF-8.
_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")

_CODES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8",
    "BOOL": "bool", "C64": "complex64",
}
_ITEMSIZE = {name: _dtypes.itemsize(name) for name in _CODES.values()}
# Sub-byte floats (safetensors 0.6+), packed: elements x bits fill whole bytes. No NumPy
# dtype holds them as stored (ml_dtypes' float4_e2m1fn takes a byte an element): such a
# tensor is checked like any other and shown as an unread leaf, the rest of the file read.
PACKED_BITS = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def parse_header(read: Callable[[int, int], bytes], size: int | Callable[[int], int],
                 file: str) -> tuple[dict[str, tuple[str, tuple[int, ...], int]], dict[str, str], int]:
    """Validate the header of a safetensors file of ``size`` bytes, read through
    ``read(offset, count)`` (a local file, or byte ranges of a remote one): checked
    against the size before anything is allocated.

    Returns:
        ``(tensors, metadata, data_start)``: ``name -> (dtype name, shape, absolute byte
        offset)`` in header order; the ``__metadata__`` strings; the byte where the data
        region starts.

    A bucket object's size is not known up front: ``size`` is then a function that
    returns it given the end of the data the header declares, or says what is wrong.

    Raises:
        FormatError: naming the file and, where there is one, the tensor.
    """
    known = size if isinstance(size, int) else None
    prefix = read(0, 8) if known is None or known >= 8 else b""
    if len(prefix) < 8:
        raise FormatError(f"file is {known} bytes, too short for a safetensors header (8-byte length + JSON)",
                          file=file)
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES:
        raise FormatError(
            f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit (corrupt or not safetensors)",
            file=file,
        )
    if known is not None and 8 + header_len > known:
        raise FormatError(
            f"file is truncated: its header declares {header_len} header bytes, "
            f"but the file is only {known} bytes",
            file=file,
        )
    raw = read(8, header_len)
    quotes = raw.count(b'"')
    _refuse_parse_bombs(raw, quotes, file)
    with _gc.paused():
        if header_len >= _TYPED_FROM:  # msgspec takes only UTF-8: any other header goes the exact way
            common = _typed_header(raw, quotes, size, 8 + header_len, file)
            if common is not None:
                return common
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FormatError(f"header is not valid UTF-8 (byte {e.start})", file=file) from None
        del raw
        pairs = _parse_pairs(text, file)
        del text
        if type(pairs) is not _Pairs:
            raise FormatError(f"header is a JSON {type(pairs).__name__}, not an object", file=file)
        return _check_header(pairs, size, 8 + header_len, file)


# What parsing and checking a header costs in Python objects, per JSON token: an array
# or object, a string (two quotes), a number or member (a comma): about 8x the size of
# a real header. One that would cost more than PARSE_BUDGET is refused before it is
# parsed: a 99 MB header of empty arrays took 4.7 GB, one of numbers 4.0 GB.
_COST_CONTAINER, _COST_QUOTE, _COST_COMMA = 120, 30, 40
PARSE_BUDGET = 1_250_000_000


def _refuse_parse_bombs(raw: bytes, quotes: int, file: str) -> None:
    """Refuse a header (holding ``quotes`` double quotes) that would cost more than PARSE_BUDGET."""
    containers = raw.count(b"[") + raw.count(b"{")
    commas = raw.count(b",")
    cost = len(raw) + _COST_CONTAINER * containers + _COST_QUOTE * quotes + _COST_COMMA * commas
    if cost > PARSE_BUDGET:
        raise FormatError(f"header would take about {cost / 2**30:.1f} GiB of memory to parse ({containers} JSON "
                          f"arrays and objects, {quotes // 2} strings in {len(raw)} bytes); no real header does",
                          file=file)


def _check_header(pairs: "_Pairs", size: int | Callable[[int], int], data_start: int,
                  file: str) -> tuple[dict, dict[str, str], int]:
    metadata: dict[str, str] = {}
    seen_metadata = False
    tensors: dict[str, tuple[str, tuple[int, ...], int]] = {}
    spans = []
    for name, info in pairs:
        if name == "__metadata__":
            if seen_metadata:
                raise FormatError(f"duplicate key {name!r} in the header", file=file)
            seen_metadata = True
            metadata = _checked_metadata(info, file)
            continue
        dtype, shape, begin, end = _check_entry(name, info, file)
        if len(shape) > MAX_NDIM:
            raise FormatError(f"shape has {len(shape)} dimensions; NumPy handles at most {MAX_NDIM}", file=file,
                              keypath=name)
        if dtype in PACKED_BITS:
            bits = math.prod(shape) * PACKED_BITS[dtype]
            if bits % 8:
                raise FormatError(f"{math.prod(shape)} elements of {dtype} do not fill whole bytes", file=file,
                                  keypath=name)
            nbytes = bits // 8
        else:
            nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        if nbytes >= _USIZE or 0 in shape:
            _refuse_overflow(shape, _ITEMSIZE.get(dtype, 1), file, name)
        if end - begin != nbytes:
            raise FormatError(
                f"byte range [{begin}, {end}) holds {end - begin} bytes but shape {list(shape)} "
                f"of {dtype} needs {nbytes}",
                file=file, keypath=name,
            )
        tensors[name] = (dtype, shape, data_start + begin)
        spans.append((begin, end, name))
    if len(tensors) != len(spans):
        _refuse_duplicates((name for _, _, name in spans), file)
    spans.sort()
    _check_tiling(spans, size, data_start, file)
    return tensors, metadata, data_start


def _checked_metadata(info: Any, file: str) -> dict[str, str]:
    if info is None:  # null: no metadata, as the reference reads it
        return {}
    metadata = _as_dict(info, file)
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError("__metadata__ must be an object of strings", file=file)
    return metadata


# Headers and shard indexes from this size on (~300 tensors) are first decoded by msgspec,
# in C: a 200k-tensor header took 0.8-1.0 s through json and the checks below, 0.36-0.45 s
# so; a DeepSeek-V3-shaped repository (163 shards of 64 KB headers, an 8 MB index) showed in
# 1.35-1.41 s before, 1.11-1.24 s after. Smaller ones stay with json (msgspec's import: 7 ms).
_TYPED_FROM = 1 << 15


def _typed_header(raw: bytes, quotes: int, size: int | Callable[[int], int], data_start: int,
                  file: str) -> tuple[dict, dict[str, str], int] | None:
    """``_check_header``'s result for a header in the form writers produce, decoded and
    checked the fast way; None for anything else (an escape, a negative number, a key
    twice, an entry out of the ordinary), which the exact path then reads and names.
    ``quotes``: how many double quotes ``raw`` holds (counted once, for the size check too).

    A JSON object decoded into a dict keeps the last of duplicate keys, and a struct skips
    fields it does not know. Neither can hide anything here: without a backslash every
    quote delimits a string, and the quotes must number exactly twice the strings decoded
    (each key, and per entry its three field names and its dtype) plus those of the
    metadata, which the exact parser reads. A key given twice, or a field decoding skipped,
    leaves quotes over."""
    if b"\\" in raw or _has_negative_number(raw):
        return None
    entries_decoder, top_decoder, decode_error = _typed_decoders()
    try:
        entries = entries_decoder.decode(raw)
        metadata_raw = top_decoder.decode(raw).metadata
    except (decode_error, UnicodeDecodeError):  # not UTF-8: the exact path names the byte
        return None
    count = len(entries) - ("__metadata__" in entries)
    if quotes != 2 * (len(entries) + 4 * count) + bytes(metadata_raw).count(b'"'):
        return None
    tensors: dict[str, tuple[str, tuple[int, ...], int]] = {}
    codes, itemsizes, prod = _CODES, _ITEMSIZE, math.prod
    position = 0  # where the next entry's data starts, while the entries come in data order
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        code, shape, offsets = entry.dtype, entry.shape, entry.data_offsets
        if code is None or shape is None or offsets is None:
            return None
        dtype = codes[code]
        begin, end = offsets
        nbytes = prod(shape) * itemsizes[dtype]
        if end - begin != nbytes or nbytes >= _USIZE:
            return None
        position = end if begin == position else -1
        tensors[name] = (dtype, shape, data_start + begin)
    try:  # (kept raw, the metadata is the one part msgspec did not check for UTF-8)
        metadata_text = bytes(metadata_raw).decode()
    except UnicodeDecodeError:
        return None
    metadata = {} if not metadata_raw else _checked_metadata(_parse_pairs(metadata_text, file), file)
    if position >= 0:
        _check_data_end(position, size, data_start, file)
    else:
        spans = sorted((offset - data_start, offset - data_start + math.prod(shape) * _ITEMSIZE[dtype], name)
                       for name, (dtype, shape, offset) in tensors.items())
        _check_tiling(spans, size, data_start, file)
    return tensors, metadata, data_start


# A minus after what may come before a number (the first byte is checked apart), searched
# for in one pass where the first 64 KiB after the first dash hold more than DASHES_FOR_REGEX.
_MINUS_AFTER = {bytes: re.compile(rb"[\[,: \t\r\n]-"), str: re.compile(r"[\[,: \t\r\n]-")}
DASHES_FOR_REGEX = 256


def _has_negative_number(raw: bytes | str) -> bool:
    """A ``-`` starting a number (first, or after ``[``, ``,``, ``:`` or a space) in JSON
    bytes or text; one in a string only sends it down the exact path."""
    # One pass of memchr per dash: searching for each two-byte start ("[-", ":-", ...) took
    # 20 ms apiece on a 22 MB header. Many dashes (an MoE index's 280k in shard names) take
    # one regex pass instead: 0.03 s for its 8 MB, where a find per dash took 0.12 s.
    minus, before = (b"-", b"[,: \t\r\n") if isinstance(raw, bytes) else ("-", "[,: \t\r\n")
    at = raw.find(minus)
    if at > 0 and raw.count(minus, at, at + (1 << 16)) > DASHES_FOR_REGEX:
        return _MINUS_AFTER[type(raw)].search(raw, at - 1) is not None
    while at != -1:
        if at == 0 or raw[at - 1 : at] in before:
            return True
        at = raw.find(minus, at + 1)
    return False


@functools.lru_cache(maxsize=1)
def _typed_decoders() -> tuple[Any, Any, type[Exception]]:
    """msgspec's decoders for the header's entries and for its metadata (kept as raw JSON,
    for the exact parser); imported on first use, as big headers are rare."""
    import msgspec

    # Every field optional (None when missing): the metadata decodes as an entry too. (Made with defstruct: this
    # module's annotations are strings, which msgspec would resolve in its globals.)
    code = Literal[tuple(_CODES)]  # type: ignore[valid-type]
    positive = Annotated[int, msgspec.Meta(ge=1)]  # zero-sized dimensions go the exact way (its overflow rule)
    entry = msgspec.defstruct("Entry", [
        ("dtype", code | None, None),
        ("shape", Annotated[tuple[positive, ...], msgspec.Meta(max_length=MAX_NDIM)] | None, None),
        ("data_offsets", tuple[Annotated[int, msgspec.Meta(ge=0)], Annotated[int, msgspec.Meta(ge=0)]] | None, None),
    ])
    top = msgspec.defstruct("Top", [("metadata", msgspec.Raw, msgspec.Raw())], rename={"metadata": "__metadata__"})
    return msgspec.json.Decoder(dict[str, entry]), msgspec.json.Decoder(top), msgspec.DecodeError


def _refuse_overflow(shape: tuple[int, ...], itemsize: int, file: str, name: str) -> None:
    """The reference multiplies a shape out in 64-bit integers, left to right, and refuses
    an overflow even when a later dimension is 0 (``[2**62, 2**62, 0]``): so does treecli."""
    count = 1
    for d in shape:
        count *= d
        if count >= _USIZE:
            break
    else:
        if count * itemsize < _USIZE:
            return
    raise FormatError(f"shape {list(shape)} overflows 64 bits when multiplied out", file=file, keypath=name)


def _check_tiling(spans: list, size: int | Callable[[int], int], data_start: int, file: str) -> None:
    """Sorted ``(begin, end, name)`` spans must tile the data region exactly: no gap, no overlap."""
    position = 0
    for begin, end, name in spans:
        if begin != position:
            what = "overlaps the previous tensor" if begin < position else f"leaves a gap at byte {position}"
            raise FormatError(f"data_offsets [{begin}, {end}) {what}", file=file, keypath=name)
        position = end
    _check_data_end(position, size, data_start, file)


def _check_data_end(position: int, size: int | Callable[[int], int], data_start: int, file: str) -> None:
    """The tensors' data, tiled up to ``position``, must end where the file does."""
    if not isinstance(size, int):
        size = size(data_start + position)
    data_len = size - data_start
    if position != data_len:
        if position > data_len:
            raise FormatError(
                f"file is truncated: its header declares tensor data through byte {data_start + position}, "
                f"but the file is only {size} bytes",
                file=file,
            )
        raise FormatError(
            f"{data_len - position} trailing bytes after the last tensor (data ends at byte "
            f"{data_start + position}, file is {size} bytes)",
            file=file,
        )


class _Pairs(list):
    """A JSON object as parsed: its ``(key, value)`` pairs in order, duplicates kept.

    Parsing objects into this (a C-level list, no Python hook per object) and
    checking for duplicates afterwards costs nothing over plain ``json.loads``;
    a Python ``object_pairs_hook`` cost 40 % more on 200k-tensor headers.
    """

    __slots__ = ()


def _parse_pairs(text: str, file: str) -> Any:
    def no_constants(name: str) -> Any:
        raise FormatError(f"header contains {name}, which is not JSON", file=file)

    def no_minus_zero(literal: str) -> int:
        if literal == "-0":
            raise FormatError("header holds the number -0, which is not an unsigned integer", file=file)
        return int(literal)

    exact = {"parse_int": no_minus_zero} if _MINUS_ZERO.search(text) else {}
    try:
        parsed = json.loads(text, object_pairs_hook=_Pairs, parse_constant=no_constants, **exact)
    except json.JSONDecodeError as e:
        raise FormatError(f"header is not valid JSON: {e.msg} at character {e.pos}", file=file) from None
    except RecursionError:
        raise FormatError("header JSON is nested too deeply", file=file) from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise FormatError(f"header is not valid JSON: {e}", file=file) from None
    if _SURROGATE.search(text):
        try:
            json.dumps(parsed, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise FormatError("header holds a lone UTF-16 surrogate (\\uD800-\\uDFFF), which is not text",
                              file=file) from None
    return parsed


def _as_dict(value: Any, file: str) -> Any:
    """Parsed JSON with every object as a ``dict``; a duplicate key anywhere is an error."""
    if type(value) is _Pairs:
        out = dict(value)
        if len(out) != len(value):
            _refuse_duplicates((key for key, _ in value), file)
        for key, child in out.items():
            if type(child) is _Pairs or type(child) is list:
                out[key] = _as_dict(child, file)
        return out
    if type(value) is list:
        return [_as_dict(v, file) if type(v) is _Pairs or type(v) is list else v for v in value]
    return value


def _refuse_duplicates(keys: Any, file: str) -> None:
    """Raise for the first key that comes twice (called once a count showed there is one)."""
    seen: set = set()
    for key in keys:
        if key in seen:
            raise FormatError(f"duplicate key {key!r} in the header", file=file)
        seen.add(key)


def _parse_json(text: str, file: str) -> Any:
    """Strict JSON: duplicate keys and NaN / Infinity refused."""
    if len(text) >= _TYPED_FROM:
        parsed = _plain_json(text)
        if parsed is not None:
            return parsed
    return _as_dict(_parse_pairs(text, file), file)


def _plain_json(text: str) -> Any:
    """Big JSON (an MoE model's shard index) decoded in C by msgspec, where that reads it
    as the exact parser would; None for anything else. A decoded dict keeps the last of a
    key given twice, but without a backslash no string hides in an escape: every string,
    key or value, comes with two quotes, so the quotes number twice the strings decoded
    exactly when no key was dropped."""
    if "\\" in text or _has_negative_number(text):
        return None
    import msgspec

    try:
        parsed = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return None
    strings = int(type(parsed) is str)
    stack = [parsed] if type(parsed) is dict or type(parsed) is list else []
    while stack:
        value = stack.pop()
        items = value.values() if type(value) is dict else value
        others = [item for item in items if type(item) is not str]
        strings += len(value) * (type(value) is dict) + len(items) - len(others)
        stack.extend(item for item in others if type(item) is dict or type(item) is list)
    return parsed if text.count('"') == 2 * strings else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_entry(name: str, info: Any, file: str) -> tuple[str, tuple[int, ...], int, int]:
    """``(dtype name, shape, begin, end)`` of a tensor entry, or a FormatError saying what is wrong."""
    # The form every writer produces, checked with as few operations as possible
    # (a 200k-tensor header runs this 200k times); anything else takes the long way.
    if type(info) is _Pairs and len(info) == 3:
        (k1, code), (k2, shape), (k3, offsets) = info
        if (k1 == "dtype" and k2 == "shape" and k3 == "data_offsets" and type(code) is str
                and type(shape) is list and type(offsets) is list and len(offsets) == 2):
            begin, end = offsets
            dtype = _CODES.get(code)
            if dtype and type(begin) is int and type(end) is int and 0 <= begin <= end:
                for d in shape:
                    if type(d) is not int or d < 0:
                        break
                else:
                    return dtype, tuple(shape), begin, end
    return _check_entry_fields(name, _as_dict(info, file), file)


def _check_entry_fields(name: str, info: Any, file: str) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(info, dict):
        raise FormatError("tensor entry is not an object", file=file, keypath=name)
    for field in ("dtype", "shape", "data_offsets"):
        if field not in info:
            raise FormatError(f"tensor entry has no {field!r}", file=file, keypath=name)
    code = info["dtype"]
    if not isinstance(code, str) or code not in _CODES and code not in PACKED_BITS:
        raise FormatError(f"unknown dtype {str(code)[:40]!r} (known: {', '.join([*_CODES, *PACKED_BITS])})",
                          file=file, keypath=name)
    shape = info["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise FormatError(f"shape {shape!r} is not a list of non-negative integers", file=file, keypath=name)
    offsets = info["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
        or offsets[1] < offsets[0]
    ):
        raise FormatError(f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end", file=file, keypath=name)
    return _CODES.get(code, code), tuple(shape), offsets[0], offsets[1]


def tensor_leaf(reader: Any, offset: int, shape: tuple[int, ...], dtype: str) -> Any:
    """A header entry's leaf: lazy bytes of the file, or, for a packed sub-byte dtype, an
    unread leaf naming it."""
    from treecli._leaf import Unreadable
    from treecli.formats._filedata import FileArrayLeaf

    if dtype in PACKED_BITS:
        return Unreadable(f"a {dtype} tensor {list(shape)}", f"{PACKED_BITS[dtype]}-bit floats packed in bytes, "
                          "which no NumPy dtype holds as stored")
    return FileArrayLeaf(reader, offset, shape, dtype)


