"""The `smddp_perf` console command: runs the nccl-tests style benchmark binary shipped in the
package (smddp/bin/smddp_perf, built with the extension; torch-free). `smddp_perf --collective
all_gather ...`, or call it through its nccl-tests names in the same directory (all_reduce_perf,
all_gather_perf, reduce_scatter_perf, broadcast_perf, alltoall_perf)."""
import os
import sys
from pathlib import Path


def binary(name="smddp_perf"):
    path = Path(__file__).resolve().parent / "bin" / name
    if not path.exists():
        raise SystemExit(f"{path} is missing: rebuild smddp (pip install --no-build-isolation -e .)")
    return path


def main():
    exe = binary()
    os.execv(str(exe), [str(exe)] + sys.argv[1:])


if __name__ == "__main__":
    main()
