"""The configuration reference in docs/operations.md is SCHEMA's rendering, key for key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gen_config_docs.py"


def test_the_guide_lists_every_key_with_the_type_and_default_of_schema() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("row", "edited"), [
    ("| `snapshot.retain` | integer | `5` |", "| `snapshot.retain` | integer | `7` |"),
    ("| `erasure.k` | integer |", "| `erasure.k` | number |"),
    ("| `tls.ca` |", "| `tls.ca_file` |"),
])
def test_a_default_type_or_key_edited_by_hand_fails_the_check(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row: str, edited: str) -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gen_config_docs
    finally:
        sys.path.pop(0)
    guide = (ROOT / "docs" / "operations.md").read_text()
    assert row in guide
    copy = tmp_path / "operations.md"
    copy.write_text(guide.replace(row, edited))
    monkeypatch.setattr(gen_config_docs, "DOC", copy)
    monkeypatch.setattr(sys, "argv", ["gen_config_docs.py", "--check"])
    assert gen_config_docs.main() == 1
