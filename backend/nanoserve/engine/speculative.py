"""Prompt-lookup (n-gram) proposals for speculative decoding: the tokens that followed the latest earlier
occurrence of a sequence's last n tokens, for the longest n in [prompt_lookup_min, prompt_lookup_max] that
occurs."""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to max_tokens proposed next tokens of a sequence holding token_ids ([] when no suffix recurs)."""
        if len(token_ids) <= self.min_n or max_tokens <= 0:
            return []
        tokens = np.asarray(token_ids)
        last = len(tokens) - 1
        # ends: positions i < last holding the last token; each step keeps those whose match extends one further
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        best_end, length = -1, 1
        while len(ends):
            if length >= self.min_n:
                best_end = int(ends[-1])  # the latest occurrence of the longest suffix matched so far
            if length == self.max_n:
                break
            ends = ends[ends >= length]
            ends = ends[tokens[ends - length] == tokens[last - length]]
            length += 1
        if best_end < 0:
            return []
        return token_ids[best_end + 1:best_end + 1 + max_tokens]


class SpecDecodeStats:
    """Running totals, as vLLM counts them: drafts (a request's proposals verified in one step), their tokens,
    the tokens accepted, and per position i the drafts whose token i was accepted."""

    def __init__(self, num_speculative_tokens: int):
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = np.zeros(num_speculative_tokens, dtype=np.int64)

    def record(self, num_draft_tokens: np.ndarray, num_accepted: np.ndarray) -> None:
        """One step's drafts: per row that verified some, how many tokens it proposed and how many were accepted."""
        self.num_drafts += len(num_draft_tokens)
        self.num_draft_tokens += int(num_draft_tokens.sum())
        self.num_accepted_tokens += int(num_accepted.sum())
        positions = np.arange(len(self.accepted_per_position))
        self.accepted_per_position += (positions < num_accepted[:, None]).sum(axis=0)

    def as_dict(self) -> dict:
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": self.accepted_per_position.tolist(),
                "spec_decode_acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                                if self.num_draft_tokens else 0.0)}
