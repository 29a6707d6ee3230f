"""Run an ONNX model through morok_py and print its outputs and a per-kernel compile/run table.

    python examples/onnx/run.py MODEL.onnx [--device CPU|CUDA|CUDA:1|ROCM] [--compiler nvrtc|llvm-nvptx]
                                [--input NAME=file.npy ...] [--runs 3]

The executor is morok_py.onnx (the `onnx` extra); this script is `python -m morok_py.onnx.run`.
"""
from __future__ import annotations

import sys

from morok_py.onnx.run import main

if __name__ == "__main__":
    sys.exit(main())
