"""scripts/gpu_check.py runs where Ray and Prefect are not installed (the GPU machine has neither): its dry run, every
check on the CPU at small sizes, with both made unimportable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WITHOUT_RAY_AND_PREFECT = """
import runpy, sys
sys.modules.update(ray=None, prefect=None)  # an import of either fails, as where they are not installed
sys.argv = ["scripts/gpu_check.py", "--dry-run"]
runpy.run_path("scripts/gpu_check.py", run_name="__main__")
"""


def test_the_gpu_check_dry_run_passes_without_ray_and_prefect():
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY_AND_PREFECT],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "gpu check: passed"
    assert any(line.startswith("real size: one FSDP2 rank in bf16") for line in lines)
    assert any("vocab 151936, bf16 engine" in line for line in lines)
