"""The README's and the docs pages' commands, flags and links against the CLI and the repository: a
renamed or dropped flag, or a moved file, fails here, not on a new user's first try."""

import re
import shlex
from pathlib import Path

import pytest

from ktm.cli.main import COMMANDS, _parser

REPO = Path(__file__).parents[1]
README = (REPO / "README.md").read_text()
# the pages a user follows: their commands must run as written (results/LOG.md is history)
PAGES = {"README.md": README, "results/README.md": (REPO / "results" / "README.md").read_text()
         } | {f"docs/{p.name}": p.read_text() for p in sorted((REPO / "docs").glob("*.md"))}
# flags of the launchers, servers and scripts the pages also show (torchrun, accelerate, pip,
# vllm, results/determinism.py)
OTHER_TOOLS = {"--cpu", "--enable-prompt-embeds", "--machine_rank", "--main_process_ip",
               "--main_process_port", "--master_addr", "--master_port", "--multi_gpu",
               "--nnodes", "--no-deps", "--node_rank", "--nproc_per_node", "--num_machines",
               "--num_processes", "--served-model-name", "--standalone",
               "--tensor-parallel-size", "--pipeline-parallel-size", "--runtimes",
               # results/history/chat_bench.py and ttft.py
               "--turns", "--budget-share", "--no-floor", "--history-presses", "--cache-mb",
               "--think-s",
               # pytest's option for the compiled sweep (tests/conftest.py)
               "--sweep"}


def shown_commands(text: str = README) -> list[str]:
    """Every whole ktm command line: the CLI table's first column and the bash blocks."""
    found = re.findall(r"^\| `(ktm [^`]+)` \|", text, flags=re.M)
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#")[0].strip()
            if "-m ktm.cli " in line:
                line = "ktm " + line.split("-m ktm.cli ", 1)[1]
            if line.startswith("ktm "):
                found.append(line)
    return found


def test_the_readme_shows_every_subcommand():
    assert {shlex.split(c)[1] for c in shown_commands()} == set(COMMANDS)


@pytest.mark.parametrize("command", [c for text in PAGES.values() for c in shown_commands(text)])
def test_every_command_the_readme_and_docs_show_parses(command):
    # "..." stands for flags left out, "[...]" for optional ones
    argv = shlex.split(command.replace("...", "").replace("[", "").replace("]", ""))[1:]
    _parser(argv).parse_args(argv)  # argparse exits (SystemExit 2) on a flag it does not know


@pytest.mark.parametrize("page", list(PAGES))
def test_every_flag_a_page_names_exists(page):
    parser = _parser([])
    sub = next(a for a in parser._actions if isinstance(getattr(a, "choices", None), dict))
    flags = {o for sp in sub.choices.values() for a in sp._actions for o in a.option_strings}
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9_-]*[a-z0-9])", PAGES[page]))
    assert named - flags - OTHER_TOOLS == set()


@pytest.mark.parametrize("page", list(PAGES))
def test_every_relative_link_points_at_a_file(page):
    # [text](target) outside code: an http(s)/mailto link or a bare #anchor is not a file
    text = re.sub(r"```.*?```", "", PAGES[page], flags=re.S)
    targets = re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)
    missing = [t for t in targets if not re.match(r"[a-z]+:|#", t)
               and not ((REPO / page).parent / t.split("#")[0]).exists()]
    assert missing == []


def test_the_python_api_example_runs_on_the_tiny_model(tiny_model_dir, corpus, tmp_path,
                                                       monkeypatch):
    # the README's first Python block as written, on the tiny model, with tiny step counts; the
    # shipped reader (the real model) is replaced by the checkpoint the example itself saves
    code = re.search(r"```python\n(.*?)```", README, flags=re.S).group(1)
    for old, new in [('"smollm2-135m"', repr(tiny_model_dir)),
                     ('"smollm2-135m-k4"', '"runs/tree/final"'), ('"my_corpus/"', repr(corpus)),
                     ("train_examples(2000", "train_examples(8"), ("max_steps=200", "max_steps=2"),
                     ("max_steps=500", "max_steps=2"), ("max_new_tokens=32", "max_new_tokens=4")]:
        assert old in code, old
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    scope = {"long_document": "The quick brown fox jumps over the lazy dog. " * 8}
    exec(compile(code, "README.md", "exec"), scope)  # our own README
    cp = scope["cp"]
    assert cp.embeds.shape[0] == cp.tokens_out < cp.tokens_in
    assert (tmp_path / "runs" / "tree-r4" / "checkpoint" / "ktm_config.json").is_file()
    assert (tmp_path / "runs" / "my-reader" / "metrics.jsonl").is_file()
