"""GGUF tensors as MLX arrays, with exactly the values llama.cpp's own dequantizer gives.

Types whose blocks are affine over groups of 32 values (value = scale * q + bias) are
repacked, not requantized, into MLX's affine quantization (group size 32, float32 scales and
biases):

- Q4_0 `d*(q-8)`, Q4_1 `d*q+m`, Q8_0 `d*q` (q stored unsigned: `d*(q+128) - 128d`);
- Q5_0 `d*(q-16)`, Q5_1 `d*q+m` (bits=5);
- Q4_K and Q5_K: each 32-value sub-block of a 256-value super-block has scale `d*sc` and
  bias `-dmin*m` (bits=4 and 5).

Every product and sum above is exact in float32 (a float16 factor times an integer of at
most 6+5 bits), so MLX's `scale*q + bias` rounds the same true value the reference
`gguf.quants.dequantize` rounds: the weights are bit for bit the reference's (tests check
each type). Float32 scales, not float16: MLX's CPU quantized matmul is ~40x slower with
float16 scales. Every other type the `gguf` library can dequantize (F16, BF16, Q2_K, Q3_K,
Q6_K with its groups of 16 that MLX cannot express, the IQ and TQ types, ...) becomes dense
float32: exact, at 4 bytes a weight. Nothing is requantized.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
import numpy.typing as npt
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor, quants

from mlxcache.errors import UnsupportedModelError

GROUP_SIZE = 32
_ROWS_PER_CHUNK_ELEMENTS = 1 << 22  # bounds the temporaries of one repack step

Blocks = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]
Affine = tuple[npt.NDArray[np.uint8], F32, F32]
"""Per block: q (one unsigned value per weight), scales and biases (one per 32 weights)."""


def _f16(raw: Blocks) -> F32:
    """(n, 2) bytes holding a float16 -> (n, 1) float32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: Blocks, runs: int) -> Blocks:
    """Low nibbles of each run of bytes, then its high nibbles (llama.cpp's layout)."""
    n = qs.shape[0]
    qs = qs.reshape(n, runs, 1, -1)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, -1)


def _high_bits(qh: Blocks, count: int) -> Blocks:
    """Bit i of the little-endian uint32 `qh`, for i < count, as the fifth bit of value i."""
    word = np.ascontiguousarray(qh).view(np.uint32)
    return (((word >> np.arange(count, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _q4_0(b: Blocks) -> Affine:
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:18], 1), d, -8 * d


def _q4_1(b: Blocks) -> Affine:
    return _nibbles(b[:, 4:20], 1), _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q5_0(b: Blocks) -> Affine:
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 6:22], 1) | _high_bits(b[:, 2:6], 32), d, -16 * d


def _q5_1(b: Blocks) -> Affine:
    q = _nibbles(b[:, 8:24], 1) | _high_bits(b[:, 4:8], 32)
    return q, _f16(b[:, 0:2]), _f16(b[:, 2:4])


def _q8_0(b: Blocks) -> Affine:
    d = _f16(b[:, 0:2])
    q = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128 * d


def _k_scales(b: Blocks) -> tuple[F32, F32]:
    """Scales `d*sc` and biases `-dmin*m` of a K-quant's eight 32-value sub-blocks."""
    sc, m = quants.Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return _f16(b[:, 0:2]) * sc.astype(np.float32), -(_f16(b[:, 2:4]) * m.astype(np.float32))


def _q4_k(b: Blocks) -> Affine:
    return _nibbles(b[:, 16:144], 4), *_k_scales(b)


def _q5_k(b: Blocks) -> Affine:
    # qh bit i of byte l is the fifth bit of value l of sub-block i.
    n = b.shape[0]
    high = (b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return _nibbles(b[:, 48:176], 4) | (high << 4).astype(np.uint8).reshape(n, 256), *_k_scales(b)


_T = GGMLQuantizationType
AFFINE: dict[GGMLQuantizationType, tuple[int, Callable[[Blocks], Affine]]] = {
    _T.Q4_0: (4, _q4_0),
    _T.Q4_1: (4, _q4_1),
    _T.Q5_0: (5, _q5_0),
    _T.Q5_1: (5, _q5_1),
    _T.Q8_0: (8, _q8_0),
    _T.Q4_K: (4, _q4_k),
    _T.Q5_K: (5, _q5_k),
}
"""Types repacked into MLX affine quantization: bits, and the block unpacker."""


def pack(q: npt.NDArray[np.uint8], bits: int) -> npt.NDArray[np.uint32]:
    """MLX's packing of `bits`-bit values: a little-endian bit stream in uint32 words.

    `q` is (rows, cols) with cols a multiple of 32; each 32 values fill `bits` words.
    """
    if 32 % bits == 0:  # whole values per word: one shift and sum per word
        per_word = 32 // bits
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        words = q.reshape(-1, per_word).astype(np.uint32) << shifts
        return words.sum(axis=-1, dtype=np.uint32).reshape(q.shape[0], -1)
    groups = q.reshape(-1, GROUP_SIZE).astype(np.uint32)
    out = np.zeros((groups.shape[0], bits), dtype=np.uint32)
    for j in range(GROUP_SIZE):
        word, shift = divmod(j * bits, 32)
        out[:, word] |= groups[:, j] << np.uint32(shift)
        if shift + bits > 32:  # the value straddles two words
            out[:, word + 1] |= groups[:, j] >> np.uint32(32 - shift)
    return out.reshape(q.shape[0], -1)


def _repack(t: ReaderTensor, rows: int, cols: int) -> dict[str, mx.array]:
    bits, unpack = AFFINE[t.tensor_type]
    data = t.data.reshape(rows, -1)
    weight = np.empty((rows, cols * bits // 32), dtype=np.uint32)
    scales = np.empty((rows, cols // GROUP_SIZE), dtype=np.float32)
    biases = np.empty_like(scales)
    step = max(1, _ROWS_PER_CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        chunk = data[start : start + step]
        n = chunk.shape[0]
        q, s, b = unpack(chunk.reshape(-1, GGML_QUANT_SIZES[t.tensor_type][1]))
        weight[start : start + n] = pack(q.reshape(n, cols), bits)
        scales[start : start + n] = s.reshape(n, -1)
        biases[start : start + n] = b.reshape(n, -1)
    return {"weight": mx.array(weight), "scales": mx.array(scales), "biases": mx.array(biases)}


def to_mlx(t: ReaderTensor) -> mx.array | dict[str, mx.array]:
    """One GGUF tensor as MLX arrays: dense float32, or for a matrix of a type in `AFFINE`
    the affine triple {"weight", "scales", "biases"} (group size 32).

    Raises:
        UnsupportedModelError: a type the `gguf` library cannot dequantize.
    """
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
    kind = t.tensor_type
    if kind in AFFINE and len(shape) == 2:
        return _repack(t, *shape)
    try:
        dense = quants.dequantize(t.data, kind)
    except NotImplementedError:
        raise UnsupportedModelError(
            f"tensor {t.name} has type {kind.name}, which mlxcache cannot read "
            f"(the gguf library cannot dequantize it)"
        ) from None
    # Never a float16 or other lossy stand-in from a quantized type: float32 holds every
    # dequantized value exactly.
    if dense.dtype != np.float32:
        raise UnsupportedModelError(f"tensor {t.name}: {kind.name} did not dequantize to float32")
    return mx.array(dense.reshape(shape))
