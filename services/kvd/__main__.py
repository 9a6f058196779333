"""``python -m services.kvd``: flags -> KvdConfig -> server -> serve."""

from __future__ import annotations

import sys

from prometheus_client import REGISTRY

from pdserve import auth
from pdserve.index import PrefixIndex
from pdserve.proto.v1 import common_pb2
from pdserve.server import Service, make_server, run_grpc_main
from services.kvd.config import KvdConfig
from services.kvd.daemon import Kvd
from services.kvd.servicer import KvdCollector, KvdServicer, servicers
from services.kvd.ucx_net import net_device_for


async def create_server(config: KvdConfig) -> Service:
    index: PrefixIndex | None = None
    if config.redis_url:
        from pdserve.index import RedisPrefixIndex

        index = RedisPrefixIndex(config.redis_url, config.index_prefix, config.index_ttl)
    kvd = Kvd(config, index, net_device_for(config.ucx_host))
    svc = make_server(config.host, config.port, servicers(KvdServicer(kvd)),
                      rules=[("/pdserve.v1.Kvd/", auth.DATA)])
    address = f"{config.host}:{svc.port}"  # the node's default id: known once bound
    me = common_pb2.KvdEndpoint(node_id=config.node_id or config.instance_id or address,
                                address=address)
    await kvd.start(me)  # before the server takes calls: the UCX worker must exist
    collector = KvdCollector(kvd)
    REGISTRY.register(collector)  # type: ignore[arg-type]

    async def stop() -> None:
        REGISTRY.unregister(collector)  # type: ignore[arg-type]
        await kvd.stop()

    svc.on_stop.append(stop)
    return svc


def main(argv: list[str] | None = None) -> int:
    return run_grpc_main(KvdConfig, create_server, argv)


if __name__ == "__main__":
    sys.exit(main())
