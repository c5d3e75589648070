"""The README's install, as a user does it: `pip install` of the repository (not editable) into a
fresh virtual environment, then, from a directory outside the repository, that environment's
`flowmesh --version`, `flowmesh up`, a deploy of an example model, an infer, and a clean stop.
And the README's Install section against what it describes: every `flowmesh` and `python -m`
command in it parses with the flags it gives, and the systemd steps make what the unit files
in scripts/systemd/ expect.

Offline: the environment sees the running interpreter's packages (torch and the other
dependencies are reused, not downloaded) and pip installs flowmesh alone (`--no-deps
--no-build-isolation --no-index`), from a copy of the sources, so that the build's files
(`build/`, `*.egg-info`) never land in the checkout. The test proves the copy in the
environment is what ran: every package imports from its site-packages, and it has no editable
hook pointing back here.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import selectors
import shlex
import shutil
import signal
import site
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from flowmesh.modelio.build import build_seeded
from flowmesh.spec import ModelSpec
from flowmesh.testing import assert_forward_close

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FOUND = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
PACKAGES = sorted(p.rstrip("*") for p in FOUND)
START_S = 180.0  # a loaded machine: torch's import in every process the mesh starts
KWARGS = {"width": 64, "depth": 2}


def sources(to: Path) -> Path:
    """What `pip install /path/to/flowmesh` reads: pyproject.toml, the readme it names, and
    the packages it lists (no caches, no earlier build's files)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    to.mkdir()
    for name in ("pyproject.toml", PYPROJECT["project"]["readme"]):
        shutil.copy2(ROOT / name, to / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, to / package, ignore=ignore)
    return to


def make_venv(where: Path) -> Path:
    """`python -m venv --system-site-packages`, seeing this interpreter's packages too (dev.sh
    puts torch in .venv, not in the system's site-packages): a path line in a .pth file adds
    them after the environment's own, without running their .pth files (so not the checkout's
    editable hook)."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(where)],
        check=True,
        timeout=120,
    )
    python = where / "bin" / "python"
    own = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.strip()
    )
    (own / "reused-packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return own


def user_env(venv: Path) -> dict[str, str]:
    """A shell with the environment activated and nothing of this session's: no PYTHONPATH
    (the checkout must not be importable), no FLOWMESH_* settings (keys, broker address)."""
    env = {
        k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("FLOWMESH_")
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["COLUMNS"] = "120"
    return env


@pytest.fixture
def installed(tmp_path: Path) -> Iterator[tuple[Path, Path, dict[str, str]]]:
    """A fresh environment with flowmesh installed from a copy of this checkout; the user's
    working directory (outside the repository) and the environment's variables."""
    venv = tmp_path / "venv"
    site_packages = make_venv(venv)
    src = sources(tmp_path / "src")
    subprocess.run(
        [
            *(str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps"),
            *("--no-build-isolation", "--no-index", "--no-input", "--disable-pip-version-check"),
            str(src),
        ],
        check=True,
        timeout=300,
        cwd=tmp_path,
        env={**user_env(venv), "PIP_NO_CACHE_DIR": "1"},
    )
    home = tmp_path / "work"
    home.mkdir()
    assert ROOT not in home.parents
    yield site_packages, home, user_env(venv)


def first_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The first line `proc` prints, or "" if it exits first; no wait past `timeout`."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"nothing printed within {timeout:.0f} s")
    return proc.stdout.readline().decode()  # `up` prints its line whole, then flushes


def stop(proc: subprocess.Popen[bytes]) -> tuple[str, int]:
    """Ctrl-C, as a user stops `flowmesh up` (it then stops its processes); killed only if it
    does not stop. What it printed after its first line, and its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()  # its processes stop by themselves once their launcher is gone
        out, _ = proc.communicate()
    return out.decode(), proc.returncode


@pytest.mark.slow  # a build, then real processes: about half a minute on two idle cores
def test_a_non_editable_install_runs_up_deploy_and_infer_outside_the_checkout(
    installed: tuple[Path, Path, dict[str, str]],
) -> None:
    site_packages, home, env = installed
    bin_dir = Path(env["VIRTUAL_ENV"]) / "bin"

    def run(*argv: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            list(argv), cwd=home, env=env, capture_output=True, text=True, timeout=timeout
        )
        assert done.returncode == 0, (argv, done.stdout, done.stderr)
        return done

    # The copy in the environment is what runs: every package from its site-packages, and no
    # editable install (no __editable__ hook, direct_url.json says so).
    where = run(
        str(bin_dir / "python"),
        "-c",
        f"import json, {', '.join(PACKAGES)}; "
        f"print(json.dumps([m.__file__ for m in ({', '.join(PACKAGES)})]))",
    )
    for path in json.loads(where.stdout):
        assert Path(path).is_relative_to(site_packages), path
    assert not list(site_packages.glob("__editable__*flowmesh*"))
    (dist,) = site_packages.glob("flowmesh-*.dist-info")
    assert not json.loads((dist / "direct_url.json").read_text())["dir_info"].get("editable")
    flowmesh = str(bin_dir / "flowmesh")
    assert run(flowmesh, "--version").stdout == f"flowmesh {PYPROJECT['project']['version']}\n"

    up = subprocess.Popen(
        [
            *(flowmesh, "up", "--cpu-workers", "1", "--memory-budget", "32MiB"),
            *("--listen", "127.0.0.1:0", "--log-dir", str(home / "logs")),
        ],
        cwd=home,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        said = first_line(up, START_S)  # printed once every process has registered
        if not said.startswith("flowmesh up: broker tcp://127.0.0.1:"):
            raise AssertionError(said + stop(up)[0])
        broker = said.split()[3]
        spec = ModelSpec(name="mlp", factory="flowmesh.examples:mlp", kwargs=KWARGS, seed=0)
        run(
            *(flowmesh, "deploy", "mlp", spec.factory, "--kwargs", json.dumps(KWARGS)),
            *("--seed", "0", "--broker", broker, "--no-progress"),
        )
        x = torch.randn(2, KWARGS["width"])
        save_file({"x": x}, home / "x.safetensors")
        run(
            flowmesh,
            "infer",
            "mlp",
            "--broker",
            broker,
            "--input",
            "x.safetensors",
            "--output",
            "y.safetensors",
        )
    finally:
        out, code = stop(up)
    assert (code, out) == (0, "flowmesh stopped\n")
    with torch.inference_mode():
        want = build_seeded(spec)(x)
    assert_forward_close(load_file(home / "y.safetensors")["output"], want, "served by the install")


# --- the README's Install section --------------------------------------------------------------

UNITS = ROOT / "scripts" / "systemd"


def install_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## Install\n")
    return text[start : text.index("\n## ", start + 1)]


def commands(section: str) -> list[list[str]]:
    """Each command line of the section's code blocks and of its inline code, as argv, from
    the `flowmesh` or `python -m MODULE` on (a path before them, a comment after dropped)."""
    block = r"(?ms)^\s*```\w*\n(.*?)^\s*```"
    found = [line for text in re.findall(block, section) for line in text.splitlines()]
    prose = re.sub(block, "", section)
    found += [" ".join(code.split()) for code in re.findall(r"`([^`]+)`", prose)]
    argvs = []
    for line in found:
        words = shlex.split(line.replace("$(hostname)", "host"), comments=True)
        if words[:1] == ["ExecStart=/opt/flowmesh/.venv/bin/python"]:
            words[0] = "python"
        for i, word in enumerate(words):
            if (i == 0 and word == "flowmesh" and len(words) > 1) or word.endswith("/bin/flowmesh"):
                argvs.append(["flowmesh", *words[i + 1 :]])
                break
            if word.endswith("python") and words[i + 1 : i + 2] == ["-m"]:
                for module in words[i + 2].split("|"):  # `-m broker|partitioner`: each
                    argvs.append(["python", "-m", module, *words[i + 3 :]])
                break
    return argvs


def test_every_command_of_the_install_section_parses() -> None:
    from client_sdk.cli import build_parser

    argvs = commands(install_section())
    said = {" ".join(argv[:3]) for argv in argvs}
    assert {"flowmesh --version", "flowmesh keys init", "flowmesh keys add"} <= said, said
    assert any(argv[:3] == ["python", "-m", "gpu_worker"] for argv in argvs), said
    for argv in argvs:
        if argv[0] == "flowmesh":
            try:
                build_parser().parse_args(argv[1:])
            except SystemExit as exc:  # --version exits 0 once printed; a bad flag exits 2
                assert exc.code == 0, argv
        else:
            module, flags = argv[2], [f.replace("%H", "host") for f in argv[3:]]
            options = __import__(f"{module}.__main__", fromlist=["OPTIONS"]).OPTIONS
            flags[flags.index("--config") + 1] = str(UNITS / "flowmesh.toml")
            options.parse(flags)


def test_the_systemd_steps_make_what_the_units_expect() -> None:
    section = install_section()
    factories = set()
    for path in sorted(UNITS.glob("*.service")):
        text = path.read_text()
        unit = configparser.ConfigParser(strict=False, interpolation=None)
        unit.optionxform = str  # type: ignore[assignment,method-assign]
        unit.read_string(text)
        service = unit["Service"]
        python, _, _, _, config = shlex.split(service["ExecStart"])[:5]
        assert f"python3 -m venv {Path(python).parents[1]} " in section, path.name
        assert f"install -m 644 scripts/systemd/flowmesh.toml {config} " in section, path.name
        assert re.search(rf"(?m)^useradd --system .* {service['User']}$", section), path.name
        for state in service.get("StateDirectory", "").split():
            assert f"`/var/lib/{state}`" in section, (path.name, state)
        factories.update(re.findall(r"(?m)^Environment=PYTHONPATH=(\S+)$", text))
    assert factories  # where one's own factory modules go, for the services
    for directory in factories:
        assert f"install -d -m 755 /etc/flowmesh {directory}\n" in section, directory
        assert f"go in\n  `{directory}`" in section, directory
