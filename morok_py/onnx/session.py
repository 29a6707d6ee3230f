"""An onnxruntime-style session over OnnxExecutor: `InferenceSession(model, providers=[...]).run(names, feeds)`.

Providers name devices the way onnxruntime does ("CUDAExecutionProvider", with a `device_id` option)
or the way morok_py does ("CUDA:1"); the first one whose device opens is used, as onnxruntime falls
back along its list.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import onnx

from morok_py.errors import DeviceUnavailableError
from morok_py.registry import get_device

from morok_py.onnx.errors import OnnxError
from morok_py.onnx.executor import OnnxExecutor, load_model

# onnxruntime's provider names -> morok_py device types
PROVIDERS = {"CPUExecutionProvider": "CPU", "CUDAExecutionProvider": "CUDA", "ROCMExecutionProvider": "ROCM",
             "TensorrtExecutionProvider": "CUDA", "MIGraphXExecutionProvider": "ROCM"}
DEVICE_PROVIDER = {"CPU": "CPUExecutionProvider", "CUDA": "CUDAExecutionProvider", "ROCM": "ROCMExecutionProvider"}


@dataclass(frozen=True)
class NodeArg:
    """A graph input or output as onnxruntime describes it: name, shape (ints, dim names or None), type."""
    name: str
    shape: list[int | str | None]
    type: str


def _type_name(elem_type: int) -> str:
    """onnxruntime's spelling: tensor(float), tensor(int64), tensor(float16), ..."""
    np_name = {1: "float", 10: "float16", 11: "double", 16: "bfloat16", 9: "bool"}.get(elem_type)
    if np_name is None:
        np_name = onnx.TensorProto.DataType.Name(elem_type).lower()
    return f"tensor({np_name})"


def node_arg(vi: onnx.ValueInfoProto) -> NodeArg:
    if not vi.type.HasField("tensor_type"):
        return NodeArg(vi.name, [], vi.type.WhichOneof("value") or "unknown")
    tt = vi.type.tensor_type
    shape: list[int | str | None] = []
    for d in tt.shape.dim:
        shape.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
    return NodeArg(vi.name, shape, _type_name(tt.elem_type))


def device_for(provider: str | tuple[str, Mapping[str, Any]], options: Mapping[str, Any] | None = None) -> str:
    """The morok_py device string a provider entry names ("CUDAExecutionProvider" + device_id 1 -> "CUDA:1")."""
    if isinstance(provider, tuple):
        provider, options = provider
    options = options or {}
    if provider in PROVIDERS:
        kind = PROVIDERS[provider]
        dev_id = options.get("device_id")
        return f"{kind}:{int(dev_id)}" if dev_id is not None and kind != "CPU" else kind
    if provider.endswith("ExecutionProvider"):
        raise OnnxError(f"provider {provider!r} has no morok_py device; known: {sorted(PROVIDERS)} "
                        f"or a morok_py device string (CPU, CUDA:1, ROCM)")
    return provider


class InferenceSession:
    """Loads a model (path, bytes or ModelProto) onto the first provider's device that opens.

    `compiler` picks the device's compiler pair (e.g. "llvm-nvptx"); `symbolic_outer` (default: whether
    an input has a dynamic dimension) gives each kernel's outermost range a launch-time extent."""

    def __init__(self, path_or_bytes: str | os.PathLike | bytes | onnx.ModelProto, sess_options: Any = None,
                 providers: Sequence[str | tuple[str, Mapping[str, Any]]] | None = None,
                 provider_options: Sequence[Mapping[str, Any]] | None = None, *, compiler: str | None = None,
                 symbolic_outer: bool | None = None, **kwargs: Any) -> None:
        self._model = load_model(path_or_bytes)
        entries = list(providers) if providers else [None]
        opts = list(provider_options) if provider_options else [None] * len(entries)
        errors: list[str] = []
        dev = None
        for entry, opt in zip(entries, opts):
            name = None if entry is None else device_for(entry, opt)
            try:
                dev = get_device(name)
                break
            except DeviceUnavailableError as e:
                errors.append(str(e))
        if dev is None:
            raise DeviceUnavailableError(", ".join(str(p) for p in entries), "; ".join(errors))
        self._ex = OnnxExecutor(self._model, dev, compiler=compiler, symbolic_outer=symbolic_outer)
        inits = {i.name for i in self._model.graph.initializer}
        self._inputs = [node_arg(vi) for vi in self._model.graph.input if vi.name not in inits]
        self._outputs = [node_arg(vi) for vi in self._model.graph.output]

    @property
    def device(self) -> str:
        """The morok_py device the session runs on."""
        return self._ex.dev.name

    @property
    def executor(self) -> OnnxExecutor:
        return self._ex

    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        return list(self._outputs)

    def get_providers(self) -> list[str]:
        base = self._ex.dev.device.type.upper()
        return [DEVICE_PROVIDER.get(base, base)]

    def get_modelmeta(self) -> onnx.ModelProto:
        return self._model

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: Any = None) -> list[np.ndarray]:
        """The outputs named (all of them for None or []) for the feeds, as numpy arrays."""
        known = {a.name for a in self._inputs}
        unknown = sorted(set(input_feed) - known)
        if unknown:
            raise OnnxError(f"feeds {unknown} are not inputs of the model; its inputs: {sorted(known)}")
        outs = self._ex.run(dict(input_feed))
        if not output_names:
            return outs
        index = {a.name: i for i, a in enumerate(self._outputs)}
        missing = [n for n in output_names if n not in index]
        if missing:
            raise OnnxError(f"outputs {missing} are not outputs of the model; its outputs: {list(index)}")
        return [outs[index[n]] for n in output_names]
