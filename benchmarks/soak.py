"""The soak run's documented command (`python benchmarks/soak.py ...`). The harness is a reliability
test and lives in tests/reliability/ (soak.py, soaklib/); this runs it as a script, not an import:
benchmarks/ imports nothing of tests/ (tests/architecture/test_import_cycles.py)."""

from __future__ import annotations

import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "tests" / "reliability" / "soak.py"),
                   run_name="__main__")
