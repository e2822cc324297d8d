"""EleutherAI's lm-evaluation-harness against `nanoserve serve`: its `local-completions` model (loglikelihood
through echo + logprobs, and generate_until; prompts as token ids and as text, with lm-eval's remote tokenizer on
vLLM's /tokenize too) gives what its `hf` model gives on the same tiny checkpoint: each choice's loglikelihood
within float32 tolerance, the same accuracy, the same generations. One server for the module."""
import json

import lm_eval
import pytest
from lm_eval.tasks import TaskManager
from triton_server import nanoserve_serve

pytestmark = [pytest.mark.triton_server, pytest.mark.slow]
MODEL = "tiny"
QUESTIONS = ["The colour of the sky is", "Cats like to", "Once upon a time, the king", "Two plus two makes",
             "A river flows into the", "My favourite food is"]
CHOICES = [" blue", " green and yellow", " nothing", " the sea"]


def task_yaml(name: str, data: str, output_type: str, extra: str) -> str:
    return f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
{extra}"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """A multiple-choice task (loglikelihood) and a generation task (generate_until), on local data."""
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    docs = [{"question": q, "choices": CHOICES, "answer": i % len(CHOICES)} for i, q in enumerate(QUESTIONS)]
    (folder / "docs.jsonl").write_text("\n".join(map(json.dumps, docs)) + "\n")
    (folder / "ns_choice.yaml").write_text(task_yaml(
        "ns_choice", folder / "docs.jsonl", "multiple_choice",
        'doc_to_choice: "{{choices}}"\nmetric_list:\n  - metric: acc\n'))
    (folder / "ns_generate.yaml").write_text(task_yaml(
        "ns_generate", folder / "docs.jsonl", "generate_until",
        'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 8\n  do_sample: false\n'
        'metric_list:\n  - metric: exact_match\n'))
    return TaskManager(include_path=str(folder))


def evaluate(tasks: TaskManager, model: str, model_args: dict) -> dict:
    """{task: {doc_id: (per-request responses, filtered responses)}} and the task results."""
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["ns_choice", "ns_generate"],
                                  task_manager=tasks, log_samples=True, batch_size=model_args.pop("batch_size", 1))
    samples = {task: {s["doc_id"]: (s["resps"], s["filtered_resps"]) for s in entries}
               for task, entries in out["samples"].items()}
    return {"samples": samples, "results": out["results"]}


@pytest.fixture(scope="module")
def served(qwen3_dir, tmp_path_factory):
    with nanoserve_serve(qwen3_dir, tmp_path_factory.mktemp("lm_eval"), "--served-model-name", MODEL) as served:
        yield served


@pytest.fixture(scope="module")
def hf(qwen3_dir, tasks):
    return evaluate(tasks, "hf", {"pretrained": qwen3_dir, "dtype": "float32", "device": "cpu"})


@pytest.mark.parametrize("args", [
    {"tokenized_requests": True, "tokenizer_backend": "huggingface", "batch_size": 4},  # lm-eval's default mode
    {"tokenized_requests": False, "tokenizer_backend": "huggingface"},
    {"tokenized_requests": True, "tokenizer_backend": "remote"},  # vLLM's /tokenizer_info, /tokenize, /detokenize
], ids=["token-ids-batched", "text", "remote-tokenizer"])
def test_local_completions_equals_hf(served, qwen3_dir, tasks, hf, args):
    ours = evaluate(tasks, "local-completions", {
        "model": MODEL, "base_url": served.openai_url + "/completions", "tokenizer": qwen3_dir, "num_concurrent": 1,
        "max_retries": 1, **args})
    for doc_id, (resps, _) in hf["samples"]["ns_choice"].items():
        served_resps = ours["samples"]["ns_choice"][doc_id][0]
        assert [r[0][0] for r in served_resps] == pytest.approx([r[0][0] for r in resps], abs=2e-3), doc_id
    assert ours["results"]["ns_choice"]["acc,none"] == hf["results"]["ns_choice"]["acc,none"]
    assert ours["samples"]["ns_generate"] == hf["samples"]["ns_generate"]
    assert any(filtered[0] for _, filtered in hf["samples"]["ns_generate"].values())  # something was generated
