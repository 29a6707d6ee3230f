"""morok_py as an ONNX backend (`onnx.backend.base.Backend`), so ONNX's own test runner can drive it:

    from onnx.backend.test import BackendTest
    from morok_py.onnx.backend import MorokBackend
    globals().update(BackendTest(MorokBackend, __name__).include("test_relu").test_cases)

The runner's device names ("CPU", "CUDA", "CUDA:1") are morok_py device strings.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
from onnx import helper
from onnx.backend.base import Backend, BackendRep, namedtupledict

from morok_py.errors import MorokError
from morok_py.registry import get_device

from morok_py.onnx.errors import OnnxError, UnsupportedDtype
from morok_py.onnx.executor import OnnxExecutor, load_model, supported


class MorokRep(BackendRep):
    """A model prepared on one device; `run(inputs)` takes a list (graph input order) or a dict."""

    def __init__(self, ex: OnnxExecutor, output_names: Sequence[str]) -> None:
        self.ex = ex
        self.output_names = list(output_names)

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        if isinstance(inputs, np.ndarray):
            inputs = [inputs]
        outs = self.ex.run(inputs)
        return namedtupledict("Outputs", self.output_names)(*outs)


class MorokBackend(Backend):
    """ONNX's backend interface over OnnxExecutor."""

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
        return all(n.domain in ("", "ai.onnx") and supported(n.op_type, opset) for n in model.graph.node)

    @classmethod
    def prepare(cls, model: Any, device: str = "CPU", **kwargs: Any) -> MorokRep:
        model = load_model(model)
        ex = OnnxExecutor(model, get_device(device), compiler=kwargs.get("compiler"))
        return MorokRep(ex, [o.name for o in model.graph.output])

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[Any, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Sequence[tuple[np.dtype, tuple[int, ...]]] | None = None,
                 **kwargs: Any) -> tuple[Any, ...]:
        """One node on numpy inputs (positional, in the node's input order; "" inputs are absent)."""
        arrays = [np.asarray(x) for x in (inputs.values() if isinstance(inputs, dict) else inputs)]
        names = [n for n in node.input if n]
        if len(names) != len(arrays):
            raise OnnxError(f"{node.op_type} has {len(names)} inputs, {len(arrays)} were given")
        vis = []
        for name, arr in zip(names, arrays):
            try:
                et = helper.np_dtype_to_tensor_dtype(arr.dtype)
            except KeyError:
                raise UnsupportedDtype(f"input {name} holds {arr.dtype}") from None
            vis.append(helper.make_tensor_value_info(name, et, arr.shape))
        outs = [helper.make_empty_tensor_value_info(o) for o in node.output if o]
        graph = helper.make_graph([node], f"{node.op_type}_node", vis, outs)
        opset = kwargs.get("opset_version") or onnx.defs.onnx_opset_version()
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid(node.domain or "", opset)])
        ex = OnnxExecutor(model, get_device(device))
        return namedtupledict("Outputs", [o for o in node.output if o])(*ex.run(dict(zip(names, arrays))))

    @classmethod
    def supports_device(cls, device: str) -> bool:
        """True where the device opens here (CPU always; CUDA or ROCm with a GPU and its driver)."""
        if device not in _OPENS:
            try:
                get_device(device)
                _OPENS[device] = True
            except MorokError:
                _OPENS[device] = False
        return _OPENS[device]


_OPENS: dict[str, bool] = {}     # supports_device's answers: the runner asks once per test and device


prepare = MorokBackend.prepare
run_model = MorokBackend.run_model
run_node = MorokBackend.run_node
supports_device = MorokBackend.supports_device
