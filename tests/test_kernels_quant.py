"""Triton weight-only quantized matmuls (kernels/quant_matmul.py) against reference.int8_matmul_ref and
reference.int4_group_matmul_ref (the weight dequantized, then F.linear), and the 4-bit packing's round trip; then
the layers on the Triton path (layers/quantization.py, as models/quantize.py installs them) against F.linear with
their dequantized weight.

Interpreter (TRITON_INTERPRET=1) without CUDA; NANOSERVE_TEST_DEVICE=cuda runs the same cases compiled. Each of
float32, bfloat16 and float16 on both. Small shapes: the interpreter is slow.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from device import ON_CUDA, TEST_DEVICE
from torch import nn

from nanoserve.kernels import ops
from nanoserve.kernels import reference as ref
from nanoserve.layers import quantization
from nanoserve.layers.embedding import VocabParallelEmbedding
from nanoserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from nanoserve.layers.quantization import GroupQuantized, Int8Weight, PackedInt4Weight, load_group_part
from nanoserve.models import quantize
from nanoserve.models.quantize import quantize_weights

DEVICE = TEST_DEVICE
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (M, N, K): one row (decode) and more rows than the 64-row block (prefill); K not a multiple of the 64-wide block
SHAPES = [(1, 48, 96), (70, 40, 160), (17, 72, 64)]


def within_rounding(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, weight_in_dtype: bool = True,
                    bias: torch.Tensor | None = None) -> None:
    """y equals x @ weight^T (+ bias) computed exactly, up to float32 sums (K of them, 2^-24 each at most) and
    rounding the output to x's dtype (under one unit of its last place: the interpreter truncates; with a bias,
    twice), and, unless the weight is exact in x's dtype (weight_in_dtype), rounding the weight too (the kernel's
    tile is in x's dtype)."""
    eps = torch.finfo(x.dtype).eps
    product = x.double() @ weight.double().T
    exact = product if bias is None else product + bias.double()
    magnitude = x.double().abs() @ weight.double().abs().T
    bound = eps * (product.abs() + (exact - product).abs() + (0 if bias is None else exact.abs()))
    bound += (2e-5 if weight_in_dtype else eps + 2e-5) * magnitude + 1e-6
    assert y.dtype == x.dtype and y.shape == exact.shape
    error = (y.double() - exact).abs()
    assert (error <= bound).all(), (error - bound).max()


def int8_weight(rows: int, cols: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8)
    scale = (torch.rand(rows, generator=gen) / 64 + 1e-3).to(torch.bfloat16)
    return codes.to(DEVICE), scale.to(DEVICE)


def int4_weight(rows: int, cols: int, seed: int, group: int = 32):
    """Scales of 2^-7..2^-4 and offsets of whole steps: every weight (an integer in [-12, 19] steps) is exact in
    each dtype, so that the kernel's tile of it is exact too."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    scale = 2.0 ** -torch.randint(4, 8, (rows, cols // group), generator=gen).float()
    offset = (torch.randint(-4, 5, (rows, cols // group), generator=gen) - 8) * scale
    return ref.pack_int4(codes).to(DEVICE), scale.to(DEVICE), offset.to(DEVICE)


def activations(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_matmul_matches_the_dequantized_reference(shape, dtype):
    rows, out_features, in_features = shape
    codes, scale = int8_weight(out_features, in_features, seed=rows)
    x = activations(rows, in_features, dtype, seed=1)
    y = ops.int8_matmul(x, codes, scale)
    within_rounding(y, x, codes.float() * scale.float()[:, None])
    torch.testing.assert_close(y.float(), ref.int8_matmul_ref(x, codes, scale).float(),
                               **({} if dtype == torch.float32 else {"atol": 0.1, "rtol": 2e-2}))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int4_group_matmul_matches_the_dequantized_reference(shape, dtype):
    rows, out_features, in_features = shape
    packed, scale, offset = int4_weight(out_features, in_features, seed=rows)
    x = activations(rows, in_features, dtype, seed=2)
    y = ops.int4_group_matmul(x, packed, scale, offset)
    within_rounding(y, x, ref.dequantize_int4_groups(packed, scale, offset))
    torch.testing.assert_close(y.float(), ref.int4_group_matmul_ref(x, packed, scale, offset).float(),
                               **({} if dtype == torch.float32 else {"atol": 0.1, "rtol": 2e-2}))


def test_int4_groups_of_64_and_leading_dims():
    """Another group size, x of shape [2, 3, K] (the output keeps the leading dims), and no rows at all."""
    packed, scale, offset = int4_weight(24, 128, seed=3, group=64)
    x = activations(6, 128, torch.float32, seed=3).reshape(2, 3, 128)
    y = ops.int4_group_matmul(x, packed, scale, offset)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y, ref.int4_group_matmul_ref(x, packed, scale, offset))
    assert ops.int4_group_matmul(x[:0], packed, scale, offset).shape == (0, 3, 24)


def test_shapes_that_do_not_fit_are_refused():
    codes, scale = int8_weight(8, 32, seed=0)
    with pytest.raises(ValueError, match="x has 16 inputs, the weight 32"):
        ops.int8_matmul(activations(1, 16, torch.float32, 0), codes, scale)
    packed, scale, offset = int4_weight(8, 64, seed=0)
    with pytest.raises(ValueError, match="x has 32 inputs, the packed weight 64"):
        ops.int4_group_matmul(activations(1, 32, torch.float32, 0), packed, scale, offset)
    packed, scale, offset = int4_weight(8, 64, seed=0, group=8)
    with pytest.raises(ValueError, match="power of two of at least 16 inputs, got 8"):
        ops.int4_group_matmul(activations(1, 64, torch.float32, 0), packed, scale, offset)


def test_pack_int4_round_trip():
    codes = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = ref.pack_int4(codes)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(packed[:, 0], codes[:, 0] | codes[:, 1] << 4)  # code 2j low, 2j + 1 high
    assert torch.equal(ref.unpack_int4(packed), codes)


# ---- the layers on the Triton path ----
@pytest.fixture
def triton_path(monkeypatch):
    """Quantized weights take the Triton kernels as on CUDA: on CPU tensors, through the interpreter."""
    if not ON_CUDA:
        for module in (quantization, quantize):
            monkeypatch.setattr(module, "runs_triton", lambda weight: True)


def test_packed_int4_round_trip_is_exact():
    """GroupQuantized -> packed nibbles -> dequantized: the very weight GroupQuantized.dequantize gives, for codes
    quantized at load and for a GGUF file's (any float32 scale and offset)."""
    gen = torch.Generator().manual_seed(0)
    at_load = GroupQuantized.from_float(torch.randn(16, 96, generator=gen))
    gguf_like = GroupQuantized(torch.randint(0, 16, (8, 64), generator=gen, dtype=torch.uint8),
                               torch.rand(8, 2, generator=gen) / 7, torch.randn(8, 2, generator=gen) / 3)
    for groups in (at_load, gguf_like):
        packed = PackedInt4Weight.from_groups(groups)
        assert packed.packed.shape == (groups.codes.shape[0], groups.codes.shape[1] // 2)
        assert torch.equal(packed.dequantize(), groups.dequantize())
    with pytest.raises(ValueError, match="uint8 codes in"):
        PackedInt4Weight.from_groups(GroupQuantized(torch.full((2, 32), 16, dtype=torch.uint8),
                                                    torch.ones(2, 1), torch.zeros(2, 1)))


class TwoLayers(nn.Module):
    def __init__(self, dtype: torch.dtype, seed: int):
        super().__init__()
        with torch.device(DEVICE):
            self.embed = VocabParallelEmbedding(40, 64)
            self.up = MergedColumnParallelLinear(64, [48, 48], bias=True)
            self.down = RowParallelLinear(96, 72)  # 72 rows: not a multiple of the 64-wide block
        gen = torch.Generator().manual_seed(seed)
        for param in self.parameters():
            param.data = torch.randn(param.shape, generator=gen).div_(8).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("quantization_arg", ["int8", "int4"])
def test_quantized_layers_equal_their_dequantized_weight(triton_path, quantization_arg, dtype):
    """quantize_weights on the Triton path: each layer's output is F.linear with the weight its format holds,
    dequantized (and the bias added); the embedding's rows are its int8 table's."""
    model = TwoLayers(dtype, seed=1)
    bias = model.up.bias.clone()
    expected_log = "int8: 3" if quantization_arg == "int8" else "int8: 1, int4: 2"
    assert quantize_weights(model, quantization_arg, dtype) == expected_log
    kind = Int8Weight if quantization_arg == "int8" else PackedInt4Weight
    assert isinstance(model.up.packed_weight, kind) and model.up.packed_weight.dequantize().device.type == DEVICE
    x = activations(19, 64, dtype, seed=4)  # more rows than the 16-row block
    for layer, inputs, layer_bias in ((model.up, x, bias), (model.down, x.repeat(1, 2)[:, :96], None)):
        y = layer(inputs)
        expected = F.linear(inputs, layer.packed_weight.dequantize().to(dtype), layer_bias)
        tolerance = {} if dtype == torch.float32 else {"atol": 0.05, "rtol": 2e-2}
        torch.testing.assert_close(y, expected, **tolerance)
        within_rounding(y, inputs, layer.packed_weight.dequantize(), bias=layer_bias,  # int8: the codes are exact
                        weight_in_dtype=dtype == torch.float32 or quantization_arg == "int8")
    ids = torch.tensor([3, 0, 39], device=DEVICE)
    torch.testing.assert_close(model.embed(ids), model.embed.quantized.dequantize()[ids].to(dtype))


def test_gguf_codes_keep_their_scales_on_the_triton_path(triton_path):
    """A GGUF file's 4-bit codes (loaded as GroupQuantized parts, on the CPU) run as they are: the layer equals
    F.linear with GroupQuantized.dequantize's weight, in float32 up to float32 sums."""
    model = TwoLayers(torch.float32, seed=2)
    gen = torch.Generator().manual_seed(3)
    groups = GroupQuantized(torch.randint(0, 16, (96, 64), generator=gen, dtype=torch.uint8),
                            torch.rand(96, 2, generator=gen) / 50, -torch.rand(96, 2, generator=gen) / 7)
    for part in ("codes", "scale", "offset"):
        load_group_part(model.up, part, getattr(groups, part)[:48], 0)
        load_group_part(model.up, part, getattr(groups, part)[48:], 1)
    quantize_weights(model, "auto", torch.float32)
    assert isinstance(model.up.packed_weight, PackedInt4Weight) and model.down.packed_weight is None
    x = activations(3, 64, torch.float32, seed=5)
    expected = F.linear(x, groups.dequantize().to(DEVICE), model.up.bias)
    torch.testing.assert_close(model.up(x), expected, atol=1e-5, rtol=1e-5)


def test_inputs_not_in_whole_groups_get_int8(triton_path):
    """int4 at load needs whole groups of 32 inputs: a layer of 40 gets int8, on the Triton path too."""
    with torch.device(DEVICE):
        model = nn.Sequential(RowParallelLinear(40, 16))
    model[0].weight.data.normal_()
    assert quantize_weights(model, "int4", torch.float32) == "int8: 1"
    x = activations(2, 40, torch.float32, seed=6)
    torch.testing.assert_close(model[0](x), F.linear(x, model[0].packed_weight.dequantize()))
