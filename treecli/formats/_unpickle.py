"""A pickle reader that runs nothing: the opcodes PyTorch's checkpoints use, read one by
one in Python, with every global looked up in an allowlist of plain-data constructors.

Python's own unpickler imports and calls whatever a pickle names (``os.system`` as
easily as ``OrderedDict``), and its C implementation grows its memo to any index a file
asks for. Here:

- a ``GLOBAL`` / ``STACK_GLOBAL`` is looked up in ``allowed`` (``"module.name"`` -> a
  function of plain data, or a plain value standing for it: a dtype); a class of plain
  settings that ``opaque`` names (``argparse.Namespace``, NumPy's state) is never built
  either: an object of it is an :class:`~treecli._leaf.Unreadable` leaf that names it;
  anything else is refused in one line naming it, before anything is built from it;
- ``REDUCE`` / ``NEWOBJ`` call only those functions; ``BUILD`` gives its state to a
  :class:`Record` (an allowed class kept as plain data) and is otherwise ignored (the
  state of a tensor subclass is not data);
- persistent ids (``BINPERSID``) go to ``persistent``, which names the storages;
- the memo is a dict, and the values on the stack and in the memo are counted
  (:data:`MAX_VALUES`): a memo or stack bomb is refused in bounded memory; a tuple is
  nested at most :data:`MAX_NESTING` deep (hashing a deeper one, a dict key, would
  overflow the C stack).

Supported: protocols 2 to 5 in binary form (what ``torch.save`` and
``torch.distributed.checkpoint`` write). Text opcodes of protocol 0 are refused.
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Mapping

from treecli._errors import FormatError, RefusedError
from treecli._leaf import Unreadable

# Values a pickle may hold on its stack and in its memo together: a state dict of 200k
# tensors holds about 4 million. Beyond that the file is refused, in bounded memory.
MAX_VALUES = 20_000_000
MAX_NESTING = 1000  # tuples in tuples: far beyond any checkpoint, far below the C stack's limit
_PYTHON_2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}


class Mark:
    """The MARK opcode's place on the stack."""


class Global:
    """An allowed global, as the pickle named it: called by REDUCE / NEWOBJ."""

    def __init__(self, name: str, build: Callable[..., Any]):
        self.name = name
        self.build = build

    def __repr__(self) -> str:
        return self.name


class OpaqueGlobal:
    """A class of plain settings outside the allowlist (``opaque``): never called; what
    REDUCE / NEWOBJ would have made of it is an :class:`Unreadable` leaf naming it."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name

    def unread(self, args: Any) -> Unreadable:
        # (a reconstructor's first argument is the class it would make: numpy.ndarray)
        made = args[0].name if isinstance(args, tuple) and args and isinstance(args[0], OpaqueGlobal) else self.name
        return Unreadable(made, "not built (treecli runs nothing from a file)")


class Record:
    """An object of an allowed class, as plain data: the arguments it was made with and
    the state ``BUILD`` gave it (a dataclass's fields, by name)."""

    def __init__(self, name: str, *args: Any):
        self.name = name
        self.args = args
        self.state: Any = None

    def field(self, name: str) -> Any:
        """A field of its state (``BUILD``'s dict, or the dict of a ``(dict, slots)`` pair)."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}
        if not isinstance(state, dict) or name not in state:
            raise KeyError(f"{self.name} has no field {name!r}")
        return state[name]


def record(name: str) -> Callable[..., Record]:
    """The constructor ``allowed`` names for a class whose objects are kept as records."""
    return lambda *args: Record(name, *args)


class Unpickler:
    """One pickle at ``start`` of ``data``; :meth:`load` returns the value and where it ended."""

    def __init__(self, data: bytes | memoryview, *, file: str, allowed: Mapping[str, Callable[..., Any]],
                 persistent: Callable[[Any], Any] | None = None, start: int = 0,
                 opaque: Callable[[str], bool] = lambda name: False):
        self.data = memoryview(data)
        self.at = start
        self.file = file
        self.allowed = allowed
        self.opaque = opaque
        self.persistent = persistent
        self.nesting: dict[int, int] = {}  # id of a tuple built here -> how deep it nests
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.values = 0

    # --- reading the opcode stream ---------------------------------------------------------------

    def _take(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.data):
            raise _Truncated()
        out = self.data[self.at:self.at + n]
        self.at += n
        return out

    def _int(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self._take(size))[0]

    def _line(self) -> str:
        end = bytes(self.data[self.at:self.at + 512]).find(b"\n")
        if end < 0:
            raise self._error("a GLOBAL name longer than 512 bytes, or not ended")
        text = bytes(self._take(end + 1))[:-1]
        try:
            return text.decode("ascii")
        except UnicodeDecodeError:
            raise self._error("a GLOBAL name that is not ASCII") from None

    def _error(self, what: str) -> FormatError:
        return FormatError(f"bad pickle at byte {self.at}: {what}", file=self.file)

    def _push(self, value: Any) -> None:
        self.values += 1
        if self.values > MAX_VALUES:
            raise FormatError(f"the pickle holds more than {MAX_VALUES:,} values; refusing it", file=self.file)
        self.stack.append(value)

    def _pop(self) -> Any:
        if not self.stack:
            raise self._error("the stack is empty")
        return self.stack.pop()

    def _pop_mark(self) -> list[Any]:
        if not self.marks:
            raise self._error("no MARK to pop to")
        items = self.stack
        self.stack = self.marks.pop()
        return items

    def _global(self, module: str, name: str) -> Any:
        """An allowed global: a :class:`Global` to call, or the plain value it stands for
        (a dtype, a storage type: whatever in ``allowed`` is not callable)."""
        module = _PYTHON_2_MODULES.get(module, module)  # (protocols 2 and under name Python 2's, as pickle maps them)
        full = f"{module}.{name}"
        build = self.allowed.get(full)
        if build is not None and not callable(build):
            return build
        if build is None and self.opaque(full):
            return OpaqueGlobal(full)
        if build is None:
            raise RefusedError(f"refused: the pickle names {full}, which is not among the plain-data constructors "
                               "a checkpoint needs (tensors, storages, dtypes, containers); treecli never calls it",
                               file=self.file)
        return Global(full, build)

    def _call(self, what: Any, args: Any) -> Any:
        if isinstance(what, OpaqueGlobal):
            return what.unread(args)
        if not isinstance(what, Global):
            raise self._error(f"REDUCE of {type(what).__name__}, not of an allowed global")
        if not isinstance(args, tuple):
            raise self._error(f"REDUCE of {what.name} with arguments that are not a tuple")
        try:
            return what.build(*args)
        except FormatError:
            raise
        except (TypeError, ValueError, KeyError, IndexError) as e:
            raise self._error(f"{what.name} with arguments it does not take: {e}") from None

    # --- the loop --------------------------------------------------------------------------------

    def load(self) -> tuple[Any, int]:
        """The pickled value and the offset just past its STOP.

        Raises:
            FormatError: truncated or malformed, an opcode outside the binary protocols,
                too many values.
            RefusedError: a global outside the allowlist.
        """
        try:
            return self._run(), self.at
        except _Truncated:
            raise FormatError(f"the pickle ends early (at byte {len(self.data)})", file=self.file) from None
        except RecursionError:
            raise self._error("nested too deeply") from None

    def _run(self) -> Any:  # noqa: C901 (one branch per opcode reads best as one loop)
        take, push, pop = self._take, self._push, self._pop
        while True:
            op = take(1)[0]
            if op == 0x80:  # PROTO
                if take(1)[0] > 5:
                    raise self._error("pickle protocol newer than 5")
            elif op == 0x95:  # FRAME: a length; the bytes follow in line
                take(8)
            elif op == 0x2E:  # STOP
                return pop()
            elif op == 0x28:  # MARK
                self.marks.append(self.stack)
                self.stack = []
            elif op == 0x7D:  # EMPTY_DICT
                push({})
            elif op == 0x5D:  # EMPTY_LIST
                push([])
            elif op == 0x29:  # EMPTY_TUPLE
                push(())
            elif op == 0x8F:  # EMPTY_SET
                push(set())
            elif op == 0x64:  # DICT
                items = self._pop_mark()
                push(dict(zip(items[::2], items[1::2])))
            elif op == 0x6C:  # LIST
                push(self._pop_mark())
            elif op == 0x74:  # TUPLE
                push(self._tuple(self._pop_mark()))
            elif op in (0x85, 0x86, 0x87):  # TUPLE1..3
                n = op - 0x84
                if len(self.stack) < n:
                    raise self._error("TUPLE of more items than the stack holds")
                items = self._tuple(self.stack[-n:])
                del self.stack[-n:]
                push(items)
            elif op == 0x73:  # SETITEM
                value, key = pop(), pop()
                self._setitems(pop(), [key, value])
            elif op == 0x75:  # SETITEMS
                items = self._pop_mark()
                self._setitems(pop(), items)
            elif op == 0x61:  # APPEND
                value = pop()
                self._extend(pop(), [value])
            elif op == 0x65:  # APPENDS
                items = self._pop_mark()
                self._extend(pop(), items)
            elif op == 0x90:  # ADDITEMS
                items = self._pop_mark()
                target = pop()
                if not isinstance(target, set):
                    raise self._error("ADDITEMS to something that is not a set")
                target.update(self._hashable(items))
                push(target)
            elif op == 0x91:  # FROZENSET
                push(self._tuple(self._hashable(self._pop_mark()), frozenset))
            elif op == 0x4A:  # BININT
                push(self._int("<i"))
            elif op == 0x4B:  # BININT1
                push(take(1)[0])
            elif op == 0x4D:  # BININT2
                push(self._int("<H"))
            elif op in (0x8A, 0x8B):  # LONG1, LONG4
                n = take(1)[0] if op == 0x8A else self._int("<i")
                if n > 64:  # no checkpoint needs an integer of more than 512 bits
                    raise self._error(f"an integer of {n} bytes")
                push(int.from_bytes(take(n), "little", signed=True))
            elif op == 0x47:  # BINFLOAT
                push(self._int(">d"))
            elif op == 0x4E:  # NONE
                push(None)
            elif op == 0x88:  # NEWTRUE
                push(True)
            elif op == 0x89:  # NEWFALSE
                push(False)
            elif op in (0x58, 0x8C, 0x8D):  # BINUNICODE, SHORT_BINUNICODE, BINUNICODE8
                n = self._int("<I") if op == 0x58 else take(1)[0] if op == 0x8C else self._int("<Q")
                try:
                    push(str(take(n), "utf-8", "surrogatepass"))
                except UnicodeDecodeError:
                    raise self._error("a string that is not UTF-8") from None
            elif op in (0x42, 0x43, 0x8E):  # BINBYTES, SHORT_BINBYTES, BINBYTES8
                n = self._int("<I") if op == 0x42 else take(1)[0] if op == 0x43 else self._int("<Q")
                push(bytes(take(n)))
            elif op in (0x54, 0x55):  # BINSTRING, SHORT_BINSTRING: Python 2's str
                n = self._int("<i") if op == 0x54 else take(1)[0]
                raw = bytes(take(n))
                try:  # as torch.load decodes it (its encoding="utf-8"); else the bytes, as encoding="bytes"
                    push(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    push(raw)
            elif op == 0x63:  # GLOBAL
                module = self._line()
                push(self._global(module, self._line()))
            elif op == 0x93:  # STACK_GLOBAL
                name, module = pop(), pop()
                if not isinstance(module, str) or not isinstance(name, str):
                    raise self._error("STACK_GLOBAL of names that are not strings")
                push(self._global(module, name))
            elif op == 0x52:  # REDUCE
                args = pop()
                push(self._call(pop(), args))
            elif op == 0x81:  # NEWOBJ
                args = pop()
                push(self._call(pop(), args))
            elif op == 0x62:  # BUILD: the state of what an allowed constructor made
                state = pop()
                if not self.stack:
                    raise self._error("BUILD without an object")
                if isinstance(self.stack[-1], Record):
                    self.stack[-1].state = state
                # (an Unreadable keeps none: its state is not read)
            elif op == 0x51:  # BINPERSID
                if self.persistent is None:
                    raise self._error("a persistent id, where none is expected")
                push(self.persistent(pop()))
            elif op in (0x71, 0x72):  # BINPUT, LONG_BINPUT
                index = take(1)[0] if op == 0x71 else self._int("<I")
                self._memoize(index)
            elif op == 0x94:  # MEMOIZE
                self._memoize(len(self.memo))
            elif op in (0x68, 0x6A):  # BINGET, LONG_BINGET
                index = take(1)[0] if op == 0x68 else self._int("<I")
                if index not in self.memo:
                    raise self._error(f"BINGET of memo entry {index}, never put")
                push(self.memo[index])
            elif op == 0x30:  # POP
                if self.stack:
                    pop()
                else:
                    self._pop_mark()
            elif op == 0x31:  # POP_MARK
                self._pop_mark()
            elif op == 0x32:  # DUP
                if not self.stack:
                    raise self._error("DUP of an empty stack")
                push(self.stack[-1])
            else:
                raise self._error(f"opcode 0x{op:02x}, which checkpoints do not use")

    def _memoize(self, index: int) -> None:
        if not self.stack:
            raise self._error("PUT of an empty stack")
        self.values += 1
        if self.values > MAX_VALUES:
            raise FormatError(f"the pickle holds more than {MAX_VALUES:,} values; refusing it", file=self.file)
        self.memo[index] = self.stack[-1]

    def _tuple(self, items: list[Any], kind: type = tuple) -> Any:
        """A tuple (or frozenset) of ``items``, refused nested deeper than :data:`MAX_NESTING`."""
        depth = 1 + max((self.nesting.get(id(item), 0) for item in items if isinstance(item, (tuple, frozenset))),
                        default=0)
        if depth > MAX_NESTING:
            raise self._error(f"tuples nested more than {MAX_NESTING} deep")
        made = kind(items)
        self.nesting[id(made)] = depth  # (set for every one made: an id reused after a POP is overwritten)
        return made

    def _setitems(self, target: Any, items: list[Any]) -> None:
        if isinstance(target, Unreadable):  # a dict-like object not built: its items are not read
            self.stack.append(target)
            return
        if not isinstance(target, dict) or len(items) % 2:
            raise self._error("SETITEMS on something that is not a dict")
        try:
            target.update(zip(self._hashable(items[::2]), items[1::2]))
        except TypeError:  # a tuple key holding a list
            raise self._error("a dict key that cannot be hashed") from None
        self.stack.append(target)

    def _extend(self, target: Any, items: list[Any]) -> None:
        if isinstance(target, Unreadable):
            self.stack.append(target)
            return
        if not isinstance(target, list):
            raise self._error("APPENDS to something that is not a list")
        target.extend(items)
        self.stack.append(target)

    def _hashable(self, items: list[Any]) -> list[Any]:
        for item in items:
            if not isinstance(item, (str, bytes, int, float, bool, type(None), tuple, frozenset, Record, Unreadable)):
                raise self._error(f"a {type(item).__name__} as a dict key or set item")
        return items


class _Truncated(Exception):
    """The pickle's bytes ran out (the caller may read more and try again)."""
