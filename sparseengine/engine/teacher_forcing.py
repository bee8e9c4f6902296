"""Teacher-forced decode (``LLM.teacher_forced``): each request is prefilled as usual, then
decoded through the method's real decode path (its selection, eviction and compression run
as in ``generate``), except that the token fed at each step is the given continuation's,
not the sampled one. Per step it keeps the float32 logits and, when asked, every layer's
attention output (the attention op's output before the o projection).

The forcing enters the engine at one place: ``LLM.step`` takes its tokens from
``Forcing.tokens`` instead of the sampler while a forcing is set, and launches them like
sampled tokens, so asynchronous scheduling feeds them the same way. An attention capture
(``AttentionCapture``) hooks every layer's o projection for the call only; while one is
set the runner runs every step eagerly (a replayed CUDA graph would not run the hooks).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from sparseengine.config import ConfigError
from sparseengine.engine.sequence import Sequence
from sparseengine.sampling_params import SamplingParams


@dataclass(frozen=True)
class TeacherForcedOutput:
    """One request of ``LLM.teacher_forced``. Row i of ``logits`` predicts
    ``continuation[i]``: row 0 comes from the prompt's last position (the prefill), row
    i > 0 from the decode step that fed ``continuation[i - 1]``. ``attention`` (when
    captured): the same positions' attention outputs, ``[n, num_layers, num_heads *
    head_dim]`` float32 on the CPU. ``preemptions``: times the pool ran out and the request
    was prefilled again (prompt + the continuation so far), so the row after each came from
    a prefill, not a decode step."""
    request_id: int
    prompt_token_ids: list[int]
    continuation: list[int]
    logits: torch.Tensor
    attention: torch.Tensor | None
    preemptions: int


class AttentionCapture:
    """Forward pre-hooks on every layer's o projection: the attention output rows of the
    step that ``select`` names (its sampled rows), kept per layer on the device."""

    def __init__(self, model) -> None:
        self.num_layers = len(model.layers)
        self._rows: torch.Tensor | None = None
        self._out: list[torch.Tensor | None] = [None] * self.num_layers
        self._handles = [layer.self_attn.o_proj.register_forward_pre_hook(partial(self._hook, i))
                         for i, layer in enumerate(model.layers)]

    def select(self, rows: list[int], device: torch.device) -> None:
        """The rows (offsets among the step's tokens) the next forward keeps."""
        self._rows = torch.tensor(rows, dtype=torch.long, device=device)
        self._out = [None] * self.num_layers

    def _hook(self, layer: int, module, args) -> None:
        if self._rows is not None:
            self._out[layer] = args[0].index_select(0, self._rows).float()

    def take(self) -> torch.Tensor:
        """The last forward's kept rows: ``[rows, num_layers, num_heads * head_dim]`` on the CPU."""
        missing = [i for i, out in enumerate(self._out) if out is None]
        if missing or self._rows is None:
            raise RuntimeError(f"no attention output captured for layers {missing}: the step ran no eager forward")
        out = torch.stack(self._out, dim=1).cpu()
        self._rows, self._out = None, [None] * self.num_layers
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class Forcing:
    """The continuations of a ``teacher_forced`` call, by request, and what each step gave them."""

    def __init__(self, seqs: list[Sequence], continuations: list[list[int]],
                 capture: AttentionCapture | None) -> None:
        self.continuation = {s.seq_id: c for s, c in zip(seqs, continuations)}
        self.logits: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        self.attention: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        self.capture = capture

    def tokens(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Keep this step's logits (and attention outputs) of ``seqs``, and return the tokens
        they are fed next: each one's continuation token at its output index (a request's
        output list holds the tokens fed so far, the last maybe still a placeholder)."""
        rows = logits.to("cpu", torch.float32, copy=True)  # a graph's logits are its buffer's, rewritten each replay
        attention = self.capture.take() if self.capture is not None else None
        fed = []
        for i, seq in enumerate(seqs):
            cont = self.continuation.get(seq.seq_id)
            if cont is None:
                raise RuntimeError(f"request {seq.seq_id} is not teacher-forced: generate and teacher_forced "
                                   "do not share an engine's steps")
            self.logits[seq.seq_id].append(rows[i])
            if attention is not None:
                self.attention[seq.seq_id].append(attention[i])
            fed.append(cont[len(seq.output_token_ids)])
        return torch.tensor(fed, dtype=torch.long, device=logits.device)

    def output(self, seq: Sequence) -> TeacherForcedOutput:
        sid = seq.seq_id
        return TeacherForcedOutput(
            request_id=sid, prompt_token_ids=list(seq.prompt_token_ids), continuation=list(self.continuation[sid]),
            logits=torch.stack(self.logits[sid]),
            attention=torch.stack(self.attention[sid]) if self.capture is not None else None,
            preemptions=seq.num_preemptions)


def forced_requests(llm, prompts, continuations) -> tuple[list[Sequence], list[list[int]]]:
    """The requests of ``llm.teacher_forced`` and their continuations as token ids, every
    one checked before any runs: a ConfigError names the first bad one."""
    if isinstance(prompts, str) or isinstance(continuations, str) or not all(
            isinstance(x, (str, list, tuple)) for x in [*prompts, *continuations]):
        raise ConfigError("teacher_forced takes a list of prompts and a list of continuations, one per prompt "
                          "(each a string or a list of token ids)")
    prompts, continuations = list(prompts), list(continuations)
    if len(prompts) != len(continuations):
        raise ConfigError(f"{len(prompts)} prompts but {len(continuations)} continuations: give one per prompt")
    vocab, ps = llm.model_config.vocab_size, llm.config.page_size
    seqs, conts = [], []
    for i, (prompt, continuation) in enumerate(zip(prompts, continuations)):
        ids, cont = llm._tokenize(prompt, False), llm._tokenize(continuation, False)
        if not cont:
            raise ConfigError(f"continuation {i} is empty: teacher forcing needs at least one token")
        _check_vocab(ids, vocab, f"prompt {i}")
        _check_vocab(cont, vocab, f"continuation {i}")
        seq = Sequence(ids, SamplingParams(temperature=0, max_tokens=len(cont), ignore_eos=True),
                       llm.model_config.num_layers)
        error = llm.scheduler.validate(seq, llm.method.cache_tokens_needed(len(ids)))
        if error is not None:
            raise ConfigError(f"request {i}: {error}")
        if len(ids) + len(cont) > llm.max_model_len:
            raise ConfigError(f"request {i}: prompt ({len(ids)} tokens) + continuation ({len(cont)}) is longer "
                              f"than max_model_len={llm.max_model_len}")
        pages = -(-llm.kv_tokens_needed(len(ids), len(cont)) // ps)
        if pages > llm.allocator.num_pages:
            raise ConfigError(f"request {i} needs {pages} KV pages but the pool holds {llm.allocator.num_pages}; "
                              "raise kv_cache_memory / gpu_memory_utilization or num_kv_pages")
        seqs.append(seq)
        conts.append(cont)
    return seqs, conts


def _check_vocab(ids: list[int], vocab_size: int, what: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ConfigError(f"{what} holds token id {bad}, outside the vocabulary [0, {vocab_size})")
