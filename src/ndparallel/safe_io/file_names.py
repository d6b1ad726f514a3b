"""File names read from files (an index's ``weight_map``, a dataset's ``state.json``, a manifest), resolved
inside the directory that holds them.

Such a name is data: an absolute path or a ``..`` component would make ndparallel read (or delete) a file
outside the directory it was pointed at. The check is on the name as written, so a directory whose files are
links elsewhere (the Hugging Face cache's snapshots link into its blob store) still works.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath


def inside(directory: Path, name: object) -> Path | None:
    """``directory / name`` when ``name`` is a relative file name that stays inside ``directory``, else None."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        return None
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts or Path(name).is_absolute():
        return None
    return Path(directory) / relative
