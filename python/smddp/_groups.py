"""Group helpers that torch's own APIs leave incomplete for a backend serving two device types."""
import datetime

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import _C


def _require_smddp(group, name, torch_serves):
    backend_name = dist.get_backend(group)
    # "smddp", or per device type ("cpu:smddp,cuda:smddp"): smddp for every one.
    if {part.split(":")[-1].strip() for part in backend_name.split(",")} != {"smddp"}:
        raise ValueError(f"smddp.{name}: the group's backend is {backend_name!r}, not smddp "
                         f"(torch.distributed.{name} {torch_serves})")


def shrink_group(ranks_to_exclude, group=None, shrink_flags=0, pg_options=None):
    """``torch.distributed.shrink_group`` for smddp groups: the group less `ranks_to_exclude`
    (ranks of `group`, default the world), renumbered in order; it replaces `group`, which is
    destroyed (and, if it was the world, so is every other group). Only the remaining ranks call
    it; the excluded ones may be dead. ``shrink_flags=torch.distributed.distributed_c10d.SHRINK_ABORT``
    first aborts `group`, failing its pending ops, as after a peer's failure.

    torch registers the new group's backend for one device type only (the group's bound device,
    else the CPU) and under gloo's or NCCL's label (``pg.name()``); this registers it for CPU and
    CUDA tensors under smddp's, as ``init_process_group`` does."""
    _require_smddp(group, "shrink_group", "shrinks other backends' groups")
    pg = dist.shrink_group(ranks_to_exclude, group=group, shrink_flags=shrink_flags, pg_options=pg_options)
    device = getattr(pg, "bound_device_id", None) or torch.device("cpu")
    backend = pg._get_backend(device)
    for device_type in ("cpu", "cuda"):
        pg._register_backend(torch.device(device_type), ProcessGroup.BackendType.CUSTOM, backend)
    pg._set_default_backend(ProcessGroup.BackendType.CUSTOM)
    return pg


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    """``torch.distributed.monitored_barrier`` for smddp groups (torch's own admits gloo groups
    only): rank 0 waits up to `timeout` (default: the group's timeout) for every other rank to
    reach it and raises ``DistBackendError`` naming the first rank that did not, or every one with
    ``wait_all_ranks=True``, and where each stands when it has waited in an op of the group
    longer than ``SMDDP_DESYNC_CHECK_MS``. The ranks that came raise too, naming the ranks rank 0
    missed, as soon as rank 0 knows; a rank that rank 0 never answers raises 5 s after its own
    timeout. `timeout` may be a timedelta or seconds. Runs on the calling thread and returns None,
    as torch's does."""
    if group is not None and group == dist.GroupMember.NON_GROUP_MEMBER:
        return
    _require_smddp(group, "monitored_barrier", "serves gloo groups")
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = datetime.timedelta(seconds=timeout)
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"smddp.monitored_barrier: timeout must be a datetime.timedelta or a number of seconds, "
                        f"got {type(timeout).__name__} {timeout!r}")
    if timeout is not None and timeout <= datetime.timedelta(0):
        raise ValueError(f"smddp.monitored_barrier: timeout must be positive, got {timeout}")
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if timeout is None:
        return pg.monitored_barrier(wait_all_ranks=wait_all_ranks)
    return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


def _setting_pg_timeout(torch_set_pg_timeout):
    """torch.distributed.distributed_c10d._set_pg_timeout, which torch applies to gloo's and NCCL's
    backends only (warning for any other), for smddp's too: torch.distributed.breakpoint() uses it
    to keep the other ranks from timing out while one sits in the debugger."""

    def _set_pg_timeout(timeout, group=None):
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        if dist.distributed_c10d._rank_not_in_group(pg):
            return torch_set_pg_timeout(timeout, group)  # torch's error
        backends = {pg._get_backend(device) for device in pg._device_types}
        ours = {b for b in backends if isinstance(b, _C.SmddpBackend)}
        for backend in ours:
            backend.set_timeout(timeout)
        if backends - ours:
            torch_set_pg_timeout(timeout, group)

    _set_pg_timeout.__doc__ = torch_set_pg_timeout.__doc__
    return _set_pg_timeout
