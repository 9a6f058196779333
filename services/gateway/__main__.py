"""``python -m services.gateway``: flags -> GatewayConfig -> HTTP + gRPC health -> serve."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from pdserve.server import event_loop, run_main
from services.gateway.auth import KeyStore
from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayServer

log = logging.getLogger(__name__)


async def serve(config: GatewayConfig) -> None:
    """Start, print the one ready line, wait for SIGTERM/SIGINT, stop gracefully."""
    keys = KeyStore.load(config.keys_file, config.api_keys)
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
    return run_main(GatewayConfig, serve, argv, lambda c: event_loop(c.loop))


if __name__ == "__main__":
    sys.exit(main())
