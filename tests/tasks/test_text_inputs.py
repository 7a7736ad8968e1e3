"""Text of every kind in the user's files: what is read, and what is refused, naming where."""

from __future__ import annotations

import gzip
import json

import pytest
from helpers import build_tokenizer

from ktm.cli.main import main
from ktm.core.tokens import raw_text_ids
from ktm.errors import KTMError
from ktm.tasks.corpus import path_texts
from ktm.tasks.custom import CustomTask
from ktm.tasks.jsonl import read_jsonl
from ktm.training.pretrain import PretrainConfig


@pytest.mark.parametrize("gzipped", [False, True])
def test_a_byte_that_is_not_utf8_in_a_jsonl_names_its_line(tmp_path, gzipped):
    # it was "cannot read ...: can't decode byte 0xff in position 10", an offset in a buffer
    data = b'{"text": "ok"}\r\n\n{"text": "caf\xe9"}\n'
    path = tmp_path / "rows.jsonl"
    path.write_bytes(gzip.compress(data) if gzipped else data)
    with pytest.raises(KTMError, match=r"rows\.jsonl line 3: byte 0xE9 at column 14 is not UTF-8"):
        list(read_jsonl(path))


def test_a_byte_that_is_not_utf8_in_a_text_file_names_its_line(tmp_path):
    # a check mark (three UTF-8 bytes), then a byte that is not UTF-8
    (tmp_path / "notes.txt").write_bytes(b"first line\r\nsecond \xe2\x9c\x93 \xff")
    with pytest.raises(KTMError, match=r"notes\.txt line 2: byte 0xFF at column 10 is not UTF-8"):
        path_texts(str(tmp_path))


def test_a_custom_file_too_small_to_split_names_the_file(tmp_path):
    # it was "test_size=0 with 1 items", a test_size the user never gave, and no file
    path = tmp_path / "one.jsonl"
    path.write_text('{"context": "日本語のテキスト", "target": "はい"}\n\n', encoding="utf-8")
    with pytest.raises(KTMError, match=r"one\.jsonl has 1 rows: .*give more rows"):
        CustomTask(data_path=path).train_examples(1, 0)


def test_unicode_equivalent_targets_are_one_label(tmp_path):
    # "café" composed and with a combining accent were two labels splitting one class's rows
    composed, combining = "caf\u00e9", "cafe\u0301"
    targets = [composed] * 6 + [combining] * 2 + [" th\u00e9 ", "th\u00e9"] * 2
    path = tmp_path / "drinks.jsonl"
    path.write_text("".join(json.dumps({"context": f"menu {i}", "target": t}) + "\n"
                            for i, t in enumerate(targets)), encoding="utf-8")
    task = CustomTask(data_path=path, test_size=2)
    assert task.chosen_metric == "accuracy"
    assert task.labels == (composed, "th\u00e9")  # the spelling most rows use
    examples = task.train_examples(10, 0) + task.eval_examples(2, 0)
    assert {e.label for e in examples} == set(task.labels)
    assert all(e.target == e.label for e in examples)
    assert task.parse_label(combining + "\n") == composed


def test_a_source_folder_whose_name_holds_an_equals_sign_is_a_source(tmp_path, monkeypatch):
    # "runs/lr=1e-3" was read as the source "runs/lr" at weight 0.001 (not found)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lr=1e-3").mkdir()
    (tmp_path / "lr=1e-3" / "notes.txt").write_text("some text")
    (tmp_path / "corpus").mkdir()
    cfg = PretrainConfig(sources=("lr=1e-3", "corpus=0.5", "code=2"), eval_sets=())
    assert cfg.source_weights == {"lr=1e-3": 1.0, "corpus": 0.5, "code": 2.0}
    assert path_texts("lr=1e-3") == ["some text"]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be"])
def test_a_utf16_file_is_named_as_such(tmp_path, encoding):
    # Windows editors save "Unicode" text as UTF-16: the error said only "byte 0xFF ... not UTF-8"
    bom = b"\xfe\xff" if encoding.endswith("be") else b""
    (tmp_path / "notes.txt").write_bytes(bom + "naïve text\n".encode(encoding))
    with pytest.raises(KTMError, match=r"notes\.txt line 1: byte 0x.. at column 1 is not UTF-8: "
                                       r"expected UTF-8 text \(this file is UTF-16: save it as"):
        path_texts(str(tmp_path / "notes.txt"))


def test_a_prompt_argument_that_is_not_utf8_names_the_byte(capsys, tiny_model_dir):
    # Python reads a non-UTF-8 byte of argv as a lone surrogate: the error spoke of "half of a
    # UTF-16 pair"; it names the byte now
    assert main(["generate", "--model", tiny_model_dir, "--prompt", "caf\udce9 au lait"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "lone surrogate '\\udce9' at character 3 (a byte 0xE9 that is not UTF-8" in err


def test_a_lone_surrogate_in_raw_text_is_named():
    # raw text (pretraining documents) went to the Rust tokenizer: a bare TypeError
    with pytest.raises(KTMError, match=r"lone surrogate '\\ud800' at character 1 \(half of a "
                                       "UTF-16 pair"):
        raw_text_ids(build_tokenizer(), ["fine", "a\ud800b"])


def test_a_damaged_gzip_stream_is_named(tmp_path):
    # zlib's own error escaped: a traceback from the CLI
    data = bytearray(gzip.compress(b'{"text": "hello world"}\n' * 500, mtime=0))
    data[20:40] = b"\xff" * 20
    for name in ("rows.jsonl.gz", "notes.txt.gz"):
        (tmp_path / name).write_bytes(bytes(data))
    with pytest.raises(KTMError, match=r"cannot read .*rows\.jsonl\.gz: Error -3 .*expected UTF-8"):
        list(read_jsonl(tmp_path / "rows.jsonl.gz"))
    with pytest.raises(KTMError, match=r"cannot read .*notes\.txt\.gz: Error -3 .*expected a text"):
        path_texts(str(tmp_path / "notes.txt.gz"))


def test_jsonl_files_concatenated_with_their_byte_order_marks_are_read(tmp_path):
    # `cat a.jsonl b.jsonl` of files an editor saved with a BOM: line 2 was "bad JSON"
    path = tmp_path / "all.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\r\n\xef\xbb\xbf{"text": "\xe2\x9c\x93"}\r\n')
    assert [row["text"] for _, row in read_jsonl(path)] == ["a", "\u2713"]


def test_a_corpus_folder_reads_linked_folders_once_and_skips_hidden_ones(tmp_path):
    # Path.rglob skipped a linked folder silently: its text was never read
    corpus, books = tmp_path / "corpus", tmp_path / "books"
    (corpus / ".git").mkdir(parents=True)
    (corpus / ".git" / "HEAD.txt").write_text("hidden")
    (corpus / "a.txt").write_text("A")
    books.mkdir()
    (books / "b.md").write_text("B")
    (books / "img.png").write_bytes(b"\x89PNG")
    (corpus / "books").symlink_to(books)
    (books / "again").symlink_to(corpus)  # a loop
    assert path_texts(str(corpus)) == ["A", "B"]


def test_a_corpus_folder_skips_archives_and_binary_files_with_one_warning(tmp_path):
    """A .tar.gz was read as gzipped text (tar headers and NULs included) and a binary file
    with a text name as text; now they are skipped, named on one warning line."""
    import io
    import tarfile
    import zipfile

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("A")
    with tarfile.open(corpus / "backup.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("inner.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"inner"))
    with tarfile.open(corpus / "plain.gz", "w:gz") as tar:  # a tarball under a text name
        tar.addfile(info, io.BytesIO(b"inner"))
    with zipfile.ZipFile(corpus / "code.zip", "w") as z:
        z.writestr("inner.txt", "inner")
    (corpus / "blob.py").write_bytes(b"\x7fELF\x02\x01\x00\x00\x00")
    with pytest.warns(UserWarning, match="skipped 4 archive or binary files") as said:
        assert path_texts(str(corpus)) == ["A"]
    assert len(said) == 1
    for name in ("backup.tar.gz", "plain.gz", "code.zip", "blob.py"):
        assert name in str(said[0].message)
    for name, why in (("backup.tar.gz", "an archive"), ("plain.gz", "an archive"),
                      ("blob.py", "a binary file")):
        with pytest.raises(KTMError, match=rf"{name} is {why}.*not text: expected a text"):
            path_texts(str(corpus / name))


def test_a_file_linked_into_a_folder_twice_is_read_once(tmp_path):
    corpus, outside = tmp_path / "corpus", tmp_path / "outside"
    corpus.mkdir()
    outside.mkdir()
    (outside / "book.txt").write_text("the book")
    (corpus / "a.txt").symlink_to(outside / "book.txt")
    (corpus / "b.txt").symlink_to(outside / "book.txt")
    (corpus / "c.txt").write_text("C")
    assert path_texts(str(corpus)) == ["the book", "C"]


def test_a_json_source_is_read_as_records_not_raw_text(tmp_path):
    """A .json source was read as one raw text, brackets, keys and escapes included."""
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"text": "one", "id": 1}, {"text": "two\r\nlines"}]))
    assert path_texts(str(path)) == ["one", "two\r\nlines"]
    path.write_text(json.dumps({"body": "only"}))
    assert path_texts(str(path), "body") == ["only"]
    path.write_text('{"text": "a"}\n{"text": "b"}\n')  # JSONL under a .json name
    assert path_texts(str(path)) == ["a", "b"]
    path.write_text(json.dumps([{"text": "a"}, {"body": "b"}]))
    with pytest.raises(KTMError, match=r"data\.json record 2: no field 'text'"):
        path_texts(str(path))
    for value, held in ((["a", "b"], "a list of str"), ("text", "str")):
        path.write_text(json.dumps(value))
        with pytest.raises(KTMError, match=rf"data\.json holds {held}: expected a list of records"):
            path_texts(str(path))
    path.write_text('{"text": ')
    with pytest.raises(KTMError, match=r"data\.json: bad JSON"):
        path_texts(str(path))


def test_a_json_file_in_a_code_folder_without_records_is_read_as_text(tmp_path):
    """A code corpus holds package.json, tsconfig.json: JSON, but no records of text. Given
    alone such a file is refused (above); inside a folder it is one document, as before."""
    corpus = tmp_path / "repo"
    corpus.mkdir()
    (corpus / "main.py").write_text("print(1)\n")
    (corpus / "package.json").write_text('{"name": "x", "version": "1.0"}\n')
    (corpus / "rows.json").write_text(json.dumps([{"text": "one"}]))
    assert path_texts(str(corpus)) == ["print(1)\n", '{"name": "x", "version": "1.0"}\n', "one"]


def test_line_ends_text_files_are_normalised_json_strings_are_kept(tmp_path):
    """The rule (README, Data): a text file's line ends are storage (a Windows checkout writes
    CRLF), read as "\\n"; a string inside JSON or JSONL is data, kept verbatim, "\\r\\n" and
    "\\r" included, whatever line ends the file itself has."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_bytes(b"one\r\ntwo\rthree\n")
    (corpus / "b.txt.gz").write_bytes(gzip.compress(b"four\r\nfive"))
    assert path_texts(str(corpus)) == ["one\ntwo\nthree\n", "four\nfive"]
    strings = ["x\r\ny", "x\ry"]
    (tmp_path / "t.jsonl").write_bytes(b"".join(json.dumps({"text": s}).encode() + b"\r\n"
                                                for s in strings))
    (tmp_path / "t.json").write_bytes(json.dumps([{"text": s} for s in strings], indent=1)
                                      .replace("\n", "\r\n").encode())
    assert path_texts(str(tmp_path / "t.jsonl")) == strings == path_texts(str(tmp_path / "t.json"))
    rows = [{"context": f"c\r\n{i}", "prompt": "p\r\n", "target": "t\r\nu"} for i in range(4)]
    (tmp_path / "d.jsonl").write_bytes(b"".join(json.dumps(r).encode() + b"\r\n" for r in rows))
    task = CustomTask(data_path=str(tmp_path / "d.jsonl"), metric="perplexity", test_size=1)
    assert [(r.context, r.prompt, r.target) for r in task.rows] == [
        (r["context"], r["prompt"], r["target"]) for r in rows]
    assert task.eval_examples(1, 0)[0].target == "t\r\nu"
