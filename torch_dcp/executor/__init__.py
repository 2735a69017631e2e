"""Executor: runs a rank's plan with pluggable kernels and transports."""

from .executor import RankExecutor, dcp_attention, emulate
from .kernels import AttentionKernel, ReferenceKernel, SDPAKernel, get_kernel
from .transport import InProcessTransport, Mailbox, TorchDistributedTransport, Transport

__all__ = [
    "RankExecutor",
    "dcp_attention",
    "emulate",
    "AttentionKernel",
    "ReferenceKernel",
    "SDPAKernel",
    "get_kernel",
    "Transport",
    "InProcessTransport",
    "Mailbox",
    "TorchDistributedTransport",
]
