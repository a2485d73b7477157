"""The sub-command -> optional extras table (k3jax/cli/extras.py): what it
names exists in pyproject.toml, the CLI refuses a command whose extra is
missing with one line (exit 2) naming it, and bin/k3jax reads the same table
(the script form, before anything is installed)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from k3jax.cli import COMMANDS, extras, main

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
OPTIONAL = PYPROJECT["optional-dependencies"]


def _name(requirement: str) -> str:
    for stop in "[=<>!~; ":
        requirement = requirement.split(stop)[0]
    return requirement.lower().replace("_", "-")


def test_the_table_names_sub_commands_and_extras_that_exist():
    sub_commands = {c.replace("_", "-") for c in COMMANDS}
    for command, backend, needed in extras.EXTRAS:
        assert command in sub_commands and set(needed) <= set(OPTIONAL), (command, needed)
        assert backend == extras.ANY or isinstance(backend, str)
    assert set(extras.PROBES) <= set(OPTIONAL)


def test_each_probe_is_a_distribution_its_extra_brings():
    """The probed distributions are named by the extra (or, for jax's
    cuda13-local extra, are what it pulls: the CUDA plugin)."""
    brought = {"jax[cuda13-local]": {"jax-cuda13-plugin"}}
    for extra, dists in extras.PROBES.items():
        names = set()
        for req in OPTIONAL[extra]:
            names |= {_name(req)} | brought.get(req.split("=")[0], set())
        assert set(dists) <= names, (extra, dists, names)


@pytest.mark.parametrize("argv, want", [
    (["run"], ()),
    (["plan", "--preset", "tiny"], ()),
    (["make-checkpoint", "d"], ()),
    (["compile", "--preset", "tiny"], ("gpu-compile",)),
    (["compile", "--backend", "pallas"], ("gpu-compile", "tokamax")),
    (["compile", "--backend=triton", "--compute-capability", "80"], ("gpu-compile", "triton")),
    (["run", "--backend", "triton"], ("triton",)),
    (["selfcheck", "--backend", "interpret"], ()),
    (["--help"], ()),
    ([], ()),
])
def test_needed_extras_of_a_command_line(argv, want):
    assert extras.needed(*extras.parse_argv(argv)) == want


def test_a_missing_extra_is_one_line_exit_2_naming_it(monkeypatch, capsys):
    monkeypatch.setattr(extras, "installed", lambda extra: extra != "tokamax")
    assert main(["compile", "--preset", "tiny", "--backend", "pallas"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("k3jax compile: error: k3jax compile --backend pallas needs the tokamax "
                             "extra") and "pip install 'k3jax[tokamax]'" in err[0]
    monkeypatch.setattr(extras, "installed", lambda extra: False)
    assert main(["compile", "--preset", "tiny"]) == 2
    assert "k3jax compile needs the gpu-compile extra" in capsys.readouterr().err


def test_installed_reads_the_environment(monkeypatch):
    assert all(extras.installed(extra) for extra in extras.PROBES)    # the suite's venv: every extra
    monkeypatch.setitem(extras.PROBES, "torch", ("torch", "no-such-distribution-k3jax"))
    assert not extras.installed("torch")


def test_the_script_form_prints_them_without_importing_the_package():
    proc = subprocess.run([sys.executable, "-I", str(REPO / "k3jax" / "cli" / "extras.py"), "compile",
                           "--backend", "pallas"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "gpu-compile,tokamax\n", proc.stdout + proc.stderr
