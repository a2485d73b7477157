"""A fuzzed command line: hypothesis draws invocations of ``run``, ``plan``,
``compile``, ``latency`` and ``make-checkpoint`` (the layout flags, sizes
from 0 to huge, flags that exclude each other, paths that are missing or of
the wrong kind, bad environment variables) and each must

- exit 0, 1 or 2 (argparse's exit counts as 2),
- print no Python traceback,
- on failure print exactly one error line on stderr (warnings aside),
- end within EXAMPLE_LIMIT_S,
- on failure leave the sandbox as it was (no file created, changed or removed).

Invocations run in-process through ``k3jax.cli.main`` (cheap); a few run
as subprocesses (integration tier). Most draws carry a flag that must be
refused before any work, so an example costs milliseconds; the rest are tiny
valid runs and plans. ``compile`` is drawn only with a flag that must be
refused before it compiles. The everyday tier runs EVERYDAY_EXAMPLES, the
slow tier SLOW_EXAMPLES; both are derandomized (no example database), so CI
sees the same examples every time.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3jax.checkpoint import make_synthetic_checkpoint
from k3jax.cli import main
from k3jax.config import TINY

pytestmark = pytest.mark.tiers(slow=["test_fuzzed_command_lines_slow"],
                               integration=["test_fuzzed_command_lines_as_processes"])

EVERYDAY_EXAMPLES = 40
SLOW_EXAMPLES = 500
EXAMPLE_LIMIT_S = 120.0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SIZES = st.sampled_from(["0", "1", "2", "3", "4", "7", "8", "16", "1024", "2049", "100000",
                         str(2**31), str(10**15), "-1", "x", "1e3"])
SMALL = st.sampled_from(["1", "2", "4", "8"])


def mostly(common, rare):
    """One of ``common`` (four times in five) or of ``rare``."""
    common, rare = list(common), list(rare)
    return st.sampled_from(common * (4 * max(1, len(rare)) // max(1, len(common)) or 1) + rare)


def sometimes(draw, n: int = 3) -> bool:
    """True once in ``n`` draws."""
    return draw(st.integers(0, n - 1)) == 0


class Sandbox:
    """A directory of inputs of every kind, and where outputs may go."""

    def __init__(self, root):
        self.root = str(root)
        join = lambda *p: os.path.join(self.root, *p)  # noqa: E731
        make_synthetic_checkpoint(join("ck"), TINY, seed=0, dtype="float32")
        x = np.random.default_rng(0).standard_normal((5, TINY.hidden_size)).astype(np.float32)
        np.save(join("x.npy"), x)
        np.save(join("wide.npy"), np.zeros((5, 97), np.float32))
        np.save(join("f64.npy"), x.astype(np.float64))
        np.savez(join("x.npz"), x=x)
        with open(join("text.txt"), "w") as f:
            f.write("not an array\n")
        os.mkdir(join("emptydir"))
        os.mkdir(join("out"))
        os.symlink(join("nowhere", "y.npy"), join("dangling.npy"))
        os.symlink(join("loop.npy"), join("loop.npy"))
        self.inputs = [join(p) for p in ("x.npy", "wide.npy", "f64.npy", "x.npz", "text.txt",
                                         "emptydir", "missing.npy", "dangling.npy", "loop.npy")]
        self.dirs = [join(p) for p in ("ck", "ck/config.json", "emptydir", "missing", "text.txt",
                                       "loop.npy")]
        self.outputs = [join(p) for p in ("out/y.npy", "out/y.json", "emptydir", "missing/y.npy",
                                          "/proc/k3jax-fuzz.npy", "dangling.npy", "loop.npy")]
        self.new_dirs = [join(p) for p in ("out/ckpt", "ck", "text.txt", "emptydir", "missing/a/b",
                                           "loop.npy", "/proc/k3jax-fuzz")]

    def snapshot(self) -> dict:
        """{path: (kind, size, mtime)} of everything under the root (a
        directory's size and mtime left out: probing it for writability
        changes them)."""
        seen = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in dirnames + filenames:
                path = os.path.join(dirpath, name)
                info = os.lstat(path)
                kind = info.st_mode >> 12
                seen[path] = (kind, None, None) if name in dirnames and not os.path.islink(path) \
                    else (kind, info.st_size, info.st_mtime_ns)
        return seen

    def restore(self, before: dict) -> None:
        """Undo what a successful example wrote (its outputs, a checkpoint):
        every path that was not there before goes."""
        for path in sorted(set(self.snapshot()) - set(before), key=len, reverse=True):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.remove(path)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    return Sandbox(tmp_path_factory.mktemp("fuzz"))


def layout_flags(draw) -> list[str]:
    flags = []
    for flag in ("--dp", "--tp", "--nodes"):
        if draw(st.booleans()):
            flags += [flag, draw(st.one_of(SMALL, SMALL, SIZES))]
    for flag in ("--sequence-parallel", "--expert-parallel", "--shard-shared-expert"):
        if sometimes(draw):
            flags.append(flag)
    if sometimes(draw):
        flags += ["--ep-dispatch", draw(mostly(["auto", "gather", "hierarchical", "all-to-all"],
                                               ["ring"]))]
    if sometimes(draw, 4):
        flags += ["--shared-overlap", draw(mostly(["auto", "ring", "none", "weights"], ["RING"]))]
    return flags


BAD_ENV = [("K3JAX_SELFCHECK", "bogus"), ("K3JAX_INIT_TIMEOUT", "0"),
           ("K3JAX_SHARD_SP_SHARED_EXPERT", "yes"), ("K3JAX_AUTOTUNE", "2")]
BAD_DISTRIBUTED = [["--num-processes", "2"], ["--process-id", "1"],
                   ["--coordinator-address", "localhost", "--num-processes", "2", "--process-id", "0"],
                   ["--coordinator-address", "127.0.0.1:1", "--num-processes", "2",
                    "--process-id", "5"],
                   ["--coordinator-address", "h:99999", "--num-processes", "3", "--process-id", "0"]]


@st.composite
def run_argv(draw, box: Sandbox) -> list[str]:
    argv = ["run", "--backend", draw(mostly(["xla"], ["auto", "pallas", "triton"]))]
    if draw(st.booleans()):
        argv += ["--checkpoint", draw(mostly(box.dirs[:1], box.dirs[1:]))]
    argv += layout_flags(draw)
    if sometimes(draw):
        argv += ["--devices", draw(st.one_of(SMALL, SIZES))]
    if sometimes(draw):
        argv += ["--layer", draw(mostly(["0", "1", "2"], ["3", "-1", "x"]))]
    if sometimes(draw, 4):
        argv += ["--layers", draw(mostly(["0:2", "1:3"], ["2:1", "0:9", "a:b", "1"]))]
    if sometimes(draw):
        argv += ["--input", draw(st.sampled_from(box.inputs))]
    if sometimes(draw):
        argv += ["--output", draw(mostly(box.outputs[:2], box.outputs[2:]))]
    if sometimes(draw, 5):
        argv += ["--cotangent", draw(st.sampled_from(box.inputs))]
    if sometimes(draw, 5):
        argv += ["--grads", draw(mostly(box.outputs[:2], box.outputs[2:]))]
    if sometimes(draw, 4):
        argv += ["--mxfp4", draw(mostly(["packed", "dequantize"], ["fp8"]))]
    if sometimes(draw, 4):
        argv += ["--dtype", draw(mostly(["float32", "bfloat16"], ["float64"]))]
    if sometimes(draw, 3):        # a flag refused before any work
        argv += draw(st.sampled_from(
            [["--layer", "7"], ["--layers", "2:9"], ["--devices", "100000"], ["--tp", "1000000"],
             ["--repeat", "0"], ["--backend", "pallas"], ["--input", box.inputs[1]],
             ["--checkpoint", box.dirs[1]], ["--grads", box.outputs[0]], ["--dtype", "float64"],
             *BAD_DISTRIBUTED]))
    return argv


GOOD_LAYOUTS = [[], ["--tp", "2"], ["--dp", "2", "--expert-parallel"],
                ["--tp", "4", "--sequence-parallel", "--expert-parallel"],
                ["--dp", "2", "--tp", "2", "--nodes", "2", "--sequence-parallel",
                 "--expert-parallel", "--ep-dispatch", "hierarchical"],
                ["--tp", "2", "--sequence-parallel", "--shard-shared-expert",
                 "--shared-overlap", "weights"]]


@st.composite
def near_valid_run_argv(draw, box: Sandbox) -> list[str]:
    """A run that works, with at most one thing wrong: checks that come late
    (files, the checkpoint, the layout against the config, outputs)."""
    argv = ["run", "--backend", "xla", *draw(st.sampled_from(GOOD_LAYOUTS))]
    argv += ["--checkpoint", box.dirs[0]] * draw(st.booleans())
    argv += ["--input", box.inputs[0]] * draw(st.booleans())
    argv += ["--output", box.outputs[0]] * draw(st.booleans())
    if sometimes(draw, 4):
        argv += ["--input", box.inputs[0], "--cotangent", box.inputs[0], "--grads", box.outputs[1]]
    argv += draw(st.sampled_from([["--layer", "2"], ["--layers", "1:3"], ["--dtype", "bfloat16"],
                                  ["--repeat", "1"]] + [[]] * 4))
    return argv + draw(st.sampled_from(
        [[]] * 6 + [["--input", p] for p in box.inputs[1:]] + [["--output", p] for p in box.outputs[2:]]
        + [["--checkpoint", p] for p in box.dirs[1:]] + [["--cotangent", box.inputs[1]],
                                                         ["--layer", "0", "--expert-parallel"],
                                                         ["--layer", "0", "--mxfp4", "dequantize"],
                                                         ["--tp", "3"], ["--tp", "64"],
                                                         ["--dp", "3", "--expert-parallel"]]))


@st.composite
def plan_argv(draw, box: Sandbox) -> list[str]:
    argv = ["plan"]
    source = draw(st.integers(0, 5))
    if source < 4:
        argv += ["--preset", draw(st.sampled_from(["tiny", "k3", "tiny-grouped"] * 3 + ["huge"]))]
    elif source == 4:
        argv += ["--config", draw(st.sampled_from(box.dirs + box.inputs))]
    argv += layout_flags(draw)
    if draw(st.booleans()):
        argv += ["--tokens", draw(st.one_of(SMALL, SIZES, st.just(str(1 << 20))))]
    if sometimes(draw):
        argv += ["--dtype", draw(mostly(["bfloat16", "float32"], ["int8"]))]
    if sometimes(draw):
        argv += ["--expert-dtype", draw(st.sampled_from(["mxfp4", "bfloat16", "float32"]))]
    argv += ["--pad-under-ep"] * sometimes(draw, 4) + ["--json"] * draw(st.booleans())
    return argv


@st.composite
def compile_argv(draw, box: Sandbox) -> list[str]:
    backend = draw(st.sampled_from(["xla", "pallas", "triton"]))
    argv = ["compile", "--preset", "tiny", "--backend", backend] + layout_flags(draw)
    for flag, values in (("--tokens", st.one_of(SMALL, SIZES)),
                         ("--layer", st.sampled_from(["0", "1", "2"])),
                         ("--expert-dtype", st.sampled_from(["mxfp4", "bfloat16"]))):
        if sometimes(draw):
            argv += [flag, draw(values)]
    argv += ["--grads"] * sometimes(draw, 4)
    refusals = [["--tp", "16"], ["--layer", "9"], ["--dp", "3", "--nodes", "2"],
                ["--tp", "1", "--sequence-parallel"], ["--tokens", "0"],
                ["--dp", "8", "--tp", "8", "--nodes", "1"], ["--dp", "4096", "--tp", "8"],
                ["--preset", "k3", "--config", box.dirs[0]], ["--layer", "0", "--expert-parallel"],
                ["--config", box.dirs[3]], ["--tokens", str(1 << 21)]]
    if backend != "triton":
        refusals.append(["--compute-capability", "90"])
    return argv + draw(st.sampled_from(refusals))     # never a compile: always refused first


@st.composite
def latency_argv(draw, box: Sandbox) -> list[str]:
    argv = ["latency", "--json"]
    if draw(st.booleans()):
        argv += ["--nodes", draw(mostly(["1", "2"], ["3", "0", "100000"]))]
    argv += ["--tp", *draw(st.lists(st.sampled_from(["2", "4", "8", "1", "3", "16", "0", "-2"]),
                                    min_size=1, max_size=2))]
    if sometimes(draw):
        argv += ["--dp", *draw(st.lists(mostly(["1", "2"], ["3", "0"]), min_size=1, max_size=2))]
    if sometimes(draw):
        argv += ["--layer", draw(st.sampled_from(["moe", "dense"]))]
    if sometimes(draw, 4):
        argv += ["--routing-skew", draw(mostly(["0", "0.5"], ["1.5", "nan", "x"]))]
    # a valid run costs a second or two: one small token count unless refused
    argv += ["--tokens", *draw(st.lists(st.sampled_from(["8", "16", "0", str(1 << 21), str(10**9),
                                                         "-5"]), min_size=1, max_size=2))]
    return argv


@st.composite
def make_checkpoint_argv(draw, box: Sandbox) -> list[str]:
    argv = ["make-checkpoint", draw(mostly(box.new_dirs[:1], box.new_dirs[1:]))]
    preset = draw(mostly(["tiny", "tiny-grouped"], ["k3", "big"]))
    argv += ["--preset", preset]
    if sometimes(draw):
        argv += ["--num-experts", draw(mostly(["4", "8", "16"], ["17", "0", str(10**12)]))]
    if sometimes(draw):
        argv += ["--num-layers", draw(mostly(["1", "2"], ["99", "0"]))]
    if sometimes(draw):
        argv += ["--num-files", draw(mostly(["1", "3"], ["1000", "0"]))]
    if sometimes(draw):
        argv += ["--experts", draw(mostly(["dense", "mxfp4"], ["fp8"]))]
    if preset == "k3" and "--num-experts" in argv:   # never build a K3-sized checkpoint
        argv += ["--num-experts", draw(st.sampled_from(["0", str(10**12), "17"]))]
    return argv


def invocation(box: Sandbox):
    commands = st.one_of(run_argv(box), near_valid_run_argv(box), plan_argv(box),
                         compile_argv(box), latency_argv(box), make_checkpoint_argv(box))
    return st.tuples(commands, st.sampled_from([None] * 12 + BAD_ENV))


def run_in_process(argv: list[str], env) -> tuple[int, str, str, float]:
    out, err = io.StringIO(), io.StringIO()
    saved = {name: os.environ.get(name) for name, _ in BAD_ENV}
    if env:
        os.environ[env[0]] = env[1]
    t0 = time.monotonic()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return code, out.getvalue(), err.getvalue(), time.monotonic() - t0


def check(box: Sandbox, argv, env, code, out, err, seconds, before) -> None:
    what = f"{' '.join(argv)} (env {env})\nexit {code}, {seconds:.1f} s\nstdout:\n{out}\nstderr:\n{err}"
    assert code in (0, 1, 2), what
    assert "Traceback" not in err and "Traceback" not in out, what
    assert seconds < EXAMPLE_LIMIT_S, what
    if code == 0:
        box.restore(before)
        return
    errors = [line for line in err.strip().splitlines() if ": warning: " not in line
              and not line.startswith(("[process", "no --checkpoint"))]
    assert len(errors) == 1 and "error:" in errors[0], what
    assert box.snapshot() == before, what + "\nthe failed run changed the sandbox"


def fuzz(box: Sandbox, data) -> None:
    argv, env = data
    before = box.snapshot()
    code, out, err, seconds = run_in_process(argv, env)
    check(box, argv, env, code, out, err, seconds, before)


@pytest.fixture(scope="module")
def strategy(sandbox):
    return invocation(sandbox)


FUZZ_SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=False,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.filter_too_much])


@settings(max_examples=EVERYDAY_EXAMPLES, **FUZZ_SETTINGS)
@given(data=st.data())
def test_fuzzed_command_lines(sandbox, strategy, data):
    fuzz(sandbox, data.draw(strategy))


@settings(max_examples=SLOW_EXAMPLES, **FUZZ_SETTINGS)
@given(data=st.data())
def test_fuzzed_command_lines_slow(sandbox, strategy, data):
    fuzz(sandbox, data.draw(strategy))


@pytest.mark.parametrize("argv", [
    ["run", "--tp", "1000000"],
    ["run", "--input", "{root}/x.npz"],
    ["plan", "--dp", str(2**31)],
    ["make-checkpoint", "{root}/ck"],
])
def test_fuzzed_command_lines_as_processes(sandbox, argv):
    """The same properties for whole processes (the console entry, its re-execution)."""
    argv = [a.format(root=sandbox.root) for a in argv]
    before = sandbox.snapshot()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "k3jax", *argv], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=EXAMPLE_LIMIT_S)
    check(sandbox, argv, None, p.returncode, p.stdout, p.stderr, time.monotonic() - t0, before)
    assert p.returncode in (1, 2)
