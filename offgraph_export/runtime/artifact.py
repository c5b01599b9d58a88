"""Load a ``.pt2`` artifact: the archive's entries first (names, links, the checksums of everything
but the weight files: nothing is extracted from a bad archive), then its specs (no code), then
each method's compiled program, cross-checked against the specs, then the weights, each file's
checksum verified over the bytes loaded (so the weights are read once, not once to verify them
and again to load them), loaded once and shared by the methods, before any step runs.
:meth:`Artifact.run` picks the method by the step's width: the decode method (static width 1)
when the package has one, the general step otherwise.

Loading a compiled package runs native code: load only artifacts you trust. These checks refuse
corrupt, inconsistent or path-traversing archives; they cannot make a malicious library safe."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from offgraph_export.errors import ArtifactError, SpecError
from offgraph_export.runtime.weights import load_method_weights, verify_unnamed_weight_files
from offgraph_export.specs.archive import archive_root, check_archive, check_pt2_layout, regular_file
from offgraph_export.specs.artifact import (
    DECODE_METHOD,
    METHOD_KEY,
    PROGRAM_KEY,
    SESSIONS_METHOD,
    STEP_METHOD,
    ArtifactSpecs,
    read_artifact_specs,
)
from offgraph_export.specs.constants import CONSTANTS_KEY, check_constants
from offgraph_export.specs.manifest import MANIFEST_KEY, parse_manifest
from offgraph_export.specs.step_width import STEP_WIDTH_KEY, parse_step_width

__all__ = ["Artifact"]


def _current_device(kind: str) -> torch.device:
    """``kind`` ("cpu" or "cuda") with the index of the current device, as tensors report it."""
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


#: AOTInductor's switch for its compiled wrappers' input checks (read once per library).
CHECK_INPUTS_ENV = "AOTI_RUNTIME_CHECK_INPUTS"


class Artifact:
    """A loaded program (one compiled method per entry of ``specs.methods``) and its specs. One
    artifact serves many sessions (weights loaded once)."""

    def __init__(
        self,
        path: Path,
        specs: ArtifactSpecs,
        methods: dict[str, object],
        single_threaded: bool = False,
        device: torch.device | None = None,
    ) -> None:
        self.path = path
        self.specs = specs
        self.methods = methods
        #: (input, dim) pairs a one-token step is repeated along where it pads (:meth:`_repeated`)
        self._width_dims = [
            (i, dim) for i, described in enumerate(specs.inputs)
            for dim, size in enumerate(described.shape) if size == specs.width_symbol
        ]
        #: loaded with AOTInductor's capturable (single-threaded) runner: CUDA graphs may capture it
        self.single_threaded = single_threaded
        self._device = device if device is not None else _current_device(specs.device)
        self.compiled = methods[STEP_METHOD]
        # the loader's run: a flat list in, a flat list out, no pytree work per call
        self._runs = {name: m.run for name, m in methods.items()}  # type: ignore[attr-defined]
        self._pads = DECODE_METHOD not in self._runs and specs.pads_one_token
        self._checks_on: set[str] = set()  # methods whose compiled input checks are latched on
        #: seconds per stage of :meth:`load`: ``archive`` (the checks and the checksums before any
        #: code loads), ``loader`` (torch's, which extracts and opens each method's library),
        #: ``cross_check``, ``weights`` (read, checksummed, loaded), ``constants``; empty for an
        #: artifact made otherwise
        self.load_seconds: dict[str, float] = {}

    @property
    def device(self) -> torch.device:
        """The device the program runs on, with its index (``cuda:0``, as tensors report it): the
        one its weights were loaded on, whatever device is current later."""
        return self._device

    @property
    def load_s(self) -> float:
        """Seconds :meth:`load` took (the sum of :attr:`load_seconds`; 0.0 for an artifact made otherwise)."""
        return sum(self.load_seconds.values())

    @classmethod
    def load(cls, path: str | os.PathLike, single_threaded: bool = False) -> "Artifact":
        """``single_threaded=True`` loads for CUDA graph capture. The archive is checked before
        torch's loader opens it (``check_archive(defer_weights=True)``: names, the one canonical
        zip layout, so torch's loader reads the entries that were checked and no others, bounded
        counts and sizes, the checksum of every member but the weight files). torch's loader reads
        only the methods' folders; the weight files are this module's to read, and each one's
        checksum is verified over the bytes loaded (``runtime/weights.py``): a bad one refuses the
        load, naming the file and both checksums, and no artifact is returned."""
        path = Path(path)
        with _pinned(path) as pinned, _named(pinned, path):
            return cls._load(path, pinned, single_threaded)

    @classmethod
    def _load(cls, path: Path, pinned: str, single_threaded: bool) -> "Artifact":
        """:meth:`load`, every read through ``pinned`` (the file ``path`` named when it was
        opened, :func:`_pinned`; :meth:`load`'s :func:`_named` puts ``path`` in the messages)."""
        clock = _StageClock()
        names = [info.filename for info in check_archive(pinned, defer_weights=True)]
        specs = read_artifact_specs(pinned)
        if specs.device == "cuda" and not torch.cuda.is_available():
            raise ArtifactError(f"{path} was compiled for cuda but no CUDA device is available")
        check_pt2_layout(names, str(path), specs.methods)
        _check_archive_version(pinned, names, path)
        verify_unnamed_weight_files(pinned, specs.methods)  # before any code loads; the rest as read
        clock.stage("archive")
        with _loader_name(pinned, path) as name:
            runners = _compiled_methods(name, specs.methods, single_threaded, specs.device, path)
        clock.stage("loader")
        for method in specs.methods:
            cls._cross_check(path, specs, runners[method], method)
        clock.stage("cross_check")
        device = _current_device(specs.device)
        # each view sized by the dtype its method was compiled for, before any weight file is read
        descriptions = {method: runners[method].get_metadata()[CONSTANTS_KEY] for method in specs.methods}
        weights = load_method_weights(pinned, specs.methods, device, constants=descriptions)  # checksummed as read
        clock.stage("weights")
        for method in specs.methods:
            check_constants(weights[method], runners[method].get_metadata()[CONSTANTS_KEY], method, str(path))
            try:  # (constants, use_inactive, check_full_update, user_managed): torch 2.11's and 2.13's binding alike
                runners[method].load_constants(weights[method], False, True, True)
            except Exception as exc:  # C++ errors: a missing or mis-shaped constant
                raise ArtifactError(f"{path}: the weights do not fit method {method!r}: {exc}") from exc
        clock.stage("constants")
        artifact = cls(path, specs, {m: runners[m] for m in specs.methods}, single_threaded, device)
        artifact.load_seconds = clock.seconds
        return artifact

    @staticmethod
    def _cross_check(path: Path, specs: ArtifactSpecs, compiled: object, method: str) -> None:
        metadata = compiled.get_metadata()  # type: ignore[attr-defined]
        missing = [k for k in (STEP_WIDTH_KEY, MANIFEST_KEY, PROGRAM_KEY, METHOD_KEY, CONSTANTS_KEY) if k not in metadata]
        if missing:
            raise ArtifactError(
                f"{path}: method {method!r}: the compiled program's metadata lacks {missing}; "
                "re-export it with this version of offgraph-export"
            )
        if metadata[METHOD_KEY] != method:
            raise ArtifactError(
                f"{path}: the program stored as method {method!r} says it is {metadata[METHOD_KEY]!r}"
            )
        try:
            width, manifest = parse_step_width(metadata[STEP_WIDTH_KEY]), parse_manifest(metadata[MANIFEST_KEY])
        except SpecError as exc:
            raise ArtifactError(f"{path}: the compiled program's own specs are invalid: {exc}") from exc
        if width != specs.step_width:
            raise ArtifactError(
                f"{path}: step width in the archive ({specs.step_width.format()!r}) disagrees with the "
                f"compiled program's ({metadata[STEP_WIDTH_KEY]!r})"
            )
        if manifest != specs.manifest:
            raise ArtifactError(f"{path}: manifest in the archive disagrees with the compiled program's")
        if metadata[PROGRAM_KEY] != specs.program_description(method):
            raise ArtifactError(
                f"{path}: the inputs the archive's specs describe (dtypes, dynamic dims, ranges, "
                f"positions, per-token outputs) disagree with the compiled {method!r} program's own"
            )
        in_spec, _ = compiled.get_call_spec()  # type: ignore[attr-defined]
        n_inputs = torch.utils._pytree.treespec_loads(in_spec).num_leaves
        batch = 0 if specs.manifest.paging is None else len(specs.manifest.paging.inputs)
        want = len(specs.inputs) + 2 * len(specs.manifest.layers) + batch
        if n_inputs != want:
            raise ArtifactError(
                f"{path}: compiled program takes {n_inputs} inputs but the specs describe {want} "
                f"({len(specs.inputs)} model inputs + {2 * len(specs.manifest.layers)} storage"
                + (f" + {batch} batch inputs)" if batch else ")")
            )

    def method_for(self, width: int | None, one_row_per_session: bool = False) -> str:
        """The method that runs a step of ``width`` tokens (None: the general step): the decode
        method at width 1, the sessions method for a wider step of one row per session (a
        batched decode step), where the package has them."""
        if width == 1 and DECODE_METHOD in self._runs:
            return DECODE_METHOD
        if one_row_per_session and width is not None and width >= 2 and SESSIONS_METHOD in self._runs:
            return SESSIONS_METHOD
        return STEP_METHOD

    @property
    def general_min_width(self) -> int:
        """The fewest tokens the general program was compiled for (``ArtifactSpecs.general_min_width``)."""
        return self.specs.general_min_width

    @property
    def pads_one_token(self) -> bool:
        """Whether a one-token step runs the general program at width 2, its token repeated
        (``ArtifactSpecs.pads_one_token``; the methods loaded are the ones the specs name)."""
        return self._pads

    def run(
        self, flat_inputs: Sequence[torch.Tensor], width: int | None = None, one_row_per_session: bool = False,
    ) -> list[torch.Tensor]:
        """Call the compiled program for a step of ``width`` tokens (:meth:`method_for`) on
        model inputs followed by storage, as a flat list. A one-token step the general program
        runs goes in at width 2 where :attr:`pads_one_token` (:meth:`_repeated`).
        ``one_row_per_session``: the caller's promise that every token is its session's only
        new row (the batched runner's decode steps); the sessions method relies on it."""
        method = self.method_for(width, True) if one_row_per_session else self.method_for(width)
        inputs = list(flat_inputs)
        padded = width == 1 and method == STEP_METHOD and self._pads
        if padded:
            inputs = self._repeated(inputs)
        if method not in self._checks_on:
            outputs = self._first_run(method, inputs)
        else:
            outputs = self._runs[method](inputs)
        return self._first_tokens(outputs) if padded else outputs

    def _repeated(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """A one-token step's model inputs with the token repeated along every dim of the step's
        width: two tokens at the same position, whose K/V rows are the same row with the same
        values (every op but the cache op is per token, and both see the same rows), so the first
        token's outputs are the one-token step's and storage holds what that step writes."""
        out = list(inputs)
        for i, dim in self._width_dims:
            out[i] = torch.cat([out[i], out[i]], dim)
        return out

    def _first_tokens(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        dims = self.specs.output_width_dims or []
        if len(outputs) != len(dims) or any(o.dim() <= d or o.shape[d] != 2 for o, d in zip(outputs, dims)):
            got = [tuple(o.shape) for o in outputs]
            raise ArtifactError(
                f"{self.path}: the general program returned outputs of shapes {got} for a step of 2 "
                f"tokens; the specs say each is per token along dims {dims}"
            )
        return [o.narrow(d, 0, 1) for o, d in zip(outputs, dims)]

    def _first_run(self, method: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The first call of ``method``, with AOTInductor's own input checks latched on for it.

        Each compiled wrapper checks every input's dtype, static sizes, size ranges and strides
        against what it was compiled for, when ``AOTI_RUNTIME_CHECK_INPUTS`` is set at its first
        call (it reads the variable once). The storage the runtime allocates is sized from the
        specs and the metadata, which an archive can rewrite together; the compiled library is
        the one fact the rewrite cannot change without the library no longer being the export's,
        so every call is checked against it: a storage tensor of other kv heads, ring rows, head
        dim or dtype than the library writes is refused (a ``StepFailed``) before any kernel runs.
        The variable is set only around this call, so other packages in the process keep theirs."""
        previous = os.environ.get(CHECK_INPUTS_ENV)
        os.environ[CHECK_INPUTS_ENV] = "1"
        try:
            return self._runs[method](inputs)
        finally:
            self._checks_on.add(method)  # latched at the call's start, whatever it returned
            if previous is None:
                del os.environ[CHECK_INPUTS_ENV]
            else:
                os.environ[CHECK_INPUTS_ENV] = previous

    def new_session(self, **kwargs) -> "Session":  # noqa: F821
        from offgraph_export.runtime.session import Session

        return Session(self, **kwargs)


@contextlib.contextmanager
def _pinned(path: Path) -> Iterator[str]:
    """A name that reaches the file ``path`` names now, whatever later happens to ``path``:
    ``/proc/self/fd/N`` of a descriptor held open for the block (on Linux; elsewhere ``path``
    itself). The checks, torch's loader and the weight reader all open it, so a file renamed over
    ``path`` between them is never read: what is loaded is the file that was checked. (Writes
    into that same file while it loads are not caught: they need write access to the package.)"""
    regular_file(path)  # a clear error for a missing or special path, before it is opened
    if not os.path.isdir("/proc/self/fd"):
        yield str(path)
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise ArtifactError(f"cannot open artifact {str(path)!r}: {exc.strerror}") from exc
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _check_archive_version(pinned: str, names: list[str], path: Path) -> None:
    """The archive's ``archive_version`` is the one this torch writes and reads (torch's
    ``load_pt2`` refused any other; the project's loader keeps that refusal). The constants come
    from torch's C++ module: ``torch.export.pt2_archive`` imports its packager and with it
    ``torch._dynamo`` (1.7 s on the dev CPU), before a hostile archive is refused."""
    from torch._C._export import pt2_archive_constants

    wanted = pt2_archive_constants.ARCHIVE_VERSION_VALUE
    entry = archive_root(names, str(path)) + pt2_archive_constants.ARCHIVE_VERSION_PATH
    found = None
    if entry in names:
        with zipfile.ZipFile(pinned) as archive:
            if archive.getinfo(entry).file_size <= 64:
                found = archive.read(entry).decode("utf-8", errors="replace").strip()
    if found != wanted:
        raise ArtifactError(
            f"{path}: its archive_version is {found!r}, this torch reads {wanted!r}: "
            "export it again with this torch"
        )


def _compiled_methods(name: str, methods: Sequence[str], single_threaded: bool, device: str, path: Path) -> dict[str, object]:
    """Each method's compiled program: torch's ``AOTIModelPackageLoader`` for it (the loader
    extracts only that method's folder), which ``load_pt2`` wraps in an ``AOTICompiledModel`` (its
    pytree calling convention, unused here: the runtime calls the loader's ``run`` with flat lists;
    importing it imports ``torch._dynamo``, 1.1 s on the dev CPU), without ``load_pt2``'s
    device-information probe. For a warning when the package was built for another
    CPU, that probe builds a test library for each CPU vector ISA and loads each one in a fresh
    Python process that imports torch: about 5 s on the dev CPU and, by session 21's measure, most
    of the 34 s the first load of every process took on the GPU machine. The one comparison that
    decides whether a cuda package can run, its compute capability, is checked here and refused by
    name; nothing else of ``load_pt2`` (its exported programs, extra files) is used."""
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader  # type: ignore[attr-defined]
        out: dict[str, object] = {}
        for method in methods:
            if device == "cuda":
                _check_compute_capability(loader.load_metadata_from_package(name, method), method, path)
            out[method] = loader(name, method, single_threaded, 1, -1)
        return out
    except ArtifactError:
        raise
    except Exception as exc:  # the loader raises RuntimeError/others from C++
        raise ArtifactError(f"cannot load the compiled program in {path}: {exc}") from exc


def _check_compute_capability(metadata: dict[str, str], method: str, path: Path) -> None:
    """Refuse a cuda method compiled for another compute capability than the current device's
    where its kernels cannot run (:func:`runs_on`), comparing what torch records at compile time
    (``AOTI_COMPUTE_CAPABILITY``) with the same function's value now; nothing to compare where the
    package records none."""
    recorded = metadata.get("AOTI_COMPUTE_CAPABILITY", "")
    if not recorded:
        return
    current = _cuda_compute_capability()
    if not runs_on(recorded, current):
        raise ArtifactError(
            f"{path}: method {method!r} was compiled for cuda compute capability {recorded}, this device is {current}: "
            "export it again on this kind of GPU"
        )


def _cuda_compute_capability() -> str:
    """The current cuda device's compute capability as AOTInductor records it at compile time
    (torch's ``CudaInterface.get_compute_capability``: ``major * 10 + minor``, or the gfx name on
    ROCm), computed here because importing that interface imports ``torch._dynamo`` (1.1 s on the
    dev CPU, paid by every process's first load)."""
    if torch.version.hip is None:
        major, minor = torch.cuda.get_device_capability()
        return str(major * 10 + minor)
    return torch.cuda.get_device_properties().gcnArchName.split(":", 1)[0]


def runs_on(recorded: str, current: str) -> bool:
    """Whether kernels built for compute capability ``recorded`` run on ``current`` (both as torch
    writes them, ``major * 10 + minor``: "90", "100"): the same major version and at least the
    minor one (a cubin runs on later minor versions of its major), or the same value where either
    is not a number."""
    if not (recorded.isdigit() and current.isdigit()):
        return recorded == current
    (major, minor), (now_major, now_minor) = divmod(int(recorded), 10), divmod(int(current), 10)
    return major == now_major and now_minor >= minor


@contextlib.contextmanager
def _loader_name(pinned: str, path: Path) -> Iterator[str]:
    """What torch's package loader is given for the pinned file: a file name (it reads no file
    object). The name is a link, in a private folder of this process's own, to
    ``/proc/self/fd/N``: opening it reaches the descriptor :func:`_pinned` holds, the file that was
    checked (a ``.pt2`` name, which torch's loaders have wanted). Where the pinned name is the path
    itself (no ``/proc``), it goes as it is."""
    if pinned.startswith("/proc/self/fd/"):
        with tempfile.TemporaryDirectory(prefix="offgraph-load-") as folder:  # mode 0700: nobody else's
            link = os.path.join(folder, "package.pt2")
            os.symlink(pinned, link)
            yield link
    else:
        yield pinned


@contextlib.contextmanager
def _named(pinned: str, path: Path) -> Iterator[None]:
    """Errors raised in the block name ``path``, not the pinned name it was read through."""
    try:
        yield
    except ArtifactError as exc:
        if pinned not in str(exc):
            raise
        raise type(exc)(str(exc).replace(pinned, str(path))) from exc


class _StageClock:
    """Seconds per named stage, each from the end of the one before (``time.perf_counter``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def stage(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._last
        self._last = now
