"""The decode step built ahead of time (aot.AOTDecodeStep, --compile-backend aot): the tokens of the
eager step, one program per read-length range a policy's branches allow, and the model's own caches."""
import hashlib
import json
from pathlib import Path

import pytest
import torch

import kernels
from conftest import assert_one_line_error
from attention import DenseDecode
from aot import AOTDecodeStep
from decoding import Generator, decode_step
from model import ModelArgs, random_model
from sparq import SparQConfig, SparQDecode


@pytest.fixture(scope="module")
def aot_cache(tmp_path_factory):
    """The module's own AOT cache (SPARQ_FAST_CACHE/aot), shared by its tests: none of them reads the user's."""
    return tmp_path_factory.mktemp("sparq-fast-cache")


@pytest.fixture(autouse=True)
def _own_cache(aot_cache, monkeypatch):
    monkeypatch.setenv("SPARQ_FAST_CACHE", str(aot_cache))
    monkeypatch.delenv("SPARQ_FAST_AOT_CACHE", raising=False)


@pytest.fixture(scope="module")
def tiny():
    error = kernels.cpu_kernel_error()
    if error is not None:
        pytest.fail(f"the fused CPU kernels did not build: {error}")
    torch.manual_seed(0)
    model = random_model(ModelArgs.from_shape("tiny"), kernels=kernels.CPU_KERNELS)
    model.setup_caches(2, 96)
    return model


def sparq(layer: int) -> SparQDecode:
    return SparQDecode(SparQConfig(r=4, k_top=32), kernels=kernels.CPU_KERNELS)  # dense up to 32 positions


def test_aot_step_generates_the_eager_tokens_one_program_per_length_range(tiny):
    """SparQ runs dense while a layer sees at most k positions: a decode from 18 positions to 58 needs one
    program up to 32 and one above, and gives the eager step's greedy tokens (fused kernels in both)."""
    prompts = [[1, 2, 3] * 6]
    tiny.set_decode_attention(sparq)
    eager = Generator(tiny).generate(prompts, 40)[0]
    generator = Generator(tiny, compile_decode=True, compile_backend="aot")
    rows, stats = generator.generate(prompts, 40)
    assert len(set(eager[0])) > 5  # tokens that vary: a comparison that can fail
    assert rows == eager and stats.steps == 39
    ranges = [(p.low, p.high) for programs in generator._decode.programs.values() for p in programs]
    assert ranges == [(2, 32), (33, float("inf"))]


def test_aot_step_writes_the_models_cache_and_follows_a_new_policy(tiny):
    """The program reads and writes the model's own buffers (no copy): the position a step writes is in
    the model's cache. A policy installed afterwards (set_decode_attention) gets programs of its own,
    with ragged rows at per-row positions."""
    step = AOTDecodeStep(decode_step)
    prompts = [[5, 6, 7] * 12, [8, 9] * 10]  # 36 and 20 positions
    for make in (lambda layer: DenseDecode(kernels.CPU_KERNELS), sparq):
        tiny.set_decode_attention(make)
        generator = Generator(tiny, compile_decode=True, compile_backend="aot")
        generator._decode = step
        rows = generator.generate(prompts, 6)[0]
        cache = tiny.layers[0].attention.kv_cache
        written = cache.k[0, :, 36:41].clone()  # row 0's decode positions (36 + 5 steps)
        tiny.set_decode_attention(make)  # a fresh copy of the same policy: the eager reference
        assert Generator(tiny).generate(prompts, 6)[0] == rows
        assert written.abs().sum() > 0  # the program wrote the model's own cache, as eager does: to the last bits
        # where inductor's fused norms and RoPE round as ATen's do (AVX-512 machines), within an ulp elsewhere
        torch.testing.assert_close(cache.k[0, :, 36:41], written, rtol=1e-5, atol=1e-6)
    assert len(step.programs) == 2  # one per policy (each holds for every length these rows read)


@pytest.mark.parametrize("args, fragment", [
    (["--compile-backend", "aot"], "without --compile"),
    (["--compile", "--compile-backend", "aot", "--speculate-k", "2", "--draft-attention", "sparq"], "--speculate-k"),
])
def test_aot_refusals(args, fragment, smollm2_checkpoint):
    from test_generate import run_generate

    assert_one_line_error(run_generate("--checkpoint", str(smollm2_checkpoint), "--prompt", "hi",
                                       "--max-new-tokens", "2", *args), "--compile-backend aot", fragment)


class _Building(Exception):
    """Raised by a patched torch.export.export: the step went to build (a cache miss), and stopped there."""


def _no_building(monkeypatch) -> None:
    """Export and AOTInductor's compile raise: a step can only load from the cache (or fail with _Building)."""
    def refuse(*args, **kwargs):
        raise _Building

    monkeypatch.setattr(torch.export, "export", refuse)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", refuse)


def _entry(program):
    """A program's entry in the cache: (its JSON's path, its contents)."""
    package = Path(program.path)
    entry = package.parent / f"step_{package.name.split('_')[1]}.json"
    return entry, json.loads(entry.read_text())


def _aot_generate(model, prompts, n: int):
    generator = Generator(model, compile_decode=True, compile_backend="aot")
    rows = generator.generate(prompts, n)[0]
    return rows, generator._decode


def test_a_step_built_with_autograd_on_is_the_inference_step(tiny, monkeypatch):
    """serve.py builds its programs on a thread of its own, where autograd is on (torch's default): the traced
    step must still be the one an inference call runs, its linears the fused GEMV (linear_cpu takes F.linear
    where autograd would need a backward), not oneDNN's GEMMs as the server's were."""
    traced = []
    real_export = torch.export.export

    def export_and_stop(*args, **kwargs):
        program = real_export(*args, **kwargs)
        traced.append({str(node.target) for node in program.graph.nodes if node.op == "call_function"})
        raise _Building  # what was traced is all this test reads: no compile

    monkeypatch.setattr(torch.export, "export", export_and_stop)
    monkeypatch.setenv("SPARQ_FAST_AOT_CACHE", "0")  # always a build, whatever earlier tests stored
    tiny.set_decode_attention(sparq)
    with torch.enable_grad(), pytest.raises(_Building):
        AOTDecodeStep(decode_step).prepare(tiny, torch.zeros((1, 1), dtype=torch.long), torch.tensor([40]), 41)
    assert "sparq.linear_cpu.default" in traced[0]
    assert not traced[0] & {"aten.linear.default", "aten.mm.default", "aten.addmm.default", "aten.matmul.default"}


def test_a_second_step_loads_the_programs_from_the_cache(tiny, monkeypatch):
    """Programs built once (here, or by the first test of this module) are stored in SPARQ_FAST_CACHE/aot with
    their ranges; a new AOTDecodeStep on the same model, shapes and policy loads them: no export, no compile,
    the eager step's tokens and the same ranges."""
    prompts = [[1, 2, 3] * 6]
    tiny.set_decode_attention(sparq)
    eager = Generator(tiny).generate(prompts, 40)[0]
    rows, first = _aot_generate(tiny, prompts, 40)  # builds, unless an earlier test has stored these programs
    assert rows == eager and len(first.events) == 2
    entries = [_entry(p)[1] for programs in first.programs.values() for p in programs]
    assert [(e["low"], e["high"]) for e in entries] == [(2, 32), (33, None)]
    for entry in entries:
        assert entry["torch"] == torch.__version__ and entry["build_s"] > 0 and entry["bytes"] > 0
        assert entry["summary"]["policies"][0]["attributes"]["config"]["r"] == 4
        assert entry["summary"]["inputs"]["tokens"]["shape"] == [1, 1]

    _no_building(monkeypatch)
    announced = []
    step = AOTDecodeStep(decode_step, announce=announced.append)
    generator = Generator(tiny, compile_decode=True, compile_backend="aot")
    generator._decode = step
    assert generator.generate(prompts, 40)[0] == eager
    programs = [p for programs in step.programs.values() for p in programs]
    assert [(p.low, p.high) for p in programs] == [(2, 32), (33, float("inf"))]
    assert [p.origin for p in programs] == ["cache", "cache"] and all(p.path.endswith(".pt2") for p in programs)
    assert announced == step.events and all(e.startswith("loaded the decode step") for e in step.events)
    assert "from the cache" in step.events[0] and "2-32" in step.events[0] and "33-inf" in step.events[1]


def _r5(model, monkeypatch):
    model.set_decode_attention(lambda layer: SparQDecode(SparQConfig(r=5, k_top=32), kernels=kernels.CPU_KERNELS))
    return model, [[1, 2, 3] * 6]


def _k16(model, monkeypatch):
    model.set_decode_attention(lambda layer: SparQDecode(SparQConfig(r=4, k_top=16), kernels=kernels.CPU_KERNELS))
    return model, [[1, 2, 3] * 6]


def _bf16(model, monkeypatch):
    model = random_model(ModelArgs.from_shape("tiny"), dtype=torch.bfloat16, kernels=kernels.CPU_KERNELS)
    model.setup_caches(2, 96)
    model.set_decode_attention(sparq)
    return model, [[1, 2, 3] * 6]


def _two_rows(model, monkeypatch):
    model.set_decode_attention(sparq)
    return model, [[1, 2, 3] * 6] * 2


def _another_thread_count(model, monkeypatch):
    torch.set_num_threads(torch.get_num_threads() % 2 + 1)  # inductor writes its loops for the thread count
    model.set_decode_attention(sparq)
    return model, [[1, 2, 3] * 6]


def _a_module_setting(model, monkeypatch):
    monkeypatch.setattr(kernels, "LINEAR_CPU_MAX_ROWS", kernels.LINEAR_CPU_MAX_ROWS // 2)  # read as the step is traced
    model.set_decode_attention(sparq)
    return model, [[1, 2, 3] * 6]


@pytest.mark.parametrize("change", [_r5, _k16, _bf16, _two_rows, _another_thread_count, _a_module_setting])
def test_what_decides_the_program_decides_the_cache_entry(change, tiny, monkeypatch, threads):
    """A policy's setting (SparQ r, k), the model's dtype, the batch's shape, the thread count the program was
    built for or a module-level setting of the repo's code: each another key, so a step goes to build (export,
    patched here to stop it) and loads nothing; the same model, policy and shape again loads."""
    tiny.set_decode_attention(sparq)
    _aot_generate(tiny, [[1, 2, 3] * 6], 4)  # stored (range 2-32), or loaded if stored before
    _no_building(monkeypatch)
    tiny.set_decode_attention(sparq)
    assert _aot_generate(tiny, [[1, 2, 3] * 6], 4)[1].events[0].startswith("loaded")
    model, prompts = change(tiny, monkeypatch)
    with pytest.raises(_Building):
        _aot_generate(model, prompts, 4)


def test_the_cache_is_off_with_the_environment_variable(tiny, monkeypatch):
    tiny.set_decode_attention(sparq)
    _aot_generate(tiny, [[1, 2, 3] * 6], 4)
    _no_building(monkeypatch)
    monkeypatch.setenv("SPARQ_FAST_AOT_CACHE", "0")
    with pytest.raises(_Building):
        _aot_generate(tiny, [[1, 2, 3] * 6], 4)
    monkeypatch.delenv("SPARQ_FAST_AOT_CACHE")
    step = AOTDecodeStep(decode_step, cache=False)
    with pytest.raises(_Building):
        step(tiny, torch.zeros(1, 1, dtype=torch.long), torch.tensor([18]), 19)


def test_a_corrupt_package_in_the_cache_is_built_anew(tiny, monkeypatch):
    """A truncated package (its hash fails) is removed with a warning and built again, the new one stored and
    loaded by the next step; a package that passes its hash but does not load is removed the same way."""
    tiny.set_decode_attention(sparq)
    prompts = [[4, 5, 6] * 6]
    eager = Generator(tiny).generate(prompts, 10)[0]  # lengths 19 to 28: the program up to 32 alone
    step = _aot_generate(tiny, prompts, 10)[1]
    [[program]] = step.programs.values()
    entry, meta = _entry(program)
    assert (meta["low"], meta["high"]) == (2, 32)
    package = entry.parent / meta["package"]
    package.write_bytes(package.read_bytes()[: meta["bytes"] // 2])  # truncated
    with pytest.warns(RuntimeWarning, match="unusable"):
        rows, step = _aot_generate(tiny, prompts, 10)
    assert rows == eager and step.events[0].startswith("built") and "cached at" in step.events[0]
    [[program]] = step.programs.values()
    assert _entry(program)[0] == entry  # stored anew: the next step loads it
    entry, meta = _entry(program)
    _no_building(monkeypatch)
    rows, step = _aot_generate(tiny, prompts, 10)
    assert rows == eager and step.events[0].startswith("loaded")

    package = entry.parent / meta["package"]
    garbage = b"not a package" * 1000
    package.write_bytes(garbage)  # whole, by its entry's count and hash, yet no package
    meta.update(bytes=len(garbage), sha256=hashlib.sha256(garbage).hexdigest())
    entry.write_text(json.dumps(meta))
    with pytest.warns(RuntimeWarning, match="unusable"), pytest.raises(_Building):
        _aot_generate(tiny, prompts, 10)
    assert not entry.exists() and not package.exists()


def test_the_cache_key_ignores_where_the_weights_sit_in_their_buffer():
    """A program's key holds each tensor's shape, dtype, strides and alignment, not its offset into its storage:
    weights on huge pages (model.weights_on_huge_pages) are views into one buffer at offsets that shift with
    where that buffer lands, so a key with offsets changed in every process and no later run found its programs.
    The same model with every weight moved to other offsets (64-byte aligned, as that buffer keeps them) keys
    alike; a weight off its alignment does not."""
    from aot import _AOTKey, _StepModule

    torch.manual_seed(0)
    model = random_model(ModelArgs.from_shape("tiny"))
    model.setup_caches(1, 32)
    tokens, positions = torch.zeros((1, 1), dtype=torch.long), torch.tensor([[5]])
    step = AOTDecodeStep(decode_step)

    def key() -> str:
        return _AOTKey.digest(step._key_parts(_StepModule(decode_step, model), tokens, positions))

    def move(extra_bytes: int) -> None:  # every parameter into one buffer, `extra_bytes` in
        params = [p for p in model.parameters()]
        arena = torch.empty(sum(p.numel() for p in params) + 64 * len(params) + 64, dtype=torch.float32)
        at = (-arena.data_ptr() % 64 + extra_bytes) // 4
        with torch.no_grad():
            for p in params:
                view = arena[at:at + p.numel()].view(p.shape)
                view.copy_(p)
                p.data = view
                at += -(-p.numel() // 16) * 16  # the next 64-byte boundary
        model.output.weight = model.tok_embeddings.weight if model.args.tie_embeddings else model.output.weight

    first = key()
    move(64)
    assert key() == first
    move(128 + 64 * 3)
    assert key() == first
    move(4)  # off the 64-byte alignment: another program's inputs
    assert key() != first
