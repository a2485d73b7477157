"""The ``k3jax`` process's start: on CPU devices it re-executes itself once
with glibc's malloc asking for transparent huge pages
(k3jax.cli.platforms.huge_page_environ), and only where that changes
something."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import k3jax.cli as cli
from k3jax.cli.platforms import HUGE_PAGE_TUNABLE, REEXECUTED, huge_page_environ

pytestmark = pytest.mark.tiers(integration=["test_the_reexecuted_process_has_the_tunable"])

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLIBC = ("glibc", "2.36")


@pytest.fixture
def madvise(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    return f


def test_cpu_processes_ask_for_huge_pages(madvise):
    env = huge_page_environ({"JAX_PLATFORMS": "cpu", "HOME": "/h"}, madvise, GLIBC)
    assert env == {"JAX_PLATFORMS": "cpu", "HOME": "/h", REEXECUTED: "1",
                   "GLIBC_TUNABLES": f"{HUGE_PAGE_TUNABLE}=1"}
    env = huge_page_environ({"JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
                            madvise, GLIBC)
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{HUGE_PAGE_TUNABLE}=1"


@pytest.mark.parametrize("environ, mode, libc", [
    ({"JAX_PLATFORMS": "cuda"}, "always [madvise] never", GLIBC),          # not CPU devices
    ({}, "always [madvise] never", GLIBC),                                  # platform not chosen
    ({"JAX_PLATFORMS": "cpu", REEXECUTED: "1"}, "always [madvise] never", GLIBC),   # once only
    ({"JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": f"{HUGE_PAGE_TUNABLE}=0"},
     "always [madvise] never", GLIBC),                                      # the user's opt-out
    ({"JAX_PLATFORMS": "cpu"}, "[always] madvise never", GLIBC),            # THP for all already
    ({"JAX_PLATFORMS": "cpu"}, "always madvise [never]", GLIBC),            # no THP at all
    ({"JAX_PLATFORMS": "cpu"}, "always [madvise] never", ("glibc", "2.31")),   # no such tunable
    ({"JAX_PLATFORMS": "cpu"}, "always [madvise] never", ("", "")),         # not glibc (musl)
], ids=["cuda", "unset", "reexecuted", "opted-out", "thp-always", "thp-never", "old-glibc", "musl"])
def test_no_reexecution_where_it_changes_nothing(tmp_path, environ, mode, libc):
    f = tmp_path / "enabled"
    f.write_text(mode + "\n")
    assert huge_page_environ(environ, f, libc) is None
    assert huge_page_environ({"JAX_PLATFORMS": "cpu"}, tmp_path / "missing", GLIBC) is None


def test_entry_reexecutes_with_the_environment(monkeypatch):
    calls = []

    class Replaced(Exception):
        pass

    def execve(path, argv, env):
        calls.append((path, argv, env))
        raise Replaced
    monkeypatch.setattr(cli, "huge_page_environ", lambda: {"GLIBC_TUNABLES": "x=1"})
    monkeypatch.setattr(os, "execve", execve)
    with pytest.raises(Replaced):
        cli.entry()
    assert calls == [(sys.executable, sys.orig_argv, {"GLIBC_TUNABLES": "x=1"})]


def test_a_failed_reexecution_runs_on_with_one_line(monkeypatch, capsys):
    def execve(path, argv, env):
        raise OSError("exec format error")
    monkeypatch.setattr(cli, "huge_page_environ", lambda: {"GLIBC_TUNABLES": "x=1"})
    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(sys, "argv", ["k3jax", "plan", "--preset", "tiny", "--json"])
    with pytest.raises(SystemExit) as e:
        cli.entry()
    assert e.value.code == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "continuing without huge pages" in err[0]


def test_the_reexecuted_process_has_the_tunable():
    """A process that starts through ``entry`` on CPU devices runs its
    command re-executed, with the tunable, exactly where huge_page_environ
    says so on this machine (the probe's ``main`` prints what it sees)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", REEXECUTED)}
    env["PYTHONPATH"] = _REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["JAX_PLATFORMS"] = "cpu"
    code = ("import os, k3jax.cli as c\n"
            "c.main = lambda argv=None: print(os.environ.get('GLIBC_TUNABLES', '-')) or 0\n"
            "c.entry()\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, cwd=_REPO)
    assert proc.returncode == 0, proc.stderr
    want = huge_page_environ(env)
    assert proc.stdout.split() == [want["GLIBC_TUNABLES"] if want else "-"], proc.stdout
