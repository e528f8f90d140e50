"""A child process for the new-process checks (tests/guarantees.py): runs prompts on a
cache directory, applying the parent's mutant if any, and writes what the spy saw."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from guarantees import Rig, load_variant, run, save_runs
from mutants import MUTANTS


def main(spec: dict[str, object]) -> None:
    if spec["mutant"]:
        MUTANTS[str(spec["mutant"])](setattr)
    bits = spec["kv_bits"]
    variant = load_variant(
        str(spec["source"]),
        bool(spec["shaped"]),
        bool(spec["checkpointed"]),
        None if bits is None else int(str(bits)),
        int(str(spec["kv_group"])),
        None if spec["adapter"] is None else str(spec["adapter"]),
    )
    engine, spy = Rig(variant, Path(str(spec["dir"]))).engine()
    prompts = spec["prompts"]
    assert isinstance(prompts, list)
    save_runs([run(engine, spy, p) for p in prompts], Path(str(spec["out"])))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
