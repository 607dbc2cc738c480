"""Fuzzes the TCP mesh's wire parsing (tests/fuzz/fuzz_wire.cc) with libFuzzer under
AddressSanitizer and UndefinedBehaviorSanitizer for a bounded time: no crash, no hang, no
out-of-bounds write. Needs clang with libFuzzer (CI installs it; SMDDP_FUZZ_SECONDS sets the time)."""
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / f"cmake-py{sys.version_info.major}{sys.version_info.minor}"
SECONDS = int(os.environ.get("SMDDP_FUZZ_SECONDS", "30"))


def _tag(seq, step):
    return (seq << 24) | step


def _seeds():
    """Valid and nearly valid inputs, so the fuzzer starts from streams the parser accepts."""
    secret = b"0123456789abcdef0123456789abcdef"
    hello = b"SMDDPNET" + secret + struct.pack("<ii", 0, 1)
    good = bytes([1, 5, 0, 0, 0, 3]) + struct.pack("<QQ", _tag(7, 3), 5) + b"hello"
    two = bytes([2, 0, 9, 0, 0, 200]) + struct.pack("<QQ", _tag(7, 3), 0) + struct.pack("<QQ", _tag(7, 3), 9) + b"123456789"
    wrong_tag = bytes([1, 4, 0, 0, 0, 1]) + struct.pack("<QQ", _tag(8, 3), 4) + b"abcd"
    why = b"allreduce #7: timed out"
    farewell = struct.pack("<QQ", 2**64 - 1, len(why)) + why
    after_one = bytes([2, 3, 3, 0, 0, 7]) + struct.pack("<QQ", _tag(7, 3), 3) + b"abc" + farewell
    return {"hello": hello, "good": good, "two": two, "wrong_tag": wrong_tag, "farewell": after_one}


def test_wire_parser_fuzzed(tmp_path):
    clang = shutil.which("clang++")
    if clang is None:
        pytest.skip("clang++ with libFuzzer is not installed (apt-get install clang libclang-rt-14-dev)")
    exe = BUILD / "fuzz_wire"
    build = subprocess.run(
        [clang, "-std=c++20", "-O1", "-g", "-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=all",
         f"-I{ROOT / 'csrc'}", str(ROOT / "tests/fuzz/fuzz_wire.cc"), str(ROOT / "csrc/transport/wire.cc"),
         str(ROOT / "csrc/core/error.cc"), str(ROOT / "csrc/core/types.cc"), "-o", str(exe)],
        capture_output=True, text=True, timeout=300)
    if build.returncode != 0 and "fuzzer" in build.stderr and "cannot find" in build.stderr:
        pytest.skip(f"clang++ has no libFuzzer runtime: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-3000:]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, data in _seeds().items():
        (corpus / name).write_bytes(data)
    run = subprocess.run([str(exe), f"-max_total_time={SECONDS}", "-timeout=5", "-rss_limit_mb=2048",
                          "-print_final_stats=1", str(corpus)],
                         capture_output=True, text=True, timeout=SECONDS + 120, cwd=tmp_path)
    log = run.stderr
    assert run.returncode == 0, log[-4000:]
    runs = re.search(r"stat::number_of_executed_units:\s*(\d+)", log)
    assert runs and int(runs.group(1)) > 10000, log[-2000:]
    print(f"wire fuzzing: {runs.group(1)} inputs in {SECONDS} s, no crash, no hang")
