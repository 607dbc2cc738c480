"""smddp: a torch.distributed backend for fast collectives.

``import smddp`` registers the backend "smddp"; then
``torch.distributed.init_process_group(backend="smddp")`` works with env://, tcp:// and file://.
"""
import atexit
import os
import threading

import torch
import torch.distributed as dist

from ._loader import load_extension as _load_extension

_C = _load_extension()

from ._build_info import VERSION as __version__  # noqa: E402
from ._groups import _setting_pg_timeout, monitored_barrier, shrink_group  # noqa: E402

BACKEND_NAME = "smddp"


def _create_backend(dist_options, backend_options):
    # torch's extended creator API: the only one that says which world ranks the group holds
    # (for the flight recorder's dumps and the rank's name in messages; an empty list means the
    # default group) and the group's name (torch sets it on the group only once it is made).
    return _C._create_backend(dist_options.store, dist_options.group_rank, dist_options.group_size,
                              dist_options.timeout, list(dist_options.global_ranks_in_group),
                              dist_options.group_id or "")


def _register():
    # Registering twice raises in torch; a re-import (e.g. importlib.reload) must not.
    if getattr(dist.Backend, BACKEND_NAME.upper(), None) == BACKEND_NAME:
        return
    # devices must be a list: a plain string would be iterated character by character.
    dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cpu", "cuda"])


_register()
# After the program's own atexit handlers (they run last registered first), before Python's
# finalisation: groups never destroyed are shut down while Python callbacks can still run.
atexit.register(_C._shut_down_live_groups)
# Ctrl-C ends a wait of the main thread for an op, as it ends Python code (SMDDP_INTERRUPTIBLE_WAITS).
try:
    _C._watch_interrupts(threading.main_thread().ident)
except RuntimeError:
    # A malformed SMDDP_INTERRUPTIBLE_WAITS: init_process_group raises ValueError naming it, as
    # for every other setting; the import must not fail on it.
    if "SMDDP_INTERRUPTIBLE_WAITS" not in os.environ:
        raise
# torch applies it to gloo's and NCCL's groups only (torch.distributed.breakpoint() relies on it).
if not hasattr(dist.distributed_c10d._set_pg_timeout, "__wrapped_by_smddp__"):
    dist.distributed_c10d._set_pg_timeout = _setting_pg_timeout(dist.distributed_c10d._set_pg_timeout)
    dist.distributed_c10d._set_pg_timeout.__wrapped_by_smddp__ = True


def env_params():
    """Every SMDDP_* environment variable: name, default, help and value: the one this process
    runs with where read already (each is read once, at its first use, mostly the first group's
    set-up: a change to os.environ after that changes nothing; where the README says rank 0's
    value holds for a group, a group's set-up may take that instead), else what the environment
    says now (unchecked: init_process_group refuses a malformed one). Reads nothing itself."""
    return _C._env_params()


def reduce_isa():
    """The instruction set the reduce kernels use on this CPU (avx512, avx2 or scalar)."""
    return _C._reduce_isa()


def dump_flight_recorder(path=None):
    """The latest ops of this process's smddp groups (TORCH_FR_BUFFER_SIZE of them, default
    2000), pickled in the layout of torch's flight recorder (what
    torch._C._distributed_c10d._dump_fr_trace() gives for NCCL and gloo): each op's group, its
    sequence number, sizes, dtypes and state (scheduled, started, completed; retired but not
    completed = failed). Written to `path` too when given. Dumps of every rank, named
    <prefix><global rank> in one directory, are what ``python -m smddp.fr_trace <dir>`` compares
    to find the rank and collective where a job diverged or hung; SMDDP_FR_DUMP_FILE writes them
    when an op fails."""
    if path is not None and not isinstance(path, (str, bytes, os.PathLike)):
        # open() would take an int as a file descriptor: path=1 wrote the pickle to stdout.
        raise TypeError(f"smddp.dump_flight_recorder: path must be a file name, got {type(path).__name__} {path!r}")
    data = _C._dump_flight_recorder()
    if path is not None:
        with open(path, "wb") as f:
            f.write(data)
    return data


__all__ = ["BACKEND_NAME", "dump_flight_recorder", "env_params", "monitored_barrier", "reduce_isa", "shrink_group",
           "__version__"]
