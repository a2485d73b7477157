"""Test session set-up: 16 simulated CPU devices before JAX's backend starts,
and the test tiers (docs/testing.md).

Tests that need 8 devices use the ``eight_devices`` fixture (the first 8),
multi-node layouts the ``sixteen_devices`` fixture (two or four simulated
nodes); each FAILS (never skips) when fewer devices exist.

Tiers are markers; a test without one is in the everyday tier, which
``bin/test`` runs (``bin/test --all`` runs every tier). A test file states
its tier in one line near its imports: ``pytestmark = pytest.mark.compile``
for the whole file, or, where a file mixes tiers, by test function name:
``pytestmark = pytest.mark.tiers(compile=["test_a"], slow=["test_b"])``
(every parametrization of a named function; a name that is not a test
function of the file is a collection error); single parametrizations take
theirs in the parametrize list (tests/tiers.py). A mark that is not
registered below is an error, not a warning.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tiny shapes: XLA:CPU's LLVM optimisation costs more than it saves.
# Subprocesses started by tests inherit it.
_FAST_CPU_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if _FAST_CPU_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_CPU_FLAGS).strip()

# The kernel check on first use (pallas_kernels.selfcheck) is off for the
# suite, which tests its kernels itself; tests/test_selfcheck.py turns it on.
os.environ.setdefault("K3JAX_SELFCHECK", "0")

import jax  # noqa: E402

SIMULATED_DEVICES = 16
jax.config.update("jax_num_cpu_devices", SIMULATED_DEVICES)

import pytest  # noqa: E402

from pallas_kernels import interpret_compat  # noqa: E402

# Interpret-mode kernels on up to 8 devices: XLA:CPU's pools hold their waits.
interpret_compat.reserve_pool_threads(8)


TIERS = {
    "compile": "deviceless compiles for the H200 (k3jax.tools.aot): XLA's GPU pipeline or ptxas",
    "slow": "heavy CPU runs: interpret-mode Mosaic kernels at larger shapes or many "
            "launches, multi-process runs",
    "integration": "end to end: notebooks, subprocess runs of the CLI and benchmark scripts",
}


def pytest_configure(config):
    for name, meaning in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning} (not in bin/test's everyday tier)")
    config.addinivalue_line(
        "markers", "tiers(**{tier: [test function names]}): puts the named test functions of "
                   f"this file in those tiers ({', '.join(TIERS)})")
    # --strict-markers for every invocation: a misspelt tier mark fails collection
    # instead of silently moving its test into the everyday tier.
    config.addinivalue_line("filterwarnings", "error::pytest.PytestUnknownMarkWarning")
    import schedule
    config.pluginmanager.register(schedule.CostliestFirst(), "k3jax-costliest-first")


def _tiers_by_name(module, mark) -> dict[str, list[str]]:
    """{test function name: [tier]} of a ``tiers(...)`` mark, checked against
    the module's own test functions (so a renamed test cannot drop out of its tier)."""
    if mark.args or set(mark.kwargs) - set(TIERS):
        raise pytest.UsageError(f"{module.__name__}: tiers() takes keyword lists of test function "
                                f"names, one per tier of {sorted(TIERS)}; got {mark.args} {mark.kwargs}")
    by_name: dict[str, list[str]] = {}
    for tier, names in mark.kwargs.items():
        for name in [names] if isinstance(names, str) else names:
            if not (name.startswith("test") and callable(vars(module).get(name))):
                raise pytest.UsageError(f"{module.__name__}: tiers({tier}=...) names {name!r}, "
                                        "which is not a test function of that file")
            by_name.setdefault(name, []).append(tier)
    return by_name


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Apply ``tiers(...)`` marks before -m selects (and xdist groups) the items."""
    cache: dict = {}
    for item in items:
        mark = item.get_closest_marker("tiers")
        if mark is None or not isinstance(item, pytest.Function):
            continue
        key = (item.module.__name__, id(mark))
        if key not in cache:
            cache[key] = _tiers_by_name(item.module, mark)
        for tier in cache[key].get(item.originalname, ()):
            item.add_marker(tier)


def _devices(n: int):
    devices = jax.devices()
    assert len(devices) >= n, f"these tests need {n} devices, found {len(devices)}: {devices}"
    return devices[:n]


@pytest.fixture
def eight_devices():
    return _devices(8)


@pytest.fixture
def sixteen_devices():
    return _devices(16)


@pytest.fixture(scope="session", autouse=True)
def _selfcheck_cache_folder(tmp_path_factory):
    """The kernel check's cache (K3JAX_CACHE_DIR) never the user's: one per run."""
    os.environ.setdefault("K3JAX_CACHE_DIR", str(tmp_path_factory.mktemp("k3jax-cache")))


@pytest.fixture(scope="session", autouse=True)
def _compile_cache_folder(tmp_path_factory):
    """tests/compile_cache.py's folder: one per run, shared by its xdist
    workers (an exported $K3JAX_TEST_CACHE is kept)."""
    import compile_cache
    os.environ.setdefault(compile_cache.CACHE_ENV, str(compile_cache.run_folder(
        tmp_path_factory.getbasetemp(), xdist_worker="PYTEST_XDIST_WORKER" in os.environ)))
