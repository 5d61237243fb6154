"""generate.py end to end on the embedded model, SparQ against dense, and one-line errors for bad input."""
import io
import sys

import pytest
import torch

import assemble
import chat
import data
import decoding
import generate
from conftest import assert_one_line_error, read_json, run_main, run_python
import kernels
from attention import DenseDecode
from cache import KVFormat
from decoding import Generator
from kernels import TORCH_KERNELS
from model import load_model
from sparq import SparQConfig, SparQDecode


def cpu_kernels():
    """The fused CPU kernels (the suite fails rather than skips when they do not build)."""
    error = kernels.cpu_kernel_error()
    if error is not None:
        pytest.fail(f"the fused CPU kernels did not build: {error}")
    return kernels.CPU_KERNELS


def run_generate(*args, timeout=600):
    return run_python("generate.py", *args, timeout=timeout)


@pytest.fixture(scope="module")
def smollm2(smollm2_checkpoint):
    import tokenizer

    model = load_model(smollm2_checkpoint)
    return model, tokenizer.load_tokenizer(smollm2_checkpoint)


def greedy(model, prompt_ids, new_tokens, policy_factory, stop_ids=frozenset(), batch_size=1, kv_layout="twice"):
    model.setup_caches(batch_size, len(prompt_ids) + new_tokens, KVFormat(kv_layout))
    model.set_decode_attention(policy_factory)
    generator = Generator(model, stop_ids=set(stop_ids))
    rows, _ = generator.generate(torch.tensor([prompt_ids] * batch_size), new_tokens)
    return rows


def test_sparq_with_full_r_and_k_generates_exactly_dense(smollm2):
    """r = d and k >= S: SparQ must reproduce dense greedy decoding token for token (a 512-token prompt)."""
    model, tok = smollm2
    prompt = data.essay_tokens(tok, 512)
    dense = greedy(model, prompt, 32, lambda layer: DenseDecode())
    full = SparQConfig(r=model.args.head_dim, k_top=4096, local=0)
    sparq = greedy(model, prompt, 32, lambda layer: SparQDecode(full, dense_when_short=False))  # SparQ itself
    assert len(dense[0]) == 32
    assert sparq == dense


NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."


def needle_prompt(tok, n_haystack_tokens=1900):
    haystack = tok.decode(data.essay_tokens(tok, n_haystack_tokens))
    cut = haystack.rfind(". ", 0, len(haystack) // 2) + 2
    context = haystack[:cut] + NEEDLE + " " + haystack[cut:]
    question = (f"{context}\n\nWhat is the best thing to do in San Francisco? "
                "Answer with one sentence from the text above.")
    return tok.encode_prompt(question, chat=True)


def test_needle_sparq_gives_the_same_answer_as_dense(smollm2):
    model, tok = smollm2
    prompt = needle_prompt(tok)
    assert 1800 < len(prompt) < 2300
    dense = tok.decode(greedy(model, prompt, 24, lambda layer: DenseDecode(), tok.stop_ids)[0])
    config = SparQConfig(r=16, k_top=128, mean_v=False)
    sparq = tok.decode(greedy(model, prompt, 24, lambda layer: SparQDecode(config), tok.stop_ids)[0])
    assert "Dolores Park" in dense, dense  # the model does retrieve it densely at this length
    assert "Dolores Park" in sparq, sparq


@pytest.mark.parametrize("make_policy", [
    lambda kernels: SparQDecode(SparQConfig(r=16, k_top=128), kernels),
    lambda kernels: DenseDecode(kernels),
], ids=["sparq", "dense"])
def test_fused_cpu_kernel_generates_the_same_tokens_as_the_torch_path(smollm2, make_policy):
    fused_kernels = cpu_kernels()
    model, tok = smollm2
    prompt = data.essay_tokens(tok, 512)
    torch_path = greedy(model, prompt, 32, lambda layer: make_policy(TORCH_KERNELS), batch_size=2)
    fused = greedy(model, prompt, 32, lambda layer: make_policy(fused_kernels), batch_size=2)
    assert fused == torch_path


def test_fused_cpu_linears_generate_the_same_tokens_as_f_linear(smollm2, smollm2_checkpoint):
    model, tok = smollm2
    fused_model = load_model(smollm2_checkpoint, kernels=cpu_kernels())  # its linears run the fused GEMV
    prompt = data.essay_tokens(tok, 128)  # the prefill's linears are F.linear's in both: the decode is what differs
    for batch_size in (1, 8):  # one decode row; eight rows (the GEMV's x blocks of 4)
        reference = greedy(model, prompt, 24, lambda layer: DenseDecode(), batch_size=batch_size)
        fused = greedy(fused_model, prompt, 24, lambda layer: DenseDecode(), batch_size=batch_size)
        assert fused == reference


FP32 = 4  # the embedded model's bytes per element on the CPU


def sparq_step_bytes(S: int, r: int, k: int, d: int) -> float:
    """One KV head's SparQ step in bytes as the CPU's default cache stores them (assemble.kt_storage_for):
    step 1 reads r of K^T's d rows at S positions in int4 (half a byte each, one fp32 scale per position),
    step 2 k rows of K and V and the 4 vectors of q, mean-V and the outputs in fp32: the paper's Sr + 2kd + 4d
    with K^T at its stored size."""
    return S * (r / 2 + 4) + (2 * k * d + 4 * d) * FP32


def dense_step_bytes(S: int, d: int) -> float:
    return (2 * S * d + 2 * d) * FP32


@pytest.mark.parametrize("policy, target", [("sparq", "1/4"), ("local", "0.3")])
def test_compression_solves_the_policy_knob_at_the_longest_prompt(tmp_path, smollm2_checkpoint, policy, target):
    """--compression picks the knob whose transfers at the prompt's length come closest to the target;
    the achieved compression over the decode is the paper's transfer formula over dense's (SmolLM2:
    30 global layers, d = 64), step by step."""
    out = tmp_path / "out.json"
    result = run_generate("--checkpoint", str(smollm2_checkpoint), "--prompt-tokens", "600", "--max-new-tokens", "6",
                          "--attention", policy, "--compression", target, "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = read_json(out)
    d, lengths = 64, range(601, 606)
    if policy == "sparq":
        r, k = report["sparq"]["r"], report["sparq"]["k"]
        step = lambda S: sparq_step_bytes(S, r, k, d)
        assert k == 128 and abs(step(600) / dense_step_bytes(600, d) - 0.25) <= 2 / d  # r: one of d steps
        moved = [step(S) for S in lengths]
    else:
        k = report["kv_budget"]
        assert abs((2 * k * d + 2 * d) / (2 * 600 * d + 2 * d) - 0.3) <= 1 / 600
        moved = [(2 * k * d + 2 * d) * FP32 for S in lengths]
    dense = [dense_step_bytes(S, d) for S in lengths]
    assert report["compression_target"] == float(eval(target))
    assert report["compression_achieved"] == pytest.approx(sum(moved) / sum(dense))
    assert f"budget: --compression {float(eval(target)):.4g} at 600 tokens" in result.stderr


@pytest.mark.parametrize("args, fragment", [
    (("--compression", "1/4", "--sparq-r", "8"), "chooses --sparq-r for --attention sparq"),
    (("--compression", "1/4", "--attention", "topk", "--kv-budget", "8"), "chooses --kv-budget"),
    (("--compression", "1/4", "--attention", "sparq-fixed-r", "--sparq-r", "8", "--sparq-k", "64"), "chooses --sparq-k"),
    (("--compression", "1/4", "--attention", "dense"), "dense has none"),
    (("--compression", "1/8", "--attention", "topk"), "lowest target it reaches"),
    (("--compression", "1/256"), "out of reach of sparq"),  # k = 8 alone reads more: below its floor
    (("--compression", "0"), "must be in (0, 1]"),
    (("--compression", "1/4", "--interactive"), "--interactive has none"),
])
def test_compression_refusals(smollm2_checkpoint, args, fragment):
    assert_one_line_error(run_main(generate.main, "--checkpoint", smollm2_checkpoint, "--prompt-tokens", "600",
                                   "--max-new-tokens", "2", *args)
                          if "--interactive" not in args else
                          run_main(generate.main, "--checkpoint", smollm2_checkpoint, *args), fragment)


def test_generate_cli_json_with_sparq(tmp_path, smollm2_checkpoint):
    out = tmp_path / "out.json"
    result = run_generate("--checkpoint", str(smollm2_checkpoint), "--prompt-tokens", "300", "--max-new-tokens", "8",
                          "--sparq-r", "16", "--sparq-k", "64", "--batch-size", "2", "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = read_json(out)
    assert report["prompt_tokens"] == 300 and report["batch_size"] == 2 and len(report["samples"]) == 2
    assert report["attention"] == "sparq"
    assert report["sparq"] == {"r": 16, "k": 64, "local": 16, "mean_v": False}  # GQA: mean-V off by default
    assert all(len(s["tokens"]) == 8 for s in report["samples"])
    # KV bytes per step by the SparQ formula (int4 K^T, the CPU default), averaged over the 7 decode steps at
    # lengths 301..307, for 3 KV heads, 30 layers and 2 rows.
    per_head = [sparq_step_bytes(S, 16, 64, 64) for S in range(301, 308)]
    assert report["kv_bytes_read_per_step"] == sum(per_head) * 3 * 30 * 2 // 7
    dense_per_head = [dense_step_bytes(S, 64) for S in range(301, 308)]
    assert report["compression_achieved"] == pytest.approx(sum(per_head) / sum(dense_per_head))
    assert report["compression_target"] is None
    for key in ("prefill_s", "decode_tokens_per_s", "total_tokens_per_s", "bandwidth_gb_s", "weight_bytes"):
        assert report[key] > 0
    assert report["total_tokens_per_s"] == pytest.approx(2 * report["decode_tokens_per_s"])


def test_a_run_that_decodes_nothing_writes_null_speeds(tmp_path, smollm2_checkpoint):
    """One new token comes from the prefill, so no decode step runs: the speeds are null in the JSON
    (NaN is not JSON), and the printed line says nothing was decoded."""
    out = tmp_path / "out.json"
    result = run_generate("--checkpoint", str(smollm2_checkpoint), "--prompt", "Write a short story about a lighthouse.",
                          "--max-new-tokens", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "nothing was decoded" in result.stderr
    report = read_json(out)
    assert report["decode_steps"] == 0 and len(report["samples"][0]["tokens"]) == 1
    assert report["decode_tokens_per_s"] is None and report["total_tokens_per_s"] is None
    assert report["bandwidth_gb_s"] is None and report["prefill_tokens_per_s"] > 0


def test_generate_chat_answers_sensibly(smollm2_checkpoint):
    result = run_generate("--checkpoint", str(smollm2_checkpoint), "--chat", "--prompt",
                          "What is the capital of France?", "--max-new-tokens", "20")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tokens/s" in result.stderr and "bandwidth achieved" in result.stderr


@pytest.mark.parametrize("args,fragment", [
    (["--batch-size", "0"], "--batch-size"),
    (["--device", "tpu"], "--device"),
    (["--dtype", "float8"], "--dtype"),
    (["--sparq-r", "0"], "--sparq-r"),
    (["--sparq-r", "65"], "--sparq-r"),
    (["--sparq-r", "8", "--sparq-k", "0"], "--sparq-k"),
    (["--sparq-r", "8", "--sparq-k", "16", "--sparq-local", "17"], "--sparq-local"),
    (["--sparq-r", "8", "--kernel", "triton"], "--kernel triton"),
    (["--prompt-tokens", "100", "--max-seq-length", "50"], "--max-seq-length"),
    (["--max-seq-length", "100000"], "context"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "--prompt-file"),
    (["--attention", "local", "--kv-budget", "8"], "sink"),
    (["--quantized-kernel", "gemv"], "not quantized"),  # a float checkpoint: the flag would do nothing
])
def test_bad_input_is_a_one_line_error(args, fragment, smollm2_checkpoint):
    assert_one_line_error(run_main(generate.main, "--checkpoint", smollm2_checkpoint, "--max-new-tokens", "2", *args),
                          fragment)


def test_cuda_without_a_gpu_is_a_one_line_error(smollm2_checkpoint):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert_one_line_error(run_generate("--checkpoint", str(smollm2_checkpoint), "--device", "cuda"), "cuda")


def test_missing_and_corrupt_checkpoints(tmp_path, smollm2_checkpoint):
    assert_one_line_error(run_generate("--checkpoint", str(tmp_path / "nothing")), "not found")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text((smollm2_checkpoint / "config.json").read_text())
    (corrupt / "model.pth").write_bytes(b"this is not a checkpoint" * 100)
    assert_one_line_error(run_generate("--checkpoint", str(corrupt)), "corrupt")
    (corrupt / "config.json").write_text('{"vocab_size": 10, "mystery": 1}')
    assert_one_line_error(run_generate("--checkpoint", str(corrupt)), "config.json")


def test_the_cards_command_with_random_weights_of_a_tiny_shape(tmp_path):
    """The card's command as an H100 runs it without a checkpoint (--random-weights, --prompt-tokens as
    random ids, SparQ, compiled), at a tiny shape on the CPU: token ids out, no tokenizer, and the
    same tokens as the eager run (compilation changes nothing), torch.compile's step and the one built
    ahead of time (--compile-backend aot) alike."""
    outs = []
    for backend in (None, "inductor", "aot"):
        out = tmp_path / f"{backend}.json"
        result = run_generate("--random-weights", "tiny", "--prompt-tokens", "120", "--max-new-tokens", "12",
                              "--sparq-r", "8", "--sparq-k", "64",
                              *(["--compile", "--compile-backend", backend] if backend else []), "--json", str(out))
        assert result.returncode == 0, result.stderr
        assert "random weights of the tiny shape" in result.stderr and "float32 on cpu" in result.stderr
        outs.append(read_json(out))
    eager, *compiled = outs
    assert eager["random_weights"] == "tiny" and eager["checkpoint"] is None and eager["attention"] == "sparq"
    assert eager["samples"][0]["text"] is None and len(eager["samples"][0]["tokens"]) == 12
    assert len(set(eager["samples"][0]["tokens"])) > 2  # tokens that vary: a comparison that can fail
    for run in compiled:
        assert run["samples"][0]["tokens"] == eager["samples"][0]["tokens"]
        assert run["compile_s"] > 0
    assert eager["compile_s"] is None


@pytest.mark.parametrize("args,fragment", [
    (["--random-weights", "tiny"], "--prompt-tokens"),
    (["--random-weights", "tiny", "--prompt", "hello"], "--prompt"),
    (["--random-weights", "tiny", "--prompt-tokens", "8", "--chat"], "--chat"),
    (["--random-weights", "tiny", "--interactive"], "--interactive"),
    (["--random-weights", "gpt-5"], "--random-weights"),
    (["--random-weights", "tiny", "--checkpoint", "x", "--prompt-tokens", "8"], "--checkpoint"),
])
def test_random_weights_refusals_are_one_line_errors(args, fragment):
    assert_one_line_error(run_main(generate.main, *args), fragment)


def test_sampling_draws_from_the_softmax_without_syncing():
    """The exponential race (no torch.multinomial, which syncs with the host) draws token i with
    probability softmax(logits / T)_i, top-k respected: frequencies over many draws, 5 standard errors."""
    from sampling import Sampling, sample

    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -8.0]]).repeat(20000, 1)
    for temperature, top_k in ((1.0, None), (0.5, None), (1.0, 2)):
        p = torch.softmax(logits[0] / temperature, dim=-1)
        if top_k is not None:
            p[top_k:] = 0
            p /= p.sum()
        counts = torch.bincount(sample(logits, Sampling(temperature, top_k)), minlength=5).double() / len(logits)
        stderr = (p * (1 - p) / len(logits)).sqrt().double()
        assert ((counts - p.double()).abs() <= 5 * stderr + 1e-12).all(), (temperature, top_k, counts, p)


def test_warm_up_compiles_every_step_variant_before_the_timed_run():
    """With a bucketed cache (as CUDA's), Generator.warm_up runs a step at every read length the decode
    reaches, SparQ's dense-while-short branch and its sparse one included: the timed generation
    compiles nothing more."""
    from torch._dynamo.utils import counters

    from model import ModelArgs, random_model

    model = random_model(ModelArgs.from_shape("tiny"))
    model.setup_caches(2, 160, length_bucket=16)
    model.set_decode_attention(lambda layer: SparQDecode(SparQConfig(r=4, k_top=32)))  # sparse past 32 positions
    generator = Generator(model, compile_decode=True)
    prompts = [[1, 2, 3] * 6, [4, 5] * 9]  # 18 positions: the decode reads 32, then 48, 64, ...
    torch._dynamo.reset()
    generator.warm_up(prompts, 40)
    compiled = counters["stats"]["unique_graphs"]
    rows, stats = generator.generate(prompts, 40)
    assert counters["stats"]["unique_graphs"] == compiled and stats.steps == 39
    model.set_decode_attention(lambda layer: SparQDecode(SparQConfig(r=4, k_top=32)))
    eager = Generator(model).generate(prompts, 40)[0]
    assert rows == eager


def test_rewind_sums_v_in_chunks_without_an_fp32_copy_of_the_cache():
    """KVCache.rewind recomputes the running V sum a chunk of positions at a time (KVCache.sum_positions):
    equal to the direct fp32 sum over a length that spans several chunks."""
    from cache import SUM_CHUNK, KVCache

    cache = KVCache(2, 3 * SUM_CHUNK, 2, 16, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    S = 2 * SUM_CHUNK + 37
    cache.update(torch.arange(S), torch.randn(2, 2, S, 16, generator=gen).bfloat16(),
                 torch.randn(2, 2, S, 16, generator=gen).bfloat16())
    cache.rewind(S - 100)
    torch.testing.assert_close(cache.v_sum, cache.v[:, :, :S - 100].float().sum(2), atol=1e-4, rtol=1e-5)
    assert int(cache.live_length[1]) == S - 100


@pytest.mark.parametrize("args, fragment", [
    (["--temperature", "-0.5"], "--temperature"),
    (["--top-k", "100000"], "--top-k must be in [1, 49152]"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    (["--prompt", "   "], "the prompt is empty"),
    (["--batch-size", "100000", "--prompt-tokens", "8000"], "--batch-size or --max-seq-length"),
    (["--prompt-tokens", "10000000"], "fewer than"),
])
def test_generate_refuses_bad_input_in_one_line(smollm2_checkpoint, args, fragment):
    assert_one_line_error(run_main(generate.main, "--checkpoint", smollm2_checkpoint, "--max-new-tokens", "2", *args),
                          fragment)


def test_prompt_files_that_are_empty_or_not_utf8(tmp_path, smollm2_checkpoint):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert_one_line_error(run_python("generate.py", "--checkpoint", smollm2_checkpoint, "--prompt-file", empty), "empty")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    assert_one_line_error(run_python("generate.py", "--checkpoint", smollm2_checkpoint, "--prompt-file", latin), "UTF-8")


def test_max_new_tokens_beyond_the_context_is_capped_and_said(smollm2_checkpoint):
    result = run_python("generate.py", "--checkpoint", smollm2_checkpoint, "--prompt", "Once upon a time",
                      "--max-seq-length", "12", "--max-new-tokens", "50", "--no-stream")
    assert result.returncode == 0, result.stderr
    assert "--max-new-tokens capped at" in result.stderr


def test_first_token_a_stop_token_says_nothing_was_decoded(smollm2_checkpoint):
    stats = decoding.DecodeStats(prefill_tokens=5, prefill_s=0.1, decode_s=0.0, steps=0, kv_bytes_read=0)
    err = io.StringIO()
    sys_stderr, sys.stderr = sys.stderr, err
    try:
        generate.report(stats, 1, 1000)
    finally:
        sys.stderr = sys_stderr
    assert "nothing was decoded" in err.getvalue() and "tokens/s per sequence" not in err.getvalue()


def test_one_decode_step_says_it_includes_the_warm_up():
    stats = decoding.DecodeStats(prefill_tokens=5, prefill_s=0.1, decode_s=0.5, steps=1, kv_bytes_read=0)
    err = io.StringIO()
    sys_stderr, sys.stderr = sys.stderr, err
    try:
        generate.report(stats, 1, 1000, first_call=True)
    finally:
        sys.stderr = sys_stderr
    assert "warm-up" in err.getvalue()


def test_streamed_text_handles_multibyte_characters():
    """A character split over two tokens is printed once complete, never as a replacement character."""

    class Bytes:  # one token per UTF-8 byte
        def decode(self, ids):
            return bytes(ids).decode("utf-8", errors="replace")

    out = io.StringIO()
    stream = decoding.TextStream(Bytes(), out)
    for b in "héllo €".encode("utf-8"):
        stream.add(b)
    stream.finish()
    assert out.getvalue() == "héllo €\n" and "\ufffd" not in out.getvalue()


def test_interactive_chat_keeps_the_conversation_in_the_cache(smollm2_checkpoint, monkeypatch):
    """Two turns: the second prefills only what the conversation adds (the first turn stays cached)."""
    args = generate.build_parser().parse_args(["--checkpoint", str(smollm2_checkpoint), "--interactive",
                                               "--max-new-tokens", "12", "--kernel", "torch"])
    config = assemble.model_args(args.checkpoint)
    model = assemble.load_checkpoint(args.checkpoint, "cpu", torch.float32,
                                     assemble.kernels_for("torch", "cpu", config))
    tok = assemble.load_tokenizer(args.checkpoint)
    prefilled = []
    original = chat.prefill

    def counting_prefill(model_, prompt, *a, **kw):
        prefilled.append((prompt.shape[1], kw.get("start", 0)))
        return original(model_, prompt, *a, **kw)

    lines = iter(["What is the capital of France?", "And of Italy?", ""])
    out = io.StringIO()
    monkeypatch.setattr(chat, "prefill", counting_prefill)
    chat.chat_loop(args, model, tok, generate.attention_settings(args), 1, lambda _: next(lines), out)
    assert len(prefilled) == 2
    assert prefilled[0][1] == 0 and prefilled[1][1] > 0  # turn 2 starts where turn 1 ended in the cache
    assert prefilled[1][0] < 40  # only the new turn's tokens
    assert out.getvalue().count("\n") >= 2 and "Paris" in out.getvalue()


def test_sampling_flags_reach_the_sampler(smollm2_checkpoint, tmp_path):
    """generate.py's top-p, min-p and penalties, seeded: the same tokens twice; a repetition penalty changes a
    greedy generation of a repetitive prompt; speculation refuses the penalties in one line."""
    base = ["--checkpoint", smollm2_checkpoint, "--prompt", "one two one two one two one two", "--max-new-tokens",
            "12", "--threads", "1"]
    sampled = ["--temperature", "0.8", "--top-p", "0.9", "--min-p", "0.05", "--presence-penalty", "0.5",
               "--frequency-penalty", "0.3", "--seed", "3"]
    runs = [run_python("generate.py", *base, *sampled, "--json", tmp_path / f"{i}.json") for i in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr
    tokens = [read_json(tmp_path / f"{i}.json")["samples"][0]["tokens"] for i in range(2)]
    assert tokens[0] == tokens[1]
    greedy = run_python("generate.py", *base, "--json", tmp_path / "g.json")
    penalised = run_python("generate.py", *base, "--repetition-penalty", "1.5", "--json", tmp_path / "p.json")
    assert greedy.returncode == 0 and penalised.returncode == 0, penalised.stderr
    assert read_json(tmp_path / "g.json")["samples"][0]["tokens"] != read_json(tmp_path / "p.json")["samples"][0]["tokens"]
    assert_one_line_error(run_python("generate.py", *base, "--repetition-penalty", "1.2", "--speculate-k", "2",
                                     "--draft-attention", "sparq", "--sparq-r", "8"), "without penalties")
