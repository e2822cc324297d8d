import os
import sys
from pathlib import Path

# client/ is a top-level folder of the repository, not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from device import KERNEL_DTYPES, ON_CUDA, engine_defaults  # noqa: E402

# Without a GPU the Triton-language kernels run through the interpreter; it must be set before triton is imported.
# With NANOSERVE_TEST_DEVICE=cuda they are compiled, as in production.
if ON_CUDA:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("NANOSERVE_TEST_DEVICE=cuda tests the compiled kernels: unset TRITON_INTERPRET")
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite's own cache (built kernels, converted GGUF files, the demo's model), never the user's: it would
# overwrite their logs and files. NANOSERVE_TEST_CACHE moves it; servers and CLIs the tests start inherit it.
os.environ["NANOSERVE_CACHE"] = os.environ.get("NANOSERVE_TEST_CACHE",
                                               str(Path(__file__).resolve().parents[1] / ".cache" / "tests"))

import pytest  # noqa: E402
import torch  # noqa: E402

# The test models are tiny: one thread avoids OpenMP spin-waits that make each op ~20x slower on a busy 2-core box.
torch.set_num_threads(1)


@pytest.fixture(params=KERNEL_DTYPES)
def dtype(request) -> torch.dtype:
    """The kernel tests' dtype: float32 in the interpreter, bfloat16 and float16 on a GPU (tests/device.py)."""
    return getattr(torch, request.param)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Random-weight checkpoints built once per session: {"qwen3": dir, "qwen2": dir, "llama": dir}."""
    from nanoserve.tiny_model import ARCHS, build_tiny_model

    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(str(root / arch), arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def qwen3_dir(tiny_models):
    return tiny_models["qwen3"]


@pytest.fixture(scope="session")
def lora_adapters(tiny_models, tmp_path_factory):
    """PEFT adapters with random weights, per architecture ("qwen3", "llama"): "wide" (rank 8, every target) and
    "narrow" (rank 4, q/v/down only, rsLoRA): {arch: {name: directory}}."""
    from lora_adapters import make_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {arch: {"wide": make_adapter(tiny_models[arch], str(root / arch / "wide"), rank=8, seed=1),
                   "narrow": make_adapter(tiny_models[arch], str(root / arch / "narrow"), rank=4, seed=2, alpha=8,
                                          targets=("q_proj", "v_proj", "down_proj"), use_rslora=True)}
            for arch in ("qwen3", "llama")}


def checked_llms():
    """(factory, llms made): LLMs built with the tests' engine defaults, for check_and_shut_down after use."""
    from nanoserve import LLM

    made = []

    def factory(model_dir, **engine_args):
        llm = LLM(model_dir, **{**engine_defaults(), **engine_args})
        made.append(llm)
        return llm

    return factory, made


def check_and_shut_down(made: list) -> None:
    """Shut each LLM down, asserting that it holds no request and that every KV block is free again (no leaks)."""
    for llm in made:
        stats = llm.stats()
        llm.shutdown()
        assert not llm.engine.has_unfinished_requests(), "requests left in the engine"
        assert stats["num_free_blocks"] == stats["num_total_blocks"], f"leaked KV blocks: {stats}"


@pytest.fixture
def make_llm():
    """Builds LLMs and checks, after the test, that every KV block is free again (no leaks)."""
    factory, made = checked_llms()
    yield factory
    check_and_shut_down(made)


@pytest.fixture(scope="module")
def make_module_llm():
    """make_llm for LLMs that a module's tests share: checked after the module's last test."""
    factory, made = checked_llms()
    yield factory
    check_and_shut_down(made)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(session, config, items):
    """The Docker image check (test_docker_image.py) runs last and starts first, in the background: its build
    mostly waits on downloads and copies, which the rest of the suite's work overlaps."""
    image_checks = [item for item in items if item.path.name == "test_docker_image.py"]
    if image_checks:
        items[:] = [item for item in items if item not in image_checks] + image_checks
        if not config.option.collectonly:
            image_checks[0].module.start_in_background()


def pytest_sessionfinish(session, exitstatus):
    image_check = sys.modules.get("test_docker_image")
    if image_check is not None:
        image_check.stop_background()
