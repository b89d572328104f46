"""A write the system refuses during a run (a full disk, a read-only folder, a quota) ends the process with one
line naming the path, the reason and the checkpoint a resume would start from, instead of a traceback.

Libraries report such a failure each their own way: Python raises OSError with an errno and the path,
torch.distributed.checkpoint a CheckpointException holding each rank's error, safetensors an error whose text
ends in "(os error 28)". `refused_write` finds the refusal in any of them.
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import save_file

from asyncrl import checkpoints
from asyncrl.errors import AsyncRLError

REFUSED = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


def save_tensors(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, whose I/O errors name their path as an OSError does."""
    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as error:
        code = re.search(r"os error (\d+)", str(error))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from error


def refused_write(error: BaseException) -> OSError | None:
    """The OSError of a refused write in `error`, its causes, or the rank failures it carries; else None."""
    stack, seen = [error], set()
    while stack:
        found = stack.pop()
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        if isinstance(found, OSError) and found.errno in REFUSED:
            return found
        stack += [found.__cause__, found.__context__]
        stack += [failure for failure, _ in getattr(found, "failures", {}).values()]
    return None


def describe(refused: OSError, output_dir: Path, parts: tuple[str, ...], resume: str) -> AsyncRLError:
    """One line: what could not be written, why, and where a resume (`resume`, the command) would start."""
    where = f"'{refused.filename}'" if refused.filename else f"under '{output_dir}'"
    try:
        step, _ = checkpoints.find_resume_step(output_dir, parts, None)
        then = (
            f"the last complete checkpoint is step {step} ({checkpoints.step_dir(output_dir, step)}): free space "
            f"or fix the folder's permissions, then continue with `{resume} --resume`"
        )
    except AsyncRLError:
        then = "no checkpoint is complete (ckpt.interval saves them): free space or fix the folder's permissions"
    return AsyncRLError(f"cannot write {where}: {refused.strerror}; {then}")
