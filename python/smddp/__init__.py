"""smddp: a torch.distributed backend for fast collectives.

``import smddp`` registers the backend "smddp"; then
``torch.distributed.init_process_group(backend="smddp")`` works with env://, tcp:// and file://.
"""
import torch
import torch.distributed as dist

from ._loader import load_extension as _load_extension

_C = _load_extension()

from ._build_info import VERSION as __version__  # noqa: E402

BACKEND_NAME = "smddp"


def _register():
    # Registering twice raises in torch; a re-import (e.g. importlib.reload) must not.
    if getattr(dist.Backend, BACKEND_NAME.upper(), None) == BACKEND_NAME:
        return
    # devices must be a list: a plain string would be iterated character by character.
    dist.Backend.register_backend(BACKEND_NAME, _C._create_backend, devices=["cpu", "cuda"])


_register()


def env_params():
    """Every SMDDP_* environment variable: name, default, help and the value in force."""
    return _C._env_params()


def reduce_isa():
    """The instruction set the reduce kernels use on this CPU (avx512, avx2 or scalar)."""
    return _C._reduce_isa()


__all__ = ["BACKEND_NAME", "env_params", "reduce_isa", "__version__"]
