"""Backend choice per device pair from ``cluster.yaml``, and the mux a worker talks to.

``make_transport(cluster, device_id)`` looks at every peer of ``device_id``: ``cluster.link_kind`` gives the link
(``links.intra_host`` within a host, ``links.inter_host`` across hosts) and :func:`backend_for` maps it to a
backend. GPU links only make sense between two ``cuda`` devices; for any pair involving a ``cpu`` or ``emulated``
device the tensors live in host memory, so ``nvlink``/``pcie``/``cuda_ipc`` become ``shm`` and ``nccl`` becomes
``tcp`` across hosts. The returned :class:`TransportMux` routes ``send`` by destination and ``recv`` by
``handle.backend``.
"""
from __future__ import annotations

from typing import Any

import torch

from shared.config import ClusterConfig, ConfigError
from shared.transport.base import TRANSPORTS, TensorHandle, Transport, TransportError, TransportLimits

GPU_INTRA_LINKS = ("cuda_ipc", "nvlink", "pcie")


def backend_for(cluster: ClusterConfig, a: str, b: str) -> str:
    """The transport backend for tensors moving between devices ``a`` and ``b``."""
    kind = cluster.link_kind(a, b)
    da, db = cluster.device(a), cluster.device(b)
    same_host = da.host == db.host
    field = "links.intra_host" if same_host else "links.inter_host"
    if not same_host and kind in ("shm", "cuda_ipc"):
        raise ConfigError(cluster.source, field, f"{kind} cannot connect {a} and {b}: they are on different hosts")
    if da.backend == "cuda" and db.backend == "cuda":
        if kind in GPU_INTRA_LINKS:
            return "cuda_ipc" if same_host else "nccl"  # nvlink/pcie across hosts: NCCL picks the fabric
        if kind == "nccl":
            return "nccl"
        return kind
    if kind in GPU_INTRA_LINKS or kind == "nccl":
        return "shm" if same_host else "tcp"
    return kind


def nccl_members(cluster: ClusterConfig) -> list[str]:
    """Devices that join the NCCL process group (those with at least one nccl pair), in cluster order."""
    ids = [d.id for d in cluster.devices]
    return [a for a in ids if any(b != a and backend_for(cluster, a, b) == "nccl" for b in ids)]


def make_transport(cluster: ClusterConfig, device_id: str, **opts: Any) -> "TransportMux":
    """Build the transports ``device_id`` needs for its peers.

    Options: ``limits`` (:class:`TransportLimits`), ``shm_dir``; tcp: ``bind_host`` (loopback default),
    ``tcp_port``, ``advertise_host`` (defaults to the bind address, or the device's ``host`` when binding all
    interfaces); nccl: ``nccl_store_addr`` (``host:port`` of rank 0's TCP store, required when the cluster has
    nccl pairs), ``nccl_backend`` (``nccl``, or ``gloo`` for CPU tests), ``init_timeout_s``.
    """
    try:
        me = cluster.device(device_id)
    except KeyError:
        raise ConfigError(cluster.source, "devices", f"unknown device {device_id!r}") from None
    known = {"limits", "shm_dir", "bind_host", "tcp_port", "advertise_host", "nccl_store_addr", "nccl_backend",
             "init_timeout_s"}
    unknown = sorted(set(opts) - known)
    if unknown:
        raise TypeError(f"make_transport: unknown options {unknown}; valid: {sorted(known)}")
    limits: TransportLimits | None = opts.get("limits")
    routes = {d.id: backend_for(cluster, device_id, d.id) for d in cluster.devices if d.id != device_id}
    transports: dict[str, Transport] = {}
    for name in sorted(set(routes.values())):
        cls = TRANSPORTS.get(name)
        if name in ("shm", "cuda_ipc"):
            transports[name] = cls(device_id, limits, shm_dir=opts.get("shm_dir", "/dev/shm"))
        elif name == "tcp":
            bind = opts.get("bind_host", "127.0.0.1")
            advertise = opts.get("advertise_host") or (me.host if bind in ("0.0.0.0", "::", "") else None)
            transports[name] = cls(device_id, limits, bind_host=bind, port=opts.get("tcp_port", 0),
                                   advertise_host=advertise)
        elif name == "nccl":
            store = opts.get("nccl_store_addr")
            if not store:
                raise ConfigError(cluster.source, "links", "the cluster has nccl links: give the transport an "
                                  "nccl_store_addr (host:port of rank 0's TCP store)")
            members = nccl_members(cluster)
            ranks = {d: i for i, d in enumerate(members)}
            backend = opts.get("nccl_backend", "nccl")
            tdev = f"cuda:{me.cuda_index or 0}" if backend == "nccl" else "cpu"
            transports[name] = cls(device_id, limits, rank=ranks[device_id], world_size=len(members),
                                   store_addr=store, peer_ranks=ranks, dist_backend=backend, torch_device=tdev,
                                   init_timeout_s=opts.get("init_timeout_s", 120.0))
    return TransportMux(device_id, routes, transports)


class TransportMux(Transport):
    """One worker's transports: ``send`` goes by destination device, ``recv``/``release`` by ``handle.backend``."""

    backend = "mux"

    def __init__(self, device_id: str, routes: dict[str, str], transports: dict[str, Transport]) -> None:
        super().__init__(device_id)
        missing = sorted(set(routes.values()) - set(transports))
        if missing:
            raise ValueError(f"routes use backends without a transport: {missing}")
        self.routes = dict(routes)
        self.transports = dict(transports)

    def route(self, dst_device: str) -> Transport:
        """The transport used for ``dst_device``."""
        try:
            return self.transports[self.routes[dst_device]]
        except KeyError:
            raise TransportError(f"no transport route from {self.device_id} to {dst_device!r}") from None

    def _for(self, handle: TensorHandle) -> Transport:
        try:
            return self.transports[handle.backend]
        except KeyError:
            raise TransportError(f"transfer {handle.transfer_id} uses backend {handle.backend!r}, which "
                                 f"{self.device_id} does not have (has: {sorted(self.transports)})") from None

    async def start(self) -> None:
        """Start every backend; a worker calls this at startup (NCCL membership is collective)."""
        self._check_open()
        for t in self.transports.values():
            await t.start()

    async def send(self, tensor: torch.Tensor, dst_device: str, transfer_id: str, timeout_s: float) -> TensorHandle:
        self._check_open()
        return await self.route(dst_device).send(tensor, dst_device, transfer_id, timeout_s)

    async def recv(self, handle: TensorHandle, timeout_s: float, out: torch.Tensor | None = None, *,
                   zero_copy: bool = False) -> torch.Tensor:
        self._check_open()
        return await self._for(handle).recv(handle, timeout_s, out, zero_copy=zero_copy)

    def release(self, handle: TensorHandle) -> None:
        self._for(handle).release(handle)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in self.transports.values():
            await t.close()
