"""``python -m services.router``: flags -> RouterConfig -> server -> serve."""

from __future__ import annotations

import sys

from pdserve.server import Service, make_server, run_main
from services.router.config import RouterConfig
from services.router.servicer import servicers


async def create_server(config: RouterConfig) -> Service:
    return make_server(config.host, config.port, servicers())


def main(argv: list[str] | None = None) -> int:
    return run_main("router", RouterConfig.from_argv, create_server, argv)


if __name__ == "__main__":
    sys.exit(main())
