"""The shipped readers (ktm/readers/): load by name, round-trip exactly, fit the size limit, read.

Slow: they run on the real embedded model.
"""

import pytest
import torch

from ktm.core.levels import merges
from ktm.core.prompt import Segment
from ktm.evaluation.readability import readability
from ktm.model import KTMModel, prompt_logits
from ktm.readers import READERS, reader_info, reader_path
from ktm.tasks.corpus import Window

pytestmark = pytest.mark.slow

# a fixed text, so the test needs no data folder; the continuation repeats names from the context
CODE = '''
def load_settings(path):
    """Read the settings file and return a dict of options."""
    with open(path) as handle:
        settings = json.load(handle)
    settings.setdefault("timeout", 30)
    settings.setdefault("retries", 3)
    return settings


def save_settings(path, settings):
    """Write the settings dict back to its file."""
    with open(path, "w") as handle:
        json.dump(settings, handle, indent=2)
'''


@pytest.mark.parametrize("name,k", [("smollm2-135m-k2", 2), ("smollm2-135m-k4", 4)])
def test_shipped_reader_loads_by_name_and_round_trips(name, k, tmp_path):
    assert name in READERS
    size = sum(f.stat().st_size for f in reader_path(name).rglob("*") if f.is_file())
    assert size <= 25e6, f"{name} is {size / 1e6:.1f} MB, over the 25 MB limit"
    info = reader_info(name)
    assert info["command"].startswith("ktm pretrain") and info["cpu_minutes"] > 0
    model = KTMModel.load(name)
    assert model.k == k and merges(model)
    prompt = [Segment(CODE), Segment("\n# Question: what does load_settings return?\n",
                                     compress=False)]
    want = prompt_logits(model, prompt)
    model.save(str(tmp_path / "again"))
    got = prompt_logits(KTMModel.load(str(tmp_path / "again")), prompt)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["smollm2-135m-k2", "smollm2-135m-k4"])
def test_shipped_reader_reads_merged_text_better_than_mean_pooling(name):
    reader = KTMModel.load(name)
    mean = KTMModel.from_base("smollm2-135m", k=reader.k)
    ids = reader.tokenizer(CODE, add_special_tokens=False)["input_ids"]
    assert len(ids) >= 80 + 24
    windows = [Window(tuple(ids[:n]), tuple(ids[n:n + 24]), "code") for n in (48, 64, 80)]
    got, base = readability(reader, windows), readability(mean, windows)
    assert got["nll_merged"] < base["nll_merged"] - 0.2, (got, base)


def test_a_local_copy_of_the_embedded_model_gets_its_readers():
    """The embedded model's converted folder under any path is the readers' base: ``--reader
    auto`` finds them by content (sizes + tokenizer vocabulary), and reads them on it."""
    import warnings

    from ktm.cli.demo import DemoConfig, load_start, start_name
    from ktm.core.base_model import resolve_model_path

    folder = str(resolve_model_path("smollm2-135m"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # its identity is recorded: checked, no warning
        cfg = DemoConfig(model=folder, k=4)  # ktm demo --model FOLDER
        model, start = load_start(cfg, start_name(cfg))
    assert start == "reader smollm2-135m-k4" and model.k == 4
    from ktm.readers import find_reader  # the API the demo uses

    assert find_reader(folder, 4) == "smollm2-135m-k4"
    # the consecutive-position K=2 reader reads as well as the spread one (readers.PREFERRED)
    assert find_reader(folder, 2) == "smollm2-135m-k2-seq"
    assert find_reader("smollm2-135m", 2) == "smollm2-135m-k2-seq"
    assert find_reader(folder, 3) is None


def test_the_question_reader_reads_the_line_a_question_asks_about():
    """smollm2-135m-k4-qa, as it loads (ratio 4, the question allocator, its LoRA on the merged
    rows only), answers a needle in held-out code at K=4's positions that a uniform K=4 reading
    of the same reader misses; and reads the needle's line plain."""
    from ktm.tasks import get_task
    from ktm.tasks.base import bind

    reader = KTMModel.load("smollm2-135m-k4-qa")
    assert (reader.config.ratio, reader.config.allocator) == (4.0, "question")
    assert reader.config.lora.scope == "merged"
    task = get_task("needle", length=768)
    bind(task, reader)
    e = task.eval_examples(3, seed=1)[1]  # the needle in the middle
    value = e.meta["answers"][0]
    cp = reader.compress(e.segments)
    assert cp.tokens_out <= cp.tokens_in / 4 + 40  # K=4's positions, the question plain
    rows = reader._prompt_encoder().layout([tuple(e.segments)])[0]
    plain = "".join(reader.tokenizer.decode(ids) for ids, level, c in rows if c and level == 0)
    assert value in plain
    assert value in reader.generate(e.segments, max_new_tokens=task.answer_tokens)
    uniform = KTMModel.load("smollm2-135m-k4-qa", allocator="even")
    assert value not in uniform.generate(e.segments, max_new_tokens=task.answer_tokens)


def test_the_code_reader_reads_the_def_a_quoted_line_sits_in():
    """smollm2-135m-k4-qa-code, as it loads (ratio 4, the scope allocator), asked which
    function a quoted line of held-out code is in, reads that function's ``def`` line plain and
    names it; read with the question allocator it reads the ``def`` merged and names another."""
    from ktm.core.config import Layout
    from ktm.tasks import get_task
    from ktm.tasks.base import bind

    reader = KTMModel.load("smollm2-135m-k4-qa-code")
    assert (reader.config.ratio, reader.config.allocator) == (4.0, "scope")
    assert reader.config.lora.scope == "merged"
    assert reader_info("smollm2-135m-k4-qa-code")["command"].startswith("ktm train --task codeqa")
    task = get_task("codeqa", length=768, variant="within")
    bind(task, reader)
    e = task.eval_examples(4, seed=1)[1]
    [name] = e.meta["answers"]
    for allocator, found in (("scope", True), ("question", False)):
        plan = Layout(ratio=4.0, allocator=allocator)
        rows = reader._prompt_encoder(plan).layout([tuple(e.segments)])[0]
        plain = "".join(reader.tokenizer.decode(ids) for ids, level, c in rows if c and level == 0)
        assert (f"def {name}(" in plain) is found
        answer = reader.generate(e.segments, layout=plan, max_new_tokens=task.answer_tokens)
        assert (name in answer) is found, answer
