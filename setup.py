"""Builds smddp: CMake + ninja compile the C++ core and the torch extension smddp._C.

Install against the torch already in the environment (never an isolated build env, which would
pull a second torch):  pip install --no-build-isolation -e .
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
VERSION = "0.1.0"


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


# nccl-tests' binary names, each running one collective of smddp_perf.
PERF_ALIASES = {"all_reduce_perf": "all_reduce", "all_gather_perf": "all_gather",
                "reduce_scatter_perf": "reduce_scatter", "broadcast_perf": "broadcast",
                "alltoall_perf": "all_to_all"}


class CMakeBuild(build_ext):
    @staticmethod
    def install_perf(build_dir, out_dir):
        """smddp_perf (and its nccl-tests names) into the package's bin/, where the `smddp_perf`
        console command finds it; also into the source tree, for editable installs and for the
        repository's benchmarks and tests, which run it from there after any install. The names are
        three-line shell scripts, not links: a wheel stores a link as a copy of its target, which made
        six copies of the binary in every wheel."""
        for pkg in {out_dir, ROOT / "python" / "smddp"}:
            bin_dir = pkg / "bin"
            bin_dir.mkdir(exist_ok=True)
            shutil.copy2(build_dir / "smddp_perf", bin_dir / "smddp_perf")
            for alias, collective in PERF_ALIASES.items():
                script = bin_dir / alias
                text = (f"#!/bin/sh\n# nccl-tests' name for smddp_perf --collective {collective}\n"
                        f'exec "$(dirname "$(readlink -f "$0")")/smddp_perf" --collective {collective} "$@"\n')
                if script.is_symlink() or not script.exists() or script.read_text() != text:
                    script.unlink(missing_ok=True)
                    script.write_text(text)
                    script.chmod(0o755)

    @staticmethod
    def check_error_path(build_dir, ext_path):
        """Loads the new extension in a child Python and formats a message the way its errors do.
        A compiler whose C++ headers differ from the libstdc++ that Python loads builds an
        extension that imports fine and then segfaults on its first error: refuse it here."""
        code = ("import importlib.util, sys, torch\n"
                "spec = importlib.util.spec_from_file_location('smddp._C', sys.argv[1])\n"
                "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
                "print(m._format_selftest())\n")
        proc = subprocess.run([sys.executable, "-c", code, str(ext_path)], capture_output=True, text=True)
        if proc.returncode == 0 and proc.stdout.strip() == "rank 7: 1.5 -3":
            return
        if proc.returncode >= 0:  # no crash: some other failure, shown as it is
            raise RuntimeError(f"smddp: the new extension {ext_path} fails to load or to format a message "
                               f"(exit code {proc.returncode}): {proc.stdout.strip()!r} {proc.stderr.strip()[-600:]}")
        cxx = next((ln.split("=", 1)[1] for ln in (build_dir / "CMakeCache.txt").read_text().splitlines()
                    if ln.startswith("CMAKE_CXX_COMPILER:")), "the C++ compiler")
        raise RuntimeError(
            f"smddp: the extension built by {cxx} crashes (signal {-proc.returncode}) formatting an error "
            "message: that compiler's C++ headers do not match the libstdc++ this Python loads, so every error "
            "would crash the process. Rebuild from scratch with the system compiler, e.g. "
            f"rm -rf {build_dir} && CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ pip install --no-build-isolation .")

    def build_extension(self, ext):
        import torch  # the torch this build must match at import time

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # A persistent build tree keeps rebuilds incremental (and fast) across pip installs.
        build_dir = ROOT / "build" / f"cmake-py{sys.version_info.major}{sys.version_info.minor}"
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = os.environ.get("SMDDP_BUILD_TYPE", "Release")
        subprocess.run(
            ["cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
             f"-DCMAKE_BUILD_TYPE={cfg}", f"-DPython_EXECUTABLE={sys.executable}",
             f"-DSMDDP_OUTPUT_DIR={out_dir}"],
            check=True)
        subprocess.run(["cmake", "--build", str(build_dir)], check=True)
        self.install_perf(build_dir, out_dir)
        self.check_error_path(build_dir, Path(self.get_ext_fullpath(ext.name)).resolve())
        # The CUDA library (built where nvcc is found) sits next to _C, which dlopens it.
        cuda_lib = out_dir / "libsmddp_cuda.so"
        in_tree = ROOT / "python" / "smddp" / "libsmddp_cuda.so"
        if cuda_lib.exists() and cuda_lib != in_tree:
            shutil.copy2(cuda_lib, in_tree)
        elif not cuda_lib.exists():
            in_tree.unlink(missing_ok=True)
        info = ROOT / "python" / "smddp" / "_build_info.py"
        text = f'TORCH_VERSION = "{torch.__version__}"\nVERSION = "{VERSION}"\n'
        for target in {info, out_dir / "_build_info.py"}:
            if not target.exists() or target.read_text() != text:
                target.write_text(text)


def torch_requirement():
    """The extension imports only under the torch it was built against, so the package asks for
    that torch's version. Its local label (+cpu) is left out: PyPI's torch has none, and the import
    check refuses a different build of the same version with a clearer message than pip's."""
    try:
        import torch
    except ImportError:  # e.g. only reading the metadata; the build itself needs torch
        return "torch"
    return f"torch=={torch.__version__.split('+')[0]}"


def pinned(requirements_file):
    """The pins of a requirements file, so `pip install .[examples]` gets what CI tests."""
    lines = (ROOT / requirements_file).read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


setup(
    name="smddp",
    version=VERSION,
    description="Shared-memory collective backend for torch.distributed with SMP-style FSDP helpers",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[CMakeExtension("smddp._C")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    install_requires=[torch_requirement()],
    extras_require={"examples": pinned("requirements-examples.txt"), "bench": pinned("requirements-bench.txt")},
    entry_points={"console_scripts": ["smddp_perf = smddp.perf:main"]},
    package_data={"smddp": ["bin/*", "libsmddp_cuda.so"]},
    zip_safe=False,
)
