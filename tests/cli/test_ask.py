"""``ktm ask FILE... --question TEXT``: files and folders read as one document and asked about."""

import re

import pytest

from ktm.cli.ask import AskConfig, ask, asked_prompt, read_document
from ktm.cli.main import main
from ktm.errors import KTMError
from ktm.model import load_any

LINE = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu\n"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def files(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "b.py").write_text("SECRET = 7731\n" + LINE * 3, encoding="utf-8")
    (tmp_path / "src" / "a.py").write_text(LINE * 4, encoding="utf-8")
    (tmp_path / "src" / ".hidden").write_text("never read", encoding="utf-8")
    (tmp_path / "src" / "blob.bin").write_bytes(b"\xff\xfe\x00binary")
    (tmp_path / "notes.txt").write_text("The answer is in b.py.\n", encoding="utf-8")
    return tmp_path


def test_files_and_a_folder_are_read_as_one_document(files):
    doc, read = read_document((str(files / "notes.txt"), str(files / "src")), progress=False)
    assert read == [str(files / "notes.txt"), str(files / "src" / "a.py"),
                    str(files / "src" / "b.py")]  # in name order; hidden and binary left out
    assert doc.startswith(f"# File: {files / 'notes.txt'}\nThe answer is in b.py.\n")
    assert "SECRET = 7731" in doc and "never read" not in doc


def test_ask_streams_what_generate_answers_and_says_what_it_read(tiny_model_dir, files,
                                                                 capsys):
    code, out, err = run(capsys, "ask", str(files / "src"), str(files / "notes.txt"),
                         "--question", "What is SECRET?", "--reader", tiny_model_dir,
                         "--max-new-tokens", "5", "--no-progress")
    assert code == 0 and "Traceback" not in err
    assert "skipping" in err and "blob.bin" in err
    got = re.search(r"\[3 file\(s\), (\d+) tokens read in (\d+) positions, ratio ([\d.]+);", err)
    assert got and int(got[2]) < int(got[1])
    model = load_any(tiny_model_dir)
    doc, _ = read_document((str(files / "src"), str(files / "notes.txt")), progress=False)
    prompt = asked_prompt(model, doc, "What is SECRET?")
    assert out == model.generate(prompt, max_new_tokens=5) + "\n"
    # without a chat template: the question plain, as the question, with an answer cue
    assert [s.text for s in prompt if s.question] == ["\nQuestion: What is SECRET?\nAnswer:"]
    assert "SECRET = 7731" in "".join(s.text for s in prompt if s.compress)


def test_a_chat_model_is_asked_in_one_user_message(tiny_model_dir, files):
    """With a chat template the files and the question are one user message, read as ktm serve
    reads it: the question (made one line) split off and marked, the files merged."""
    model = load_any(tiny_model_dir)
    model.tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    doc, _ = read_document((str(files / "src"),), progress=False)
    prompt = asked_prompt(model, doc, "What is\n  SECRET?")
    assert [s.text for s in prompt if s.question] == ["What is SECRET?"]
    assert "SECRET = 7731" in "".join(s.text for s in prompt if s.compress)
    assert prompt[-1].text.endswith("<|assistant|>") and not prompt[-1].compress


def test_a_document_past_the_window_is_fitted_not_refused(tiny_model_dir, tmp_path):
    (tmp_path / "long.txt").write_text(LINE * 60, encoding="utf-8")  # ~3,400 tokens, K=4: 850
    row = ask(AskConfig(paths=(str(tmp_path / "long.txt"),), question="What follows kappa?",
                        reader=tiny_model_dir, max_new_tokens=4, progress=False),
              out=open(tmp_path / "answer.txt", "w"))
    assert row["fitted"] and row["positions"] + 3 <= 512 < row["tokens"] / 4


@pytest.mark.parametrize("argv,match", [
    (["{tmp}/missing.txt", "--question", "Why?"], "cannot read '{tmp}/missing.txt': no such"),
    (["{tmp}/src/blob.bin", "--question", "Why?"], "blob.bin' is not UTF-8 text"),
    (["{tmp}/notes.txt"], "no question: expected --question TEXT"),
    (["{tmp}/notes.txt", "--question", "Why?", "--max-new-tokens", "0"],
     "max_new_tokens must be an integer >= 1, got 0"),
])
def test_bad_input_is_one_line_and_nonzero(capsys, tiny_model_dir, files, argv, match):
    argv = [a.format(tmp=files) for a in argv]
    code, _, err = run(capsys, "ask", *argv, "--reader", tiny_model_dir, "--no-progress")
    assert code == 2 and "Traceback" not in err
    assert match.format(tmp=files) in err.strip().splitlines()[-1]


def test_an_empty_folder_is_refused_by_name(tmp_path):
    with pytest.raises(KTMError, match="no text file in"):
        read_document((str(tmp_path),), progress=False)
