"""Fetch the evaluation benchmarks where the configs look for them, and check them.

    python tools/prepare_data.py gsm8k math500 aime24 humaneval     # online: from their public sources
    python tools/prepare_data.py all --from /path/to/benchmarks      # offline: from a local copy

Why: the benchmark presets (``configs/data/{gsm8k,math,aime,humaneval}.yaml``) and
``tools/eval.py`` read files that nothing in the repo could get. Each file here is the upstream
file itself, byte for byte, from a pinned commit of its GitHub repository (raw.githubusercontent.com),
so a SHA-256 and a row count check it whether it was downloaded or copied. Files go to ``--out``
(default ``$DARL_BENCHMARK_DIR``, else ``data/benchmarks`` under the repo: the directory the
presets read first, ``megatron_darl/data/locations.py``), with the upstream licenses under
``licenses/`` and a ``MANIFEST.json`` saying where each file came from. A file already there with
the right checksum is kept; one with another checksum is refused unless ``--force``. Offline,
``--from DIR`` copies (``--link``: symlinks) from a directory of the same layout, after the same
checks. docs/guide.md (Benchmarks data) lists the sources and licenses.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import sys
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_darl.data.locations import LOCAL_BENCHMARKS, SHARED_BENCHMARKS  # noqa: E402

RAW = "https://raw.githubusercontent.com"  # {RAW}/{repo}/{commit}/{path}


@dataclass(frozen=True)
class Source:
    """One benchmark file: where it lives upstream and what it must be."""

    file: str  # path under the benchmark directory (what configs/eval/benchmarks.yaml names)
    repo: str  # GitHub owner/name
    commit: str  # pinned revision
    path: str  # path inside the repository
    sha256: str  # of the file as stored upstream
    rows: int  # JSON lines (after gunzip for .gz)
    license: str  # the license and the file under licenses/ that holds its text


@dataclass(frozen=True)
class LicenseFile:
    """An upstream license text, saved beside the data it covers (fetched best effort)."""

    name: str  # file under licenses/
    repo: str
    commit: str
    path: str


_GSM8K = ("openai/grade-school-math", "3101c7d5072418e28b9008a6636bde82a006892c")
_MATH500 = ("hkust-nlp/simpleRL-reason", "cf1c7858bfc145a27aa733e75d930d34f0d318a6")
_AIME24 = ("QwenLM/Qwen2.5-Math", "a45202bd16f1ec06f433442dc1152d0074773465")
_HUMANEVAL = ("openai/human-eval", "6d43fb980f9fee3c892a914eda09951f772ad10d")

SOURCES: dict[str, tuple[Source, ...]] = {
    "gsm8k": (
        Source("gsm8k/test.jsonl", *_GSM8K, "grade_school_math/data/test.jsonl",
               "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14", 1319,
               "MIT (licenses/openai_grade-school-math_LICENSE)"),
        Source("gsm8k/train.jsonl", *_GSM8K, "grade_school_math/data/train.jsonl",
               "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465", 7473,
               "MIT (licenses/openai_grade-school-math_LICENSE)"),
    ),
    "math500": (
        Source("math500/test.jsonl", *_MATH500, "examples/simplelr_math_eval/data/math500/test.jsonl",
               "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132", 500,
               "MIT (licenses/hkust-nlp_simpleRL-reason_LICENSE); the PRM800K MATH-500 split of "
               "Hendrycks MATH, byte-identical to openai/prm800k prm800k/math_splits/test.jsonl (MIT)"),
    ),
    "aime24": (
        Source("aime24/test.jsonl", *_AIME24, "evaluation/data/aime24/test.jsonl",
               "af2b8bd2aa911b6333ad0df32f3ca05c7ae8ed10f1731f4372c8ae26990bf7ac", 30,
               "MIT for evaluation/ (licenses/QwenLM_Qwen2.5-Math_evaluation_LICENSE); the problems "
               "are the MAA's AIME 2024 I and II"),
    ),
    "humaneval": (
        Source("humaneval/HumanEval.jsonl.gz", *_HUMANEVAL, "data/HumanEval.jsonl.gz",
               "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", 164,
               "MIT (licenses/openai_human-eval_LICENSE)"),
    ),
}
LICENSES: dict[str, LicenseFile] = {
    "gsm8k": LicenseFile("openai_grade-school-math_LICENSE", *_GSM8K, "LICENSE"),
    "math500": LicenseFile("hkust-nlp_simpleRL-reason_LICENSE", *_MATH500, "LICENSE"),
    "aime24": LicenseFile("QwenLM_Qwen2.5-Math_evaluation_LICENSE", *_AIME24, "evaluation/LICENSE"),
    "humaneval": LicenseFile("openai_human-eval_LICENSE", *_HUMANEVAL, "LICENSE"),
}


def url_of(repo: str, commit: str, path: str, mirror: str = RAW) -> str:
    """The raw file at a pinned commit (``mirror``: another host of the same layout, or file://)."""
    return f"{mirror.rstrip('/')}/{repo}/{commit}/{path}"


def check_file(path: Path, src: Source) -> None:
    """``ValueError`` naming the file when its SHA-256 or its row count is not the pinned one."""
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != src.sha256:
        raise ValueError(f"{path}: sha256 {digest[:16]}... is not {src.sha256[:16]}... of "
                         f"{src.repo}@{src.commit[:10]}:{src.path} (a different or damaged copy)")
    text = (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")
    rows = sum(1 for line in text.splitlines() if line.strip())
    if rows != src.rows:
        raise ValueError(f"{path}: {rows} rows, expected {src.rows}")


def _download(url: str, dest: Path, timeout_s: float) -> None:
    """``url`` to ``dest`` through a temporary file (nothing half-written is left)."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response, open(tmp, "wb") as f:
            shutil.copyfileobj(response, f)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _offline_hint() -> str:
    have = f" (a copy is at {SHARED_BENCHMARKS}: --from {SHARED_BENCHMARKS})" if SHARED_BENCHMARKS.is_dir() else ""
    return f"offline? copy from a local copy of the same layout with --from DIR{have}"


def place(src: Source, out: Path, origin: Path | None, mirror: str, link: bool, force: bool,
          timeout_s: float = 60.0) -> str:
    """Put ``src`` at ``out/src.file`` (checked); returns what was done, for the report line."""
    dest = out / src.file
    if dest.exists() or dest.is_symlink():
        try:
            check_file(dest, src)
            return "kept (already there, checksum ok)"
        except (ValueError, OSError) as exc:
            if not force:
                raise ValueError(f"{exc}; --force replaces it") from None
            dest.unlink()
    if origin is not None:
        local = origin / src.file
        if not local.is_file():
            raise FileNotFoundError(f"--from {origin}: no {src.file} there")
        check_file(local, src)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if link:
            dest.symlink_to(local.resolve())
            return f"linked to {local}"
        shutil.copyfile(local, dest)
        return f"copied from {local}"
    url = url_of(src.repo, src.commit, src.path, mirror)
    try:
        _download(url, dest, timeout_s)
    except OSError as exc:  # URLError is an OSError: no network, DNS, HTTP errors
        raise ConnectionError(f"{url}: {getattr(exc, 'reason', exc)}; {_offline_hint()}") from None
    try:
        check_file(dest, src)
    except ValueError:
        dest.unlink()
        raise
    return f"downloaded from {url}"


def place_license(name: str, out: Path, origin: Path | None, mirror: str) -> str | None:
    """Save the license text of ``name``'s source; a warning line when it cannot be had."""
    lic = LICENSES[name]
    dest = out / "licenses" / lic.name
    if dest.is_file():
        return None
    dest.parent.mkdir(parents=True, exist_ok=True)
    if origin is not None:
        if (origin / "licenses" / lic.name).is_file():
            shutil.copyfile(origin / "licenses" / lic.name, dest)
            return None
        return f"warning: {name}: no licenses/{lic.name} under --from {origin}"
    url = url_of(lic.repo, lic.commit, lic.path, mirror)
    try:
        _download(url, dest, 30.0)
    except OSError as exc:
        return f"warning: {name}: license text not fetched ({url}: {getattr(exc, 'reason', exc)})"
    return None


def write_manifest(out: Path, names: list[str]) -> Path:
    """``MANIFEST.json``: every prepared file's source, checksum, rows and license (merged)."""
    path = out / "MANIFEST.json"
    entries = {e["file"]: e for e in (json.loads(path.read_text()) if path.is_file() else [])}
    for name in names:
        for src in SOURCES[name]:
            entries[src.file] = {**asdict(src), "url": url_of(src.repo, src.commit, src.path)}
    path.write_text(json.dumps(sorted(entries.values(), key=lambda e: e["file"]), indent=1) + "\n")
    return path


def default_out() -> Path:
    """``$DARL_BENCHMARK_DIR``, else ``data/benchmarks`` under the repo."""
    env = os.environ.get("DARL_BENCHMARK_DIR")
    return Path(env).expanduser() if env else LOCAL_BENCHMARKS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="+", metavar="BENCHMARK", help=f"{', '.join(SOURCES)} or all")
    p.add_argument("--out", default=str(default_out()), help="benchmark directory to fill (default: %(default)s)")
    p.add_argument("--from", dest="origin", default="", help="local copy to take the files from (offline)")
    p.add_argument("--link", action="store_true", help="with --from: symlink instead of copying")
    p.add_argument("--force", action="store_true", help="replace a file whose checksum is not the pinned one")
    p.add_argument("--mirror", default=RAW, help="host of the raw files (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = list(SOURCES) if "all" in args.names else args.names
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        print(f"prepare_data: unknown benchmark(s) {unknown}; known: {', '.join(SOURCES)} (or all)", file=sys.stderr)
        return 2
    out, origin = Path(args.out), Path(args.origin).expanduser() if args.origin else None
    if origin is not None and not origin.is_dir():
        print(f"prepare_data: --from {origin}: no such directory", file=sys.stderr)
        return 2
    try:
        for name in names:
            for src in SOURCES[name]:
                print(f"{src.file}: {place(src, out, origin, args.mirror, args.link, args.force)}")
            warning = place_license(name, out, origin, args.mirror)
            if warning:
                print(warning, file=sys.stderr)
    except (ValueError, FileNotFoundError, ConnectionError) as exc:
        print(f"prepare_data: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {write_manifest(out, names)}; the benchmark presets read {out}"
          + ("" if out.resolve() == LOCAL_BENCHMARKS.resolve() else f" when DARL_BENCHMARK_DIR={out}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
