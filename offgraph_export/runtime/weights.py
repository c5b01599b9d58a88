"""Load a package's weights once and give the same tensors to every method.

The packager (:mod:`offgraph_export.lowering.aoti`) keeps weights out of the compiled libraries:
``<root>/data/weights/weight_<n>`` holds one tensor each (a tensor both methods use is stored once)
and each method's ``<root>/data/aotinductor/<method>/weights_config.json`` maps its constant names
to ``[file, shape, stride, storage offset]``. Both are untrusted input: a config must be valid JSON of
that form within the size limits, name only weight files that exist in the archive, and describe
views that lie inside the loaded tensor (their dtype, shape and strides are then compared with what
the program was compiled for, ``specs/constants.py``); the files are read with ``torch.load(weights_only=True)``
(tensors only, no code) straight onto the artifact's device. Each file is read from the archive once:
its CRC-32 is computed over the bytes as they are read and compared before ``torch.load`` sees them
(:func:`~offgraph_export.specs.archive.read_member`), which is why the loader's up-front checksum
pass leaves the weight files out (a 16 GB package would otherwise be read twice); a weight file no
config names is verified here too. Nothing is read unbounded: the archive passes the checks of
:func:`~offgraph_export.specs.archive.check_archive` (its one canonical layout and the limits on
counts and sizes) first, a weight file larger than the bytes its views take (their extent
times the element size of the dtype the program was compiled for, plus
:data:`~offgraph_export.specs.limits.MAX_TENSOR_FILE_OVERHEAD`) is refused before it is read, and
the tensor file, itself a zip archive that torch's reader inflates record by record, must pass the
same layout check with its records declaring no more than that bound before ``torch.load`` sees it.
Each method then receives its views with ``user_managed`` set, so the compiled code reads these
tensors in place and the weights occupy device memory once however many methods the package holds.
"""

from __future__ import annotations

import io
import os
import threading
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO
from typing import Annotated

import torch
from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError

from offgraph_export.errors import ArtifactError
from offgraph_export.specs.archive import (
    AOTI_DIR,
    UNREADABLE_MEMBER,
    WEIGHT_FILE,
    WEIGHTS_DIR,
    ArchiveMember,
    archive_root,
    check_layout,
    checked_members,
    is_weight_member,
    read_member,
    regular_file,
    verify_member,
)
from offgraph_export.specs.limits import MAX_JSON_BYTES, MAX_TENSOR_FILE_OVERHEAD, loads_limited

__all__ = [
    "WeightView",
    "load_method_weights",
    "verify_unnamed_weight_files",
]


#: Sizes, strides and offsets beyond this are refused (no real tensor comes near it).
MAX_EXTENT = 1 << 48
Size = Annotated[int, Field(ge=0, le=MAX_EXTENT)]


class WeightView(BaseModel):
    """One constant: a view ``(shape, stride, offset)`` of the tensor stored in ``file``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    file: str = Field(pattern=f"^{WEIGHT_FILE}$")
    shape: list[Size] = Field(max_length=16)
    stride: list[Size] = Field(max_length=16)
    offset: Size

    @classmethod
    def from_entry(cls, entry: object) -> "WeightView":
        if not isinstance(entry, list) or len(entry) != 4:
            raise ValueError(f"expected [file, shape, stride, offset], got {entry!r:.80}")
        file, shape, stride, offset = entry
        return cls(file=file, shape=shape, stride=stride, offset=offset)

    def extent(self) -> int:
        """Elements from the storage start the view reaches (0 for an empty view)."""
        if any(s == 0 for s in self.shape):
            return 0
        return self.offset + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) + 1


class _Config(RootModel[dict[str, list[object]]]):
    pass


def _read_config(archive: BinaryIO, member: ArchiveMember, source: str) -> dict[str, WeightView]:
    entry = member.name
    if member.size > MAX_JSON_BYTES:
        raise ArtifactError(f"{source}: {entry} is {member.size} bytes; more than {MAX_JSON_BYTES}")
    data = loads_limited(read_member(archive, member, source), f"{source}: {entry}", ArtifactError)
    try:
        raw = _Config.model_validate(data).root
        views = {}
        for name, value in raw.items():
            views[name] = WeightView.from_entry(value)
            if len(views[name].shape) != len(views[name].stride):
                raise ValueError(f"{name}: shape and stride have different ranks")

    except (ValidationError, ValueError) as exc:
        raise ArtifactError(f"{source}: {entry} is not a valid weights config: {exc}") from exc
    return views


#: The element size a view is sized with when the program's dtype for it is not known (the widest,
#: complex128): a constant the program was not compiled for is refused after loading, by name.
_WIDEST_ELEMENT = 16


def _element_sizes(description: str | None, method: str, source: str) -> dict[str, int]:
    """Element size by constant name, from ``method``'s compiled constants description
    (``specs/constants.py``: ``{name: [dtype, shape, stride]}``); entries it cannot read are left
    out (:func:`~offgraph_export.specs.constants.check_constants` refuses them by name later)."""
    if description is None:
        return {}
    data = loads_limited(description, f"{source}: method {method!r} constants", ArtifactError)
    sizes = {}
    for name, want in data.items() if isinstance(data, dict) else ():
        dtype = getattr(torch, want[0], None) if isinstance(want, list) and want and isinstance(want[0], str) else None
        if isinstance(dtype, torch.dtype):
            sizes[name] = dtype.itemsize
    return sizes


def _needed_bytes(
    configs: dict[str, dict[str, WeightView]], constants: Mapping[str, str] | None, source: str
) -> dict[str, int]:
    """Per weight file, the bytes the views that the configs take from it reach: the largest
    extent times its element size."""
    needed: dict[str, int] = {}
    for method, views in configs.items():
        sizes = _element_sizes(None if constants is None else constants.get(method), method, source)
        for name, view in views.items():
            reach = view.extent() * sizes.get(name, _WIDEST_ELEMENT)
            needed[view.file] = max(needed.get(view.file, 0), reach)
    return needed


def _check_tensor_file_size(member: ArchiveMember, needed: int, source: str) -> int:
    """The most weight file ``member`` may hold (``needed`` plus a tensor file's own overhead),
    once the size its record declares is within it."""
    bound = needed + MAX_TENSOR_FILE_OVERHEAD
    if member.size > bound:
        raise ArtifactError(
            f"{source}: {member.name} is {member.size} bytes; the views the weights configs take from it reach "
            f"{needed} bytes, so its file holds at most {bound}"
        )
    return bound


def _read_tensor_file(archive: BinaryIO, member: ArchiveMember, bound: int, source: str) -> bytes:
    """The bytes of weight file ``member``, read once and their CRC-32 verified as they are read,
    a zip archive itself, once it is in the one canonical layout with its records declaring no
    more than ``bound`` (torch's reader allocates and inflates each record as declared)."""
    data = read_member(archive, member, source)
    check_layout(io.BytesIO(data), f"{source}: {member.name}", kind="tensor file", max_total=bound)
    return data


def _method_configs(archive: BinaryIO, members: Mapping[str, ArchiveMember], root: str, methods: list[str],
                    source: str) -> dict[str, dict[str, WeightView]]:
    configs = {}
    for method in methods:
        entry = f"{root}{AOTI_DIR}{method}/weights_config.json"
        if entry not in members:
            raise ArtifactError(
                f"{source}: method {method!r} has no weights config ({entry}); re-export it "
                "with this version of offgraph-export"
            )
        configs[method] = _read_config(archive, members[entry], source)
    return configs


def verify_unnamed_weight_files(path: str | os.PathLike, methods: list[str]) -> None:
    """Verify the checksum of every weight file no method's weights config names (a file the
    weight reader will never load), before any code of the package is loaded: a hostile member
    hidden there is refused as early as a bad code member. The named ones are verified as they are
    read (:func:`load_method_weights`), so each byte is still read once."""
    source = str(path)
    try:
        with open(regular_file(path), "rb") as archive:
            members = {member.name: member for member in checked_members(archive, source)}
            root = archive_root(list(members), source)
            named = {view.file for views in _method_configs(archive, members, root, methods, source).values()
                     for view in views.values()}
            for name, member in members.items():
                if is_weight_member(name) and name[len(root) + len(WEIGHTS_DIR):] not in named:
                    verify_member(archive, member, source)
    except ArtifactError:
        raise
    except (OSError, *UNREADABLE_MEMBER) as exc:
        raise ArtifactError(f"{source}: cannot read the weights: {exc}") from exc


#: Weight files read, checksummed, unpickled and copied to the device at once (file reads, CRC-32,
#: the copy out of the tensor file and the host-to-device copy release the GIL): an 8B package's
#: 16 GB were read at 0.55 GB/s one file after another (H100 machine, torch 2.11).
LOAD_WORKERS = 4


#: the positional read the workers use (``os.pread``: no shared file offset); None where the
#: platform lacks it, and the files are then read one at a time through the loader's handle
_pread = getattr(os, "pread", None)


class _PositionalReader:
    """``seek``/``read`` over a shared descriptor with a position of its own (``os.pread``), so
    the workers read the one file the loader opened and checked, none sharing another's offset.
    (One ``pread`` returns at most about 2 GiB on Linux; a larger member is read in parts.)"""

    def __init__(self, fd: int) -> None:
        self._fd, self._at = fd, 0

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_SET:
            raise ValueError("only absolute seeks")
        self._at = offset
        return offset

    def read(self, size: int) -> bytes:
        data = _pread(self._fd, size, self._at)  # type: ignore[misc]
        self._at += len(data)
        return data


class _Stopped(Exception):
    """A file not started because another one failed."""


class _FirstFailure:
    """The first exception any worker raised (the one the load reports); once set, no further
    file starts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.error: BaseException | None = None

    def record(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error


def _loaded_tensor(reader: BinaryIO, member: ArchiveMember, bound: int, device: torch.device, source: str,
                   failure: _FirstFailure) -> torch.Tensor:
    """Weight file ``member`` on ``device``: read once, its CRC-32 verified as read, its layout
    checked, then unpickled tensors-only straight onto ``device`` (its whole storage). Not started
    once another file failed."""
    if failure.error is not None:
        raise _Stopped
    try:
        data = _read_tensor_file(reader, member, bound, source)
        try:
            loaded = torch.load(io.BytesIO(data), map_location=device, weights_only=True)
        except Exception as exc:  # a bad pickle raises UnpicklingError, others
            raise ArtifactError(f"{source}: {member.name} is not a readable tensor file: {exc}") from exc
        if not isinstance(loaded, torch.Tensor):
            raise ArtifactError(f"{source}: {member.name} holds a {type(loaded).__name__}, not a tensor")
        return loaded
    except BaseException as exc:
        failure.record(exc)
        raise


def _load_files(archive: BinaryIO, entries: Mapping[str, ArchiveMember], bounds: Mapping[str, int],
                device: torch.device, source: str) -> dict[str, torch.Tensor]:
    """Every weight file of ``entries`` (name -> member, in load order) on ``device``, up to
    :data:`LOAD_WORKERS` at once (each read, verified, unpickled and copied to the device by its
    thread), so at most that many files are held on the host. Once one fails no further file is
    started, and that failure is raised."""
    names = list(entries)
    files: dict[str, torch.Tensor] = {}
    workers = max(1, min(LOAD_WORKERS, os.cpu_count() or 1, len(names))) if _pread is not None else 1
    failure = _FirstFailure()

    def reader() -> BinaryIO:
        return archive if _pread is None else _PositionalReader(archive.fileno())  # type: ignore[return-value]

    def take(future: Future[torch.Tensor]) -> None:
        try:
            files[names[len(files)]] = future.result()
        except _Stopped:
            raise failure.error from None  # type: ignore[misc]

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="offgraph-weights") as pool:
        pending: deque[Future[torch.Tensor]] = deque()
        try:
            for name in names:
                if failure.error is not None:
                    raise failure.error
                pending.append(pool.submit(_loaded_tensor, reader(), entries[name], bounds[name], device, source, failure))
                if len(pending) > workers:
                    take(pending.popleft())
            while pending:
                take(pending.popleft())
        finally:
            for future in pending:
                future.cancel()
    return files


def load_method_weights(
    path: str | os.PathLike,
    methods: list[str],
    device: torch.device,
    constants: Mapping[str, str] | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Each method's constants by name, as views of tensors loaded once onto ``device``.
    ``constants``: each method's compiled constants description (its ``offgraph_constants``
    metadata), which sizes each view by its dtype; without it views are sized by the widest."""
    source = str(path)
    try:
        with open(regular_file(path), "rb") as archive:
            members = {member.name: member for member in checked_members(archive, source)}
            root = archive_root(list(members), source)
            configs = _method_configs(archive, members, root, methods, source)
            bounds: dict[str, int] = {}  # every file named and sized before any is read
            for file, needed in _needed_bytes(configs, constants, source).items():
                entry = f"{root}{WEIGHTS_DIR}{file}"
                if entry not in members:
                    raise ArtifactError(f"{source}: a weights config names {file!r}, which the archive lacks")
                bounds[file] = _check_tensor_file_size(members[entry], needed, source)
            # a weight file no config names is never loaded: verify_unnamed_weight_files checked it
            order = list(dict.fromkeys(view.file for views in configs.values() for view in views.values()))
            entries = {file: members[f"{root}{WEIGHTS_DIR}{file}"] for file in order}
            files = _load_files(archive, entries, bounds, device, source)
    except ArtifactError:
        raise
    except (OSError, *UNREADABLE_MEMBER) as exc:
        raise ArtifactError(f"{source}: cannot read the weights: {exc}") from exc
    out: dict[str, dict[str, torch.Tensor]] = {}
    for method, views in configs.items():
        out[method] = {}
        for name, view in views.items():
            base = files[view.file]
            held = base.untyped_storage().nbytes() // base.element_size()
            if view.extent() > held:
                raise ArtifactError(
                    f"{source}: weight {name!r} of method {method!r} reaches element {view.extent()} "
                    f"of {view.file}, which holds {held}"
                )
            try:
                out[method][name] = base.as_strided(view.shape, view.stride, view.offset)
            except Exception as exc:  # sizes that fit the storage but not torch's limits
                raise ArtifactError(f"{source}: weight {name!r} of method {method!r} is not a valid view: {exc}") from exc
    return out

