"""The llvmlite binding with every target and asm printer initialized once (CPU, NVPTX, AMDGPU)."""
from __future__ import annotations

import threading

from ..errors import DeviceUnavailableError

_lock = threading.Lock()
_ready = False


def llvm_binding(device: str = "CPU"):
    """`llvmlite.binding`, initialized; a missing llvmlite is DeviceUnavailableError for `device`."""
    global _ready
    try:
        import llvmlite.binding as binding
    except ImportError as e:
        raise DeviceUnavailableError(device, f"llvmlite is not importable ({e})", "pip install llvmlite") from None
    with _lock:
        if not _ready:
            binding.initialize_all_targets()
            binding.initialize_all_asmprinters()
            binding.initialize_native_target()
            binding.initialize_native_asmprinter()
            _ready = True
    return binding
