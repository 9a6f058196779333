"""Configuration of the kvd service: every setting declared once (``pdserve.env``).

Every field is a flag of ``python -m services.kvd`` with a ``PDSERVE_KVD_*`` twin;
``fault_*`` fields are test hooks only.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.env import (
    ADDRESSES,
    BOOL,
    STR,
    ConfigError,
    choice_kind,
    float_kind,
    int_kind,
    port_setting,
    redis_url_setting,
    setting,
)
from pdserve.server import GrpcServiceConfig
from services.kvd.wirecodec import CODECS


@dataclass(frozen=True)
class KvdConfig(GrpcServiceConfig):
    SERVICE = "kvd"

    port: int = port_setting(50081)
    redis_url: str = redis_url_setting()
    node_id: str = setting("", STR, "node id in the index (default: host:port)")
    capacity_mib: int = setting(1024, int_kind(1), "shared-memory pool size in MiB")
    ucx_host: str = setting(
        "127.0.0.1", STR,
        "address whose network interface UCX may use (empty or 0.0.0.0 = every one)")
    ucx_tls: str = setting(
        "^cma", STR, "UCX_TLS transports; default: every one but CMA (shared memory and TCP "
        "on a host, RDMA between hosts); empty = UCX's own default")
    ucx_error_handling: bool = setting(
        False, BOOL, "UCX peer-failure handling on endpoints: on between hosts (a lost peer's "
        "endpoint is then closed at once, not flushed); off keeps shared memory on one host")
    lease_ms: int = setting(30000, int_kind(100), "default lease of a pin, milliseconds")
    max_lease_ms: int = setting(60000, int_kind(100),
                                "longest lease a client may ask for, milliseconds")
    max_client_share: float = setting(
        0.5, float_kind(0.01), "most of the pool one client (client_id) may hold pinned at once")
    peers: tuple[str, ...] = setting(
        (), ADDRESSES, "kvds this one may push to or pull from besides the index's registered "
        "nodes (host:port list; without Redis, the only ones)")
    index_ttl: int = setting(300, int_kind(1), "seconds an index entry lives without refresh")
    index_prefix: str = setting("pdserve:", STR, "key prefix of the prefix index in Redis")
    heartbeat: float = setting(2.0, float_kind(0.1), "seconds between registry heartbeats")
    max_batch_blocks: int = setting(4096, int_kind(1, 1 << 20), "most blocks in one call")
    transfer_timeout: float = setting(
        30.0, float_kind(0.1),
        "seconds a transfer may go without progress before it is abandoned")
    max_message_kib: int = setting(8192, int_kind(4), "largest UCX message (runs of blocks)")
    wire_codec: str = setting(
        "none", choice_kind(*CODECS),
        "lossless codec offered to peers for unquantized blocks, used when the peer enables "
        "it too; off by default: it does not pay on a host's link (docs/benchmarks.md)")
    same_host: bool = setting(
        True, BOOL, "same-host pushes: a receiving kvd maps the sending kvd's pool and copies "
        "the blocks from it (one copy) when both share a host; off = UCX only")
    control_socket: bool = setting(
        True, BOOL, "serve the Control messages also on a Unix socket next to the pool "
        "(mode 0600; Register names it): engines of this host skip gRPC's per-message cost")
    copy_threads: int = setting(
        2, int_kind(1, 64), "threads of one same-host copy (numpy and xxhash release the GIL); "
        "a copy under 4 MiB runs on the event loop")
    fault_corrupt_every: int = setting(
        0, int_kind(0), "TEST HOOK: flip a byte of every Nth block sent; 0 = off")
    fault_send_delay_ms: int = setting(
        0, int_kind(0), "TEST HOOK: sleep before sending each transfer's bytes; 0 = off")
    fault_same_host_corrupt_every: int = setting(
        0, int_kind(0), "TEST HOOK: flip a byte of every Nth block copied from a same-host "
        "peer; 0 = off")
    fault_same_host_delay_ms: int = setting(
        0, int_kind(0), "TEST HOOK: sleep after a same-host copy, before checking that the "
        "peer lives; 0 = off")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_client_share > 1:
            raise ConfigError(f"--max-client-share: invalid value {self.max_client_share} "
                              "(accepted: a share of the pool, 0.01..1)")
        if self.lease_ms > self.max_lease_ms:
            raise ConfigError(f"--lease-ms: {self.lease_ms} is above --max-lease-ms "
                              f"{self.max_lease_ms}")

    @property
    def lease_s(self) -> float:
        return self.lease_ms / 1000
