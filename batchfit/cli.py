"""`batchfit search|fit|train ARGS`: the console command, beside `python -m search`,
`python -m search.fit` and `python -m train` (the same entry points, the same Hydra
overrides).

    batchfit search +experiment=resnet data=digits   # a study
    batchfit fit +experiment=llm_lora search.gpu=A100-40GB   # what fits, in seconds
    batchfit train +best=mlruns/.../best.yaml         # one run

Unlike `python -m`, which puts the working folder first on the import path, the command
imports batchfit's modules before the folder's, so a `train.py`, `search.py` or `common/`
there never stands in for them; the folder is still searched, last, for the modules a
config's `_target_` names (`_target_: myproject.models.build`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

COMMANDS = {  # subcommand -> (the entry point's module, what it does)
    "search": ("batchfit.search.__main__", "run a study: Optuna trials under the memory budget"),
    "fit": ("batchfit.search.fit.__main__", "which batch sizes fit, predicted in seconds"),
    "train": ("batchfit.train.__main__", "one training run (a study's winner, +best=PATH)"),
}
USAGE_STATUS = 2  # as argparse exits on a usage error


def usage() -> str:
    from batchfit import __version__

    lines = [
        f"usage: batchfit {{{','.join(COMMANDS)}}} [HYDRA OVERRIDES...]",
        "",
        f"batchfit {__version__}: batch size, accumulation, precision and learning rate, tuned",
        "jointly under a device-memory budget.",
        "",
        "commands:",
        *(f"  {name:<8}{words}" for name, (_, words) in COMMANDS.items()),
        "",
        "Each takes Hydra overrides (`batchfit fit +experiment=resnet data=digits`); its own",
        "--help lists the config groups and keys (`batchfit search --help`).",
        "The same commands: python -m search | python -m search.fit | python -m train.",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """The `batchfit` console script: dispatch to an entry point, which exits itself."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        sys.exit(0 if args else USAGE_STATUS)
    if args[0] in ("-V", "--version"):
        from batchfit import __version__

        print(f"batchfit {__version__}")
        sys.exit(0)
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(
            f"batchfit: unknown command {command!r}; use one of {', '.join(COMMANDS)} "
            "(batchfit --help)",
            file=sys.stderr,
        )
        sys.exit(USAGE_STATUS)
    _folder_last_on_path()
    from batchfit.common.overrides import run_entry_point

    entry = importlib.import_module(COMMANDS[command][0])
    sys.argv = [f"batchfit {command}", *rest]  # what Hydra parses, and names in its help
    run_entry_point(entry.main)


def _folder_last_on_path() -> None:
    """The working folder, where a user's `_target_` modules live, searched after
    batchfit's own (a console script's sys.path[0] is its bin folder, not the folder)."""
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", cwd)] + [cwd]
