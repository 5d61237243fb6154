"""The decode step built ahead of time (decoding.AOTDecodeStep, --compile-backend aot): the tokens of the
eager step, one program per read-length range a policy's branches allow, and the model's own caches."""
import pytest
import torch

import kernels
from conftest import assert_one_line_error
from attention import DenseDecode
from decoding import AOTDecodeStep, Generator, decode_step
from model import ModelArgs, random_model
from sparq import SparQConfig, SparQDecode


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
        assert torch.equal(cache.k[0, :, 36:41], written)
    assert len(step.programs) == 2  # one per policy (each holds for every length these rows read)


@pytest.mark.parametrize("args, fragment", [
    (["--compile-backend", "aot"], "without --compile"),
    (["--compile", "--compile-backend", "aot", "--speculate-k", "2", "--draft-attention", "sparq"], "--speculate-k"),
])
def test_aot_refusals(args, fragment, smollm2_checkpoint):
    from test_generate import run_generate

    assert_one_line_error(run_generate("--checkpoint", str(smollm2_checkpoint), "--prompt", "hi",
                                       "--max-new-tokens", "2", *args), "--compile-backend aot", fragment)
