"""A write the system refuses during a run becomes one line: the path, the reason, and the checkpoint to
resume from. /dev/full refuses every write with ENOSPC, as a full disk does (written only in place here)."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from asyncrl import checkpoints
from asyncrl.metrics import MetricsLogger
from asyncrl.write_errors import describe, refused_write

FULL = Path("/dev/full")
pytestmark = pytest.mark.skipif(not FULL.exists(), reason="needs /dev/full")


def test_safetensors_past_the_file_size_limit_raises_an_oserror_naming_the_file(tmp_path):
    """The kernel refuses to grow a file past RLIMIT_FSIZE (EFBIG) as a full disk refuses it more (ENOSPC).
    Not /dev/full: safetensors writes a temporary file and renames it over its target."""
    script = textwrap.dedent(
        f"""
        import resource, torch
        from asyncrl.write_errors import save_tensors
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, resource.RLIM_INFINITY))
        try:
            save_tensors({{"w": torch.zeros(256)}}, {str(tmp_path / "w.safetensors")!r})
        except OSError as error:
            print(error.errno, error.filename)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == [str(errno.EFBIG), str(tmp_path / "w.safetensors")], result.stderr


def test_a_metrics_line_on_a_full_disk_names_the_file(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.symlink_to(FULL)
    with pytest.raises(OSError) as error:
        MetricsLogger(tmp_path, "trainer").log(1, {"loss": 0.5})
    assert error.value.errno == errno.ENOSPC and error.value.filename == str(metrics)


def test_a_refusal_is_found_inside_the_errors_that_wrap_it():
    try:
        try:
            FULL.write_bytes(b"x")
        except OSError as disk:
            raise RuntimeError("saving the checkpoint failed") from disk
    except RuntimeError as wrapped:
        found = refused_write(wrapped)
    assert found is not None and found.errno == errno.ENOSPC
    assert refused_write(RuntimeError("a bug")) is None
    assert refused_write(FileNotFoundError(errno.ENOENT, "No such file", "x")) is None  # a read, not a write


def save_checkpoint(output_dir: Path, step: int) -> None:
    for part in checkpoints.RL_PARTS:
        staging = checkpoints.begin_part(output_dir, step, part)
        (staging / "progress.json").write_text(json.dumps({"step": step}))
        checkpoints.finish_part(output_dir, step, part)


def test_the_message_names_the_path_and_the_checkpoint_to_resume_from(tmp_path):
    save_checkpoint(tmp_path, 4)
    refused = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "weights" / "step_5"))
    message = str(describe(refused, tmp_path, checkpoints.RL_PARTS, "asyncrl rl"))
    assert message == (
        f"cannot write '{tmp_path / 'weights' / 'step_5'}': No space left on device; the last complete checkpoint "
        f"is step 4 ({tmp_path / 'checkpoints' / 'step_4'}): free space or fix the folder's permissions, then "
        "continue with `asyncrl rl --resume`"
    )


def test_without_a_checkpoint_the_message_says_so(tmp_path):
    refused = OSError(errno.EROFS, "Read-only file system", str(tmp_path / "metrics.jsonl"))
    message = str(describe(refused, tmp_path, checkpoints.SFT_PARTS, "asyncrl sft"))
    assert message.startswith(f"cannot write '{tmp_path / 'metrics.jsonl'}': Read-only file system; no checkpoint")
    assert "--resume" not in message
