"""Rewriting ``.pt2`` archives for the tests that feed the loader broken or hostile ones."""

from __future__ import annotations

import json
from pathlib import Path
import zipfile

from offgraph_export.specs.artifact import SPECS_ENTRY


def rewrite(src: Path, dst: Path, edit=None, extra=(), edit_info=None) -> Path:
    """Copy a .pt2 entry by entry (``edit(name, data)`` returns new bytes, or None to drop the
    entry; ``edit_info(info, data)`` the same, and may change the entry's ZipInfo, e.g. its
    attributes) and append ``extra`` entries ``(ZipInfo or name, data)``; CRCs are computed afresh."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            data = edit(info.filename, data) if edit else data
            data = edit_info(info, data) if edit_info and data is not None else data
            if data is not None:
                zout.writestr(info, data)
        for info, data in extra:
            zout.writestr(info, data)
    return dst


def specs_edit(change):
    """An ``edit`` for :func:`rewrite` that applies ``change(specs_dict)`` to the specs entry."""

    def edit(name, data):
        if name.endswith(SPECS_ENTRY):
            specs = json.loads(data)
            change(specs)
            return json.dumps(specs).encode()
        return data

    return edit
