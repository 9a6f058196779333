"""``python -m services.kvd``: flags -> KvdConfig -> server -> serve."""

from __future__ import annotations

import sys

from pdserve.server import Service, make_server, run_main
from services.kvd.config import KvdConfig
from services.kvd.servicer import servicers


async def create_server(config: KvdConfig) -> Service:
    return make_server(config.host, config.port, servicers())


def main(argv: list[str] | None = None) -> int:
    return run_main("kvd", KvdConfig.from_argv, create_server, argv)


if __name__ == "__main__":
    sys.exit(main())
