"""The decode step built ahead of time (`--compile-backend aot`, the CPU's default): torch.export traces the
step over the model, AOTInductor compiles it to a shared library, and a step then runs with no dynamo, no
guards and no Python between its ops, one program per read-length range. Programs are cached on disk under
data.cache_dir() / "aot", keyed by everything the traced code reads (the repo's sources, the model's and its
policies' settings, shapes, dtypes, torch, the CPU and the fused kernels' build), so only the first run of
a configuration pays the build. decoding.compiled_decode_step is the one place that chooses it.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib
import json
import os
import platform
import sys
import tempfile
import time
import types
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

import data
import kernels
from model import Transformer


class _StepModule(torch.nn.Module):
    """A step over the model as a module torch.export can trace. The read length arrives as the length
    of `span` (a tensor of that many bytes, never read): an exported program's dynamic sizes are tensor
    dimensions, and AOTInductor (torch 2.13) fails on a plain int input marked dynamic."""

    def __init__(self, step: Callable, model: Transformer):
        super().__init__()
        self.step, self.model = step, model

    def forward(self, tokens: Tensor, input_pos: Tensor, span: Tensor) -> Tensor:
        return self.step(self.model, tokens, input_pos, span.shape[0])


@dataclass
class _Program:
    low: int  # the read lengths it holds for (its exported range, both ends included)
    high: float
    run: Callable  # (tokens, input_pos, span) -> logits
    origin: str = "built"  # "built" here, or "cache": loaded from the AOT cache (no export, no compile)
    seconds: float = 0.0  # what building (export + compile) or loading it took
    path: Optional[str] = None  # its package in the AOT cache; None: not cached


AOT_CACHE_ENV = "SPARQ_FAST_AOT_CACHE"  # "0" (or "false", "off", "no"): AOTDecodeStep neither reads nor writes its cache
_AOT_INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False}  # the weights stay the model's (user-managed)
# The repo's Python files a traced step runs, hashed into every key; the files of the step function, of every module
# class in the model (and its bases) and of every function its modules hold are added to these (AOTDecodeStep._key_parts).
_AOT_SOURCES = ("model.py", "cache.py", "attention.py", "sparq.py", "sparq_adaptive.py", "baselines.py", "policies.py",
                "kernels.py", "kernels_triton.py", "kernels_triton_jit.py", "qlinear.py", "quantize.py", "decoding.py", "aot.py")
_AOT_VALUE_HASH_MAX = 1 << 16  # plain tensor attributes (not parameters or buffers) up to this many elements: key by value too
_AOT_DESCRIBE_DEPTH = 4  # how deep _AOTKey.describe follows plain objects' attributes
_aot_digests: dict[str, str] = {}  # file -> sha256 of its bytes, read once per process (the code this process runs)
_NN_MODULE_FIELDS = frozenset(vars(torch.nn.Module()))  # nn.Module's own bookkeeping (hooks, parameter dicts, training)


def _aot_file_digest(path: str) -> str:
    digest = _aot_digests.get(path)
    if digest is None:
        try:
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()[:16]
        except OSError as e:
            digest = f"unreadable ({type(e).__name__})"
        _aot_digests[path] = digest
    return digest


def _aot_machine() -> dict:
    """What a -march=native library depends on beyond torch: the CPU (its model and ISA flags) and the C++ kernels'
    build tag (their sources, flags, torch and CPU), when the fused kernels are there."""
    if "machine" not in _aot_digests:
        try:
            with open("/proc/cpuinfo") as f:
                lines = sorted({line.strip() for line in f if line.startswith(("model name", "flags", "Features"))})
        except OSError:
            lines = [platform.processor()]
        _aot_digests["machine"] = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
        try:
            _aot_digests["kernels"] = kernels._cpu_build_tag()
        except Exception as e:  # no csrc/, or kernels without the tag: the key says so
            _aot_digests["kernels"] = f"unavailable ({type(e).__name__})"
    return {"arch": platform.machine(), "cpu": _aot_digests["machine"], "cpu_kernels_build_tag": _aot_digests["kernels"]}


class _AOTKey:
    """A program's key for the cache across processes: everything that decides the program AOTInductor builds,
    as a JSON-able dict of readable parts (AOTDecodeStep._key_parts), and its hash. Describing Python values
    (describe) also collects the repo files whose functions and classes the program runs, hashed into the key."""

    def __init__(self, repo: str):
        self.repo = repo
        self.files: set[str] = set()

    def note_file(self, path: Optional[str]) -> Optional[str]:
        """path's place in the repo (its source is then part of the key), or None outside it (torch: its version)."""
        if not path:
            return None
        path = os.path.realpath(path)
        inside = path[len(self.repo) + 1:] if path.startswith(self.repo + os.sep) else None
        if inside is None or not path.endswith(".py") or "site-packages" in inside or inside.startswith(".venv"):
            return None  # torch and the other packages (a virtual environment in the repo too): their versions
        self.files.add(path)
        return os.path.relpath(path, self.repo)

    def note_class(self, cls: type) -> str:
        for base in cls.__mro__:
            module = sys.modules.get(base.__module__)
            self.note_file(getattr(module, "__file__", None))
        return f"{cls.__module__}.{cls.__qualname__}"

    def tensor(self, t: Tensor, values: bool) -> dict:
        # its alignment, not its offset in its storage: a model's weights on huge pages (model.weights_on_huge_pages)
        # sit at offsets into one buffer that shift with where the buffer lands, and a key with them changed at
        # every process, so no later run ever found its programs; the program reads the tensor it is bound to
        entry = {"shape": list(t.shape), "dtype": str(t.dtype), "stride": list(t.stride()),
                 "aligned64": t.data_ptr() % 64 == 0, "device": str(t.device), "requires_grad": t.requires_grad,
                 "class": self.note_class(type(t))}
        if values and t.numel() <= _AOT_VALUE_HASH_MAX and t.device.type == "cpu" and t.layout == torch.strided:
            entry["sha256"] = hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                                             ).hexdigest()[:16] if t.numel() else "empty"
        return entry

    def describe(self, value, depth: int = 0):
        """A stable, readable description of a Python value a traced step may read: plain values as themselves,
        floats by repr, tensors by shape, dtype and stride (and small ones by value), dataclasses, containers and
        plain objects field by field, functions by name and source file (closures by their cells' contents), a
        module held outside the module tree by its class. Nothing that varies between identical processes (ids)."""
        deeper = depth + 1
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return repr(value)
        if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return str(value)
        if isinstance(value, torch.Size):
            return list(value)
        if isinstance(value, Tensor):
            return {"tensor": self.tensor(value, values=True)}
        if isinstance(value, enum.Enum):
            return f"{self.note_class(type(value))}.{value.name}"
        if isinstance(value, type):
            return {"class": self.note_class(value)}
        if isinstance(value, torch.nn.Module):
            return {"module": self.note_class(type(value))}
        if depth >= _AOT_DESCRIBE_DEPTH:
            return {"object": self.note_class(type(value))}
        if isinstance(value, (list, tuple)):
            return [self.describe(v, deeper) for v in value]
        if isinstance(value, (set, frozenset)):
            return sorted((self.describe(v, deeper) for v in value), key=repr)
        if isinstance(value, dict):
            return {repr(k) if not isinstance(k, str) else k: self.describe(v, deeper)
                    for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))}
        if dataclasses.is_dataclass(value):
            return {"dataclass": self.note_class(type(value)),
                    **{f.name: self.describe(getattr(value, f.name, None), deeper) for f in dataclasses.fields(value)}}
        if isinstance(value, functools.partial):
            return {"partial": self.describe(value.func, deeper), "args": self.describe(value.args, deeper),
                    "keywords": self.describe(value.keywords, deeper)}
        if isinstance(value, types.MethodType):
            return {"method": self.describe(value.__func__, deeper), "of": self.note_class(type(value.__self__))}
        if isinstance(value, types.FunctionType):
            code = value.__code__
            entry = {"function": f"{value.__module__}.{value.__qualname__}", "code_name": code.co_name,
                     "file": self.note_file(code.co_filename) or code.co_filename.rsplit("/", 1)[-1]}
            if value.__closure__:
                cells = []
                for cell in value.__closure__:
                    try:
                        cells.append(self.describe(cell.cell_contents, deeper))
                    except ValueError:  # an empty cell
                        cells.append("<empty>")
                entry["closure"] = cells
            if value.__defaults__:
                entry["defaults"] = self.describe(value.__defaults__, deeper)
            if value.__kwdefaults__:
                entry["kwdefaults"] = self.describe(value.__kwdefaults__, deeper)
            return entry
        if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)) or callable(value) and (
                type(value).__module__.startswith("torch")):  # torch ops, builtins: their names
            name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None) or str(value)
            return {"callable": f"{getattr(value, '__module__', None) or type(value).__module__}.{name}"}
        attributes = getattr(value, "__dict__", None)
        entry = {"object": self.note_class(type(value))}
        if isinstance(attributes, dict):
            entry["attributes"] = {k: self.describe(v, deeper) for k, v in sorted(attributes.items())}
        return entry

    def module_state(self, name: str, module: torch.nn.Module) -> dict:
        """One module of the traced tree: its class, its plain attributes (a policy's settings, a cache's format,
        storage, bucket, window and raggedness, a norm's eps, the kernels a layer calls, the training flag) and
        the hooks it runs, if any."""
        attributes = {k: self.describe(v, 1) for k, v in sorted(vars(module).items()) if k not in _NN_MODULE_FIELDS}
        entry = {"name": name, "class": self.note_class(type(module)), "training": module.training,
                 "attributes": attributes}
        hooks = {k: self.describe(list(v.values()), 1) for k, v in sorted(vars(module).items())
                 if k.endswith("hooks") and isinstance(v, dict) and v}
        if hooks:
            entry["hooks"] = hooks
        return entry

    def module_globals(self) -> dict:
        """The public module-level values of the repo files noted so far (kernels.LINEAR_CPU_MAX_ROWS, a registry
        of policies, the functions a module calls by name): a source file's hash does not see one changed at run
        time (a test's monkeypatch, a script's setting), and the traced step reads them as they are then."""
        def modules_by_file() -> dict:
            by_file = {}
            for module in list(sys.modules.values()):
                path = getattr(module, "__file__", None)
                if isinstance(path, str) and path.endswith(".py"):
                    by_file.setdefault(os.path.realpath(path), module)
            return by_file

        by_file = modules_by_file()
        missing = [os.path.join(self.repo, name) for name in _AOT_SOURCES]
        if any(path in self.files and path not in by_file for path in missing):
            for path in missing:  # each of these, as every process that imports it holds it (one that has not yet
                if path in self.files and path not in by_file:  # would otherwise get another key)
                    try:
                        importlib.import_module(os.path.basename(path)[:-3])
                    except Exception:
                        pass
            by_file = modules_by_file()
        values = {}
        for path in sorted(self.files):
            module = by_file.get(path)
            if module is None:
                continue
            entry = {}
            for name, value in sorted(vars(module).items()):
                if name.startswith("_") or isinstance(value, (types.ModuleType, type)) or \
                        type(value).__module__ in ("typing", "typing_extensions", "threading", "logging", "__future__"):
                    continue
                if isinstance(value, (types.FunctionType, functools.partial)) and \
                        getattr(value, "__module__", module.__name__) != module.__name__:
                    entry[name] = {"imported": f"{value.__module__}.{getattr(value, '__qualname__', name)}"}
                else:
                    entry[name] = self.describe(value, 1)
            values[os.path.relpath(path, self.repo)] = entry
        return values

    @staticmethod
    def digest(parts: dict) -> str:
        return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _aot_cache_root(enabled: bool):
    """data.cache_dir() / "aot", read at each build (tests point SPARQ_FAST_CACHE elsewhere), or None when off."""
    if not enabled or os.environ.get(AOT_CACHE_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    return data.cache_dir() / "aot"


def _atomic_write(path, payload: bytes) -> None:
    """payload into path whole or not at all: a temporary name in the same directory, then os.replace (a reader sees
    the old file or the new, never a part; two writers of the same name leave one of theirs)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _aot_range_name(low: int, high: float) -> str:
    return f"{low}-{'inf' if high == float('inf') else int(high)}"


class AOTDecodeStep:
    """A decode step built ahead of time by AOTInductor (CPU): torch.export traces the step, inductor
    compiles it into a shared library whose C++ calls the step's kernels and ops in turn, and a call
    runs that library: no dynamo, no guard checks, no Python between ops (the short step's remainder
    after its GEMVs; README, docs/NOTES.md). Same signature as the compiled step: (model, tokens,
    input_pos, length) -> logits.

    A program holds for the range of read lengths its branches allow (export's Dim.AUTO: dense for
    every length; SparQ one program up to k positions, where its layers run dense, and one above); a
    length outside every built range exports and builds another, as dynamo recompiles. The library
    reads the model's own parameters and buffers in place (user-managed constants: no copy of the
    weights, and the caches it writes are the model's). Programs are kept per model, input shapes,
    installed policies, cache storage and raggedness, since set_decode_attention, setup_caches and
    set_live_lengths change what a program was built on. What a program does not see: Python values
    changed in place after it was built (a norm's eps, a policy's settings), which torch.compile's
    guards would catch; install a new policy instead. Building one is a C++ compile: a minute or more on
    2 cores, quicker than torch.compile's cold build of the same step (docs/NOTES.md, 'Figures behind the
    code's choices').

    The cache across processes: each package built is kept in data.cache_dir() / "aot" / KEY /, KEY the hash
    of everything that decides the program (_key_parts: torch and Python versions, the CPU and the C++
    kernels' build tag, the source of the repo files the step runs, the model's args and every module's plain
    attributes (policies' settings, caches' formats), every parameter's and buffer's name, shape, dtype and
    stride (not values: they are bound at load), the inputs' shapes and dtypes, the thread count inductor
    specialises its loops for, inductor's config), as step_LOW-HIGH_SHA.pt2 beside step_LOW-HIGH.json (its
    range, digest, torch version, build seconds) and KEY/key.json (the key's parts, readable). A later
    process with the same key whose read length falls in a stored range loads that package (aoti_load_package,
    about a second) and binds the model's tensors to it, with no export and no compile. Writes are atomic
    (a temporary name, then os.replace; the package's name carries its hash), so processes building the same
    key at once each leave a whole entry; an entry that does not load (truncated, corrupt, its hash wrong) is
    removed with a warning and built anew. cache=False or SPARQ_FAST_AOT_CACHE=0 turns it off.

    events: one line per program, "built ... in 63 s (cached at PATH)" or "loaded ... from the cache (PATH)";
    announce, if given, is called with each as it happens."""

    def __init__(self, step: Callable, cache: bool = True, announce: Optional[Callable[[str], None]] = None):
        self.step = step
        self.cache = cache
        self.announce = announce
        self.events: list[str] = []
        self.programs: dict[tuple, list[_Program]] = {}
        self._attention_modules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its layers' _modules
        self._span = torch.empty(0, dtype=torch.int8)
        self._dir = tempfile.TemporaryDirectory(prefix="sparq-fast-aot-")

    def __call__(self, model: Transformer, tokens: Tensor, input_pos: Tensor, length: int) -> Tensor:
        if self._span.numel() < length:
            self._span = torch.empty(max(length, 2 * self._span.numel()), dtype=torch.int8)
        span = self._span[:length]
        programs = self.programs.setdefault(self._key(model, tokens, input_pos), [])
        for program in programs:
            if program.low <= length <= program.high:
                return program.run(tokens, input_pos, span)
        program = self._build(model, tokens, input_pos, span, len(self.programs), len(programs))
        programs.append(program)
        return program.run(tokens, input_pos, span)

    def prepare(self, model: Transformer, tokens: Tensor, input_pos: Tensor, length: int,
                build_on: Optional[Transformer] = None) -> str:
        """Have the program a call with these inputs would run ready, without running it: built (or loaded
        from the cache) now, and kept for `model`'s calls. build_on: a copy of `model` sharing its tensors
        (serve.shadow_copy), which export traces instead, so that the model itself, which a server's engine
        steps meanwhile, is never swapped out under it; the program reads and writes the shared tensors.
        Returns what was done, in words."""
        if self._span.numel() < length:
            self._span = torch.empty(max(length, 2 * self._span.numel()), dtype=torch.int8)
        programs = self.programs.setdefault(self._key(model, tokens, input_pos), [])
        if any(program.low <= length <= program.high for program in programs):
            return f"lengths up to {length} already covered"
        programs.append(self._build(model if build_on is None else build_on, tokens, input_pos, self._span[:length],
                                    len(self.programs), len(programs)))
        return self.events[-1]

    def _key(self, model: Transformer, tokens: Tensor, input_pos: Tensor) -> tuple:
        """What a program is built on: the model, the input shapes, the cache's storage and raggedness (a
        ragged cache's view masks each row at its own live length) and each layer's policy object. Read from
        the attention modules' own module dicts, kept per model: nn.Module's attribute lookup made this key a
        visible share of a short step (docs/NOTES.md, 'Figures behind the code's choices')."""
        modules = self._attention_modules.get(model)
        if modules is None:
            modules = self._attention_modules[model] = [layer.attention._modules for layer in model.layers]
        cache = modules[0]["kv_cache"]
        return (id(model), tokens.shape, input_pos.shape, cache.k.data_ptr(), cache.ragged,
                *[id(m["decode_attention"]) for m in modules])

    def summary(self) -> str:
        """Its programs in words, for a startup line: how many were built (and how long that took) and
        how many came from the cache."""
        programs = [p for ranges in self.programs.values() for p in ranges]
        built = [p for p in programs if p.origin == "built"]
        loaded = [p for p in programs if p.origin == "cache"]
        parts = []
        if built:
            cached = " (cached for the next run)" if any(p.path for p in built) else ""
            parts.append(f"{len(built)} built in {sum(p.seconds for p in built):.0f} s{cached}")
        if loaded:
            parts.append(f"{len(loaded)} loaded from the cache in {sum(p.seconds for p in loaded):.1f} s")
        return f"{len(programs)} AOT program{'s' * (len(programs) != 1)}: {', '.join(parts) or 'none'}"

    def _event(self, text: str) -> None:
        self.events.append(text)
        if self.announce is not None:
            self.announce(text)

    def _key_parts(self, module: _StepModule, tokens: Tensor, input_pos: Tensor) -> dict:
        """Everything that decides the program built for these inputs, readable (key.json) and hashed (the
        cache's key): see the class docstring. The read length is not a part: a program holds for its whole
        range (its entry records it, and the length it was built at)."""

        repo = os.path.dirname(os.path.realpath(__file__))
        key = _AOTKey(repo)
        for name in _AOT_SOURCES:
            key.note_file(os.path.join(repo, name))
        model = module.model
        tensors = {}
        first_name: dict[tuple, str] = {}
        for kind, named in (("parameter", module.named_parameters(remove_duplicate=False)),
                            ("buffer", module.named_buffers(remove_duplicate=False))):
            for name, t in named:
                entry = {"kind": kind, **key.tensor(t, values=False)}
                storage = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
                if storage in first_name:  # tied weights: the program may rely on the alias
                    entry["alias_of"] = first_name[storage]
                first_name.setdefault(storage, name)
                tensors[name] = entry
        modules = [key.module_state(name, m) for name, m in module.named_modules(remove_duplicate=False)]
        layers = []
        for i, layer in enumerate(model.layers):
            attention = layer.attention
            policy, cache = attention._modules.get("decode_attention"), attention._modules.get("kv_cache")
            layers.append({"layer": i, "policy": key.describe(policy) if policy is None else key.module_state(
                "decode_attention", policy), "cache": None if cache is None else key.module_state("kv_cache", cache)})
        import torch._dynamo.config as dynamo_config  # here, not at import: dynamo takes a second to import, and
        import torch._inductor.config as inductor_config  # an eager run or a one-line error never needs it

        dynamo = {k: v for k, v in dynamo_config.save_config_portable().items() if "limit" not in k}  # limits: no
        # program of theirs; aot_inductor.metadata: filled in by the first AOTInductor build of the process
        inductor = {k: v for k, v in inductor_config.save_config_portable().items() if k != "aot_inductor.metadata"}
        try:
            autocast = torch.is_autocast_enabled("cpu")
        except TypeError:
            autocast = torch.is_autocast_cpu_enabled()
        parts = {
            "format": 1,  # this layout of the key
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": _aot_machine(),
            "step": key.describe(self.step),
            "model_args": key.describe(model.args),
            "inputs": {"tokens": key.tensor(tokens, values=False), "input_pos": key.tensor(input_pos, values=False),
                       "span": "int8 (length,), Dim.AUTO"},
            "layers": layers,  # each layer's policy and cache (also in modules; here for the reader)
            "modules": modules,
            "tensors": tensors,
            "threads": torch.get_num_threads(),  # inductor's CPU loops are written for this many (cpp.threads -1)
            "grad": torch.is_grad_enabled(),  # False: _build traces under no_grad, whatever the caller's mode
            "inference_mode": torch.is_inference_mode_enabled(),
            "autocast_cpu": autocast,
            "default_dtype": str(torch.get_default_dtype()),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "inductor_configs": _AOT_INDUCTOR_CONFIGS,
            "inductor_config": key.describe(inductor, 1),
            "dynamo_config": key.describe(dynamo, 1),
        }
        parts["globals"] = key.module_globals()  # the values these files' code reads, as this process holds them
        parts["sources"] = {os.path.relpath(path, repo): _aot_file_digest(path) for path in sorted(key.files)}
        return parts

    def _bind(self, runner, module: _StepModule) -> None:
        """The model's own tensors as the program's constants, in place (user-managed: no copy)."""
        named = {**dict(module.named_parameters(remove_duplicate=False)),
                 **dict(module.named_buffers(remove_duplicate=False))}
        constants = {}
        for name in runner.get_constant_fqns():
            tensor = named.get(name)
            if tensor is None:  # a plain tensor attribute export lifted as a constant: the model's own
                tensor = module
                for part in name.split("."):
                    tensor = getattr(tensor, part, None)
            if not isinstance(tensor, Tensor):
                raise KeyError(f"the program's constant {name} is none of the model's tensors")
            constants[name] = tensor
        runner.load_constants(constants, check_full_update=True, user_managed=True)

    @torch.no_grad()  # a decode step is inference, whichever thread builds it: serve.py builds on a thread of its
    # own, where autograd is on (torch's default), and traced so, linear_cpu took F.linear (it keeps the GEMV for
    # calls autograd has no need to differentiate): the server's programs ran oneDNN's GEMMs, neither as fast nor
    # batch-invariant (docs/serving.md, "The server's programs")
    def _build(self, model: Transformer, tokens: Tensor, input_pos: Tensor, span: Tensor, n_key: int,
               n_range: int) -> _Program:
        module, length = _StepModule(self.step, model), span.shape[0]
        root, key_dir, parts, digest = _aot_cache_root(self.cache), None, None, None
        if root is not None:
            try:
                parts = self._key_parts(module, tokens, input_pos)
                digest = _AOTKey.digest(parts)
                key_dir = root / digest
            except Exception as e:  # a model the key cannot describe: build, and keep nothing
                warnings.warn(f"AOTDecodeStep: no cache key for this step ({type(e).__name__}: {e}); building it "
                              f"without the cache", RuntimeWarning, stacklevel=3)
            else:
                program = self._load_cached(key_dir, digest, module, length)
                if program is not None:
                    self._event(f"loaded the decode step for lengths {_aot_range_name(program.low, program.high)} "
                                f"from the cache in {program.seconds:.1f} s ({program.path})")
                    return program
        if self.announce is None:  # a command's own build: said on one line as it runs (a server announces its own)
            from cli import OneTimeWork

            with OneTimeWork(f"building the compiled decode step for {tokens.shape[0]} row(s) (once: cached for "
                             f"later runs)"):
                program, built = self._export_and_compile(module, tokens, input_pos, span, n_key, n_range)
        else:
            program, built = self._export_and_compile(module, tokens, input_pos, span, n_key, n_range)
        where = "not cached: the cache is off"
        if key_dir is not None:
            try:
                program.path = str(self._store(key_dir, digest, parts, program, built, length))
                where = f"cached at {program.path}"
            except Exception as e:  # a read-only or full disk: the program still runs
                where = f"not cached: {type(e).__name__}: {e}"
                warnings.warn(f"AOTDecodeStep: could not write the cache in {key_dir} ({type(e).__name__}: {e})",
                              RuntimeWarning, stacklevel=3)
        elif root is not None:
            where = "not cached: no key"
        self._event(f"built the decode step for lengths {_aot_range_name(program.low, program.high)} in "
                    f"{program.seconds:.0f} s ({where})")
        return program

    def _export_and_compile(self, module: _StepModule, tokens: Tensor, input_pos: Tensor, span: Tensor, n_key: int,
                            n_range: int) -> tuple[_Program, str]:
        """Export and build as before the cache: (the program, bound to the model; its package's path)."""
        from torch.export import Dim

        start, length = time.perf_counter(), span.shape[0]
        with warnings.catch_warnings():  # torch 2.13's export and packaging warn of its own deprecated pytree API
            warnings.simplefilter("ignore", FutureWarning)
            exported = torch.export.export(module, (tokens, input_pos, span), strict=False,
                                           dynamic_shapes={"tokens": None, "input_pos": None, "span": {0: Dim.AUTO}})
            path = torch._inductor.aoti_compile_and_package(
                exported, package_path=f"{self._dir.name}/step_{n_key}_{n_range}.pt2",
                inductor_configs=dict(_AOT_INDUCTOR_CONFIGS))
        ranges = list(exported.range_constraints.values())  # the span's length, unless export specialised it
        low, high = (int(ranges[0].lower), float(ranges[0].upper)) if ranges else (length, length)
        runner = torch._inductor.aoti_load_package(path)
        self._bind(runner, module)
        return _Program(low, high, runner, "built", time.perf_counter() - start, None), path

    @staticmethod
    def _discard(entry, meta_text: Optional[str], package) -> None:
        """Remove a broken entry: its package, and its JSON unless another process has replaced it meanwhile."""
        try:
            if meta_text is None or entry.read_text() == meta_text:
                entry.unlink()
        except OSError:
            pass
        if package is not None:
            try:
                package.unlink()
            except OSError:
                pass

    def _load_cached(self, key_dir, digest: str, module: _StepModule, length: int) -> Optional[_Program]:
        """The stored program of this key whose range holds `length`, loaded and bound; None if there is none.
        An entry that cannot be read, fails its hash or does not load is removed (a warning) and skipped."""
        try:
            entries = sorted(key_dir.glob("step_*.json"))
        except OSError:
            return None
        retried = set()
        while entries:
            entry = entries.pop(0)
            meta_text, package = None, None
            try:
                meta_text = entry.read_text()
                meta = json.loads(meta_text)
                low, high = int(meta["low"]), float("inf") if meta["high"] is None else float(meta["high"])
                if not low <= length <= high:
                    continue
                if meta["key"] != digest:
                    raise ValueError(f"its key is {meta['key']}")
                package = key_dir / meta["package"]
                if package.parent != key_dir:
                    raise ValueError(f"its package {meta['package']!r} lies outside {key_dir}")
                start = time.perf_counter()
                payload = package.read_bytes()
                if len(payload) != meta["bytes"] or hashlib.sha256(payload).hexdigest() != meta["sha256"]:
                    raise ValueError(f"{package.name} holds {len(payload)} bytes, not the {meta['bytes']} stored "
                                     f"(or not their hash)")
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    runner = torch._inductor.aoti_load_package(str(package))
                self._bind(runner, module)
            except FileNotFoundError as e:
                if meta_text is None:  # the entry went away (another process removed it): not ours to judge
                    continue
                try:
                    replaced = entry.read_text() != meta_text
                except OSError:
                    replaced = True
                if replaced:  # another process stored this range anew (and removed the package read of): read it again
                    if entry not in retried:
                        retried.add(entry)
                        entries.insert(0, entry)
                    continue
                warnings.warn(f"AOTDecodeStep: the cached decode step {entry} is unusable ({e}); building it anew",
                              RuntimeWarning, stacklevel=4)
                self._discard(entry, meta_text, package)
                continue
            except Exception as e:
                warnings.warn(f"AOTDecodeStep: the cached decode step {entry} is unusable ({type(e).__name__}: "
                              f"{str(e).strip()[:200]}); building it anew", RuntimeWarning, stacklevel=4)
                self._discard(entry, meta_text, package)
                continue
            return _Program(low, high, runner, "cache", time.perf_counter() - start, str(package))
        return None

    def _store(self, key_dir, digest: str, parts: dict, program: _Program, built: str, length: int):
        """Write a built program's package into the cache: the package under a name carrying its hash, then the
        entry's JSON naming it (each atomically: a reader finds no entry, or a whole one), and key.json."""
        key_dir.mkdir(parents=True, exist_ok=True)
        payload = Path(built).read_bytes()
        sha = hashlib.sha256(payload).hexdigest()
        name = _aot_range_name(program.low, program.high)
        package = key_dir / f"step_{name}_{sha[:16]}.pt2"
        _atomic_write(package, payload)
        if not (key_dir / "key.json").exists():
            _atomic_write(key_dir / "key.json", json.dumps(parts, indent=1, sort_keys=True, default=str).encode())
        layers = parts["layers"]
        meta = {
            "key": digest, "low": program.low, "high": None if program.high == float("inf") else int(program.high),
            "package": package.name, "bytes": len(payload), "sha256": sha, "torch": parts["torch"],
            "build_s": round(program.seconds, 2), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "built_at_length": length, "threads": parts["threads"],
            "summary": {  # the key's main parts in brief (all of them: key.json)
                "model_args": parts["model_args"], "inputs": parts["inputs"],
                "policies": [layer["policy"] for layer in layers[:1]] + (
                    ["... the same in every layer"] if all(layer["policy"] == layers[0]["policy"] for layer in layers)
                    else [layer["policy"] for layer in layers[1:]]),
                "caches": [layer["cache"]["attributes"] if layer["cache"] else None for layer in layers[:1]],
                "sources": parts["sources"], "machine": parts["machine"],
            },
        }
        entry = key_dir / f"step_{name}.json"
        try:
            replaced = json.loads(entry.read_text()).get("package")
        except (OSError, ValueError, AttributeError):
            replaced = None
        _atomic_write(entry, json.dumps(meta, indent=1, sort_keys=True, default=str).encode())
        if replaced and replaced != package.name and "/" not in replaced:  # the package this entry named before:
            try:  # another process's build of the same range, or one found broken; programs loaded from it keep running
                (key_dir / replaced).unlink()
            except OSError:
                pass
        return package
