"""The module paths flowq had before its layout (`flowq.runs`, `flowq.queues`, ...), kept for
one release: each is a shim module that warns and hands on the module that replaced it.

`alias(old, new)` makes `old` the very module `new` (in `sys.modules`, so `flowq.runs is
flowq.ops.runs` and a test's monkeypatch reaches the code that runs); `warn_moved(old, new)`
only warns, for the shims that gather names now split across modules. Either warns once per
process, a `DeprecationWarning` naming the new path, attributed to the line that imported the
old one (or read it as an attribute of `flowq`), so Python shows it where the user can fix it.
The shims go in the release after 0.1 (`REMOVED_IN`).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from pathlib import Path
from types import FrameType
from typing import Final

__all__ = ["REMOVED_IN", "alias", "warn_moved"]

REMOVED_IN: Final = "0.2"
_PACKAGE: Final = f"{Path(__file__).parent}{os.sep}"


def _is_import_machinery(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    # Frames the warnings module itself skips (importlib._bootstrap*), so they count no level.
    return "importlib" in filename and "_bootstrap" in filename


def _warn(old: str, new: str) -> None:
    """Warn from the shim's caller: called by `alias` or `warn_moved`, called by the shim."""
    frame = sys._getframe(3)  # the shim's module code
    level = 3  # as warnings counts: _warn 1, alias or warn_moved 2, the shim 3
    while frame.f_back is not None and (
            frame.f_code.co_filename.startswith(_PACKAGE)
            or frame.f_code.co_filename == importlib.__file__
            or _is_import_machinery(frame)):
        frame = frame.f_back
        if not _is_import_machinery(frame):
            level += 1
    warnings.warn(f"{old} is deprecated and goes in flowq {REMOVED_IN}: import {new} instead.",
                  DeprecationWarning, stacklevel=level)


def warn_moved(old: str, new: str) -> None:
    """Warn that module `old` is now `new` (for several modules: "`a` and `b`")."""
    _warn(old, new)


def alias(old: str, new: str) -> None:
    """Warn, then make module `old` the module `new` for every importer from now on."""
    _warn(old, new)
    # The import system hands the importer whatever sys.modules holds once the shim ran,
    # and binds that as the attribute of flowq too.
    sys.modules[old] = importlib.import_module(new)
