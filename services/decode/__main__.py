"""``python -m services.decode``: flags -> DecodeConfig -> server -> serve."""

from __future__ import annotations

import sys

from pdserve.server import Service, run_main
from pdserve.serving.service import create_engine_service
from services.decode.config import DecodeConfig
from services.decode.servicer import servicers


async def create_server(config: DecodeConfig) -> Service:
    svc, _ = await create_engine_service(config, servicers)
    return svc


def main(argv: list[str] | None = None) -> int:
    return run_main("decode", DecodeConfig.from_argv, create_server, argv)


if __name__ == "__main__":
    sys.exit(main())
