"""The DCP transfers never block the host on a device, and the groups they use.

Runs on PyTorch's ``fake`` process-group backend (collectives are no-ops, no peers needed) in a
subprocess of its own, so that no default group leaks into other tests.
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import datetime
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch_dcp.executor import TorchDistributedTransport
    from torch_dcp.executor.groups import forget_groups, has_cpu_backend, host_group, transfer_group

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    calls = []

    class Work:  # records how the transport waits
        def wait(self, *args):
            calls.append(args)
            return True

        def is_completed(self):
            return True

    dist.batch_isend_irecv = lambda ops: [Work() for _ in ops]
    limit = datetime.timedelta(seconds=7)
    msg = torch.zeros(4, dtype=torch.uint8)
    for device, expect in (("cuda", ()), ("cpu", (limit,))):
        comm = transfer_group(None, limit) if device == "cuda" else None
        t = TorchDistributedTransport(None, device=device, timeout=limit, comm_group=comm)
        calls.clear()
        handle = t.launch(3, [(0, 1, msg), (2, 1, msg)], [(3, 1, msg.clone())])
        list(t.wait(handle))
        assert calls == [expect] * 3, (device, calls)
        assert t.host_waits == (device == "cpu")
    # created once per group and timeout, with the same members
    assert transfer_group(None, limit) is transfer_group(None, limit)
    assert transfer_group(None, limit) is not transfer_group(None, datetime.timedelta(seconds=8))
    assert dist.get_process_group_ranks(transfer_group(None, limit)) == [0, 1, 2, 3]
    assert has_cpu_backend(None) and host_group(None) is None  # the fake backend runs CPU tensors itself
    try:
        TorchDistributedTransport(None, device="cuda", comm_group=dist.new_group([0, 1], use_local_synchronization=True))
    except ValueError as err:
        assert "same members" in str(err)
    else:
        raise AssertionError("a comm_group with other members was accepted")
    forget_groups()
    dist.destroy_process_group()
    print("OK")
    """
)


def test_device_transport_waits_on_the_stream_cpu_transport_bounds_the_host():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr
