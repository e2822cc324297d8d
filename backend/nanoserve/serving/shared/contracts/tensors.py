"""A Triton tensor as a contract names it (`TensorSpec`), and the conversions between its values and numpy arrays,
tritonclient gRPC inputs and the JSON of HTTP /generate."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# a config's data_type -> (the wire's datatype, numpy's dtype)
DATA_TYPES = {
    "TYPE_STRING": ("BYTES", np.object_),
    "TYPE_BOOL": ("BOOL", np.bool_),
    "TYPE_INT32": ("INT32", np.int32),
    "TYPE_UINT32": ("UINT32", np.uint32),
    "TYPE_UINT64": ("UINT64", np.uint64),
    "TYPE_FP32": ("FP32", np.float32),
}


@dataclass(frozen=True)
class TensorSpec:
    """One input or output tensor of a model config (dims -1: any length)."""
    name: str
    data_type: str  # a config's data_type: "TYPE_STRING", "TYPE_INT32", ...
    dims: tuple[int, ...]
    optional: bool = False  # inputs only: the client may leave it out

    def config(self, is_input: bool = True) -> dict:
        """As Triton's auto-complete takes it (model.py's auto_complete_config)."""
        entry = {"name": self.name, "data_type": self.data_type, "dims": list(self.dims)}
        return {**entry, "optional": self.optional} if is_input else entry

    def array(self, values) -> np.ndarray:
        """Values (one, or a list for dims -1) as this tensor's numpy array; strings are sent as UTF-8."""
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        if self.data_type == "TYPE_STRING":
            values = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
        return np.array(values, dtype=DATA_TYPES[self.data_type][1])


def specs(*tensors: TensorSpec) -> dict[str, TensorSpec]:
    return {tensor.name: tensor for tensor in tensors}


def grpc_inputs(arrays: dict[str, np.ndarray], declared: dict[str, TensorSpec]) -> list:
    """tritonclient.grpc InferInputs (usable with .grpc.aio too) for arrays of the declared tensors."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, array in arrays.items():
        infer_input = grpcclient.InferInput(name, list(array.shape), DATA_TYPES[declared[name].data_type][0])
        infer_input.set_data_from_numpy(array)
        inputs.append(infer_input)
    return inputs


def json_values(arrays: dict[str, np.ndarray], declared: dict[str, TensorSpec]) -> dict:
    """Arrays as HTTP /generate's JSON takes inputs: a tensor of dims [1] as its value, others as lists."""
    body = {}
    for name, array in arrays.items():
        values = [v.decode("utf-8") if isinstance(v, bytes) else v for v in array.reshape(-1).tolist()]
        body[name] = values[0] if declared[name].dims == (1,) else values
    return body


def values_of(value) -> list | None:
    """An output as a flat list (None: not in the response), from tritonclient's numpy array or /generate's JSON
    (a value, or a list); strings decoded from UTF-8."""
    if value is None:
        return None
    if hasattr(value, "tolist"):
        value = value.reshape(-1).tolist()
    values = value if isinstance(value, list) else [value]
    return [v.decode("utf-8") if isinstance(v, bytes) else v for v in values]
