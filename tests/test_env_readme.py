"""The README's environment-variable table lists exactly the parameters the core declares."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_env_table_matches_registry():
    smddp = pytest.importorskip("smddp")
    declared = {p["name"]: p["default"] for p in smddp.env_params()}
    rows = re.findall(r"^\| `(SMDDP_[A-Z0-9_]+)` \| `([^`]*)` \|", README.read_text(), re.M)
    documented = dict(rows)
    assert documented == declared
