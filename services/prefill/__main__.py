"""``python -m services.prefill``: flags -> PrefillConfig -> server -> serve."""

from __future__ import annotations

import sys

from pdserve.server import Service, make_server, run_main
from services.prefill.config import PrefillConfig
from services.prefill.servicer import servicers


async def create_server(config: PrefillConfig) -> Service:
    return make_server(config.host, config.port, servicers())


def main(argv: list[str] | None = None) -> int:
    return run_main("prefill", PrefillConfig.from_argv, create_server, argv)


if __name__ == "__main__":
    sys.exit(main())
