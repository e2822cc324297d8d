"""Structured outputs with xgrammar (docs/architecture.md, "Where features attach"): grammars compiled for the
model's vocabulary, a matcher per sequence, and the token bitmask of each step's constrained rows."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np
import torch
import xgrammar as xgr

from nanoserve.errors import RequestError
from nanoserve.sampling_params import StructuredOutputsParams

CACHE_LIMIT_BYTES = 256 << 20  # compiled grammars kept for reuse (xgrammar's cache; least recently used go first)
MAX_ERROR_CHARS = 500
# xgrammar's errors start with a C++ log prefix ("[10:58:49] /project/cpp/regex_converter.cc:83: ") and may add
# a failed check's condition ("Check failed: (error.empty()) is false: ")
_LOG_PREFIX = re.compile(r"^\[[\d:.]+\] \S+:\d+: (Check failed: .*? is false: )?")


@dataclass
class TokenBitmask:
    """The tokens that the constrained logits rows of one step may take: bit j % 32 of bitmask[row, j // 32]
    allows token j. Only `rows` are filled; the other rows are not constrained (and their bits are garbage)."""
    bitmask: torch.Tensor  # [logits rows, ceil(vocab_size / 32)] int32, on the host
    rows: list[int]


class Grammar:
    """One request's place in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0  # tokens of the request's output the matcher has seen

    def advance(self, token_id: int) -> bool:
        """Accept the request's next generated token; True when the grammar ends the request: it is complete (the
        token was a stop token), or it rejects the token (the mask allows only grammar tokens, so that happens
        only when nothing was allowed, e.g. min_tokens banning the EOS that alone could come next)."""
        self.num_accepted += 1
        return not self.matcher.accept_token(token_id) or self.matcher.is_terminated()

    def valid_prefix(self, proposals: list[int]) -> int:
        """How many of the proposed next tokens the grammar allows in a row, the matcher left as it was. A token
        that would end the grammar (a stop token) is not counted: the target's own token decides the end."""
        accepted, ends = 0, False
        for token_id in proposals:
            if not self.matcher.accept_token(token_id):
                break
            accepted += 1
            if self.matcher.is_terminated():
                ends = True
                break
        self.matcher.rollback(accepted)
        return accepted - ends

    def fill_with_proposals(self, bitmask: torch.Tensor, first_row: int, proposals: list[int]) -> int:
        """The bitmask rows of a row that verifies proposals: the tokens allowed after the request's output so
        far and after each proposal, up to the first proposal the grammar rejects or that would end it (a draft
        model's proposals are not checked before). The target's token there is sampled within the grammar, so it
        rejects such a proposal and the rows after it are never emitted. Returns the number of rows filled."""
        proposals = proposals[:self.valid_prefix(proposals)]
        for offset, token_id in enumerate(proposals):
            self.matcher.fill_next_token_bitmask(bitmask, first_row + offset)
            self.matcher.accept_token(token_id)
        self.matcher.fill_next_token_bitmask(bitmask, first_row + len(proposals))
        self.matcher.rollback(len(proposals))
        return len(proposals) + 1

    def catch_up(self, output_token_ids: list[int]) -> None:
        """Accept the output tokens the matcher has not seen (after a step failed half-way through its outputs)."""
        for token_id in output_token_ids[self.num_accepted:]:
            self.advance(token_id)


class StructuredOutputManager:
    """Compiles grammars for one tokenizer and vocabulary (thread-safe), and fills a step's bitmask."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        self.vocab_size = vocab_size
        info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, cache_limit_bytes=CACHE_LIMIT_BYTES)
        self.batch_matcher = xgr.BatchGrammarMatcher()

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of a request; ValueError naming structured_outputs when it does not compile."""
        any_whitespace = not spec.disable_any_whitespace
        try:
            if spec.json is not None:
                return self.compiler.compile_json_schema(json.dumps(spec.json), any_whitespace=any_whitespace)
            if spec.json_object:  # any object: strict_mode off, or {"type": "object"} would allow only {}
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace,
                                                         strict_mode=False)
            if spec.regex is not None:
                return self.compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return self.compiler.compile_grammar(choice_grammar(spec.choice))
            if "::=" in spec.grammar:  # EBNF (GBNF), as llama.cpp and vLLM write it
                return self.compiler.compile_grammar(spec.grammar)
            return self.compiler.compile_lark(spec.grammar)
        except (RuntimeError, ValueError) as e:  # xgrammar's parse errors are RuntimeErrors
            message = _LOG_PREFIX.sub("", str(e).strip())[:MAX_ERROR_CHARS]
            kind = "json schema" if spec.kind == "json" else spec.kind
            raise RequestError("structured_outputs", f"invalid {kind}: {message}") from None

    def bitmask(self, grammars: list[Grammar | None], num_drafts: np.ndarray | None = None,
                draft_token_ids: np.ndarray | None = None) -> TokenBitmask | None:
        """The bitmask of a step whose sampling rows follow these grammars (None: that row is free), over its
        logits rows: with speculative decoding (num_drafts per sampling row, their proposals in row order) a row
        has 1 + its proposals' logits rows."""
        if num_drafts is None:
            num_drafts = np.zeros(len(grammars), dtype=np.int64)
        groups = num_drafts + 1
        firsts, starts = np.cumsum(groups) - groups, np.cumsum(num_drafts) - num_drafts
        plain = [row for row, grammar in enumerate(grammars) if grammar is not None and not num_drafts[row]]
        drafted = [row for row, grammar in enumerate(grammars) if grammar is not None and num_drafts[row]]
        if not plain and not drafted:
            return None
        bitmask = torch.empty(xgr.get_bitmask_shape(int(groups.sum()), self.vocab_size), dtype=xgr.bitmask_dtype)
        rows = [int(firsts[row]) for row in plain]
        if plain:
            self.batch_matcher.batch_fill_next_token_bitmask([grammars[row].matcher for row in plain], bitmask, rows)
        for row in drafted:
            proposals = draft_token_ids[starts[row]:starts[row] + num_drafts[row]].tolist()
            filled = grammars[row].fill_with_proposals(bitmask, int(firsts[row]), proposals)
            rows += range(int(firsts[row]), int(firsts[row]) + filled)
        return TokenBitmask(bitmask, rows)


def choice_grammar(choices: list[str]) -> str:
    """EBNF for "exactly one of these strings" (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, over the model's vocab_size (rows past the tokenizer's are padding:
    never allowed). Special tokens (those skip_special_tokens drops from the text) are never allowed either, but
    the stop tokens: xgrammar would take "<|im_start|>" for text, and the text would then lack it."""
    stop_token_ids = sorted(t for t in stop_token_ids if 0 <= t < vocab_size) or None
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    vocab = [""] * vocab_size  # "": a token xgrammar never allows
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size:
            vocab[token_id] = token
    for token_id, added in tokenizer.added_tokens_decoder.items():
        if added.special and token_id < vocab_size:
            vocab[token_id] = ""
    return xgr.TokenizerInfo(vocab, detected.vocab_type, vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                             add_prefix_space=detected.add_prefix_space)
