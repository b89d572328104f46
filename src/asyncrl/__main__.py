import os

if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank torchrun started: bound to its agent before the slow imports
    from asyncrl.processes import die_with_torchrun_agent

    die_with_torchrun_agent()

from asyncrl.cli import main  # noqa: E402

main()
