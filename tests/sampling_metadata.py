"""The SamplingMetadata the engine gives the sampler for a list of sequences: built by an InputBatch, as in a
step, so the sampler's tests see what the engine sends."""
import numpy as np
import torch

from nanoserve.engine.input_batch import InputBatch
from nanoserve.engine.scheduler_output import NewSequence, SchedulerOutput


def metadata(seqs, eos, bitmask=None):
    """The SamplingMetadata of an InputBatch holding seqs, each sampling its next token; eos: an id, a list, None;
    bitmask: the TokenBitmask of structured outputs."""
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
    batch = InputBatch(max(len(seqs), 1), max([64] + [seq.num_tokens for seq in seqs]), 16, eos_ids)
    out = SchedulerOutput(new_seqs=[NewSequence(seq.request_id, seq.token_ids, seq.num_prompt_tokens,
                                                seq.sampling_params, []) for seq in seqs],
                          num_computed_tokens=np.zeros(len(seqs), np.int64),
                          num_scheduled_tokens=np.array([seq.num_tokens for seq in seqs], np.int64),
                          samples=np.ones(len(seqs), bool), num_batched_tokens=sum(seq.num_tokens for seq in seqs))
    batch.update(out)
    batch.prepare(out)
    return batch.sampling_metadata(torch.device("cpu"), bitmask)
