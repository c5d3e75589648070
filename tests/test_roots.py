"""Clients' paths lead only under the configured roots, and no error quotes a file.

A path is refused with not_allowed when, as written or as its real path (`..` and symbolic links
followed), it leaves every root; the refusal reads the same whatever the host has there. Files
that are not what they should be are named as such, never quoted.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import pytest

from flowmesh import protocol as p
from flowmesh.errors import Code, FlowmeshError
from flowmesh.modelio.weights import read_header
from flowmesh.roots import Roots
from flowmesh.spec import ModelSpec


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """data/ and ckpt/ (the roots) beside outside/, which holds a secret and links to it."""
    for d in ("data/models", "ckpt", "outside"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "data/models/m.safetensors").write_bytes(b"")
    (tmp_path / "outside/secret").write_text("root:*:20000:0:99999:7:::\n")
    (tmp_path / "data/to-secret").symlink_to(tmp_path / "outside/secret")
    (tmp_path / "data/to-outside").symlink_to(tmp_path / "outside")
    (tmp_path / "data/to-ckpt").symlink_to(tmp_path / "ckpt")
    (tmp_path / "outside/to-data").symlink_to(tmp_path / "data")
    return tmp_path


def roots(tree: Path) -> Roots:
    return Roots.of([tree / "data"], [tree / "ckpt"], "worker w0")


def refusal(call, path: str) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(FlowmeshError) as info:
        call(path)
    assert info.value.code == Code.NOT_ALLOWED, info.value
    return info.value.reason


def test_a_path_inside_a_root_is_its_real_path(tree: Path) -> None:
    r = roots(tree)
    model = str(tree / "data/models/m.safetensors")
    assert r.readable(model, "weights") == model
    assert r.readable(str(tree / "data/models/../models/m.safetensors"), "weights") == model
    # A link from one root into another stays inside; the real path is what is opened.
    assert r.readable(str(tree / "data/to-ckpt/run"), "checkpoint") == str(tree / "ckpt/run")
    assert r.writable(str(tree / "ckpt/new/run"), "checkpoint") == str(tree / "ckpt/new/run")
    assert r.readable(str(tree / "ckpt/run"), "checkpoint") == str(tree / "ckpt/run")


def test_relative_paths_are_taken_from_the_working_directory(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tree / "data")
    here = Roots.of(None, None, "worker w0")  # the defaults: the working directory
    assert here.data == here.checkpoints == (str(tree / "data"),)
    model = str(tree / "data/models/m.safetensors")
    assert here.readable("models/m.safetensors", "weights") == model
    refusal(lambda p: here.readable(p, "weights"), "../outside/secret")


def test_dotdot_and_links_out_of_the_roots_are_refused_naming_the_roots(tree: Path) -> None:
    r = roots(tree)
    read = lambda p: r.readable(p, "weights")  # noqa: E731
    for path in (
        str(tree / "outside/secret"),
        str(tree / "data/../outside/secret"),
        str(tree / "data/to-secret"),
        str(tree / "data/to-outside/secret"),
        str(tree / "data/to-outside/../outside/secret"),  # `..` from the link's target
        # Written outside, though it leads inside: refused, or it would tell the link is there.
        str(tree / "outside/to-data/models/m.safetensors"),
        str(tree / "data-not/x"),  # a prefix of a root's name is not inside it
        "/etc/shadow",
    ):
        reason = refusal(read, path)
        assert reason == (
            f"worker w0 refused weights {path!r}: it reads only under its data and checkpoint "
            f"roots ({tree / 'data'}, {tree / 'ckpt'}; an operator adds one with --data-root or "
            "--checkpoint-root)"
        )
    # Saves only under the checkpoint roots, though data roots are readable.
    assert "writes only under its checkpoint roots" in refusal(
        lambda p: r.writable(p, "checkpoint"), str(tree / "data/run")
    )
    assert "refused checkpoint" in refusal(
        lambda p: r.writable(p, "checkpoint"), str(tree / "ckpt/../../etc/x")
    )


def test_a_refusal_reads_the_same_whatever_the_host_has_there(tree: Path) -> None:
    r = roots(tree)
    paths = [
        str(tree / "outside/secret"),
        str(tree / "outside/secret/../secret"),
        str(tree / "data/to-outside/secret"),
        str(tree / "data/to-secret"),
        str(tree / "outside/to-data/models/m.safetensors"),
    ]
    before = [refusal(lambda p: r.readable(p, "weights"), p) for p in paths]
    (tree / "outside/secret").unlink()  # the links dangle now, the file is gone
    (tree / "outside/to-data").unlink()
    (tree / "outside").rmdir()
    assert [refusal(lambda p: r.readable(p, "weights"), p) for p in paths] == before


def test_not_a_path_is_a_bad_request_and_root_is_called_out(tree: Path) -> None:
    r = roots(tree)
    for path in ("", 3, str(tree / "data/a\0b")):
        with pytest.raises(FlowmeshError) as info:
            r.readable(path, "weights")
        assert info.value.code == Code.BAD_REQUEST
    assert roots(tree).warnings() == []
    assert Roots.of(["/"], [tree], "w").warnings() == [
        "data root / lets clients read every file this process can"
    ]


def test_the_partitioner_plans_hf_directories_only_under_its_roots(tree: Path) -> None:
    from partitioner.service import plan_for

    (tree / "outside/model").mkdir()
    (tree / "outside/model/config.json").write_text(json.dumps({"architectures": ["SECRETARCH"]}))
    (tree / "data/model").mkdir()
    (tree / "data/model/config.json").write_text(json.dumps({"architectures": ["SECRETARCH"]}))
    part = Roots.of([tree / "data"], (), "partitioner p0")

    def plan(hf: str) -> FlowmeshError:
        request = p.PlanAsk(spec=ModelSpec(name="m", hf=hf), kind="stages")
        with pytest.raises(FlowmeshError) as info:
            plan_for(request, ("flowmesh.examples",), None, "partitioner p0", part)
        return info.value

    outside = plan(str(tree / "outside/model"))
    assert outside.code == Code.NOT_ALLOWED and "SECRETARCH" not in outside.reason
    assert "reads only under its data roots" in outside.reason
    # The same words with nothing there.
    (tree / "outside/model/config.json").unlink()
    assert plan(str(tree / "outside/model")).reason == outside.reason
    # Inside a root the directory is read, and still not quoted.
    inside = plan(str(tree / "data/model"))
    assert inside.code == Code.BAD_REQUEST and "not supported" in inside.reason
    assert "SECRETARCH" not in inside.reason


def test_a_file_that_is_not_safetensors_is_named_never_quoted(tmp_path: Path) -> None:
    for name, content in [
        ("passwd", b"root:*:20000:0:99999:7:::\n"),  # an implausible header length
        ("short", b"root"),
        ("bad-utf8", struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc"),
        ("not-json", struct.pack("<Q", 6) + b"secret"),
        ("not-object", struct.pack("<Q", 8) + b'"secret"'),
    ]:
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(FlowmeshError) as info:
            read_header(str(path))
        assert (info.value.code, info.value.reason) == (
            Code.BAD_REQUEST,
            f"weights {str(path)!r} is not a safetensors file",
        )
    (first,) = struct.unpack("<Q", b"root:*:2")
    assert str(first) not in info.value.reason


def test_a_config_that_does_not_decode_is_not_quoted(tmp_path: Path) -> None:
    from flowmesh.modelio.hf_dir import read_config

    (tmp_path / "config.json").write_bytes(b'{"architectures": ["\xffSECRET"]}')
    with pytest.raises(FlowmeshError) as info:
        read_config(str(tmp_path))
    assert info.value.code == Code.BAD_REQUEST
    assert "SECRET" not in info.value.reason and "0xff" not in info.value.reason


def test_an_unreadable_file_is_an_io_error_with_the_system_s_words(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    path.mkdir()  # open() fails: a directory
    with pytest.raises(FlowmeshError) as info:
        read_header(str(path))
    assert (info.value.code, info.value.reason) == (
        Code.IO_ERROR,
        f"weights {str(path)!r}: {os.strerror(errno.EISDIR)}",
    )


def test_up_passes_its_roots_to_the_mesh() -> None:
    from client_sdk.cli import build_parser, up_mesh

    argv = ["up", "--cpu-workers", "1", "--data-root", "/m", "--data-root", "/n"]
    mesh = up_mesh(build_parser().parse_args([*argv, "--checkpoint-root", "/c"]), gpus=[])
    assert (mesh.data_roots, mesh.checkpoint_roots) == (["/m", "/n"], ["/c"])
    plain = up_mesh(build_parser().parse_args(["up", "--cpu-workers", "1"]), gpus=[])
    assert (plain.data_roots, plain.checkpoint_roots) == (None, None)
