"""Weight-only quantized weights (layers/quantization.py): each kernel against F.linear with the weight it holds,
dequantized independently of the kernel (bfloat16 activations in, bfloat16-rounded outputs: the bounds are those
roundings); each format's quantization error within its bound; GGUF blocks (models/gguf.py) equal to the `gguf`
package's dequantization and run within the format's error; the formats models/quantize.py gives a model's layers;
LoRA on a quantized layer."""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from kernel_cache import cache_with_kernels
from nanoserve import SamplingParams
from nanoserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoserve.layers.linear import ColumnParallelLinear, LinearBase, MergedColumnParallelLinear, pack_cpu_weights
from nanoserve.layers.lora import LoRABatch, StackedLoRA
from nanoserve.kernels.cpu_ops import cpu_op, int8_dot_products
from nanoserve.kernels.reference import (BLOCK, BLOCK_TOP, TOP_CODE, deinterleave_groups, dequantize_int4_chunks,
                                        dequantize_int4_interleaved, int4_block_linear_ref, int4_linear_bf16_ref,
                                        int4_linear_int16_ref, int8_block_linear_ref, interleave_groups,
                                        pack_int4_chunks, pack_int4_interleaved, quantize_blocks_ref,
                                        quantize_rows_ref, split_digits, unpack_int4_chunks,
                                        unpack_int4_interleaved, w8a8_linear_ref)
from nanoserve.layers import quantization as quantization_layer
from nanoserve.layers.quantization import (ChunkedInt4Weight, GroupQuantized, Int4Weight, Int8Weight,
                                           InterleavedInt4Weight, cpu_int4_weight, exact_int8_gemm, int4_kernel_works,
                                           runs_blocks, runs_w8a8)
from nanoserve.models.gguf import group_quantized
from nanoserve.models.quantize import INT8_INPUTS_REASON, quantize_weights

T = gguf.GGMLQuantizationType
BF16_EPS = 2.0 ** -8  # bfloat16's relative rounding error, at most


class GGUFTensor:  # the two fields of a gguf ReaderTensor that group_quantized reads
    def __init__(self, data, tensor_type):
        self.data, self.tensor_type = data, tensor_type


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def activation_error(x: torch.Tensor, w8a8: bool, digits: int = 2) -> torch.Tensor | None:
    """How far activations quantized per row (w8a8_linear; int8_linear's int16 codes: 2 digits) may be from
    bf16(x): half their row's step, and x's bfloat16 rounding. Blocks of the row have steps no larger."""
    if not w8a8:
        return None
    _, row_scale = quantize_rows_ref(x, digits)
    return row_scale[:, None] / 2 + BF16_EPS * x.float().abs()


def block_activation_error(x: torch.Tensor) -> torch.Tensor:
    """How far activations in blocks (int4_block_linear, int8_block_linear) may be from bf16(x): half their
    group's step, and x's bfloat16 rounding."""
    _, step, _ = quantize_blocks_ref(x)
    return step.repeat_interleave(BLOCK, dim=1) / 2 + BF16_EPS * x.float().abs()


def int8_activation_error(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor | None:
    """The activations' error of the path an Int8Weight computes with."""
    return block_activation_error(x) if weight.blocks else activation_error(x, weight.w8a8)


def assert_linear_within(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, weight_error: torch.Tensor,
                         x_error: torch.Tensor | None = None):
    """y equals F.linear(bf16(x), weight) up to weight_error per weight element, x_error per activation (where
    they were quantized: activation_error) and y's bfloat16 rounding."""
    reference = F.linear(bf16(x), weight)
    bound = F.linear(bf16(x).abs(), weight_error) + BF16_EPS * reference.abs() + 1e-5
    if x_error is not None:
        bound += F.linear(x_error, weight.abs() + weight_error)
    assert y.dtype == x.dtype and y.shape == reference.shape
    assert ((y.float() - reference).abs() <= bound).all(), (y.float() - reference).abs().max()


def int4_reference(weight: Int4Weight, codes: torch.Tensor) -> torch.Tensor:
    """What the int4 kernel computes with, from its own scales and zeros: (q - 8) * scale + zero per group."""
    scale, zero = (weight.scale_and_zero[..., i].float().t().repeat_interleave(weight.group, 1) for i in (0, 1))
    return (codes.float() - 8) * scale + zero


@pytest.mark.parametrize("shape", [(48, 64), (960, 576), (576, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_its_dequantized_weight(shape, dtype):
    torch.manual_seed(0)
    weight, x, bias = torch.randn(shape), torch.randn(5, shape[1], dtype=dtype), torch.randn(shape[0], dtype=dtype)
    quantized = Int8Weight.from_float(weight)
    dequantized = quantized.dequantize()
    scales = quantized.scales.float()[:, None]
    assert ((dequantized - weight).abs() <= scales / 2 * (1 + 1e-6)).all()  # round to nearest
    assert (scales <= weight.abs().amax(1, keepdim=True) / 127 * (1 + 2 ** -6)).all()  # the step is max|w| / 127
    assert quantized.w8a8 == runs_w8a8(quantized.qweight) and quantized.blocks == runs_blocks(quantized.qweight)
    assert_linear_within(quantized.linear(x, None), x, dequantized, torch.zeros_like(weight),
                         int8_activation_error(x, quantized))
    torch.testing.assert_close(quantized.linear(x, bias), quantized.linear(x, None) + bias)
    rows = torch.tensor([3, 0, 3])
    torch.testing.assert_close(quantized.embedding(rows, dtype), dequantized[rows].to(dtype))


@pytest.mark.parametrize("shape", [(48, 64), (960, 576), (576, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_matches_its_dequantized_weight(shape, dtype):
    torch.manual_seed(0)
    weight, x = torch.randn(shape), torch.randn(7, shape[1], dtype=dtype)
    groups = GroupQuantized.from_float(weight)
    assert groups.group == 32 and groups.codes.dtype == torch.uint8 and int(groups.codes.max()) <= 15
    step = groups.scale.repeat_interleave(32, 1)
    assert ((groups.dequantize() - weight).abs() <= step / 2 * (1 + 1e-5)).all()  # round to nearest in [min, max]
    spread = weight.reshape(shape[0], -1, 32).aminmax(dim=-1)
    assert (groups.scale <= (spread.max - spread.min) / 15 * (1 + 2 ** -6)).all()
    quantized = Int4Weight.from_groups(groups)
    held = int4_reference(quantized, groups.codes)
    # the kernel's zero (offset + 8 scale) is rounded to bfloat16
    zero_error = BF16_EPS * (groups.offset + 8 * groups.scale).abs().repeat_interleave(32, 1)
    assert ((held - groups.dequantize()).abs() <= zero_error).all()
    assert_linear_within(quantized.linear(x, None), x, held, torch.zeros_like(weight))


def test_int4_refuses_what_its_layout_cannot_hold():
    with pytest.raises(ValueError, match="multiple of 16 output rows"):
        Int4Weight.from_groups(GroupQuantized.from_float(torch.randn(40, 64)))
    with pytest.raises(ValueError, match="uint8 codes"):
        codes = torch.zeros(16, 64, dtype=torch.int8)
        Int4Weight.from_groups(GroupQuantized(codes, torch.ones(16, 2), torch.zeros(16, 2)))


@pytest.fixture(scope="module")
def w8a8_kernel():
    kernel = cpu_op("w8a8_linear")
    if kernel is None:
        pytest.skip("nanoserve's C++ CPU kernels are not built here (no compiler or ninja)")
    if not exact_int8_gemm():
        pytest.skip("oneDNN's int8 GEMM saturates on this CPU (no VNNI), so nanoserve runs no w8a8_linear here")
    return kernel


@pytest.mark.parametrize("rows", [1, 3, 6, 8, 9, 16, 17, 64])
@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("inputs", [576, 100])  # 100: not a multiple of 32 or 64
@pytest.mark.parametrize("dtype, scale_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.float32)])
def test_w8a8_kernel_equals_its_reference(w8a8_kernel, rows, digits, inputs, dtype, scale_dtype):
    """The same integer codes and exact integer sums as w8a8_linear_ref (weight codes of -128 included)."""
    torch.manual_seed(rows)
    x = torch.randn(rows, inputs, dtype=dtype) * torch.rand(rows, 1, dtype=dtype) * 10
    x[0] = 0  # an all-zero row: scale 0, no division by it
    x[-1, :3] = torch.tensor([1e4, -1e4, 1e-3])  # an outlier row: codes of both extremes
    qweight = torch.randint(-128, 128, (203, inputs), dtype=torch.int8)
    scales = (torch.rand(203) / 100).to(scale_dtype)
    y = w8a8_kernel(x, qweight, scales, digits)
    assert y.dtype == dtype and y.shape == (rows, 203)
    tolerance = 1e-6 if dtype == torch.float32 else BF16_EPS
    torch.testing.assert_close(y, w8a8_linear_ref(x, qweight, scales, digits), rtol=tolerance, atol=1e-6)


INT8_BLOCK_MAX_ROWS = 8  # cpu_ops.cpp's kInt8BlockMaxRows


@pytest.mark.parametrize("rows", [1, 5, INT8_BLOCK_MAX_ROWS, INT8_BLOCK_MAX_ROWS + 1, 16])
@pytest.mark.parametrize("inputs", [576, 100])  # 100: not whole blocks, so per row at every count
def test_int8_linear_runs_blocks_for_few_rows_and_rows_for_more(w8a8_kernel, rows, inputs):
    torch.manual_seed(rows)
    x = torch.randn(rows, inputs) * torch.rand(rows, 1) * 10
    qweight, scales = torch.randint(-128, 128, (203, inputs), dtype=torch.int8), torch.rand(203) / 100
    y = cpu_op("int8_linear")(x, qweight, scales)
    if rows <= INT8_BLOCK_MAX_ROWS and inputs % BLOCK == 0:
        terms = x.abs() @ (qweight.float() * scales[:, None]).abs().T
        assert_within_sum_rounding(y, int8_block_linear_ref(x, qweight, scales), terms)
    else:
        torch.testing.assert_close(y, w8a8_linear_ref(x, qweight, scales, 2), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("digits", [1, 2])
def test_rows_quantize_within_half_their_step(digits):
    torch.manual_seed(0)
    x = torch.randn(6, 300) * torch.tensor([1e-3, 1, 50, 0, 7, 1e4])[:, None]
    codes, scale = quantize_rows_ref(x, digits)
    assert scale.shape == (6,)
    assert ((codes.float() * scale[:, None] - x).abs() <= scale[:, None] / 2 * (1 + 1e-5) + 1e-30).all()
    top = TOP_CODE[digits]
    assert codes.int().abs().amax(dim=1).tolist() == [top, top, top, 0, top, top]


def test_int16_codes_split_into_two_int8_digits():
    codes = torch.arange(-TOP_CODE[2], TOP_CODE[2] + 1, dtype=torch.int16)
    hi, lo = split_digits(codes)
    assert hi.dtype == lo.dtype == torch.int8
    assert torch.equal(hi.int() * 256 + lo.int(), codes.int())


def test_w8a8_reference_is_the_dequantized_product_within_the_activations_step():
    torch.manual_seed(0)
    quantized = Int8Weight.from_float(torch.randn(96, 128))
    x = torch.randn(4, 128)
    for digits in (1, 2):
        y = w8a8_linear_ref(x, quantized.qweight, quantized.scales, digits)
        codes, scale = quantize_rows_ref(x, digits)
        torch.testing.assert_close(y, F.linear(codes.float() * scale[:, None], quantized.dequantize()))
        assert_linear_within(y, x, quantized.dequantize(), torch.zeros(96, 128), activation_error(x, True, digits))


def test_int8_gemm_is_exact_where_the_cpu_has_int8_dot_products():
    if not int8_dot_products():
        pytest.skip("this CPU has no AVX-512 VNNI")
    assert exact_int8_gemm()


def test_without_int8_dot_products_int8_runs_activation_blocks_or_weight_only(monkeypatch):
    """An AVX2-only CPU (here: ATEN_CPU_CAPABILITY's cap) has no VNNI: int8 weights run int8_block_linear where the
    kernels are built, and torch's weight-only kernel with bfloat16 activations where they are not."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert not int8_dot_products()
    torch.manual_seed(0)
    weight, x = torch.randn(64, 128), torch.randn(9, 128)
    int8 = Int8Weight.from_float(weight)
    assert not int8.w8a8 and int8.blocks == (cpu_op("int8_block_linear") is not None)
    if int8.blocks:
        torch.testing.assert_close(int8.linear(x, None), int8_block_linear_ref(x, int8.qweight, int8.scales))
    monkeypatch.setattr(quantization_layer, "cpu_op", lambda name: None)  # no C++ kernels
    int8 = Int8Weight.from_float(weight)
    assert not int8.w8a8 and not int8.blocks
    expected = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), int8.qweight, int8.scales).float()
    torch.testing.assert_close(int8.linear(x, None), expected)


def test_a_layer_the_int8_kernel_cannot_take_stays_float():
    """torch's _weight_int8pack_mm crashes (SIGSEGV) on in_features not a multiple of 16: such a layer keeps its
    float weight, the summary says why, and it computes F.linear."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"odd": ColumnParallelLinear(40, 32), "even": ColumnParallelLinear(64, 32)})
    weights = {name: layer.weight.data.normal_().clone() for name, layer in model.items()}
    summary = quantize_weights(model, "int8", torch.float32)
    assert summary == f"float: 1, int8: 1; {INT8_INPUTS_REASON}"
    pack_cpu_weights(model)
    assert isinstance(model["even"].packed_weight, Int8Weight)
    x = torch.randn(3, 40)
    torch.testing.assert_close(model["odd"](x), F.linear(x, weights["odd"]))


def gguf_blocks(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A [rows, cols] weight as qtype's blocks: quantized by the gguf package, or (Q4_K, which it cannot quantize)
    random blocks with small super-block scales."""
    rng = np.random.default_rng(seed)
    if qtype != T.Q4_K:
        return gguf.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    blocks[..., :4] = np.frombuffer(np.array([0.004, 0.01], np.float16).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K])
def test_gguf_blocks_keep_their_codes_and_run_within_the_format(qtype):
    rows, cols = 64, 512
    blocks = gguf_blocks(qtype, rows, cols)
    reference = torch.from_numpy(gguf.dequantize(blocks, qtype).reshape(rows, cols))
    groups = GroupQuantized(*(torch.from_numpy(a) for a in group_quantized(GGUFTensor(blocks, qtype)).values()))
    assert torch.equal(groups.dequantize(), reference)  # codes, scales and mins kept exactly
    x = torch.randn(5, cols)
    if qtype == T.Q8_0:  # per-block scales become one per row: requantized, within half the row's step
        quantized = Int8Weight.from_float(groups.dequantize())
        step = quantized.scales.float()[:, None].expand(rows, cols)
        assert ((quantized.dequantize() - reference).abs() <= step / 2 * (1 + 1e-6)).all()
        assert_linear_within(quantized.linear(x, None), x, reference, step / 2, int8_activation_error(x, quantized))
    else:  # the codes as they are; the scale and zero rounded to bfloat16
        quantized = Int4Weight.from_groups(groups)
        error = BF16_EPS * (15 * groups.scale.abs() + (groups.offset + 8 * groups.scale).abs())
        error = error.repeat_interleave(32, 1)
        assert ((int4_reference(quantized, groups.codes) - reference).abs() <= error).all()
        assert_linear_within(quantized.linear(x, None), x, reference, error)


def test_a_quantized_layer_adds_its_lora_delta():
    torch.manual_seed(0)
    layer = MergedColumnParallelLinear(64, [32, 32])
    layer.weight.data.normal_()
    lora = StackedLoRA(layer, num_slots=2, max_rank=4)
    lora.a.normal_(), lora.b.normal_()
    layer.lora = lora
    quantized = Int8Weight.from_float(layer.weight)
    layer.packed_weight = quantized
    x, slots = torch.randn(3, 64), torch.tensor([0, -1, 1])
    expected = quantized.linear(x, None)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            for part, (offset, size) in enumerate(lora.parts):
                a, b = lora.a[slot, part * 4:(part + 1) * 4], lora.b[slot, offset:offset + size]
                expected[row, offset:offset + size] += (x[row] @ a.t()) @ b.t()
    torch.testing.assert_close(layer(x, LoRABatch(slots)), expected)


# ---- engines: the formats a model's layers get, and greedy agreement with the float engine on the same weights --
@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama (no rope scaling: GGUF keeps none) and it as Q4_0, Q8_0 and Q4_1 GGUF files."""
    from gguf_files import write_gguf

    from nanoserve.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("quantized")
    hf_dir = build_tiny_model(str(root / "hf"), "llama", seed=5, rope_scaling=None)
    files = {qtype.name: write_gguf(hf_dir, str(root / f"tiny-{qtype.name}.gguf"), "llama", qtype=qtype)
             for qtype in (T.Q4_0, T.Q8_0, T.Q4_1)}
    return hf_dir, files, cache_with_kernels(root / "cache")


def model_formats(llm) -> dict[str, str]:
    """Each linear layer's and embedding's weight format: int8, int4 or float."""
    formats = {}
    for name, module in llm.engine.executor.runner.model.named_modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            weight = module.packed_weight
        elif isinstance(module, VocabParallelEmbedding):
            weight = module.quantized
        else:
            continue
        formats[name] = "float" if weight is None or isinstance(weight, torch.Tensor) else weight.name
    return formats


@pytest.mark.parametrize("qtype, quantization, linears, tables", [
    ("Q4_0", "auto", "int4", "int8"), ("Q8_0", "auto", "int8", "int8"), ("Q4_0", "none", "float", "float"),
    ("Q8_0", "int4", "int4", "int8"), ("Q4_1", "int8", "int8", "int8")])
def test_each_layer_gets_the_format_chosen(tiny_llama, qtype, quantization, linears, tables, make_llm, capfd,
                                           monkeypatch):
    monkeypatch.setenv("NANOSERVE_CACHE", tiny_llama[2])
    llm = make_llm(tiny_llama[1][qtype], quantization=quantization, num_kvcache_blocks=32)
    formats = model_formats(llm)
    assert {name: kind for name, kind in formats.items() if "embed" in name or "lm_head" in name} == {
        "model.embed_tokens": tables, "lm_head": tables}
    assert {kind for name, kind in formats.items() if "layers" in name} == {linears}
    assert f"nanoserve: weights (quantization={quantization}" in capfd.readouterr().err


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
def test_gguf_model_on_the_triton_path_equals_its_reference(tiny_llama, qtype, make_llm, monkeypatch):
    """CUDA's path (PackedInt4Weight and Int8Weight through the Triton kernels; here in the interpreter on the CPU's
    float32): the engine's prompt logprobs equal those of the same weights through the references (dequantize,
    then F.linear) up to float32 sums."""
    from nanoserve.layers import quantization
    from nanoserve.models import quantize

    monkeypatch.setenv("NANOSERVE_CACHE", tiny_llama[2])
    for module in (quantization, quantize):
        monkeypatch.setattr(module, "runs_triton", lambda weight: True)
    triton_llm = make_llm(tiny_llama[1][qtype], num_kvcache_blocks=32)
    linears = {type(module.packed_weight).__name__ for module in triton_llm.engine.executor.runner.model.modules()
               if isinstance(module, LinearBase)}
    assert linears == {"PackedInt4Weight" if qtype == "Q4_1" else "Int8Weight"}
    got = prompt_logprobs(triton_llm, TINY_PROMPTS)
    monkeypatch.setattr(quantization, "cuda_op", lambda name: None)  # the references
    expected = prompt_logprobs(make_llm(tiny_llama[1][qtype], num_kvcache_blocks=32), TINY_PROMPTS)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


GREEDY_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=0)


def greedy_agreement(expected: list, quantized_llm, prompts) -> tuple[int, float]:
    """(prompts whose first GREEDY_TOKENS greedy tokens equal the float engine's `expected` outputs, the largest
    |logprob difference| of a chosen token while the two agree)."""
    got = quantized_llm.generate(prompts, GREEDY, use_tqdm=False)
    equal, worst = 0, 0.0
    for a, b in zip(expected, got):
        equal += a.token_ids == b.token_ids
        for token_a, token_b, logprobs_a, logprobs_b in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if token_a != token_b:
                break
            worst = max(worst, abs(logprobs_a[token_a] - logprobs_b[token_b]))
    print(f"\n{quantized_llm.engine.config.quantization}: {equal}/{len(prompts)} prompts agree on {GREEDY_TOKENS} "
          f"tokens; largest |logprob difference| while they agree {worst:.4f}")
    return equal, worst


TINY_PROMPTS = ["The future of AI is", "def fibonacci(n):", "Paged attention keeps", "Hello, my name is",
                "import numpy as np", "The license grants"]


def prompt_logprobs(llm, prompts) -> list[float]:
    """Each prompt token's logprob given the tokens before it, over all prompts."""
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    tokens = [llm.tokenizer.encode(prompt) for prompt in prompts]
    return [logprobs[token] for out, ids in zip(outputs, tokens)
            for logprobs, token in zip(out.prompt_logprobs[1:], ids[1:])]


@pytest.mark.parametrize("quantization, max_logprob_error", [("int8", 0.15), ("int4", 1.0)])
def test_tiny_model_logprobs_follow_the_float_engine(tmp_path, quantization, max_logprob_error, make_llm):
    """On a random model greedy tokens are near-ties (at the tiny models' initializer_range of 0.5 even float32
    activations with int8 weights flip them), so the bound is on each prompt token's logprob under the same
    context (teacher-forced), on a model initialized at 0.1: measured, int8 <= 0.06 and int4 <= 0.4, where a
    kernel reading its layout wrong is off by several."""
    from nanoserve.tiny_model import build_tiny_model

    model = build_tiny_model(str(tmp_path / "hf"), "llama", seed=5, rope_scaling=None, initializer_range=0.1)
    expected = prompt_logprobs(make_llm(model, num_kvcache_blocks=64), TINY_PROMPTS)
    got = prompt_logprobs(make_llm(model, quantization=quantization, num_kvcache_blocks=64), TINY_PROMPTS)
    errors = np.abs(np.array(got) - np.array(expected))
    print(f"\n{quantization}: prompt-token |logprob difference| mean {errors.mean():.4f}, max {errors.max():.4f}")
    assert errors.max() <= max_logprob_error


SMOLLM2_QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?",
                     "Write a haiku about the sea.", "Who wrote Romeo and Juliet?", "What do bees make?",
                     "Give me a synonym for happy.", "How many days are in a week?",
                     "What is the boiling point of water?", "Name a planet in our solar system.",
                     "What language is spoken in Brazil?", "Translate 'thank you' into Spanish.",
                     "What is the opposite of cold?", "How many legs does a spider have?",
                     "What color is the sky on a clear day?", "Suggest a name for a pet cat."]
SMOLLM2_TEXTS = ["The three primary colors are", "Once upon a time, in a small village,", "def add(a, b):",
                 "The quick brown fox"]


@pytest.fixture(scope="module")
def smollm2_prompts():
    from transformers import AutoTokenizer

    from nanoserve.demo_model import smollm2_gguf
    from nanoserve.models.gguf import checkpoint_dir

    path = str(smollm2_gguf())
    tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(path))
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True) for question in SMOLLM2_QUESTIONS]
    return path, chats + SMOLLM2_TEXTS


@dataclass
class FloatRuns:
    """The float engine's runs that the quantized engines are held against: greedy outputs of the prompts, and
    the prompts continued by it (32 sampled tokens each) with its prompt logprobs over them."""
    greedy: list
    sequences: list[list[int]]
    prompt_logprobs: list


SMOLLM2_ARGS = {"max_model_len": 512, "num_kvcache_blocks": 64}
PROMPT_LOGPROBS = SamplingParams(max_tokens=1, prompt_logprobs=1)


@pytest.fixture(scope="module")
def smollm2_float_runs(smollm2_prompts, make_module_llm) -> FloatRuns:
    """Made once for the module: the float32 engine on SmolLM2's dequantized weights."""
    path, prompts = smollm2_prompts
    llm = make_module_llm(path, quantization="none", **SMOLLM2_ARGS)
    greedy = llm.generate(prompts, GREEDY, use_tqdm=False)
    continued = llm.generate(prompts, SamplingParams(temperature=1.0, seed=1, max_tokens=32, ignore_eos=True),
                             use_tqdm=False)
    sequences = [llm.tokenizer.encode(prompt) + out.token_ids for prompt, out in zip(prompts, continued)]
    scored = llm.generate(sequences, PROMPT_LOGPROBS, use_tqdm=False)
    return FloatRuns(greedy, sequences, [out.prompt_logprobs for out in scored])


def teacher_forced_agreement(float_runs: FloatRuns, quantized_llm) -> tuple[float, float]:
    """Over every position of the prompts continued by the float engine: the share where the quantized engine's
    most likely next token is the float engine's, and the mean |logprob difference| of the token that follows.
    Unlike greedy runs, which part at the first near-tie, each position counts once."""
    got = quantized_llm.generate(float_runs.sequences, PROMPT_LOGPROBS, use_tqdm=False)
    same, differences = [], []
    for sequence, expected, b in zip(float_runs.sequences, float_runs.prompt_logprobs, got):
        for token, logprobs_a, logprobs_b in zip(sequence[1:], expected[1:], b.prompt_logprobs[1:]):
            top_a, top_b = (max(logprobs, key=lambda t: float(logprobs[t])) for logprobs in (logprobs_a, logprobs_b))
            same.append(top_a == top_b)
            differences.append(abs(float(logprobs_a[token]) - float(logprobs_b[token])))
    share, mean = float(np.mean(same)), float(np.mean(differences))
    print(f"\n{quantized_llm.engine.config.quantization}: the most likely token agrees at {share:.3f} of "
          f"{len(same)} positions; mean |logprob difference| {mean:.4f}")
    return share, mean


@pytest.mark.slow
@pytest.mark.parametrize("quantization, min_equal, min_share, max_logprob_error", [
    ("auto", 11, 0.94, 0.07), ("int4", 11, 0.94, 0.07), ("int8", 6, 0.90, 0.14)])
def test_smollm2_follows_the_float_engine(smollm2_prompts, smollm2_float_runs, quantization, min_equal, min_share,
                                          max_logprob_error, make_llm):
    """The demo's file (Q4_1 codes: "auto" runs them as int4, "int4" requantizes the dequantized weights to groups
    of 32 again, "int8" to one scale per row) against the float32 engine on the same, dequantized, weights, on 20
    prompts: greedy runs of 16 tokens equal, and (a measure that near-ties do not swing) the most likely token under
    the float engine's context. Measured on an AVX2 CPU, greedy equal / share agreeing / mean logprob difference:
    auto and int4 (int4_block_linear) 16/20, 0.975, 0.041, with torch's weight-only kernel 14/20, 0.954, 0.050;
    int8 (int8_block_linear) 10/20, 0.974, 0.081, weight-only 9/20, 0.972, 0.090. Activations in int8 blocks
    (llama.cpp's Q8 codes) tripled the logprob difference (cpu_ops.cpp). Broken kernels agree on none."""
    path, prompts = smollm2_prompts
    quantized_llm = make_llm(path, quantization=quantization, **SMOLLM2_ARGS)
    equal, _ = greedy_agreement(smollm2_float_runs.greedy, quantized_llm, prompts)
    share, mean_error = teacher_forced_agreement(smollm2_float_runs, quantized_llm)
    assert equal >= min_equal and share >= min_share and mean_error <= max_logprob_error


@pytest.mark.parametrize("qtype, quantization", [("Q4_0", "auto"), ("Q4_1", "int8")])
def test_tp2_quantizes_each_shard_as_tp1_does(tiny_llama, qtype, quantization, monkeypatch):
    """Each rank quantizes (or takes the codes of) its own shard after loading it: tp=2 gives tp=1's logits up
    to the bfloat16 rounding of each rank's partial sums (int8 rows of a row-parallel shard get scales of
    their own, within int8's error)."""
    from test_model_runner import make_config, make_runner
    from test_tensor_parallel import AllRanks, _steps

    from nanoserve.engine.executor import Executor

    monkeypatch.setenv("NANOSERVE_CACHE", tiny_llama[2])
    model = tiny_llama[1][qtype]
    single = make_runner(model, quantization=quantization)
    expected = _steps(single)
    single.shutdown()
    executor = Executor(make_config(model, tensor_parallel_size=2, quantization=quantization))
    try:
        down_proj = executor.runner.model.model.layers[0].mlp.down_proj.packed_weight
        assert down_proj.name == ("int4" if quantization == "auto" else "int8")
        got = _steps(AllRanks(executor))
    finally:
        executor.shutdown()
    for ours, ref in zip(got, expected):
        torch.testing.assert_close(ours, ref, atol=0.03 * float(ref.abs().max()), rtol=0.03)



def test_the_quantization_argument_is_checked(tiny_llama):
    from nanoserve.cli import build_parser
    from nanoserve.config import EngineConfig
    from nanoserve.serving.serve.engine_flags import given_engine_args

    hf_dir = tiny_llama[0]
    assert EngineConfig.from_kwargs(hf_dir, device="cpu").quantization == "auto"
    assert EngineConfig.from_kwargs(hf_dir, device="cpu", quantization="none").quantization == "none"  # model.json
    flags = given_engine_args(build_parser().parse_args(["serve", hf_dir, "--quantization", "none"]))
    assert EngineConfig.from_kwargs(hf_dir, device="cpu", **flags).quantization == "none"
    with pytest.raises(ValueError, match="quantization: must be one of auto, none, int8, int4, got 'int3'"):
        EngineConfig.from_kwargs(hf_dir, device="cpu", quantization="int3")
    for quantization in ("int8", "int4"):  # on CUDA too: the Triton kernels (tests/test_kernels_quant.py)
        assert EngineConfig.from_kwargs(hf_dir, device="cuda", quantization=quantization).quantization == quantization


def test_auto_keeps_float_weights_on_cuda_until_asked_by_name():
    from nanoserve.models.quantize import on_device

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [on_device(q, cpu) for q in ("auto", "none", "int8", "int4")] == ["auto", "none", "int8", "int4"]
    assert [on_device(q, cuda) for q in ("auto", "none", "int8", "int4")] == ["none", "none", "int8", "int4"]


# ---- nanoserve's int4 kernel (cpu_ops.cpp's int4_linear: VNNI for up to 4 rows, AMX for more) -------------------
INT4_VNNI_MAX_ROWS = 4  # cpu_ops.cpp's kInt4VnniMaxRows


@pytest.fixture(scope="module")
def int4_kernel():
    if not int4_kernel_works():
        pytest.skip("nanoserve's int4 kernel does not run here (it needs AMX and AVX-512 VNNI)")
    return cpu_op("int4_linear")


def test_int4_chunks_pack_and_unpack_in_order():
    codes = torch.randint(0, 16, (3, 128), dtype=torch.uint8)
    packed = pack_int4_chunks(codes)
    assert packed.shape == (3, 64) and torch.equal(unpack_int4_chunks(packed), codes)
    assert torch.equal(packed[:, :32] & 0xF, codes[:, :32]) and torch.equal(packed[:, :32] >> 4, codes[:, 32:64])


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 64, 65])  # VNNI up to 4, AMX above (64 rows a pass)
@pytest.mark.parametrize("inputs", [576, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_kernel_equals_its_reference(int4_kernel, rows, inputs, dtype):
    """The VNNI path's integer sums and the AMX path's bfloat16 products, each against its float64 reference."""
    torch.manual_seed(rows)
    x = torch.randn(rows, inputs, dtype=dtype) * torch.rand(rows, 1, dtype=dtype) * 10
    x[0] = 0  # an all-zero row
    x[-1, :3] = torch.tensor([1e4, -1e4, 1e-3])  # an outlier row
    codes = torch.randint(0, 16, (48, inputs), dtype=torch.uint8)
    codes[0] = 15  # the largest code everywhere in one channel
    scale, offset = torch.rand(48, inputs // 32) / 100, torch.randn(48, inputs // 32) / 10
    packed = pack_int4_chunks(codes)
    y = int4_kernel(x, packed, scale, offset)
    assert y.dtype == dtype and y.shape == (rows, 48)
    reference = int4_linear_int16_ref if rows <= INT4_VNNI_MAX_ROWS else int4_linear_bf16_ref
    expected = reference(x.float(), packed, scale, offset)
    # float32 sums in the kernel's order (AMX's tiles sum in an order of their own): their rounding is relative to
    # the terms' magnitudes, which the outlier row's cancelling terms make far larger than its result
    terms = x.float().abs() @ dequantize_int4_chunks(packed, scale, offset).abs().T
    bound = 1e-5 * terms + (BF16_EPS * expected.abs() if dtype == torch.bfloat16 else 0) + 1e-6
    assert ((y.float() - expected).abs() <= bound).all(), ((y.float() - expected).abs() / bound).max()


@pytest.mark.parametrize("rows", [2, 9])
def test_the_cpus_int4_weight_computes_with_its_groups(rows):
    """cpu_int4_weight's layout holds the groups' weight exactly and its linear is F.linear with it, within its
    kernel's roundings (int16 activation codes per row or per block, or bfloat16 activations and weights)."""
    torch.manual_seed(0)
    weight, x = torch.randn(96, 192), torch.randn(rows, 192)
    groups = GroupQuantized.from_float(weight)
    quantized = cpu_int4_weight(groups)
    expected_type = (ChunkedInt4Weight if int4_kernel_works() else
                     InterleavedInt4Weight if cpu_op("int4_block_linear") is not None else Int4Weight)
    assert type(quantized) is expected_type
    if expected_type is Int4Weight:
        pytest.skip("nanoserve's int4 kernels do not run here (int4_linear needs AMX and AVX-512 VNNI, "
                    "int4_block_linear AVX2)")
    assert torch.equal(quantized.dequantize(), groups.dequantize())
    held = groups.dequantize()
    if expected_type is InterleavedInt4Weight:
        assert_linear_within(quantized.linear(x, None), x, held, torch.zeros_like(held), block_activation_error(x))
    elif rows <= INT4_VNNI_MAX_ROWS:
        assert_linear_within(quantized.linear(x, None), x, held, torch.zeros_like(held), activation_error(x, True, 2))
    else:
        assert_linear_within(quantized.linear(x, None), x, held, BF16_EPS * held.abs())


@pytest.mark.parametrize("channels", [1, 8, 13, 24])
@given(data=st.data())
@settings(max_examples=20, deadline=None)
def test_int4_interleaved_layout_packs_and_unpacks_in_order(channels, data):
    """Blocks of 8 channels, the last padded: run j of a group holds inputs 2j, 2j + 1 (low nibbles) and 16 + 2j,
    17 + 2j (high ones) of each channel in turn; the groups' scales interleave alike."""
    groups = data.draw(st.integers(1, 4))
    torch.manual_seed(data.draw(st.integers(0, 2 ** 16)))
    codes = torch.randint(0, 16, (channels, 32 * groups), dtype=torch.uint8)
    packed = pack_int4_interleaved(codes)
    blocks = -(-channels // 8)
    assert packed.shape == (blocks, 128 * groups) and torch.equal(unpack_int4_interleaved(packed, channels), codes)
    c, g, j, p = (data.draw(st.integers(0, top - 1)) for top in (channels, groups, 8, 2))
    byte = int(packed[c // 8, 128 * g + 16 * j + 2 * (c % 8) + p])
    assert (byte & 0xF, byte >> 4) == (codes[c, 32 * g + 2 * j + p], codes[c, 32 * g + 16 + 2 * j + p])
    scale = torch.rand(channels, groups)
    held = interleave_groups(scale)
    assert held.shape == (blocks, 8 * groups) and held[c // 8, 8 * g + c % 8] == scale[c, g]
    assert torch.equal(deinterleave_groups(held, channels), scale)


# ---- nanoserve's AVX2 kernels with activations in blocks (int4_block_linear, int8_block_linear) ----------------
@pytest.fixture(scope="module")
def block_kernels():
    if cpu_op("int4_block_linear") is None:
        pytest.skip("nanoserve's C++ CPU kernels are not built for AVX2 here")
    return cpu_op("int4_block_linear"), cpu_op("int8_block_linear")


def hard_activations(rows: int, inputs: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of different magnitudes, an all-zero row, and an outlier row whose terms cancel."""
    torch.manual_seed(rows * inputs)
    x = torch.randn(rows, inputs, dtype=dtype) * torch.rand(rows, 1, dtype=dtype) * 10
    x[0] = 0
    x[-1, :3] = torch.tensor([1e4, -1e4, 1e-3])
    return x


def assert_within_sum_rounding(y: torch.Tensor, expected: torch.Tensor, terms: torch.Tensor):
    """y is expected up to float32 sums of terms' size (relative to them: the outlier row's cancelling terms are
    far larger than its result) and, for bfloat16, y's own rounding."""
    bound = 1e-5 * terms + (BF16_EPS * expected.abs() if y.dtype == torch.bfloat16 else 0) + 1e-6
    assert ((y.float() - expected.float()).abs() <= bound).all(), ((y.float() - expected.float()).abs() / bound).max()


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 6, 7, 8, 9, 16, 17, 65])  # 6 rows a pass (AVX2), 8 (AVX-512 VNNI)
@pytest.mark.parametrize("inputs", [576, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("channels", [49, 57])  # blocks of 8: 6 and a last one alone, or 7 and a last one in a pair
def test_int4_block_kernel_equals_its_reference(block_kernels, rows, inputs, dtype, group_dtype, channels):
    x = hard_activations(rows, inputs, dtype)
    codes = torch.randint(0, 16, (channels, inputs), dtype=torch.uint8)
    codes[0] = 15  # the largest code everywhere in one channel
    scale, offset = torch.rand(channels, inputs // 32) / 100, torch.randn(channels, inputs // 32) / 10
    packed = pack_int4_interleaved(codes)
    held_scale, held_offset = (interleave_groups(t).to(group_dtype) for t in (scale, offset))
    y = block_kernels[0](x, packed, held_scale, held_offset, channels)
    assert y.dtype == dtype and y.shape == (rows, channels)
    terms = x.float().abs() @ dequantize_int4_interleaved(packed, held_scale, held_offset, channels).abs().T
    assert_within_sum_rounding(y, int4_block_linear_ref(x.float(), packed, held_scale, held_offset, channels), terms)


def test_interleaved_groups_are_float16_where_it_holds_them_exactly():
    """A GGUF file's float16 scales and mins take half the bytes; a scale float16 cannot hold keeps float32."""
    codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    halves = GroupQuantized(codes, torch.rand(16, 2).half().float(), -torch.rand(16, 2).half().float())
    held = InterleavedInt4Weight.from_groups(halves)
    assert held.scale.dtype == held.offset.dtype == torch.float16
    assert torch.equal(held.dequantize(), halves.dequantize())
    finer = GroupQuantized(codes, halves.scale + 2 ** -20, halves.offset)  # more bits than float16's 11
    held = InterleavedInt4Weight.from_groups(finer)
    assert held.scale.dtype == held.offset.dtype == torch.float32
    assert torch.equal(held.dequantize(), finer.dequantize())


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 17, 65])
@pytest.mark.parametrize("inputs", [576, 96])  # 96: three groups
@pytest.mark.parametrize("dtype, scale_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.float32)])
def test_int8_block_kernel_equals_its_reference(block_kernels, rows, inputs, dtype, scale_dtype):
    """Weight codes of -128 included (their magnitude is the kernel's unsigned operand)."""
    x = hard_activations(rows, inputs, dtype)
    qweight = torch.randint(-128, 128, (49, inputs), dtype=torch.int8)
    scales = (torch.rand(49) / 100).to(scale_dtype)
    y = block_kernels[1](x, qweight, scales)
    assert y.dtype == dtype and y.shape == (rows, 49)
    terms = x.float().abs() @ (qweight.float().abs() * scales.float()[:, None]).T
    assert_within_sum_rounding(y, int8_block_linear_ref(x.float(), qweight, scales), terms)


def test_blocks_quantize_within_half_their_step_and_keep_an_outlier_to_its_block():
    torch.manual_seed(0)
    x = torch.randn(3, 128)
    x[1] = 0
    codes, step, sums = quantize_blocks_ref(x)
    assert codes.dtype == torch.int16 and codes.shape == (3, 4, 32) and step.shape == sums.shape == (3, 4)
    error = (codes.double() * step[..., None].double()).reshape(3, 128) - x.double()
    assert (error.abs() <= step.repeat_interleave(32, 1).double() / 2 * (1 + 1e-5)).all()
    assert (codes[1] == 0).all() and (step[1] == 0).all()
    torch.testing.assert_close(sums, x.double().reshape(3, 4, 32).sum(-1))
    spiked = x.clone()
    spiked[0, 5] = 1e4  # in block 0 of row 0
    _, spiked_step, _ = quantize_blocks_ref(spiked)
    assert spiked_step[0, 0] == 1e4 / BLOCK_TOP and torch.equal(spiked_step[0, 1:], step[0, 1:])


def test_block_reference_is_the_dequantized_product_within_the_activations_step():
    torch.manual_seed(0)
    x = torch.randn(4, 128)
    groups, int8 = GroupQuantized.from_float(torch.randn(96, 128)), Int8Weight.from_float(torch.randn(96, 128))
    for y, weight in [(int4_block_linear_ref(x, pack_int4_interleaved(groups.codes), interleave_groups(groups.scale),
                                             interleave_groups(groups.offset), 96), groups.dequantize()),
                      (int8_block_linear_ref(x, int8.qweight, int8.scales), int8.dequantize())]:
        assert_linear_within(y, x, weight, torch.zeros_like(weight), block_activation_error(x))
