"""Executor: runs a rank's plan with pluggable kernels and transports."""

from .device_plan import DevicePlan
from .division import Division, build_division
from .emulate import emulate
from .executor import InstructionTime, RankExecutor, dcp_attention
from .heads import HeadParallelExecutor
from .kernels import (AutoKernel, DivisionKernel, FlashAttnKernel, GroupKernel, KernelLayout, ReferenceKernel, SDPAKernel,
                      VarlenKernel, get_kernel)
from .make import EXECUTORS, make_executor
from .reduce import merge_partials, reduce_loop
from .transport import (InProcessTransport, Mailbox, PeerRefusedError, RefusalChannel, TorchDistributedTransport,
                        TransferError, TransferTimeoutError, Transport)

__all__ = [
    "RankExecutor",
    "HeadParallelExecutor",
    "EXECUTORS",
    "make_executor",
    "DevicePlan",
    "InstructionTime",
    "dcp_attention",
    "emulate",
    "DivisionKernel",
    "GroupKernel",
    "KernelLayout",
    "ReferenceKernel",
    "SDPAKernel",
    "FlexKernel",
    "VarlenKernel",
    "FlashAttnKernel",
    "AutoKernel",
    "get_kernel",
    "Division",
    "build_division",
    "merge_partials",
    "reduce_loop",
    "Transport",
    "InProcessTransport",
    "Mailbox",
    "TorchDistributedTransport",
    "TransferError",
    "TransferTimeoutError",
    "PeerRefusedError",
    "RefusalChannel",
]


def __getattr__(name: str):
    """``FlexKernel``, imported at first use (see :mod:`torch_dcp.executor.kernels`)."""
    if name == "FlexKernel":
        from .kernels.flex import FlexKernel

        return FlexKernel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
