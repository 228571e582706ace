"""What GGUF's reader and writer share (as gguf-py's ``constants.py``): the magic, the
type numbers, a metadata value as read, and a quantized tensor's leaf, whose blocks a
GGUF output copies as they are."""

from __future__ import annotations

from typing import Any

from treecli import _leaf
from treecli._errors import FormatError

MAGIC = b"GGUF"
MAX_TENSORS = 1_000_000  # a 671B model has under 2,000
MAX_KEYS = 100_000
MAX_DIMS = 8  # GGML_MAX_DIMS is 4
MAX_NESTING = 32  # metadata arrays in arrays: gguf-py reads any depth; no model nests more than 2
SHOWN_ITEMS = 16  # a metadata array longer than this is summarised

# ggml types stored as plain arrays, by their number
ARRAYS = {0: "float32", 1: "float16", 24: "int8", 25: "int16", 26: "int32", 27: "int64", 28: "float64",
          30: "bfloat16"}
# metadata value types: (struct format, name) for the fixed-size ones
SCALARS = {0: ("<B", "uint8"), 1: ("<b", "int8"), 2: ("<H", "uint16"), 3: ("<h", "int16"), 4: ("<I", "uint32"),
           5: ("<i", "int32"), 6: ("<f", "float32"), 7: ("<?", "bool"), 10: ("<Q", "uint64"), 11: ("<q", "int64"),
           12: ("<d", "float64")}
STRING, ARRAY = 8, 9
# The quantized types treecli writes, as `--dtype` names them (the K-quants and IQ4 by llama.cpp's
# reference quantizers, in _kquants.py and _iquants.py; the others by the gguf package)
WRITTEN_QUANTIZATIONS = ("q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k", "q4_1", "q4_0", "iq4_nl", "iq4_xs", "q3_k",
                         "q2_k")


class MetaValue(str):
    """A metadata value: its text as ``show`` prints it (an array of more than 16 items
    summarised, ``[151936 strings]``), carrying its GGUF type and its whole value, so that
    a GGUF output writes it back as it was (and any other writer writes the text)."""

    kind: int
    value: Any

    def __new__(cls, kind: int, value: Any) -> "MetaValue":
        text = super().__new__(cls, _text(kind, value))
        text.kind, text.value = kind, value
        return text


def _text(kind: int, value: Any) -> str:
    if kind != ARRAY:
        return str(value)
    item, items = value
    if len(items) > SHOWN_ITEMS:
        what = SCALARS[item][1] if item in SCALARS else "strings" if item == STRING else "arrays"
        return f"[{len(items)} {what}]"
    return "[" + ", ".join(_text(item, v) if item == ARRAY else repr(v) if item == STRING else str(v)
                           for v in items) + "]"


def type_name(kind: int) -> str:
    """A ggml type's name (``Q4_K``), as the gguf package knows it."""
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(kind).name


class QuantizedLeaf(_leaf.WholeLeaf):
    """A quantized tensor: float32 values of its logical shape, its blocks read whole and
    dequantized by the gguf package when asked. A GGUF output copies its blocks as they
    are (``kind``, ``raw_nbytes`` bytes at ``raw_offset`` of ``reader``)."""

    def __init__(self, reader: Any, offset: int, shape: tuple[int, ...], kind: int, sizes: tuple[int, int],
                 name: str = ""):
        self._reader, self._offset, self._kind, self._name = reader, offset, kind, name
        self._block, self._block_bytes = sizes
        self.shape = shape
        self.dtype_name = "float32"

    @property
    def place(self) -> tuple[str, int] | None:
        """Its file and the offset of its blocks there (None: computed, not read)."""
        return None if self._reader is None else (self._reader.path, self._offset)

    @property
    def kind(self) -> int:
        return self._kind

    @property
    def raw_nbytes(self) -> int:
        return self.size // self._block * self._block_bytes

    stored_otherwise = True

    @property
    def stored_dtype(self) -> str:
        return type_name(self._kind)

    @property
    def stored_nbytes(self) -> int:
        return self.raw_nbytes

    def read_raw(self, start: int, stop: int):
        """Bytes ``[start, stop)`` of its blocks, as stored."""
        import numpy as np

        out = np.empty(stop - start, np.uint8)
        self._reader.read_into(out, self._offset + start)
        return out

    @property
    def sources(self) -> tuple[str, ...]:
        return (self._reader.path,)

    def blocks(self):
        """All its blocks, as stored (flat bytes)."""
        return self.read_raw(0, self.raw_nbytes)

    def as_blocks(self) -> "StoredBlocks":
        """Its blocks as a leaf of bytes, one for the tensor (a writer records their digest
        under it, and a verification finds it there)."""
        if getattr(self, "_as_blocks", None) is None:
            self._as_blocks = StoredBlocks(self)
        return self._as_blocks

    def load(self):
        import numpy as np
        from gguf import quants
        from gguf.constants import GGMLQuantizationType

        row = self.shape[-1] if self.shape else 1
        raw = self.blocks().reshape(self.size // max(1, row), row // self._block * self._block_bytes)
        try:
            with np.errstate(all="ignore"):  # a block's scale may be inf or NaN in the file: so are its values
                values = quants.dequantize(raw, GGMLQuantizationType(self._kind))
        except NotImplementedError:  # (Q8_1, Q8_K: llama.cpp's intermediate types; copied as they are)
            raise FormatError(f"{type_name(self._kind)} blocks, which the gguf package does not dequantize; a GGUF "
                              "output copies them as they are", file=self._reader.path, keypath=self._name) from None
        return values.astype(np.float32, copy=False).reshape(-1)


class StoredBlocks(_leaf.WholeLeaf):
    """A quantized tensor's blocks, as stored: bytes (what a GGUF output's verification
    compares, bit for bit)."""

    def __init__(self, quantized: QuantizedLeaf):
        self._quantized = quantized
        self.shape = (quantized.raw_nbytes,)
        self.dtype_name = "uint8"

    @property
    def sources(self) -> tuple[str, ...]:
        return self._quantized.sources

    def load(self):
        return self._quantized.read_raw(0, self._quantized.raw_nbytes)
