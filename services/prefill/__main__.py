"""``python -m services.prefill``: flags -> PrefillConfig -> server -> serve."""

from __future__ import annotations

import sys

from pdserve.server import Service, run_main
from pdserve.serving.service import create_engine_service
from services.prefill.config import PrefillConfig
from services.prefill.servicer import servicers


async def create_server(config: PrefillConfig) -> Service:
    svc, _ = await create_engine_service(config, servicers)
    return svc


def main(argv: list[str] | None = None) -> int:
    return run_main("prefill", PrefillConfig.from_argv, create_server, argv)


if __name__ == "__main__":
    sys.exit(main())
