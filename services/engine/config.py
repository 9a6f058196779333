"""The configuration both engine services share: every setting declared once (``pdserve.env``).

``PrefillConfig`` and ``DecodeConfig`` only change the port, the default role and the roles
they accept; a flex engine starts in its service's ``HOME_ROLE``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pdserve.attention import BACKENDS
from pdserve.attention.cpu_decode import MODES as NATIVE_MODES
from pdserve.attention.kv_quant import KV_CACHE_DTYPES
from pdserve.engine.config import DTYPE_NAMES, EngineArgs
from pdserve.env import (
    BLOCK_SIZE,
    BOOL,
    NAME,
    OPTIONAL_ADDRESS,
    STR,
    ConfigError,
    choice_kind,
    float_kind,
    int_kind,
    redis_url_setting,
    setting,
)
from pdserve.models.packed import FLOAT32_GEMMS
from pdserve.roles import Role
from pdserve.server import GrpcServiceConfig


def role_setting(default: Role) -> Any:
    return setting(str(default), choice_kind(*Role),
                   "engine role; flex instances may switch between prefill, decode and colocated")


@dataclass(frozen=True)
class EngineServiceConfig(GrpcServiceConfig):
    ROLES: ClassVar[tuple[Role, ...]] = tuple(Role)
    HOME_ROLE: ClassVar[Role] = Role.PREFILL

    model: str = setting("tiny", NAME,
                         "built-in model name (tiny, tiny-moe, bench-50m) or HF directory")
    dtype: str = setting("auto", choice_kind(*DTYPE_NAMES),
                         "weights dtype; auto = the checkpoint's (float32 ones run in bfloat16 "
                         "on CUDA)")
    device: str = setting("cpu", NAME, "torch device of the engine: cpu, cuda or cuda:N")
    gpu_memory_utilization: float = setting(
        0.9, float_kind(0.0),
        "share of the CUDA device's memory this engine may use (weights, activations, KV "
        "cache); the KV cache gets what is left (with --num-blocks 0)")
    cuda_graphs: bool = setting(True, BOOL,
                                "replay decode steps from CUDA graphs (CUDA with FlashInfer)")
    role: str = role_setting(Role.PREFILL)
    kvd: str = setting("", OPTIONAL_ADDRESS, "this node's kvd gRPC address; empty = no kvd")
    block_size: int = setting(16, BLOCK_SIZE, "tokens per KV block")
    num_blocks: int = setting(0, int_kind(0), "KV blocks in the engine cache; 0 = from memory")
    max_num_seqs: int = setting(64, int_kind(1), "most sequences in one running batch")
    max_num_batched_tokens: int = setting(512, int_kind(1),
                                          "token budget of one step (chunked prefill)")
    max_queued: int = setting(256, int_kind(1),
                              "most queued requests before RESOURCE_EXHAUSTED")
    max_prompt_tokens: int = setting(0, int_kind(0),
                                     "longest accepted prompt; 0 = model context")
    attention_backend: str = setting("auto", choice_kind(*BACKENDS), "attention kernels")
    kv_cache_dtype: str = setting(
        "auto", choice_kind(*KV_CACHE_DTYPES),
        "KV cache dtype: auto = the model's; fp8 (e4m3) or int8 with per-token per-head scales "
        "(engines exchange blocks only with the same one)")
    packed_weights: bool = setting(
        True, BOOL, "pre-pack the CPU GEMM weights at load: faster decode, but in float32 the "
        "packed copy sits beside the plain weight (several times its size); off = plain only")
    float32_gemm: str = setting(
        "mkl", choice_kind(*FLOAT32_GEMMS),
        "whose packed GEMM serves float32 weights: mkl = bit-identical to transformers' "
        "F.linear; onednn = not bit-identical (another summation order) but 1.2-1.5x faster "
        "where MKL does not run its AVX-512 code (an AMD EPYC)")
    decode_mirror_mib: int = setting(
        -1, int_kind(-1),
        "most MiB the CPU decode mirror may hold (a dense copy of the running decode batch's "
        "K/V, so a step skips the paged gather); -1 = as much as the KV cache, at most 1024; "
        "0 = none")
    native_kernels: str = setting(
        "auto", choice_kind(*NATIVE_MODES),
        "pdserve's C++ CPU kernels (decode attention; RMSNorm and SiLU-and-mul in bfloat16): "
        "need AVX2 and FMA (AVX-512 and AVX-512-BF16 used where present), built once with "
        "the machine's C++ compiler and cached in $PDSERVE_KERNEL_CACHE; auto = where they "
        "can run, else torch's ops; on = fail where they cannot; off = torch's ops")
    calibrate: bool = setting(
        False, BOOL, "measure this engine's prefill rate and decode steps at start (~1-3 s on "
        "a CPU core for a 50M model) and report them in Stats, for the P:D controller to start "
        "from; `pdserve up --controller` turns it on")
    threads: int = setting(0, int_kind(0), "torch CPU threads; 0 = torch's default")
    redis_url: str = redis_url_setting()
    advertise: str = setting("", OPTIONAL_ADDRESS,
                             "address others reach this instance at (default host:port)")
    max_model_len: int = setting(0, int_kind(0),
                                 "longest sequence (prompt + output); 0 = model's")
    default_max_tokens: int = setting(256, int_kind(1),
                                      "max_tokens when a request leaves it 0")
    kvd_timeout: float = setting(
        30.0, float_kind(0.01),
        "seconds a kvd call may take (a decode's own RPC deadline wins when shorter)")
    registry_prefix: str = setting("pdserve:", STR,
                                   "key prefix of the instance registry in Redis")
    registry_ttl: float = setting(
        10.0, float_kind(0.5),
        "seconds the registry entry lives without a heartbeat (beats every ttl/3)")
    stats_window: float = setting(10.0, float_kind(0.1),
                                  "seconds of the recent tokens/s window")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.role not in self.ROLES:
            raise ConfigError(f"--role: this service runs one of "
                              f"{', '.join(self.ROLES)}, got {self.role!r}")
        if self.role != Role.COLOCATED and not self.kvd and self.redis_url:
            # Registered disaggregated instances without a kvd could never hand blocks over.
            raise ConfigError(f"--kvd: role {self.role} registered in Redis needs the "
                              "node's kvd")
        self.engine_args()  # raises on a bad engine knob, naming it

    @property
    def is_flex(self) -> bool:
        return self.role == Role.FLEX

    @property
    def initial_role(self) -> Role:
        """The role the engine runs first: its own, or for flex its service's home role."""
        return self.HOME_ROLE if self.is_flex else Role(self.role)

    def engine_args(self) -> EngineArgs:
        try:
            return EngineArgs(
                block_size=self.block_size, num_blocks=self.num_blocks or None,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=self.max_model_len or None,
                attention_backend=self.attention_backend, dtype=self.dtype,
                kv_cache_dtype=self.kv_cache_dtype,
                device=self.device, gpu_memory_utilization=self.gpu_memory_utilization,
                cuda_graphs=self.cuda_graphs, packed_weights=self.packed_weights,
                float32_gemm=self.float32_gemm,
                decode_mirror_memory_bytes=(None if self.decode_mirror_mib < 0
                                            else self.decode_mirror_mib << 20),
                native_kernels=self.native_kernels)
        except ValueError as exc:
            field, _, rest = str(exc).partition(" ")  # every message starts with its field
            raise ConfigError(f"--{field.replace('_', '-')} {rest}") from exc
