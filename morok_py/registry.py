"""The device registry: built-in backends, `register_backend`, and the `morok_py.backends`
entry-point group. One module, one lock."""
from __future__ import annotations

import importlib
import threading
from typing import Callable

from .device import Device, DeviceSpec
from .errors import ArgumentError, ArgumentTypeError, ConfigError, DeviceUnavailableError, UnknownNameError

BackendFactory = Callable[[DeviceSpec], Device]

# built-ins load lazily: a missing GPU stack must not break `import morok_py`
_BUILTIN = {
    "CPU": ("morok_py.backends.cpu", "", "pip install llvmlite"),
    "CUDA": ("morok_py.backends.cuda", "cuda", "pip install morok-py[cuda]"),
    "ROCM": ("morok_py.backends.rocm", "rocm", "pip install morok-py[rocm]"),
}

_lock = threading.RLock()
_factories: dict[str, BackendFactory] = {}
_devices: dict[str, Device] = {}
_entry_points_loaded = False


def register_backend(name: str, factory: BackendFactory) -> None:
    """Register (or replace) a backend: `factory(DeviceSpec) -> Device`."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ArgumentError(f"backend name must be an identifier, got {name!r}")
    if not callable(factory):
        raise ArgumentTypeError("factory must be callable: DeviceSpec -> Device")
    with _lock:
        key = name.upper()
        _factories[key] = factory
        for dev in [d for d in _devices if DeviceSpec.parse(d).type == key]:
            del _devices[dev]


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points
    for ep in entry_points(group="morok_py.backends"):
        try:
            factory = ep.load()
        except Exception as e:  # a broken plugin must not hide the others
            import warnings
            warnings.warn(f"morok_py backend entry point {ep.name!r} failed to load: {e}")
            continue
        _factories.setdefault(ep.name.upper(), factory)


def registered() -> list[str]:
    with _lock:
        _load_entry_points()
        return sorted(set(_BUILTIN) | set(_factories))


def _factory(kind: str) -> BackendFactory:
    with _lock:
        _load_entry_points()
        if kind in _factories:
            return _factories[kind]
        if kind not in _BUILTIN:
            raise UnknownNameError(f"unknown device {kind!r}; registered: {', '.join(registered())}")
        module, extra, install = _BUILTIN[kind]
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            raise DeviceUnavailableError(kind, f"backend could not be imported ({e})", install) from None
        factory = getattr(mod, "create_device", None)
        if factory is None:   # e.g. an empty backends/<name>/ folder imported as a namespace package
            raise DeviceUnavailableError(kind, f"{module} has no create_device(); the backend is not built here")
        _factories[kind] = factory
        return factory


def get_device(name: "str | DeviceSpec | None" = None) -> Device:
    """Open (once) and return the device named `name`; None means Device.DEFAULT."""
    if name.__class__ is str:       # an opened device by its canonical key ("CUDA:0"): no parse
        dev = _devices.get(name)
        if dev is not None:
            return dev
    spec = DeviceSpec.parse(name if name is not None else Device.DEFAULT)
    key = f"{spec.type}:{spec.ordinal}"   # not str(spec): that prints CPU:1 as CPU, which skipped the check
    with _lock:
        dev = _devices.get(key)
        if dev is not None:
            return dev
        try:
            factory = _factory(spec.type)
        except UnknownNameError as e:
            if name is None:
                raise ConfigError(f"MOROK_DEVICE={Device.DEFAULT!r}: {e}") from None
            raise
        dev = factory(spec)
        _devices[key] = dev
        return dev


def opened() -> list[Device]:
    with _lock:
        return list(_devices.values())


# ---- one GPU vendor stack per process ----------------------------------------------------------

_stack: str | None = None


def claim_gpu_stack(name: str) -> None:
    """Called by a GPU backend before it opens its driver; refuses a second vendor stack."""
    global _stack
    from .errors import RuntimeStackConflictError
    with _lock:
        if _stack is None:
            _stack = name
        elif _stack != name:
            raise RuntimeStackConflictError(
                f"cannot open {name}: this process already runs the {_stack} stack; one GPU vendor stack per "
                f"process (the CPU device works beside either)")


def active_gpu_stack() -> str | None:
    return _stack
