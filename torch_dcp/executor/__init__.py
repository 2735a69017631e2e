"""Executor: runs a rank's plan with pluggable kernels and transports."""

from .division import Division, build_division
from .executor import InstructionTime, RankExecutor, dcp_attention, emulate
from .flex import FlexKernel
from .kernels import AttentionKernel, DivisionKernel, ReferenceKernel, SDPAKernel, get_kernel
from .reduce import reduce_fused, reduce_loop
from .transport import InProcessTransport, Mailbox, TorchDistributedTransport, Transport

__all__ = [
    "RankExecutor",
    "InstructionTime",
    "dcp_attention",
    "emulate",
    "AttentionKernel",
    "DivisionKernel",
    "ReferenceKernel",
    "SDPAKernel",
    "FlexKernel",
    "get_kernel",
    "Division",
    "build_division",
    "reduce_fused",
    "reduce_loop",
    "Transport",
    "InProcessTransport",
    "Mailbox",
    "TorchDistributedTransport",
]
