"""Every file under results/ is there for a reason a reader can follow: the table script reads it,
or a page or a script names it. A result nothing reads or names leaves the tree (git history
keeps it) or gets a line that cites it.

A file is reached when it is
- a script or a page itself (``*.py``, ``*.sh``, ``*.md``);
- opened by ``python results/tables.py --check`` (traced, not guessed);
- named by a path in a page (every ``*.md``) or a script (``results/``, ``ktm/``, ``tests/``):
  taken from the repository root, from results/ or from the naming file's folder, with
  ``{a,b}`` alternatives and ``*`` / ``?`` globs (one that names no folder of results/, as
  ``results/*/*.json`` in ``ktm report``'s usage, cites nothing); in a page an upper-case word
  stands for a value (``TASK``, ``kK-sN.json``), a partial path (``amazon-long/k4.json``)
  matches the files it ends, and a bare file name the one file of that name;
- below a folder so named, unless it is a raw log (``*.jsonl``, ``*.log``, ``*.txt``): a training
  log is kept for what reads it, so it must be read or named itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
SELF = {".py", ".sh", ".md"}
RAW_LOGS = (".jsonl", ".log", ".txt")
# a path as pages and scripts write it: word characters, dots, dashes, slashes, globs, {a,b}, $VAR
TOKEN = re.compile(r"(?:[\w.*?$\-/]|\{[\w.*?$\-/,]*\})+")
# runs `results/tables.py --check` and prints every file it opened
TRACE = """
import os, runpy, sys
opened = set()
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, os.PathLike)):
        opened.add(os.path.realpath(args[0]))
sys.addaudithook(hook)
sys.argv = [sys.argv[1], "--check"]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit:
    pass
print("\\n".join(sorted(opened)))
"""


def result_files() -> list[str]:
    """Every file under results/ that .gitignore does not ignore, relative to the repository."""
    ignored = [line.strip() for line in (REPO / ".gitignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]

    def skip(rel: str) -> bool:
        parts = rel.split("/")
        for pat in ignored:
            names = parts[:-1] if pat.endswith("/") else parts
            pat = pat.strip("/")
            if "/" in pat:  # anchored at the repository root
                if any(glob_match("/".join(parts[:i + 1]), pat) for i in range(len(parts))):
                    return True
            elif any(glob_match(name, pat) for name in names):
                return True
        return False

    rels = (str(p.relative_to(REPO)) for p in RESULTS.rglob("*") if p.is_file())
    return sorted(r for r in rels if not skip(r))


def read_by_tables() -> set[str]:
    out = subprocess.run([sys.executable, "-c", TRACE, str(RESULTS / "tables.py")], cwd=REPO,
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    root = str(REPO.resolve()) + os.sep
    return {p[len(root):] for p in out.stdout.splitlines() if p.startswith(root)}


def expand(token: str) -> list[str]:
    """``a{b,c}d`` -> ``abd``, ``acd``; ``{x}`` without a comma stands for any value."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    alts = m.group(1).split(",") if "," in m.group(1) else ["*"]
    return [t for a in alts for t in expand(token[:m.start()] + a + token[m.end():])]


def to_regex(pattern: str) -> str:
    return "".join(".*" if part == "**" else "[^/]*" if part == "*" else "[^/]"
                   if part == "?" else re.escape(part)
                   for part in re.split(r"(\*\*|\*|\?)", pattern))


def glob_match(name: str, pattern: str) -> bool:
    """``name`` matches the glob ``pattern`` (``*`` within a folder, ``**`` across). Not
    fnmatch: the standard library's modules no project file imports are the held-out text
    (``ktm.tasks.corpus.STDLIB_MODULES``)."""
    return re.fullmatch(to_regex(pattern), name) is not None


def citing_files() -> list[Path]:
    pages = [*REPO.glob("*.md"), *(REPO / "docs").rglob("*.md"), *RESULTS.rglob("*.md")]
    code = [*RESULTS.rglob("*.py"), *RESULTS.rglob("*.sh"), *(REPO / "ktm").rglob("*.py"),
            *(REPO / "tests").rglob("*.py")]
    return [p for p in pages + code if p != Path(__file__).resolve()]


def paths_named(src: Path) -> list[tuple[str, bool]]:
    """(path or pattern, is a folder) for each path ``src`` writes, as it writes it."""
    page = src.suffix == ".md"
    out = []
    for token in set(TOKEN.findall(src.read_text(encoding="utf-8", errors="replace"))):
        if "$" in token or (not page and re.search(r"\{[^,}]*\}", token)):
            continue  # a variable of a script, not a path
        if page:  # markdown emphasis: **bold**, *italic*
            token = token.removeprefix("**").removesuffix("**")
            if len(token) > 2 and token[0] == token[-1] == "*":
                token = token[1:-1]
        folder = token.endswith("/")
        token = token.rstrip("/") if folder else token.strip("./-")
        if not folder and not re.search(r"\.(?:[a-z]\w*|\*)$", token):
            continue  # neither a folder nor a file name
        for path in expand(token):
            out.append((path, folder))
            if page and not folder:
                out.append((re.sub(r"[A-Z]+", "*", path), folder))  # TASK, METHOD: any value
    return out


def cited(files: list[str]) -> set[str]:
    """The files of ``files`` that a page or a script names."""
    by_name: dict[str, list[str]] = {}
    for f in files:
        by_name.setdefault(f.rsplit("/", 1)[-1], []).append(f)
    named, folders = [], []
    for src in citing_files():
        page = src.suffix == ".md"
        bases = ("", "results/", str(src.parent.relative_to(REPO)) + "/")
        for path, folder in paths_named(src):
            for base in bases:
                full = os.path.normpath(base + path)
                if full.startswith("results/") and not full.startswith("results/*"):
                    (folders if folder else named).append(to_regex(full))
            if page and not folder and "/" in path and not path.startswith("results/"):
                named.append("(?:.*/)?" + to_regex(path))  # a path within a folder named before
            if page and not folder and "/" not in path:
                same = [f for n in by_name if glob_match(n, path) for f in by_name[n]]
                if len(same) == 1:
                    named.append(re.escape(same[0]))
    named_re = re.compile("|".join(named) or "(?!)")
    below_re = re.compile("(?:" + ("|".join(folders) or "(?!)") + ")/")
    return {f for f in files if named_re.fullmatch(f)
            or (not f.endswith(RAW_LOGS) and below_re.match(f))}


def unreached(files: list[str]) -> list[str]:
    reached = cited(files) | read_by_tables()
    return [f for f in files if Path(f).suffix not in SELF and f not in reached]


def test_every_result_file_is_read_or_cited():
    missing = unreached(result_files())
    assert missing == [], (
        "results files no table reads and no page or script names: cite each where its numbers "
        "are used (a path in a .md), or git rm it:\n  " + "\n  ".join(missing))


def test_an_unnamed_file_is_caught():
    files = result_files()
    log = "results/readers/probes/k4x-conv1/nobody.metrics.jsonl"  # in a folder pages name
    alone = "results/unnamed/row.json"
    assert unreached([*files, log, alone]) == [log, alone]
