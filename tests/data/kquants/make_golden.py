"""Golden K-quant blocks from llama.cpp's own reference quantizer, for
tests/test_kquants.py (so that CI compiles nothing). Run by hand when a type is added:

    pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d /tmp/src
    tar xzf /tmp/src/llama_cpp_python-0.3.36.tar.gz -C /tmp/src
    python tests/data/kquants/make_golden.py /tmp/src/llama_cpp_python-0.3.36/vendor/llama.cpp

It compiles ggml-quants.c (with -ffp-contract=off: no fused multiply-adds, every float
operation rounded as written) into a shared library, calls quantize_row_<type>_ref (for
IQ4_NL, quantize_iq4_nl: what llama-quantize runs, unlike its _ref) on rows of several
distributions through ctypes, and writes golden.npz beside this file:
each type's input rows (float32) and the blocks the reference made (uint8).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np

STUBS = """
#include <stddef.h>
#include <stdlib.h>
void ggml_abort(const char * file, int line, const char * fmt, ...) { abort(); }
size_t ggml_row_size(int type, long ne) { abort(); }
const char * ggml_type_name(int type) { return "?"; }
size_t ggml_type_size(int type) { abort(); }
"""
# the reference's function, bytes per 256 values (IQ4_NL: 8 blocks of 32)
TYPES = {"q6_k": ("quantize_row_q6_K_ref", 210), "q5_k": ("quantize_row_q5_K_ref", 176),
         "q4_k": ("quantize_row_q4_K_ref", 144), "q3_k": ("quantize_row_q3_K_ref", 110),
         "q2_k": ("quantize_row_q2_K_ref", 84), "iq4_nl": ("quantize_iq4_nl", 144),
         "iq4_xs": ("quantize_row_iq4_xs_ref", 136)}


def inputs() -> np.ndarray:
    """Rows of 1,024 values: normal at four scales, heavy tails, bf16-rounded, integers (ties
    everywhere), zero groups and a zero block, outliers."""
    rng = np.random.default_rng(42)
    rows = [rng.standard_normal(1024) * scale for scale in (1e-4, 0.02, 1.0, 300.0)]
    rows.append(rng.standard_t(2, 1024) * 10)
    rows.append((rng.standard_normal(1024) * 0.05).astype(ml_dtypes.bfloat16).astype(np.float64))
    rows.append(rng.integers(-3, 4, 1024).astype(np.float64))
    sparse = rng.standard_normal(1024)
    sparse[16:32] = 0
    sparse[256:512] = 0
    sparse[rng.integers(0, 1024, 8)] *= 100
    rows.append(sparse)
    return np.asarray(rows, np.float32)


def main(sources: Path) -> None:
    with tempfile.TemporaryDirectory() as work:
        (Path(work) / "stubs.c").write_text(STUBS)
        library = Path(work) / "libquants.so"
        subprocess.run(["gcc", "-O2", "-ffp-contract=off", "-fPIC", "-shared", "-I", sources / "ggml/include",
                        "-I", sources / "ggml/src", sources / "ggml/src/ggml-quants.c", Path(work) / "stubs.c",
                        "-lm", "-o", library], check=True)
        lib = ctypes.CDLL(str(library))
        x = inputs()
        out = {}
        for kind, (function, size) in TYPES.items():
            blocks = np.zeros((x.shape[0], x.shape[1] // 256 * size), np.uint8)
            for row, values in enumerate(x):
                source, target = values.ctypes.data_as(ctypes.c_void_p), blocks[row].ctypes.data_as(ctypes.c_void_p)
                if function.endswith("_ref"):
                    getattr(lib, function)(source, target, ctypes.c_int64(values.size))
                else:  # (llama-quantize's own: one row, no importance matrix)
                    getattr(lib, function)(source, target, ctypes.c_int64(1), ctypes.c_int64(values.size), None)
            out[kind] = blocks
    np.savez(Path(__file__).parent / "golden.npz", inputs=x, **out)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
