"""Loads smddp._C after checking it was built for the torch that is running."""
import importlib

import torch


def load_extension():
    try:
        from . import _build_info
    except ImportError as e:
        raise ImportError(
            "smddp's compiled extension is missing: build it with "
            "`pip install --no-build-isolation -e .` from the smddp checkout") from e
    if _build_info.TORCH_VERSION != torch.__version__:
        # Loading a C++ extension built against another torch fails with cryptic symbol
        # errors or crashes, so refuse before dlopen.
        raise ImportError(
            f"smddp was built against torch {_build_info.TORCH_VERSION} but torch {torch.__version__} "
            "is loaded. Rebuild smddp for this torch: `pip install --no-build-isolation "
            "--force-reinstall --no-deps -e .` in the smddp checkout (or reinstall the matching wheel).")
    return importlib.import_module("smddp._C")
