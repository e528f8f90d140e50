"""`python -m mlxcache.regress.child SUITE_JSON WORK_DIR BLOCK_SIZE`: the disk variant.

Runs the suite like the warm variant, in a process of its own whose memory tier starts
empty, so every resume comes from the disk tier the parent filled. Prints the outputs on
stdout; each case's start and end on stderr (`runner.PROGRESS` lines, which the parent
shows as its own progress).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mlxcache.regress import suite as suite_mod
from mlxcache.regress.runner import PROGRESS, LocalRunner


def _progress(_variant: str, case: str, what: str) -> None:
    if case:  # the variant's own start and end are the parent's to show
        sys.stderr.write(PROGRESS + json.dumps([case, what]) + "\n")
        sys.stderr.flush()


def main(argv: list[str]) -> None:
    suite_file, work_dir, block_size = Path(argv[0]), Path(argv[1]), int(argv[2])
    suite = suite_mod.parse(json.loads(suite_file.read_text()), str(suite_file))
    runner = LocalRunner(suite, work_dir, block_size, _progress)
    outputs = runner.run("warm")
    sys.stdout.write(json.dumps({"outputs": outputs, "cache": runner.cache_stats["warm"]}))


if __name__ == "__main__":
    main(sys.argv[1:])
