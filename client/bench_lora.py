"""Multi-LoRA decode speed: a batch whose rows use different LoRA adapters (and the base model) against a batch of
the base model alone, side by side in one engine, in one run.

One LLM with enable_lora serves --num-adapters random adapters of rank --rank on every q/k/v/o and gate/up/down
projection (written here in PEFT's format). Each round fills the batch with --num-rows requests, first all
without an adapter, then row i on adapter i mod (num_adapters + 1) (the last one: the base model), runs their
prefills, and times --steps decode-only steps of each. Prints decode steps/s of both and their ratio per round,
then the median ratio. Builds a random-weight Qwen3-shaped model locally unless --model is given.

    OMP_NUM_THREADS=1 python client/bench_lora.py --num-rows 16 --num-adapters 2 --steps 50 --rounds 3
    python client/bench_lora.py --model DIR --device cuda --num-rows 16 --num-adapters 4 --rank 16
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling bench scripts
from bench_offline import build_bench_model  # noqa: E402

TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(model: str, out_dir: str, rank: int, seed: int) -> str:
    """A PEFT LoRA adapter with random weights for every projection of the checkpoint in model."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv, hidden, inter = (config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim,
                            config.hidden_size, config.intermediate_size)
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for block, names in TARGETS.items():
            for name in names:
                out_size, in_size = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_size, generator=generator) / in_size ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(out_size, rank, generator=generator) / rank
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sum(map(list,
                   TARGETS.values()), [])}, f)
    return out_dir


def decode_steps_per_second(llm, prompts: list[list[int]], lora_names: list[str | None], steps: int,
                            tag: str) -> float:
    """Admit one request per prompt, run their prefills, then time `steps` decode-only steps."""
    from nanoserve import SamplingParams

    engine = llm.engine
    for i, (prompt, name) in enumerate(zip(prompts, lora_names)):
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True, lora_name=name)
        engine.add_request(f"{tag}-{i}", prompt, params, stream=False)
    engine.step()
    while engine.last_step.num_prefill_tokens:
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - start
    engine.abort_all()
    return steps / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint dir (default: build a random-weight Qwen3-shaped model)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--num-rows", type=int, default=16, help="requests in the batch")
    parser.add_argument("--num-adapters", type=int, default=2, help="distinct adapters in the mixed batch")
    parser.add_argument("--rank", type=int, default=16, help="the adapters' LoRA rank")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed per batch")
    parser.add_argument("--rounds", type=int, default=3, help="base-only and mixed batches, alternating")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    from nanoserve import LLM

    model = args.model or build_bench_model(args.hidden, args.layers)
    engine_args = {"device": args.device, "enable_lora": True, "max_loras": args.num_adapters,
                   "max_lora_rank": args.rank, "enable_prefix_caching": False, "max_num_seqs": args.num_rows,
                   "max_model_len": args.prompt_len + args.steps + 16}
    llm = LLM(model, **engine_args)
    adapter_root = tempfile.mkdtemp(prefix="nanoserve-bench-lora-")
    names = [f"adapter{i}" for i in range(args.num_adapters)]
    for i, name in enumerate(names):
        llm.add_lora(name, write_adapter(model, os.path.join(adapter_root, name), args.rank, seed=i))
    mixed = [([*names, None])[row % (args.num_adapters + 1)] for row in range(args.num_rows)]
    print(f"model={model} device={args.device} rows={args.num_rows} adapters={args.num_adapters} rank={args.rank} "
          f"torch_threads={torch.get_num_threads()}")
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    batch = lambda: [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_rows)]  # noqa
    decode_steps_per_second(llm, batch(), mixed, args.steps, "warmup")
    ratios = []
    try:
        for round_ in range(args.rounds):
            base = decode_steps_per_second(llm, batch(), [None] * args.num_rows, args.steps, f"base{round_}")
            lora = decode_steps_per_second(llm, batch(), mixed, args.steps, f"mixed{round_}")
            ratios.append(lora / base)
            print(f"round {round_}: base-only {base:.1f} steps/s, mixed ({args.num_adapters} adapters + base) "
                  f"{lora:.1f} steps/s, mixed / base = {lora / base:.3f}")
    finally:
        llm.shutdown()
    print(f"median mixed / base: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
