"""``python -m services.gateway.on_granian <gateway flags>``: the gateway's ASGI app (the same
``FastPath`` over FastAPI and the same handlers) served by granian's Rust HTTP server embedded
in this loop, instead of uvicorn: a side-by-side row of ``pdserve bench router``, not a
supported way to serve (granian's embedding is experimental; no ``--header-timeout``, no gRPC
health port). Prints the gateway's ready line; serves until stdin closes."""

from __future__ import annotations

import asyncio
import socket
import sys

from pdserve import env
from services.gateway.app import FastPath, create_app
from services.gateway.auth import CacheSalter, KeyStore
from services.gateway.config import GatewayConfig
from services.gateway.metrics import GatewayMetrics
from services.gateway.server import router_api
from services.gateway.servicer import Gateway


async def serve(config: GatewayConfig) -> None:
    # granian comes with the bench extra: imported only here, so this module imports without.
    from granian.constants import Interfaces
    from granian.server.embed import Server

    client = router_api(config)
    await client.start()
    gw = Gateway(config, client, KeyStore.load(config.keys_file, config.api_keys),
                 GatewayMetrics(), CacheSalter(env.secret(env.CACHE_SALT_SECRET_VAR)))
    port = config.port
    if port == 0:  # granian binds by number: find a free one
        with socket.socket() as probe:
            probe.bind((config.host, 0))
            port = probe.getsockname()[1]
    server = Server(FastPath(create_app(gw), gw), address=config.host, port=port,
                    interface=Interfaces.ASGINL, log_enabled=False)
    serving = asyncio.create_task(server.serve())
    while True:  # until it accepts connections
        try:
            _, writer = await asyncio.open_connection(config.host, port)
            writer.close()
            break
        except OSError:
            if serving.done():
                await serving
            await asyncio.sleep(0.05)
    print(f"pdserve gateway (granian) listening on {config.host}:{port}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    server.stop()
    await serving
    await client.close()


if __name__ == "__main__":
    asyncio.run(serve(GatewayConfig.from_argv(sys.argv[1:])))
