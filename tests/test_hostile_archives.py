"""Hostile and inconsistent archives: each is refused with an error naming what is wrong, before
anything is extracted or loaded; nothing is written outside a temp folder; no code an archive names
is imported or run."""

from __future__ import annotations

import os
import re
import stat
import struct
import tempfile
import uuid
import zipfile
from pathlib import Path

import pytest

from offgraph_export.errors import ArtifactError
from offgraph_export.runtime import Artifact
from offgraph_export.specs.archive import check_pt2_layout
from offgraph_export.specs.artifact import SPECS_ENTRY, read_artifact_specs
from offgraph_export.specs.limits import MAX_SPEC_ITEMS, MAX_SPEC_VALUES
from tests.archive_tools import rewrite, specs_edit
from tests.conftest import EXAMPLE, cli


def root_of(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        return next(n for n in z.namelist() if n.endswith("archive_format"))[: -len("archive_format")]


def flip_byte_in(path: Path, dst: Path, suffix: str) -> Path:
    """Flip one byte inside the stored data of the first member ending in ``suffix``, leaving the
    archive's directory (and so the recorded CRC) as it was."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    assert info.compress_type == zipfile.ZIP_STORED
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    data[start + info.file_size // 2] ^= 0x40
    dst.write_bytes(bytes(data))
    return dst


# -- every hostile archive: (builder, expected message) ----------------------------------------

MARK = f"offgraph_escape_{uuid.uuid4().hex}"


def _traversal(good, tmp):
    return rewrite(good, tmp / "traversal.pt2", extra=[(root_of(good) + f"../../{MARK}.txt", b"escaped")])


def _deep_traversal(good, tmp):
    return rewrite(good, tmp / "deep.pt2", extra=[(root_of(good) + f"data/../../../../../../tmp/{MARK}.txt", b"x")])


def _absolute(good, tmp):
    return rewrite(good, tmp / "absolute.pt2", extra=[(str(tmp / "abs_target" / f"{MARK}.txt"), b"x")])


def _backslash(good, tmp):
    return rewrite(good, tmp / "backslash.pt2", extra=[(root_of(good) + "..\\..\\" + MARK, b"x")])


def _symlink(good, tmp):
    info = zipfile.ZipInfo(root_of(good) + "data/link")
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return rewrite(good, tmp / "symlink.pt2", extra=[(info, b"/etc/passwd")])


def _outside_root(good, tmp):
    return rewrite(good, tmp / "outside.pt2", extra=[("elsewhere/file.txt", b"x")])


def _duplicate(good, tmp):
    name = root_of(good) + "byteorder"
    with pytest.warns(UserWarning, match="Duplicate name"):
        return rewrite(good, tmp / "duplicate.pt2", extra=[(name, b"big")])


def _corrupt_library(good, tmp):
    return flip_byte_in(good, tmp / "flipped_so.pt2", ".so")


def _corrupt_specs_member(good, tmp):
    return flip_byte_in(good, tmp / "flipped_specs.pt2", SPECS_ENTRY)


def _corrupt_weight(good, tmp):  # refused by the read that loads it (no pass of its own reads it)
    return flip_byte_in(good, tmp / "flipped_weight.pt2", "data/weights/weight_0")


def _widened_range(good, tmp):
    def change(specs):
        width = specs["inputs"][0]["shape"][1]
        specs["symbols"][width]["max"] = 4096

    return rewrite(good, tmp / "widened.pt2", specs_edit(change))


def _narrowed_range(good, tmp):
    def change(specs):
        width = specs["inputs"][0]["shape"][1]
        specs["symbols"][width]["max"] = 8

    return rewrite(good, tmp / "narrowed.pt2", specs_edit(change))


def _empty_range(good, tmp):
    def change(specs):
        width = specs["inputs"][0]["shape"][1]
        specs["symbols"][width].update(min=9, max=3)

    return rewrite(good, tmp / "empty_range.pt2", specs_edit(change))


def _wrong_dtype(good, tmp):
    return rewrite(good, tmp / "dtype.pt2", specs_edit(lambda s: s["inputs"][0].update(dtype="int32")))


def _patched_headers(good, dst, local=None, central=None):
    """``good`` with ``local(data, offset)`` applied at every local file header and ``central``
    at every central directory header (byte-level edits zipfile would never write)."""
    data = bytearray(good.read_bytes())
    for signature, patch in ((b"PK\x03\x04", local), (b"PK\x01\x02", central)):
        i = data.find(signature)
        while patch is not None and i >= 0:
            patch(data, i)
            i = data.find(signature, i + 4)
    dst.write_bytes(bytes(data))
    return dst


def _zip_version(good, tmp):  # "version needed to extract" 25.5: zipfile raises NotImplementedError
    return _patched_headers(good, tmp / "version.pt2", central=lambda d, i: d.__setitem__(i + 6, 255))


def _encrypted(good, tmp):  # the encryption flag: zipfile raises RuntimeError on reading
    def flag(offset):
        return lambda d, i: d.__setitem__(i + offset, d[i + offset] | 1)

    return _patched_headers(good, tmp / "encrypted.pt2", local=flag(6), central=flag(8))


def _not_utf8_name(good, tmp):  # the UTF-8 name flag on names that are not: UnicodeDecodeError
    data = good.read_bytes().replace(b"archive_format", b"archive_for\xff\xfe\xfd")
    (tmp / "latin.pt2").write_bytes(data)
    return _patched_headers(tmp / "latin.pt2", tmp / "utf8.pt2", central=lambda d, i: d.__setitem__(i + 9, d[i + 9] | 0x08))


def _no_root_folder(good, tmp):
    """Every entry moved to the top of the archive: no package folder."""
    root = root_of(good)
    dst = tmp / "noroot.pt2"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(dst, "w") as out:
        for info in src.infolist():
            out.writestr(info.filename[len(root):], src.read(info))
    return dst


def _coerced_bool(good, tmp):
    return rewrite(good, tmp / "coerced.pt2", specs_edit(lambda s: s.update(decode_method="yes")))


def _nan_model_arg(good, tmp):  # json.dumps writes NaN; it would come back as null
    return rewrite(good, tmp / "nan.pt2", specs_edit(lambda s: s.update(model_args={"scale": float("nan")})))


def _model_dtype_lie(good, tmp):
    """bf16 recorded for an f32 artifact: check would cast the eager model to bf16 and compare
    with bf16's wider tolerance."""
    return rewrite(good, tmp / "model_dtype.pt2", specs_edit(lambda s: s.update(model_dtype="bfloat16")))


def _unknown_dtype(good, tmp):
    return rewrite(good, tmp / "int65.pt2", specs_edit(lambda s: s["inputs"][1].update(dtype="int65")))


def _static_dim_changed(good, tmp):
    return rewrite(good, tmp / "batch.pt2", specs_edit(lambda s: s["inputs"][0]["shape"].__setitem__(0, 2)))


def _positions_dropped(good, tmp):
    return rewrite(good, tmp / "nopos.pt2", specs_edit(lambda s: s.update(positions_input=None)))


def _output_dims_moved(good, tmp):  # a one-token step's outputs would be cut along another dim
    return rewrite(good, tmp / "outdims.pt2", specs_edit(lambda s: s.update(output_width_dims=[2])))


def _bound_dropped(good, tmp):
    return rewrite(good, tmp / "nobound.pt2", specs_edit(lambda s: s["inputs"][0].update(index_bound=None)))


def _input_dropped(good, tmp):
    return rewrite(good, tmp / "oneinput.pt2", specs_edit(lambda s: s.update(inputs=s["inputs"][:1], positions_input=None)))


def _deeply_nested(good, tmp):
    return rewrite(good, tmp / "nested.pt2", lambda n, d: b"[" * 50_000 + b"]" * 50_000 if n.endswith(SPECS_ENTRY) else d)


def _huge_specs(good, tmp):
    return rewrite(good, tmp / "huge.pt2", lambda n, d: d + b" " * (5 << 20) if n.endswith(SPECS_ENTRY) else d)


def _build_from_sources(good, tmp):
    """The library dropped and a compile-flags file added: torch's loader would build the library
    from the archive's sources by running the flags file's compiler through a shell."""
    flags = b'{"compiler": "touch ' + str(tmp / MARK).encode() + b'; g++", "compile_only": true}'

    def edit(name, data):
        return None if name.endswith(".so") else data

    wrapper = next(n for n in zipfile.ZipFile(good).namelist() if n.endswith("wrapper.cpp"))
    return rewrite(good, tmp / "sources.pt2", edit, extra=[(wrapper[:-4] + "_compile_flags.json", flags)])


def _huge_integer(good, tmp):
    def edit(name, data):
        return data.replace(b'"version": 1', b'"version": ' + b"9" * 5000) if name.endswith(SPECS_ENTRY) else data

    return rewrite(good, tmp / "huge_integer.pt2", edit)


def _no_library(good, tmp):
    return rewrite(good, tmp / "no_library.pt2", lambda n, d: None if n.endswith(".so") else d)


def _version_string(good, tmp):
    return rewrite(good, tmp / "version.pt2", specs_edit(lambda s: s.update(version="1")))


def _storage_renamed(good, tmp):
    """Layer 0's K storage under layer 1's name: refused for the name, not merely as a manifest
    that differs from the compiled one (which ``inspect`` never compares)."""
    return rewrite(good, tmp / "renamed.pt2", specs_edit(lambda s: s["manifest"]["layers"][0]["k"].update(name="k_cache_1")))


def _input_names_repeated(good, tmp):
    return rewrite(good, tmp / "names.pt2", specs_edit(lambda s: s["inputs"][1].update(name=s["inputs"][0]["name"])))


def _unbounded_symbol(good, tmp):
    def change(specs):
        specs["inputs"][0]["shape"][0] = "batch"
        specs["symbols"]["batch"] = {"min": 1, "max": None}

    return rewrite(good, tmp / "unbounded.pt2", specs_edit(change))


def _directory_entry(good, tmp):
    """A plain directory entry: no package holds one (the loader took it before)."""
    return rewrite(good, tmp / "directory.pt2", extra=[(root_of(good) + "extra/", b"")])


def _directory_attribute(good, tmp):
    """The library marked as a folder by its MS-DOS attribute: one ``.so`` to the layout check, a
    folder to torch's extractor."""
    def edit(info, data):
        if info.filename.endswith(".so"):
            info.external_attr |= 0x10
        return data

    return rewrite(good, tmp / "dos_directory.pt2", edit_info=edit)


def _many_layers(good, tmp):
    """Twenty thousand ``{}`` layers (60 kB; fewer values than MAX_SPEC_VALUES): validated one by
    one they made a message of tens of megabytes before the refusal."""
    return rewrite(good, tmp / "layers.pt2", specs_edit(lambda s: s["manifest"].update(layers=[{}] * 20_000)))


def _many_values(good, tmp):
    """Two hundred thousand unknown keys in a layer's K storage (2.6 MB; objects of fixed fields
    take no per-collection count): one validation error each before the value limit."""
    def edit(s):
        s["manifest"]["layers"][0]["k"].update({f"x{i}": 0 for i in range(200_000)})
    return rewrite(good, tmp / "values.pt2", specs_edit(edit))


HOSTILE = [
    pytest.param(_traversal, "climbs out of the package folder", id="traversal"),
    pytest.param(_deep_traversal, "climbs out of the package folder", id="deep-traversal"),
    pytest.param(_absolute, "is an absolute path", id="absolute-name"),
    pytest.param(_backslash, "contains a backslash", id="backslash-name"),
    pytest.param(_symlink, "is a link or special file", id="symlink"),
    pytest.param(_outside_root, "lies outside the package folder", id="outside-root"),
    pytest.param(_duplicate, "appear more than once", id="duplicate-entry"),
    pytest.param(_corrupt_library, r"wrapper\.so' is corrupt", id="flipped-byte-in-library"),
    pytest.param(_corrupt_specs_member, r"offgraph_specs.json(' is corrupt|: BadZipFile: Bad CRC-32)", id="flipped-byte-in-specs"),
    pytest.param(_corrupt_weight, r"weights/weight_0' is corrupt: its data's CRC-32 is 0x[0-9a-f]{8}, the directory "
                 r"records 0x[0-9a-f]{8}$", id="flipped-byte-in-weight"),
    pytest.param(_widened_range, r"must lie in \[1, max_write=32\]", id="widened-width-range"),
    pytest.param(_narrowed_range, r"disagree with the compiled ('model' )?program's own", id="narrowed-width-range"),
    pytest.param(_empty_range, r"min > max", id="min-above-max"),
    pytest.param(_wrong_dtype, r"disagree with the compiled ('model' )?program's own", id="dtype-changed"),
    pytest.param(_unknown_dtype, r"inputs\.1\.dtype\W+Input should be .*'int64'", id="unknown-dtype"),
    pytest.param(_zip_version, r"not a readable .pt2 archive: NotImplementedError: zip file version", id="zip-version"),
    pytest.param(_encrypted, r"RuntimeError: .*encrypted", id="encrypted"),
    pytest.param(_not_utf8_name, r"not a readable .pt2 archive: UnicodeDecodeError", id="name-not-utf8"),
    pytest.param(_no_root_folder, "a package holds it in one folder at the top of the archive", id="no-root-folder"),
    pytest.param(_coerced_bool, r"decode_method\W+Input should be a valid boolean", id="coerced-bool"),
    pytest.param(_nan_model_arg, "NaN is not a JSON number", id="nan-model-arg"),
    pytest.param(_model_dtype_lie, "model_dtype 'bfloat16' disagrees with the cache's storage dtype 'float32'", id="model-dtype"),
    pytest.param(_static_dim_changed, r"disagree with the compiled ('model' )?program's own", id="static-dim-changed"),
    pytest.param(_positions_dropped, r"disagree with the compiled ('model' )?program's own", id="positions-dropped"),
    pytest.param(_bound_dropped, r"disagree with the compiled ('model' )?program's own", id="index-bound-dropped"),
    pytest.param(_output_dims_moved, r"disagree with the compiled ('model' )?program's own", id="output-dims-moved"),
    pytest.param(_input_dropped, "must follow the 1 model inputs", id="input-dropped"),
    pytest.param(_deeply_nested, "nests deeper than", id="deeply-nested-specs"),
    pytest.param(_huge_specs, "more than the", id="oversized-specs"),
    pytest.param(_version_string, r"version\W+Input should be a valid integer", id="version-as-string"),
    pytest.param(_build_from_sources, r"_compile_flags\.json' is not part of an offgraph package", id="build-from-sources"),
    pytest.param(_huge_integer, "offgraph specs entry is not a valid spec: Exceeds the limit", id="huge-integer"),
    pytest.param(_no_library, r"method 'model' holds 0 compiled libraries \(\.so\)", id="no-library"),
    pytest.param(_storage_renamed, "layer 0: its K storage input is named 'k_cache_1'; expected 'k_cache_0'",
                 id="storage-name-off-rule"),
    pytest.param(_input_names_repeated, "input 1 is named 'tokens', the name of input 0", id="input-names-repeated"),
    pytest.param(_unbounded_symbol, "symbol 'batch' has max null", id="unbounded-symbol"),
    pytest.param(_directory_entry, r"archive entry '[^']*/extra/' is a directory entry", id="directory-entry"),
    pytest.param(_directory_attribute, r"wrapper\.so' is marked as a directory", id="directory-attribute"),
    pytest.param(_many_layers, f"20000 entries; a spec's list or object holds at most {MAX_SPEC_ITEMS}", id="many-layers"),
    pytest.param(_many_values, f"holds more than {MAX_SPEC_VALUES} values", id="many-values"),
]


def _written_outside(tmp: Path) -> list[str]:
    """Files named like the hostile entries anywhere they could have landed: where the names point
    from an extraction folder under the temp dir (the temp dir, one level below it, ``/``), the
    working directory, and the absolute target."""
    temp = Path(tempfile.gettempdir())
    places = [temp, Path("/"), tmp.parent, Path.cwd(), tmp / "abs_target"]
    try:
        places += [p for p in temp.iterdir() if p.is_dir()]
    except OSError:
        pass
    found = []
    for place in places:
        try:
            found += [str(p) for p in place.glob(f"{MARK}*")]
        except OSError:  # another process's temp folder vanished meanwhile
            continue
    return found


@pytest.mark.parametrize(("make", "message"), HOSTILE)
def test_hostile_archive_is_refused_before_loading(make, message, example_artifact, tmp_path):
    path = make(example_artifact, tmp_path)
    with pytest.raises(ArtifactError, match=message) as info:
        Artifact.load(path)
    assert str(path) in str(info.value)
    assert not _written_outside(tmp_path)


@pytest.mark.parametrize(("make", "message"), HOSTILE)
def test_cli_refuses_hostile_archive_in_one_line(make, message, example_artifact, tmp_path):
    path = make(example_artifact, tmp_path)
    proc = cli("check", str(path), "--model", EXAMPLE, "--steps", "1", check=False)
    assert proc.returncode == 2, proc.stdout
    assert proc.stderr.count("\n") <= 2 and "Traceback" not in proc.stderr  # "checking ..." + error
    assert proc.stderr.splitlines()[-1].startswith("error: ")
    assert re.search(message, proc.stderr), proc.stderr  # refused for the reason the case plants
    assert not _written_outside(tmp_path)


def test_names_are_checked_even_where_only_the_specs_are_read(example_artifact, tmp_path):
    path = _traversal(example_artifact, tmp_path)
    with pytest.raises(ArtifactError, match="climbs out"):
        read_artifact_specs(path)
    proc = cli("inspect", str(path), check=False)
    assert proc.returncode == 2 and "climbs out" in proc.stderr


@pytest.mark.parametrize(("make", "message"), [
    (_directory_entry, "is a directory entry"),
    (_storage_renamed, "expected 'k_cache_0'"),
    (_many_layers, "20000 entries"),
    (_many_values, f"more than {MAX_SPEC_VALUES} values"),
])
def test_inspect_refuses_what_load_refuses_before_the_compiled_program(make, message, example_artifact, tmp_path):
    """Where only the specs are read there is no compiled program to compare them with: the
    specs' own rules are all that stands between the archive and what ``inspect`` reports."""
    path = make(example_artifact, tmp_path)
    with pytest.raises(ArtifactError, match=message):
        read_artifact_specs(path)


def _layout_names(example_artifact) -> list[str]:
    with zipfile.ZipFile(example_artifact) as z:
        return z.namelist()


@pytest.mark.parametrize(("entry", "message"), [
    ("data/", "is a directory entry"),
    ("data/aotinductor/model/", "is a directory entry"),
    ("data/aotinductor/other/", "is a directory entry"),
    ("anything/at/all/", "is a directory entry"),
    ("../../", "climbs out"),
    ("data/./weights/", "directory entry"),
    ("data/aotinductor/model/.", "empty or '.' segment"),
    ("data//weights/weight_0", "empty or '.' segment"),
], ids=["data", "method-folder", "other-method-folder", "anywhere", "climbing", "dot-folder", "dot-file", "empty-segment"])
def test_the_layout_refuses_directory_entries_and_odd_names(entry, message, example_artifact):
    """``check_pt2_layout`` accepted every name ending in ``/``, and took names unchecked when given
    them by anything but ``check_archive``."""
    names = _layout_names(example_artifact)
    root = root_of(example_artifact)
    check_pt2_layout(names, "p.pt2", ["model"])  # control
    with pytest.raises(ArtifactError, match=re.escape(f"archive entry {root + entry!r} ") + ".*" + re.escape(message)):
        check_pt2_layout([*names, root + entry], "p.pt2", ["model"])


def test_the_layout_checks_names_given_without_check_archive(example_artifact):
    """A whole package under ``../``: ``archive_root`` finds ``../`` a root of one folder, and
    every name then matched the layout."""
    names = [n.replace(root_of(example_artifact), "../", 1) for n in _layout_names(example_artifact)]
    with pytest.raises(ArtifactError, match="climbs out of the package folder"):
        check_pt2_layout(names, "p.pt2", ["model"])


def test_control_a_faithful_rewrite_loads(example_artifact, tmp_path):
    """The rewriting itself breaks nothing: only the hostile changes are refused."""
    path = rewrite(example_artifact, tmp_path / "same.pt2")
    assert Artifact.load(path).specs == read_artifact_specs(example_artifact)


# -- code named by an archive never runs -------------------------------------------------------


@pytest.fixture
def foreign_model_archive(example_artifact, tmp_path):
    """The archive names a model file that writes a marker when imported, and a factory that
    would run a shell command."""
    marker = tmp_path / "imported.txt"
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(marker)!r}, 'w').write('ran')\ndef build(**kw):\n    raise SystemExit(0)\n")
    shell_marker = tmp_path / "shell.txt"

    def change(specs):
        specs["model"] = f"{evil}:build"
        specs["model_args"] = {"command": f"touch {shell_marker}"}

    path = rewrite(example_artifact, tmp_path / "foreign.pt2", specs_edit(change))
    os_system = rewrite(example_artifact, tmp_path / "os_system.pt2",
                        specs_edit(lambda s: s.update(model="os:system", model_args={"command": f"touch {shell_marker}"})))
    return path, os_system, marker, shell_marker


@pytest.mark.parametrize("command", [["check"], ["run", "--tokens", "1,2,3", "--max-new-tokens", "2"]])
def test_recorded_model_is_not_imported_without_asking(foreign_model_archive, command):
    path, os_system, marker, shell_marker = foreign_model_archive
    for archive in (path, os_system):
        proc = cli(command[0], str(archive), *command[1:], check=False)
        assert proc.returncode == 2
        assert "--model" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists() and not shell_marker.exists()


def test_the_model_the_user_names_is_the_one_used(foreign_model_archive):
    path, _, marker, shell_marker = foreign_model_archive
    proc = cli("check", str(path), "--model", EXAMPLE, "-a", "seed=0", "--steps", "2", check=False)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists() and not shell_marker.exists()


def test_run_takes_the_model_arguments_the_user_gives(foreign_model_archive):
    """``run`` used the archive's arguments for the model the user names, with no way to choose
    others (these name a parameter the example's factory does not have)."""
    path, _, marker, shell_marker = foreign_model_archive
    proc = cli("run", str(path), "--model", EXAMPLE, "-a", "seed=0", "--tokens", "1,2,3", "--max-new-tokens", "2",
               check=False)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists() and not shell_marker.exists()


def test_recorded_model_arguments_are_said_aloud(example_artifact, tmp_path):
    archive = rewrite(example_artifact, tmp_path / "args.pt2", specs_edit(lambda s: s.update(model_args={"n_layers": 2})))
    proc = cli("check", str(archive), "--model", EXAMPLE, "--steps", "1", check=False)
    assert proc.returncode == 0, proc.stderr
    assert f"model arguments recorded in {archive}: {{'n_layers': 2}} (give -a NAME=VALUE to choose them)" in proc.stderr


def test_recorded_model_opt_in_says_what_it_imports(foreign_model_archive):
    path, _, marker, _ = foreign_model_archive
    proc = cli("check", str(path), "--recorded-model", check=False)
    assert f"importing the model recorded in {path}: " in proc.stderr
    assert marker.exists()  # the user asked for it, and was told
    assert proc.returncode == 2 and "called exit(0)" in proc.stderr


def test_nothing_from_the_archive_is_left_in_the_working_directory(example_artifact, tmp_path):
    before = set(os.listdir(Path.cwd()))
    Artifact.load(rewrite(example_artifact, tmp_path / "ok.pt2"))
    assert set(os.listdir(Path.cwd())) == before
