"""``python -m services.kvd``: flags -> KvdConfig -> server -> serve."""

from __future__ import annotations

import logging
import os
import sys

from prometheus_client import REGISTRY

from pdserve import auth
from pdserve.index import PrefixIndex
from pdserve.proto.v1 import common_pb2
from pdserve.server import Service, make_server, run_grpc_main
from services.kvd.config import KvdConfig
from services.kvd.control_socket import ControlSocket, socket_path
from services.kvd.daemon import Kvd
from services.kvd.servicer import KvdCollector, KvdServicer, servicers
from services.kvd.ucx_net import net_device_for

log = logging.getLogger(__name__)


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
    sock: ControlSocket | None = None
    if config.control_socket:
        sock = ControlSocket(kvd, socket_path(me.node_id, os.getpid(), kvd.epoch),
                             auth.secrets().get(auth.DATA.name, ""))
        try:
            await sock.start()
            kvd.control_socket = str(sock.path)
        except OSError as exc:  # no /dev/shm here: engines use the Control rpc
            log.warning("control socket not served; engines use the Control rpc",
                        extra={"fields": {"path": str(sock.path), "error": str(exc)}})
            sock = None
    collector = KvdCollector(kvd)
    REGISTRY.register(collector)  # type: ignore[arg-type]

    async def stop() -> None:
        REGISTRY.unregister(collector)  # type: ignore[arg-type]
        if sock is not None:
            await sock.stop()
        await kvd.stop()

    svc.on_stop.append(stop)
    return svc


def main(argv: list[str] | None = None) -> int:
    return run_grpc_main(KvdConfig, create_server, argv)


if __name__ == "__main__":
    sys.exit(main())
