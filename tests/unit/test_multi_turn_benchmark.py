"""benchmarks/multi_turn.py's tiny preset, three turns, one timed round, end to end in a subprocess: with the
prefix cache on, every later turn reads the conversation so far from the cache (at least the previous turn's
prompt, but its last partly filled block and one block of slack) and prefills only the rest; with it off,
every turn prefills its whole prompt; both sample the same tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "multi_turn.py"
TURNS = 3


def test_multi_turn_benchmark_caches_the_conversation_and_samples_the_same(tmp_path):
    output = tmp_path / "multi_turn.json"
    command = [sys.executable, str(SCRIPT), "--preset", "tiny", "--turns", str(TURNS), "--repeats", "1"]
    command += ["--model-dir", str(tmp_path / "tiny"), "--output", str(output)]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "turn | prompt tokens | cached (on)" in run.stdout
    results = json.loads(output.read_text())
    on, off = results["on"]["turns"], results["off"]["turns"]
    block = results["on"]["block_size"]
    assert len(on) == len(off) == TURNS
    assert on[0]["cached"] == 0 and on[0]["prefilled"] == on[0]["prompt"]
    for previous, turn in zip(on, on[1:]):
        assert 0 < turn["cached"] and turn["prefilled"] < turn["prompt"]
        assert turn["cached"] >= previous["prompt"] // block * block - block
        assert turn["prefilled"] == turn["prompt"] - turn["cached"] == turn["prompt"] - turn["hit_tokens"]
    for turn_on, turn_off in zip(on, off):
        assert turn_off["prompt"] == turn_on["prompt"]
        assert turn_off["cached"] == 0 and turn_off["prefilled"] == turn_off["prompt"]
    assert results["parity"] == {"completions": TURNS, "same": TURNS, "matched": True, "first_differing_turn": None}
    assert results["on"]["tokens"] == results["off"]["tokens"]
