"""The check's cache: one JSON file per (KernelConfig, environment) key.

Directory: ``K3JAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/k3jax``, else
``~/.cache/k3jax``; files ``selfcheck-<sha256 of the key>.json``. Each file
holds {"format", "key": {"config", "environment"}, "result"}; a file
written atomically (a temporary file beside it, then os.replace), so a
concurrent reader sees the old file or the new one, never half of one, and
two processes checking the same key at once both write a whole file.

A file that cannot be parsed, has another format or holds another key is
ignored (``load`` says so, naming it): the caller checks again and rewrites
it. A directory that cannot be written is not an error: ``store`` returns
the reason once and the checks run again on the next start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import tempfile

FORMAT = 1
CACHE_DIR_ENV = "K3JAX_CACHE_DIR"


def cache_dir() -> pathlib.Path:
    """Where the cache lives (module docstring); not created here."""
    if os.environ.get(CACHE_DIR_ENV):
        return pathlib.Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "k3jax"


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """The outcome of one check.

    verdict: "ok" | "mismatch" | "error" | "timeout"; max_rel_err: max |kernel
    - XLA| / max |XLA| in float32 (None when the kernel gave no output);
    seconds: the check's wall time; error: what went wrong (None when ok);
    tuned: the tiling a tuning run picked for this configuration (None: not
    tuned), ``tuned_entry`` the same in the committed table's entry format,
    the candidates' median times in ``timings_us`` (tiling -> microseconds);
    checked_groups: the groups the check ran on when fewer than the
    launch's (None: the full shape).
    """

    verdict: str
    max_rel_err: float | None
    seconds: float
    error: str | None = None
    tuned: str | None = None
    tuned_entry: dict | None = None
    timings_us: dict[str, float] | None = None
    checked_groups: int | None = None

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"


VERDICTS = ("ok", "mismatch", "error", "timeout")


def key_of(config_json: dict, environment: dict) -> dict:
    return {"config": config_json, "environment": environment}


def path_of(directory: pathlib.Path, key: dict) -> pathlib.Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return directory / f"selfcheck-{digest}.json"


def load(path: pathlib.Path, key: dict) -> tuple[CheckResult | None, str | None]:
    """(result, None) from a valid file; (None, None) when there is none;
    (None, why) when the file is there but unusable (corrupt, truncated,
    another format or another key)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cannot read {path}: {e.strerror or e}"
    try:
        entry = json.loads(text)
        if not isinstance(entry, dict) or entry.get("format") != FORMAT:
            return None, f"{path} has another format"
        if entry.get("key") != key:
            return None, f"{path} holds another key"
        result = CheckResult(**entry["result"])
        if result.verdict not in VERDICTS:
            return None, f"{path} holds an unknown verdict {result.verdict!r}"
        return result, None
    except (ValueError, TypeError, KeyError) as e:
        return None, f"{path} is corrupt ({type(e).__name__}: {e})"


def store(path: pathlib.Path, key: dict, result: CheckResult) -> str | None:
    """Write the entry atomically; the reason when it cannot be written, else None."""
    body = json.dumps({"format": FORMAT, "key": key, "result": dataclasses.asdict(result)},
                      sort_keys=True, indent=1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=path.parent)
    except OSError as e:
        return f"cannot write to the cache directory {path.parent}: {e.strerror or e}"
    try:
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        return f"cannot write {path}: {e.strerror or e}"
    return None
