"""An export must not depend on the interpreter's hash seed: NVFlare's job API writes a filter's tasks from a set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from jobs.assembly import sort_filter_tasks

REPO = Path(__file__).resolve().parents[2]


def test_filter_tasks_are_written_sorted_and_nothing_else_changes(tmp_path):
    config = tmp_path / "app" / "config" / "config_fed_client.json"
    config.parent.mkdir(parents=True)
    content = {
        "executors": [{"tasks": ["validate", "train"], "executor": {}}],
        "task_data_filters": [{"tasks": ["validate", "train"], "filters": []}],
        "task_result_filters": [{"tasks": ["train"], "filters": []}],
    }
    config.write_text(json.dumps(content, indent=4))
    sort_filter_tasks(tmp_path)
    written = json.loads(config.read_text())
    assert written["task_data_filters"][0]["tasks"] == ["train", "validate"]
    assert written["executors"][0]["tasks"] == ["validate", "train"]  # an executor's list is the user's order
    assert written["task_result_filters"] == content["task_result_filters"]


def test_the_he_job_exports_the_same_under_two_hash_seeds(tmp_path):
    exported = []
    for seed in ("1", "3"):  # seeds that gave the two orders of {"train", "validate"} before
        out = tmp_path / seed
        command = [sys.executable, "-m", "jobs.build", "--secure-aggregation", "he", "--name", "he"]
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run([*command, "--output-dir", str(out)], check=True, cwd=REPO, env=env, capture_output=True)
        exported.append((out / "he" / "app" / "config" / "config_fed_client.json").read_text())
    assert exported[0] == exported[1]
