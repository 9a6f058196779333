"""The engine: requests in, one batched model step at a time, tokens out.

    add_request -> WAITING -> step() ... -> RequestOutput(finished=True)
    step() = schedule -> run -> postprocess

Hooks for the disaggregated services: ``prefill_only`` requests stop after their first token
and keep their pages (HELD) until ``release``; every step reports the full blocks it completed
(hash, page id), ``export_blocks`` copies pages out in the wire layout and ``import_blocks``
scatters received blocks into free pages registered in the prefix cache, so a request added
next reuses them instead of recomputing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from pdserve.engine.config import EngineArgs
from pdserve.engine.detokenizer import Detokenizer
from pdserve.engine.guided import GuideFactory
from pdserve.engine.kv_cache import KVCacheManager
from pdserve.engine.logits_process import LogitsState, needs_processing
from pdserve.engine.request import EngineStats, Request, RequestOutput, RequestStatus
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import Sampler, SamplerOutput
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.engine.setup import build_parts
from pdserve.engine.stop import check_stop
from pdserve.errors import BadRequest
from pdserve.hashing import kv_fingerprint
from pdserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.models import LoadedModel


class Engine:
    def __init__(self, lm: LoadedModel, args: EngineArgs | None = None) -> None:
        args = args or EngineArgs()
        cfg = lm.config
        self.args, self.config, self.tokenizer = args, cfg, lm.tokenizer
        # Full attention equals a sliding window only up to the window's length: cap the
        # context there, so a windowed model (Mistral, Mixtral) never drifts from its reference.
        context = min(cfg.max_position_embeddings, cfg.sliding_window or 1 << 62)
        self.max_model_len = min(args.max_model_len or context, context)
        parts = build_parts(lm, args, self.max_model_len)
        device, self.cache, self.kernels = parts.device, parts.cache, parts.kernels
        quant = parts.cache.quant  # fp8/int8 blocks never meet unquantized ones: own hashes
        self.kv_dtype = quant.name if quant else str(cfg.dtype).removeprefix("torch.")
        # What this engine's block hashes cover besides tokens (shared with kvd and router).
        self.fingerprint = kv_fingerprint(cfg.fingerprint, self.kv_dtype)
        self.model_version = lm.version or cfg.fingerprint  # changes with reload.swap_weights
        self.kv = KVCacheManager(parts.num_blocks, args.block_size, self.fingerprint,
                                 args.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.max_num_batched_tokens)
        self.runner = ModelRunner(lm.model, self.kv, parts.backend,
                                  Sampler(args.seed, device, parts.argmax), device,
                                  parts.graphs)
        self.device = device
        self.eos_token_ids = frozenset(cfg.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._pending: list[RequestOutput] = []  # abort notices, delivered by the next step
        self._counters = {"prefill": 0, "decode": 0}
        self.guides = GuideFactory(lm.tokenizer, cfg.vocab_size, cfg.eos_token_ids)

    @classmethod
    def from_model(cls, model: str, args: EngineArgs | None = None) -> Engine:
        """Load a built-in name or a Hugging Face directory and build an engine on it."""
        from pdserve.models import load_model

        args = args or EngineArgs()
        return cls(load_model(model, dtype=args.dtype, device=args.device,
                              packed_weights=args.packed_weights,
                              float32_gemm=args.float32_gemm), args)

    # -- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str = "", prefill_only: bool = False,
                    hold: bool = False, prior_output: int = 0) -> None:
        """Queue a request; raises BadRequest (a ValueError) naming the bad field.

        prefill_only: finish after the first token and keep the pages (a decode engine goes
        on). hold: keep the pages once finished, until ``release``. prior_output: the last
        that many prompt tokens are this request's own output so far (made by a prefill
        engine): its text continues after theirs, and a stop string may begin in them."""
        self._validate(request_id, prompt_token_ids, params)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise BadRequest(f"priority must be an int, got {priority!r}")
        if not isinstance(cache_salt, str):
            raise BadRequest(f"cache_salt must be a str, got {type(cache_salt).__name__}")
        if not 0 <= prior_output < len(prompt_token_ids):
            raise BadRequest(f"prior_output must be in 0..{len(prompt_token_ids) - 1}, "
                             f"got {prior_output}")
        max_len = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
        gen = None
        if params.seed is not None:
            gen = torch.Generator(self.device).manual_seed(params.seed)
        detok = None
        if self.tokenizer is not None:
            replay = prompt_token_ids[len(prompt_token_ids) - prior_output:]
            detok = Detokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output,
                                replay=replay)
        logits_state = self._logits_state(prompt_token_ids, params, prior_output)
        req = Request(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
            arrival=next(self._arrivals), max_len=max_len,
            eos_token_ids=self.eos_token_ids, priority=priority,
            cache_salt=cache_salt, prefill_only=prefill_only, hold=hold or prefill_only,
            generator=gen, detok=detok, logits_state=logits_state)
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _logits_state(self, prompt: list[int], params: SamplingParams,
                      prior_output: int) -> LogitsState | None:
        """Grammar, bias and penalties, with the prior output replayed (the hand-off)."""
        if not needs_processing(params):
            return None
        prior = prompt[len(prompt) - prior_output:]
        guide = None if params.structured is None else self.guides.guide(params.structured,
                                                                         prior)
        return LogitsState(params, prompt, prior_output, guide)

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise BadRequest(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise BadRequest(f"params must be SamplingParams, got {type(params).__name__}")
        if len(prompt) == 0:
            raise BadRequest("prompt must not be empty")
        if len(prompt) >= self.max_model_len:
            raise BadRequest(f"prompt has {len(prompt)} tokens; the model's context "
                             f"(max_model_len) is {self.max_model_len}, leaving no room to "
                             "generate")
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"prompt token ids must be in [0, {vocab}) (vocab_size); "
                             f"got {bad[:5]}")
        bad = [t for t, _ in params.logit_bias if t >= vocab]  # type: ignore[misc]
        if bad:
            raise BadRequest(f"logit_bias: token ids must be < vocab_size {vocab}, "
                             f"got {bad[:5]}")
        max_len = min(len(prompt) + params.max_tokens, self.max_model_len)
        if self.kv.num_blocks_for(max_len) > self.kv.pool.num_blocks:
            raise BadRequest(f"prompt + max_tokens ({max_len} tokens) needs more KV blocks "
                             f"than the cache has (num_blocks={self.kv.pool.num_blocks})")
        if params.stop and self.tokenizer is None:
            raise BadRequest("stop strings need a tokenizer; this model has none")

    def abort(self, request_id: str) -> bool:
        """Stop a request at any point and free its pages; False if it is unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.status == RequestStatus.HELD:
            self.release(request_id)
            return True
        self.scheduler.finish(req, "abort")
        del self.requests[request_id]
        self._pending.append(RequestOutput(request_id, [], finished=True, finish_reason="abort"))
        return True

    def release(self, request_id: str) -> None:
        """Free the pages a finished held (prefill_only or ``hold``) request still has."""
        req = self.requests.get(request_id)
        if req is None or req.status != RequestStatus.HELD:
            raise ValueError(f"request_id {request_id!r} is not a finished held request")
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        del self.requests[request_id]

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._pending)

    # -- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        sampled = self.runner.run(batch)
        return self._postprocess(batch, sampled)

    def _postprocess(self, batch: ScheduledBatch,
                     sampled: SamplerOutput | None) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if batch.is_empty and self.scheduler.waiting and not self.scheduler.running:
            raise RuntimeError("no request can be scheduled: the KV cache is full of pages "
                               f"held by {self._num_held()} prefill_only requests")
        results = iter(zip(sampled.token_ids, sampled.logprobs, strict=True) if sampled else ())
        for req, num_new in zip(batch.reqs, batch.num_new_tokens, strict=True):
            is_prefill = num_new > 1 or req.is_prefilling
            kind = "prefill" if is_prefill else "decode"
            self._counters[kind] += num_new
            req.num_computed_tokens += num_new
            out = RequestOutput(req.request_id, [], new_full_blocks=self.kv.commit(req),
                                num_prompt_tokens=req.num_prompt_tokens,
                                num_prefix_hit_tokens=req.num_prefix_hit_tokens)
            if req.num_computed_tokens == req.num_tokens:
                token, logprob = next(results)
                req.token_ids.append(token)
                out.new_token_ids = [token]
                out.logprobs = None if logprob is None else [logprob]
                if req.detok is not None:
                    req.detok.append(token)
                if req.logits_state is not None:
                    req.logits_state.accept(token)
                if req.params.prompt_logprobs is not None and req.num_computed_tokens == (
                        req.num_prompt_tokens):  # the first token: the prompt is all scored
                    out.prompt_logprobs = list(req.prompt_logprobs)
                reason = check_stop(req)
                if reason is not None or req.prefill_only:
                    self._finish(req, reason, out)
                elif req.detok is not None:
                    out.text = req.detok.take()
            if out.new_token_ids or out.new_full_blocks or out.finished:
                outputs.append(out)
        return outputs

    def _finish(self, req: Request, reason: str | None, out: RequestOutput) -> None:
        """``reason`` None: a prefill_only request whose first token does not end it."""
        self.scheduler.finish(req, reason or "stop")
        out.finished, out.finish_reason = True, reason
        if req.detok is not None:
            out.text = req.detok.take() if reason is None else req.detok.finish()
        if req.status == RequestStatus.HELD:
            num_full = req.num_computed_tokens // self.kv.block_size
            out.block_hashes = req.block_hashes[:num_full]
            out.page_ids = self.kv.blocks_of(req.request_id)[:num_full]
        else:
            del self.requests[req.request_id]

    # -- KV block transfer ----------------------------------------------------------------

    def page_of(self, block_hash: bytes, page_id: int) -> int | None:
        """The page holding ``block_hash`` now: a page reported earlier may have been freed
        (preemption) and reused since; then another page with those tokens' KV, or None."""
        if not self.args.enable_prefix_caching:
            return page_id
        return self.kv.pool.lookup(block_hash)

    def export_blocks(self, page_ids: list[int], out: torch.Tensor) -> None:
        """Copy pages into ``out`` [n, layers, 2, block_size, kv_heads, head_dim]."""
        bad = [p for p in page_ids if not 0 <= p < self.kv.pool.num_blocks]
        if bad:
            raise ValueError(f"page_ids out of range [0, {self.kv.pool.num_blocks}): {bad[:5]}")
        self.cache.export_pages(page_ids, out)

    def import_blocks(self, hashes: list[bytes],
                      data: torch.Tensor | Sequence[torch.Tensor],
                      scatter: Callable[[list[int], list[torch.Tensor]], None] | None = None
                      ) -> int:
        """Scatter wire-layout blocks (``data[i]`` is block i) into free pages, cached under
        ``hashes`` (a chain from the first block). Returns how many were newly imported
        (already cached ones and those beyond the free pages are skipped). ``scatter(pages,
        blocks)`` replaces the synchronous copy (the kvd staging's pinned, async one)."""
        if not self.args.enable_prefix_caching:
            raise ValueError("import_blocks needs enable_prefix_caching=True")
        if len(data) != len(hashes):
            raise ValueError(f"data has {len(data)} blocks but hashes has {len(hashes)}")
        todo, pages, pinned = self.kv.import_begin(hashes)
        if todo and scatter is not None:
            scatter(pages, [data[i] for i in todo])
        elif todo:
            block_data = data if isinstance(data, torch.Tensor) else torch.stack(list(data))
            self.cache.import_pages(pages, block_data[torch.tensor(todo)])
        self.kv.import_end([hashes[i] for i in todo], pages, pinned)
        return len(todo)

    # -- introspection --------------------------------------------------------------------

    def _num_held(self) -> int:
        return sum(1 for r in self.requests.values() if r.status == RequestStatus.HELD)

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_waiting=len(self.scheduler.waiting), num_running=len(self.scheduler.running),
            num_held=self._num_held(), num_blocks_free=pool.num_free,
            num_blocks_used=pool.num_used, num_blocks_cached=pool.num_cached,
            num_prefill_tokens=self._counters["prefill"],
            num_prefix_hit_tokens=self.scheduler.prefill.num_hit_tokens,
            num_decode_tokens=self._counters["decode"],
            num_preemptions=self.scheduler.decode.num_preemptions)

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    def reset_prefix_cache(self) -> int:
        return self.kv.pool.reset_prefix_cache()

    def reset_counters(self) -> None:
        """Zero the cumulative counters ``stats`` reports (after work that was not serving,
        e.g. ``calibrate.measure`` at start)."""
        self._counters = {"prefill": 0, "decode": 0}
        self.scheduler.prefill.num_hit_tokens = 0
        self.scheduler.decode.num_preemptions = 0
