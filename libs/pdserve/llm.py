"""Offline API: ``LLM(model).generate(prompts, params) -> list[Completion]``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from pdserve.engine.config import EngineArgs
from pdserve.engine.engine import Engine
from pdserve.engine.request import Logprob
from pdserve.sampling_params import SamplingParams

Prompt = str | Sequence[int]


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    logprobs: list[Logprob] | None = None
    # With params.prompt_logprobs: entry i scores prompt token i + 1 (the first has none).
    prompt_logprobs: list[Logprob] | None = None


class LLM:
    """One in-process engine. ``model``: a built-in name ("tiny", "tiny-moe", "bench-50m") or
    a Hugging Face directory; ``engine_args``: any EngineArgs field."""

    _ids = itertools.count()

    def __init__(self, model: str, dtype: str = "auto", **engine_args: Any) -> None:
        known = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        self.engine = Engine.from_model(model, EngineArgs(dtype=dtype, **engine_args))
        self.tokenizer = self.engine.tokenizer

    @classmethod
    def from_engine(cls, engine: Engine) -> LLM:
        """Wrap an existing engine (tests, or a caller that built the model itself)."""
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        return llm

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            return list(self.tokenizer.encode(prompt))
        ids = list(prompt) if isinstance(prompt, Sequence) else [prompt]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt must be a string or a list of int token ids")
        return ids  # type: ignore[return-value]  # checked element-wise above

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[Completion]:
        batch = _as_prompt_list(prompts)
        plist = _as_params_list(params, len(batch))
        encoded = [self.encode(p) for p in batch]
        ids = [f"llm-{next(self._ids)}" for _ in encoded]
        added: list[str] = []
        try:
            for rid, prompt, p in zip(ids, encoded, plist, strict=True):
                self.engine.add_request(rid, prompt, p)
                added.append(rid)
        except ValueError:
            for rid in added:
                self.engine.abort(rid)
            self.engine.step()  # drain the abort notices
            raise
        return self._run(ids, encoded, plist)

    def _run(self, ids: list[str], prompts: list[list[int]],
             plist: list[SamplingParams]) -> list[Completion]:
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        logprobs: dict[str, list[Logprob]] = {rid: [] for rid in ids}
        prompt_logprobs: dict[str, list[Logprob] | None] = {}
        done: dict[str, str] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                tokens[out.request_id] += out.new_token_ids
                texts[out.request_id].append(out.text)
                logprobs[out.request_id] += out.logprobs or []
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.finished:
                    done[out.request_id] = out.finish_reason or "stop"
        if not self.engine.has_unfinished():
            self.engine.check_integrity()  # idle: every page is free or cached
        results = []
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            results.append(Completion(prompt, tokens[rid], "".join(texts[rid]), done[rid],
                                      logprobs[rid] if p.logprobs is not None else None,
                                      prompt_logprobs.get(rid)))
        return results


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items: list[Any] = list(prompts)
    if not items:
        raise ValueError("prompts must not be empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # one prompt given as token ids
    return items


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None,
                    n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    plist = list(params)
    if len(plist) != n:
        raise ValueError(f"params has {len(plist)} entries for {n} prompts")
    return plist
