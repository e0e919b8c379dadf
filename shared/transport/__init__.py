"""Tensor transport: one async interface, backends per device pair (shm, tcp, cuda_ipc, nccl), and a mux.

Handles (:class:`TensorHandle`) travel over Redis streams; the bytes go worker-to-worker. See ``docs/transport.md``.
"""
from shared.transport.base import (DTYPES, TRANSPORTS, TensorHandle, Transport, TransferExpired, TransferTimeout,
                                   TransferTooLarge, TransportClosed, TransportError, TransportLimits,
                                   UnsupportedTensor, decode_handle, encode_handle)
from shared.transport.cuda_ipc import CudaIpcTransport
from shared.transport.mux import TransportMux, backend_for, make_transport, nccl_members
from shared.transport.nccl import NcclTransport
from shared.transport.shm import ShmTransport, reap_orphan_segments
from shared.transport.tcp import TcpTransport

__all__ = [
    "DTYPES", "TRANSPORTS", "TensorHandle", "Transport", "TransferExpired", "TransferTimeout", "TransferTooLarge",
    "TransportClosed", "TransportError", "TransportLimits", "UnsupportedTensor", "decode_handle", "encode_handle",
    "CudaIpcTransport", "TransportMux", "backend_for", "make_transport", "nccl_members", "NcclTransport",
    "ShmTransport", "reap_orphan_segments", "TcpTransport",
]
