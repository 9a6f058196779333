"""``python -m services.gateway``: flags -> GatewayConfig -> HTTP + gRPC health -> serve."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from pdserve import env
from pdserve.log import setup_logging
from pdserve.telemetry import init_tracing
from services.gateway.auth import KeyStore
from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayServer

log = logging.getLogger(__name__)


async def serve(config: GatewayConfig, keys: KeyStore) -> None:
    """Start, print the one ready line, wait for SIGTERM/SIGINT, stop gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = GatewayServer(config, keys)
    await server.start()
    print(server.ready_line, flush=True)
    await stop.wait()
    log.info("shutting down")
    await server.stop()


def main(argv: list[str] | None = None) -> int:
    try:
        config = GatewayConfig.from_argv(argv)
        keys = KeyStore.load(config.keys_file, config.api_keys)
    except ValueError as exc:
        sys.stderr.write(f"pdserve gateway: error: {exc}\n")
        return 2
    setup_logging("gateway")
    init_tracing("gateway", env.otel_endpoint())
    try:
        asyncio.run(serve(config, keys))
    except OSError as exc:
        sys.stderr.write(f"pdserve gateway: error: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
