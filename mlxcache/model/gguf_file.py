"""Open a GGUF file with llama.cpp's own reader (`gguf.GGUFReader`), checked as it is read.

A damaged file must give one error line, never a crash or a hang. The reader parses the
header through numpy views of a memory map; on a damaged file it would read views cut short
by the end of the file (an IndexError somewhere), or loop over an array length of 2**60 read
from garbage. `_CheckedReader` bounds every read by the file's size, every count and array
length by the bytes left, and checks the tensor table (type, shape, offset, size, overlap)
before the reader makes any tensor view. The hooks are the reader's own internal helpers,
hence the narrow version range of `gguf` in pyproject.toml.
"""

from __future__ import annotations

import math
import os
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

from mlxcache.errors import ModelNotFoundError, UnsupportedModelError

_MAGIC = b"GGUF"
_MAX_DIMS = 4  # GGML_MAX_DIMS
# Fewest bytes one metadata entry / tensor table entry / array item can take: bounds for
# counts read from the file, so garbage cannot make the reader loop for hours.
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
_MIN_ITEM_BYTES = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 4 + 8}
_VALUE_TYPES = frozenset(int(t) for t in GGUFValueType)
_V = TypeVar("_V", int, float, str, bool, list)


class _DamagedError(Exception):
    """What is wrong with the file, as the error line says it."""


class _CheckedReader(GGUFReader):
    """`GGUFReader` that refuses, with a message, what would make it crash or hang."""

    _plain: npt.NDArray[np.uint8] | None = None

    def _size(self) -> int:
        return int(self.data.size)

    def _get(
        self, offset: int, dtype: npt.DTypeLike, count: int = 1, override_order: Any = None
    ) -> npt.NDArray[Any]:
        count = int(count)
        end = int(offset) + np.dtype(dtype).itemsize * count
        if count < 0 or end > self._size():
            raise _DamagedError(
                f"truncated or damaged header: it runs past the end of the file "
                f"({self._size()} bytes)"
            )
        # Plain ndarray views of the map: slicing the np.memmap itself costs ~3x the time
        # on a 50k-token vocabulary (each slice is a new memmap object).
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)
        arr = self._plain[int(offset) : end].view(dtype=dtype)
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _build_fields(self, offs: int, count: int) -> int:
        self._check_count(offs, int(count), _MIN_KV_BYTES, "metadata entries")
        return int(super()._build_fields(offs, count))

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[ReaderField]]:
        self._check_count(offs, int(count), _MIN_TENSOR_INFO_BYTES, "tensors")
        return super()._build_tensor_info(offs, count)

    def _check_count(self, offs: int, count: int, least: int, what: str) -> None:
        if count * least > self._size() - offs:
            raise _DamagedError(
                f"truncated or damaged header: it announces {count} {what}, more than a "
                f"file of {self._size()} bytes can hold"
            )

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[GGUFValueType]]:
        if int(raw_type) == GGUFValueType.ARRAY:  # called once per array item: kept cheap
            item = _value_type(self._get(orig_offs, np.uint32)[0], orig_offs)
            length = int(self._get(orig_offs + 4, np.uint64)[0])
            least = _MIN_ITEM_BYTES.get(item) or np.dtype(self.gguf_scalar_to_np[item]).itemsize
            if length * least > self._size() - orig_offs - 12:
                raise _DamagedError(
                    f"truncated or damaged header: an array of {length} items at byte "
                    f"{orig_offs} runs past the end of the file ({self._size()} bytes)"
                )
        elif int(raw_type) not in _VALUE_TYPES:
            _value_type(raw_type, orig_offs)
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        spans = sorted(self._span(start_offs, field) for field in fields)
        for (_, end, name), (start, _, other) in pairwise(spans):
            if start < end:
                raise _DamagedError(f"damaged tensor table: tensors {name} and {other} overlap")
        super()._build_tensors(start_offs, fields)

    def _span(self, start_offs: int, field: ReaderField) -> tuple[int, int, str]:
        """(first byte, end, name) of one tensor's data, checked against the file."""
        _, name_data, n_dims, dims, raw_type, offset = field.parts
        name = bytes(name_data).decode("utf-8", errors="replace")
        try:
            kind = GGMLQuantizationType(int(raw_type[0]))
            block, type_size = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise _DamagedError(f"tensor {name} has an unknown type ({int(raw_type[0])})") from None
        shape = [int(d) for d in dims]
        if not 1 <= int(n_dims[0]) <= _MAX_DIMS or shape[0] % block:
            raise _DamagedError(f"tensor {name} has an invalid shape {shape} for {kind.name}")
        start = start_offs + int(offset[0])
        end = start + math.prod(shape) // block * type_size
        if int(offset[0]) % self.alignment:
            raise _DamagedError(f"tensor {name} is not aligned (offset {int(offset[0])})")
        if end > self._size():
            raise _DamagedError(
                f"truncated: tensor {name} ({kind.name}, bytes {start}..{end}) ends past the "
                f"end of the file ({self._size()} bytes)"
            )
        return start, end, name


def _value_type(raw: Any, offset: int) -> GGUFValueType:
    try:
        return GGUFValueType(int(raw))
    except ValueError:
        raise _DamagedError(
            f"damaged header: unknown metadata value type {int(raw)} at byte {offset}"
        ) from None


def _version(raw: bytes) -> int | None:
    """The header's version, in whichever byte order makes it small (as the reader does)."""
    if len(raw) < 4:
        return None
    version = int.from_bytes(raw, "little")
    return version if version & 0xFFFF else int.from_bytes(raw, "big")


def open_gguf(path: Path) -> tuple[GGUFReader, dict[str, Any]]:
    """The file's reader (tensor views not yet read) and its metadata as plain Python values.

    Raises:
        ModelNotFoundError: the file does not exist or cannot be read.
        UnsupportedModelError: the file is not a GGUF file, or it is truncated or damaged
            (the message names the problem).
    """
    if not path.is_file():
        raise ModelNotFoundError(f"model file not found: {path}")
    if not os.access(path, os.R_OK):
        raise ModelNotFoundError(f"model file is not readable: {path}")
    with path.open("rb") as f:
        head = f.read(8)
    version = _version(head[4:])
    if not head:
        problem = "the file is empty"
    elif head[:4] != _MAGIC:
        problem = "not a GGUF file (it does not start with 'GGUF')"
    elif version is None:
        problem = "truncated: the file ends inside the header"
    elif version not in READER_SUPPORTED_VERSIONS:
        known = ", ".join(map(str, READER_SUPPORTED_VERSIONS))
        problem = f"unsupported or damaged header: GGUF version {version} (known: {known})"
    else:
        try:
            reader = _CheckedReader(path)
            meta = {
                key: field.contents()
                for key, field in reader.fields.items()
                if not key.startswith("GGUF.")
            }
            return reader, meta
        except _DamagedError as exc:
            problem = str(exc)
        # The reader parses untrusted bytes: whatever else it raises (a bad version, a
        # duplicate key, a name that is not UTF-8, ...) means the same, a damaged file.
        except Exception as exc:
            problem = f"damaged header: {exc}"
    raise UnsupportedModelError(f"cannot read GGUF {path}: {problem}")


def meta_value(meta: dict[str, Any], key: str, kind: type[_V], default: _V | None = None) -> _V:
    """`meta[key]` as `kind` (an int is a float too), or `default` when absent.

    Raises:
        UnsupportedModelError: the key is absent without a default, or holds another type.
    """
    value = meta.get(key, default)
    if value is None:
        raise UnsupportedModelError(f"GGUF metadata lacks {key}")
    if kind is float and type(value) is int:
        value = float(value)
    # bool is an int subclass: a flag is no count, and a count no flag.
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise UnsupportedModelError(
            f"GGUF metadata {key} should be {kind.__name__}, not {type(value).__name__}"
        )
    return cast(_V, value)
