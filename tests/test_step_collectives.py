"""scripts.step_collectives compiles a sharded decode step from shapes alone and lists its collectives (a subprocess:
the script sets the CPU device count before JAX starts)."""

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_the_sharded_step_of_two_devices_compiles_and_lists_its_collectives(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "scripts.step_collectives", "--smoke", "--contexts", "4k",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads((tmp_path / "step_collectives_cpu.json").read_text())["rows"]
    assert (row["devices"], row["context"], row["batch"]) == (2, 4096, 1)
    assert [c["opcode"] for c in row["collectives"]] == ["all-reduce"]
