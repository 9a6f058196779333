"""UCX facts about the network: which lanes an endpoint uses, which interface carries a host.

Which transports carry the bytes is UCX's choice; ``endpoint_lanes`` asks UCX itself
(``ucp_ep_query``) for each new endpoint's lanes, which kvd logs and exports as a metric: the
proof that kvds on different nodes talk over the network (``tcp/eth0``), not shared memory.

``net_device_for`` picks ``UCX_NET_DEVICES`` for ``--ucx-host`` so the TCP transport listens
only on that interface.
"""

from __future__ import annotations

import ctypes
import fcntl
import socket
import struct
from typing import Any

_UCP_EP_ATTR_FIELD_TRANSPORTS = 1 << 3
_MAX_LANES = 32


class _TransportEntry(ctypes.Structure):  # ucp_transport_entry_t (ucp_def.h)
    _fields_ = [("transport_name", ctypes.c_char_p), ("device_name", ctypes.c_char_p)]


class _Transports(ctypes.Structure):  # ucp_transports_t
    _fields_ = [("entries", ctypes.POINTER(_TransportEntry)), ("num_entries", ctypes.c_uint),
                ("entry_size", ctypes.c_size_t)]


class _EpAttr(ctypes.Structure):  # ucp_ep_attr_t: name[UCP_ENTITY_NAME_MAX], 2 sockaddr_storage
    _fields_ = [("field_mask", ctypes.c_uint64), ("name", ctypes.c_char * 32),
                ("local_sockaddr", ctypes.c_byte * 128), ("remote_sockaddr", ctypes.c_byte * 128),
                ("transports", _Transports), ("user_data", ctypes.c_void_p)]


def endpoint_lanes(ep: Any) -> list[str]:
    """UCX's own report of the transports a ucxx endpoint uses: one ``transport/device`` per
    lane (``ucp_ep_query``), e.g. ``["tcp/eth0"]``, or ``["sysv/memory", "posix/memory",
    "tcp/lo"]`` between two processes of one host. Empty if UCX cannot say."""
    try:
        ucp = ctypes.CDLL("libucp.so.0")  # already loaded by ucxx: the same library
    except OSError:
        return []
    entries = (_TransportEntry * _MAX_LANES)()
    attr = _EpAttr(field_mask=_UCP_EP_ATTR_FIELD_TRANSPORTS)
    attr.transports = _Transports(ctypes.cast(entries, ctypes.POINTER(_TransportEntry)),
                                  _MAX_LANES, ctypes.sizeof(_TransportEntry))
    if ucp.ucp_ep_query(ctypes.c_void_p(ep.ucp_endpoint), ctypes.byref(attr)) != 0:  # UCS_OK
        return []
    lanes = []
    for e in entries[:attr.transports.num_entries]:
        lanes.append(f"{(e.transport_name or b'?').decode()}/{(e.device_name or b'?').decode()}")
    return lanes


def net_device_for(host: str) -> str:
    """The network interface that carries ``host`` (UCX_NET_DEVICES), so UCX's TCP transport
    listens only there; "" (every interface) for an empty or wildcard host."""
    if host in ("", "0.0.0.0", "::"):
        return ""
    ip = socket.gethostbyname(host)
    if ip.startswith("127."):
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                  struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    raise ValueError(f"--ucx-host: no network interface has address {host} ({ip})")
