"""The curated results are what the raw run files say."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_csvs_and_readmes_table_are_up_to_date():
    r = subprocess.run([sys.executable, "-m", "results.build", "--check"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr


def test_every_row_has_its_hardware_and_a_command_that_names_the_model():
    for name in ("cifar10", "long_range"):
        rows = list(csv.DictReader(open(ROOT / "results" / f"{name}.csv")))
        assert rows
        for row in rows:
            assert row["hardware"] != "unknown", row["run"]
            assert row["command"].startswith(f"python train_cifar.py --model {row['model']}")
            assert 0 <= float(row["accuracy"]) <= 1 and float(row["images_per_s"]) > 0
