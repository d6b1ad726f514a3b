"""Private PyTorch APIs are used in one module only (src/ndparallel/_compat.py). No processes."""

import re
from pathlib import Path

import ndparallel

# torch._x, torch.utils._x, torch.distributed.fsdp._x ... as an import or an attribute, and aten's private ops.
PRIVATE = re.compile(r"\btorch(\.[a-z]\w*)*\._[a-zA-Z]|\baten\._[a-z]")


def test_private_torch_apis_only_in_compat():
    root = Path(ndparallel.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if PRIVATE.search(line.split("#")[0]):
                offenders.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not offenders, "private torch APIs outside _compat.py:\n" + "\n".join(offenders)
