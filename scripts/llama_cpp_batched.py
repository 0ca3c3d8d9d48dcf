"""Greedy batched generation on llama.cpp through llama-cpp-python's low-level API, for the
benchmark scripts: N sequences share one context, and each step is one `llama_decode` call.

    prompts (N x L) ──one llama_decode, logits on each prompt's last token──> first tokens
    then output_len - 1 times: one llama_decode over N tokens (one per sequence) ──> next tokens

Each sequence has its own seq_id; its tokens carry positions 0, 1, ... in that sequence. The
context holds N sequences of up to `max_seq_len` tokens; with kv_unified off (llama.cpp's
default, and its advice when sequences share no prefix) each sequence gets its own KV stream.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import llama_cpp as lc
import numpy as np


class BatchedLlama:
    """One llama.cpp model and context for up to `n_seq` concurrent greedy sequences."""

    def __init__(self, gguf: Path, n_seq: int = 32, max_seq_len: int = 256,
                 max_prompt_tokens: int = 4096, n_ubatch: int = 512,
                 n_threads: int | None = None, verbose: bool = False):
        # llama-cpp-python routes llama.cpp's log through this logger; ERROR hides the load chatter
        logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if verbose else logging.ERROR)
        lc.llama_backend_init()
        self.n_seq = n_seq
        self.model = lc.llama_model_load_from_file(str(gguf).encode(),
                                                   lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = lc.llama_context_default_params()
        params.n_ctx = n_seq * max_seq_len  # split evenly: max_seq_len per sequence
        params.n_seq_max = n_seq
        params.n_batch = max(max_prompt_tokens, n_seq)  # all prompts in one llama_decode
        params.n_ubatch = min(n_ubatch, params.n_batch)
        params.n_threads = params.n_threads_batch = n_threads or os.cpu_count()
        params.kv_unified = False
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context "
                               f"(n_ctx {params.n_ctx}, n_seq_max {n_seq})")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(params.n_batch, 0, 1)  # one seq_id per token

    def close(self) -> None:
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.ctx)
        lc.llama_model_free(self.model)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode over items (token, pos, seq_id, wants_logits); returns the greedy
        next token for each item that wants logits, in order."""
        b = self.batch
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0] = tok, pos, 1, seq
            b.logits[i] = int(out)
        b.n_tokens = len(items)
        rc = lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(items)} tokens")
        nxt = []
        for i, (_, _, _, out) in enumerate(items):
            if out:
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, i),
                                               shape=(self.n_vocab,))  # (vocab,)
                nxt.append(int(logits.argmax()))
        return nxt

    def generate(self, prompts: list[list[int]], output_len: int) -> dict:
        """Greedy-generate output_len tokens for each prompt, all at once.

        Returns:
            tokens (one list per prompt), prefill_s (prompts in, first tokens out),
            decode_s (the remaining output_len - 1 steps), total_s.
        """
        n = len(prompts)
        assert 0 < n <= self.n_seq and output_len >= 1
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        last = self._decode([(tok, pos, seq, pos == len(p) - 1)
                             for seq, p in enumerate(prompts) for pos, tok in enumerate(p)])
        t_first = time.perf_counter()
        out = [[t] for t in last]
        for step in range(output_len - 1):
            last = self._decode([(last[seq], len(prompts[seq]) + step, seq, True)
                                 for seq in range(n)])
            for seq, t in enumerate(last):
                out[seq].append(t)
        t_end = time.perf_counter()
        return {"tokens": out, "prefill_s": t_first - t0, "decode_s": t_end - t_first,
                "total_s": t_end - t0}
