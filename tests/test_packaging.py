"""The sdist holds what a build from it needs and nothing a build leaves in the tree; the package
asks for the torch it is built against.

Made from a copy of the checkout's tracked files plus this machine's build outputs (a tree smddp
was built in, as the developer's who runs `setup.py sdist`), so the source tree is not touched.
Building a wheel from the sdist takes minutes on 2 cores and is left out of the suite.
"""
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# Left in python/smddp/ by an editable build; an sdist must carry none of them.
BUILD_OUTPUTS = ("bin/smddp_perf", "bin/all_reduce_perf", "_build_info.py", "libsmddp_cuda.so")


def tracked_files():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.decode().strip()}")
    return [p for p in out.stdout.decode().split("\0") if p and (ROOT / p).is_file()]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    tree = tmp_path_factory.mktemp("tree")
    tracked = tracked_files()
    for rel in tracked:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tree / rel)
    for rel in BUILD_OUTPUTS:  # as if built here, whether or not this checkout has built them
        target = tree / "python" / "smddp" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("build output\n")
    dist = tree / "dist"
    proc = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(dist)], cwd=tree,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (archive,) = dist.glob("smddp-*.tar.gz")
    top = archive.name.removesuffix(".tar.gz")  # the directory every member sits in
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        pkg_info = tar.extractfile(f"{top}/PKG-INFO").read().decode()
    return names, pkg_info, tracked


def test_sdist_holds_every_source_the_build_compiles(sdist):
    names, _, tracked = sdist
    cmake = (ROOT / "CMakeLists.txt").read_text()
    compiled = set(re.findall(r"(?<![\w/.$}])((?:csrc|tests|benchmarks)/[\w/.-]+\.(?:cc|cu|h|cuh))", cmake))
    assert compiled, "no source paths found in CMakeLists.txt"
    needed = {"setup.py", "CMakeLists.txt", "README.md", "requirements-examples.txt", "requirements-bench.txt",
              "benchmarks/perf_check.h"} | compiled
    needed |= {p for p in tracked if p.startswith(("csrc/", "tests/cpp/"))}  # headers included by them
    assert sorted(needed - names) == []


def test_sdist_carries_no_build_outputs(sdist):
    names, _, _ = sdist
    shipped = sorted(n for n in names
                     if n.endswith((".so", ".pyc")) or n.startswith(tuple(f"python/smddp/{o}" for o in BUILD_OUTPUTS)))
    assert shipped == []


def test_package_requires_the_torch_it_is_built_against(sdist):
    _, pkg_info, _ = sdist
    public = torch.__version__.split("+")[0]
    assert f"Requires-Dist: torch=={public}\n" in pkg_info, pkg_info
