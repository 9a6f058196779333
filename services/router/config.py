"""Configuration of the router service: every setting declared once (``pdserve.env``).

Every field is a flag of ``python -m services.router`` with a ``PDSERVE_ROUTER_*`` twin.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.controller.capacity import CalibrationError, starting_model
from pdserve.controller.optimizer import PREFERENCES
from pdserve.env import (
    ADDRESSES,
    BLOCK_SIZE,
    BOOL,
    NAME,
    STR,
    TOKENS,
    ConfigError,
    choice_kind,
    float_kind,
    int_kind,
    port_setting,
    redis_url_setting,
    setting,
)
from pdserve.server import LOOPS, GrpcServiceConfig
from pdserve.tool_calls import PARSERS
from services.router.policy import POLICIES
from services.router.quotas import load_quotas
from services.router.slo_admission import SLO_ADMISSION_MODES

CONTROLLER_MODES = ("off", "dry-run", "in-place", "kubernetes")


@dataclass(frozen=True)
class RouterConfig(GrpcServiceConfig):
    SERVICE = "router"

    port: int = port_setting(50051)
    redis_url: str = redis_url_setting()
    model: str = setting("tiny", NAME, "model (tokenizer, chat template) the cluster serves")
    served_model_name: tuple[str, ...] = setting(
        (), TOKENS, "names clients use for the model, comma-separated (default: --model)")
    tool_call_parser: str = setting(
        "auto", choice_kind("auto", *PARSERS),
        "the model family's tool-call format (auto: read from the chat template)")
    policy: str = setting("cache_aware", choice_kind(*POLICIES), "routing policy")
    loop: str = setting("auto", choice_kind(*LOOPS), "event loop of the standalone router; "
                        "auto = uvloop when installed (pdserve[fast]), else asyncio (embedded "
                        "in a gateway: the gateway's --loop)")
    prefill: tuple[str, ...] = setting(
        (), ADDRESSES, "static prefill instances host:port (besides the registry)")
    decode: tuple[str, ...] = setting((), ADDRESSES,
                                      "static decode (or colocated) instances host:port")
    block_size: int = setting(16, BLOCK_SIZE, "tokens per KV block (as the engines)")
    max_prompt_tokens: int = setting(0, int_kind(0), "longest accepted prompt in tokens; "
                                     "0 = the model's context length less one")
    max_prompt_bytes: int = setting(0, int_kind(0), "largest prompt text in UTF-8 bytes, "
                                    "checked before tokenizing; 0 = 32 x --max-prompt-tokens")
    max_tokens: int = setting(4096, int_kind(1), "largest accepted max_tokens")
    max_concurrent: int = setting(1024, int_kind(1), "most requests in flight")
    max_queued: int = setting(4096, int_kind(0),
                              "most requests waiting for a --max-concurrent slot; beyond: 429")
    max_wait: float = setting(30.0, float_kind(0.0), "seconds a request may wait while every "
                              "engine answers busy (KV cache or queue full) before a 429")
    health_failures: int = setting(3, int_kind(1), "consecutive timed-out Stats calls (a busy "
                                   "engine) before an instance leaves the rotation; a timed-out "
                                   "health check (a paused or hung process) takes it out at once")
    first_answer_timeout: float = setting(
        3.0, float_kind(0.01), "seconds an engine call may bring nothing (a prefill's answer, "
        "a decode's first chunk) before the engine is probed (--probe-timeout); one that does "
        "not answer is left and the request goes on on another instance")
    stall_timeout: float = setting(3.0, float_kind(0.01), "seconds a decode stream may bring no "
                                   "chunk before the engine is probed, as --first-answer-timeout")
    probe_timeout: float = setting(2.0, float_kind(0.01), "seconds an engine silent on a call "
                                   "has to answer a health check before the call is left")
    quotas_file: str = setting("", STR, "per-tenant quotas file (JSON); empty = no quotas")
    max_retries: int = setting(2, int_kind(0), "extra attempts on another instance")
    poll_interval: float = setting(1.0, float_kind(0.05),
                                   "seconds between instance health/stats polls")
    recheck_interval: float = setting(
        0.2, float_kind(0.01), "seconds between health checks of the instances out of the "
        "rotation (a restarted engine is back within this of answering)")
    registry_prefix: str = setting("pdserve:", STR,
                                   "key prefix of the instance registry in Redis")
    index_prefix: str = setting("pdserve:", STR,
                                "key prefix of the prefix index (as the kvds)")
    index_timeout: float = setting(
        0.05, float_kind(0.001),
        "seconds one index lookup may take before routing by load only")
    # The P:D controller (docs/controller.md), run inside the router.
    controller: str = setting("off", choice_kind(*CONTROLLER_MODES),
                              "the P:D controller: off, dry-run (decides and logs only), "
                              "in-place (switches flex engines), kubernetes (scales Deployments)")
    slo_ttft_ms: float = setting(2000.0, float_kind(1.0),
                                 "time-to-first-token SLO the controller plans for and "
                                 "--slo-admission enforces (ms)")
    slo_tpot_ms: float = setting(100.0, float_kind(1.0),
                                 "time-per-output-token SLO the controller plans for (ms)")
    controller_interval: float = setting(10.0, float_kind(0.1), "seconds between decisions")
    controller_window: float = setting(30.0, float_kind(1.0),
                                       "seconds of load and Stats each decision looks at")
    controller_dwell: float = setting(30.0, float_kind(0.0),
                                      "least seconds a plan stays in force (no flapping)")
    controller_margin: float = setting(0.1, float_kind(0.0), "a new plan must serve this "
                                       "fraction more than the plan in force to replace it")
    controller_stabilize: float = setting(0.0, float_kind(0.0),
                                          "a new plan must be the best for this many seconds "
                                          "before it replaces one that serves the load (or one "
                                          "that does not, when it does not either)")
    controller_prefer: str = setting(
        "split", choice_kind(*PREFERENCES),
        "split: the best prefill/decode split while it serves the forecast load x (1 + "
        "--controller-headroom), colocated only when no split keeps up (disaggregation's ITL); "
        "goodput: the plan of the most modelled goodput")
    controller_headroom: float = setting(0.2, float_kind(0.0), "--controller-prefer split: a "
                                         "split is chosen when it serves this fraction more "
                                         "than the forecast load")
    controller_colocated: bool = setting(
        True, BOOL, "the controller may choose colocated plans (in place: flex engines switch "
        "to colocated); false keeps a prefill/decode split")
    controller_chunk: int = setting(
        0, int_kind(0), "prompt tokens a step of an engine the controller switches to "
        "colocated may carry; 0: sized from the TPOT SLO and the starting calibration (a "
        "decode step plus the chunk within --slo-tpot-ms), at most the engine default's 512")
    controller_calibration: str = setting(
        "", STR, "a `pdserve bench engine --json` run of the engines' model, dtype and "
        "--threads to start the capacity model from (and to size --controller-chunk 0 and "
        "--slo-admission by until Stats refit it); empty: the engines' own measurements "
        "(engine --calibrate) when every engine has them, else the shipped 2-core run")
    controller_lease_ms: int = setting(5000, int_kind(30), "leader lease among routers sharing "
                                       "Redis (ms); a dead leader's lapses after this")
    slo_admission: str = setting("off", choice_kind(*SLO_ADMISSION_MODES),
                                 "a request predicted to miss --slo-ttft-ms: queue (held until "
                                 "it fits, up to --max-wait), reject (429), off")
    controller_namespace: str = setting("pdserve", NAME, "kubernetes: the Deployments' namespace")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.prefill and not self.decode and not self.redis_url:
            raise ConfigError("--prefill/--decode/--redis-url: no instances: give static "
                              "instances or a Redis registry")
        if self.quotas_file:
            load_quotas(self.quotas_file)  # fail at startup, naming the file, not per request
        if self.controller_calibration:
            try:
                starting_model(self.controller_calibration)
            except CalibrationError as exc:
                raise ConfigError(f"--controller-calibration: {exc}") from None
