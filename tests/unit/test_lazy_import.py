"""``import ndparallel`` and the CLI's help import neither transformers nor FSDP until a public name is used."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_the_package_and_the_cli_import_nothing_heavy_until_used():
    loaded = _run(
        "import sys, ndparallel, ndparallel.cli; "
        "print(sorted(m for m in ('transformers', 'torch.distributed.fsdp', 'torchao') if m in sys.modules))"
    )
    assert loaded == "[]"
    # a public name imports its module on first use, and names that do not exist still raise AttributeError
    got = _run(
        "import ndparallel as ndp\n"
        "print(ndp.Topology.__module__, ndp.clip_grad_norm_.__module__, 'Topology' in dir(ndp))\n"
        "try:\n    ndp.no_such_name\nexcept AttributeError as e:\n    print('AttributeError', e)"
    )
    assert got.splitlines() == [
        "ndparallel.topology ndparallel.step True",
        "AttributeError module 'ndparallel' has no attribute 'no_such_name'",
    ]
