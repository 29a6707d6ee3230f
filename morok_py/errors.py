"""The error hierarchy: every failure the library raises on purpose is a MorokError."""
from __future__ import annotations


class MorokError(Exception):
    """Base of every error morok_py raises on purpose."""


def number_lines(src: str) -> str:
    lines = src.splitlines()
    width = len(str(len(lines)))
    return "\n".join(f"{i + 1:>{width}} | {line}" for i, line in enumerate(lines))


class CompileError(MorokError):
    """A compiler rejected a kernel: carries its log, the numbered source and an equivalent command."""

    def __init__(self, message: str, *, log: str = "", src: str = "", command: str = "",
                 kernel: str = "") -> None:
        self.log, self.src, self.command, self.kernel = log, src, command, kernel
        parts = [message]
        if log:
            parts.append("compiler log:\n" + log.rstrip())
        if command:
            parts.append("equivalent command: " + command)
        if src:
            parts.append("source:\n" + number_lines(src))
        super().__init__("\n".join(parts))


class DeviceUnavailableError(MorokError):
    """A device (or one of its compiler pairs) can't be used here: says why and what to install."""

    def __init__(self, device: str, reason: str, install: str = "") -> None:
        self.device, self.reason, self.install = device, reason, install
        msg = f"{device} is unavailable: {reason}"
        if install:
            msg += f" (install: {install})"
        super().__init__(msg)


class RuntimeStackConflictError(MorokError):
    """A second GPU vendor stack was opened in a process that already runs another."""


class LaunchError(MorokError, ValueError):
    """A launch was refused before reaching the device: wrong buffers, variables or index bounds."""


class BufferFreedError(LaunchError):
    """A freed Buffer was used: launched, copied, read or exported (a LaunchError, so also a ValueError)."""


class UnknownNameError(MorokError, ValueError, KeyError):
    """A name that matches nothing registered: a device, backend, compiler, dtype, kernel, op or arch
    (a ValueError, and a KeyError for the lookups that raised one before)."""

    __str__ = Exception.__str__     # KeyError's would quote the message


class ConfigError(MorokError, ValueError):
    """A MOROK_* environment setting holds a value it cannot take."""


class ArgumentError(MorokError, ValueError):
    """An argument's value is outside what the call takes: a size, a shape, a schedule field."""


class ArgumentTypeError(MorokError, TypeError):
    """An argument of the wrong type or dtype: a str where a UOp goes, a float16 array into an int32 buffer."""


class DeviceError(MorokError):
    """A driver call failed: names the call and the driver's error code and name."""

    def __init__(self, call: str, code: int, name: str, detail: str = "") -> None:
        self.call, self.code, self.name = call, code, name
        msg = f"{call} failed with {name} ({code})"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


class ContextLostError(DeviceError):
    """A sticky device error (an illegal address, a kernel that trapped): the driver refuses every later
    call in this context, so the process must exit and a new one recreate it."""

    def __init__(self, call: str, code: int, name: str, detail: str = "") -> None:
        lost = ("the GPU context is lost: a kernel faulted and the driver now fails every call in this "
                "process; exit the process and start a new one to recreate the context")
        super().__init__(call, code, name, f"{detail}; {lost}" if detail else lost)


class OutOfMemoryError(MorokError, MemoryError):
    """An allocation failed even after the allocator freed its cache and retried."""

    def __init__(self, device: str, nbytes: int, in_use: int, detail: str = "") -> None:
        self.device, self.nbytes, self.in_use = device, nbytes, in_use
        msg = (f"{device}: out of memory allocating {nbytes} bytes "
               f"({in_use} bytes in use by morok_py buffers, cache already freed and retried)")
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


class ValidationError(MorokError):
    """MOROK_VALIDATE_WITH_CPU found a kernel whose output differs from the CPU's."""
