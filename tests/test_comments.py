"""The code's comments and docstrings say why, without session or version labels.

A label naming an experiment version or a development session points at a log the reader does
not have; the history lives in git and, as rejected decisions, in docs/history.md. The
package's contract is docs/contract.md, so code cites that, not a design file outside the
package. The checker's own test below shows each pattern it flags and the look-alikes it keeps.

Only COMMENT tokens (``tokenize``) and docstrings (``ast``) of the .py files are read, plus the
``#`` comments of the benchmark shell scripts. String literals and code are not: a graph dump's
``v0: f32[...]`` or an error message is not a comment.
"""
import ast
import io
import pathlib
import re
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
DIRS = ("hyscale_compile", "passes", "lowerings", "examples", "benchmarks", "tests")

# Files other branches are rewriting right now; each is checked once it is merged and its
# entry removed. Every entry must still exist (a deleted file does not linger here).
_PENDING: set[str] = set()

# a development session by number, singular or plural
SESSION = re.compile(r"\b[Ss]essions?\s+\d+")
# an experiment version: "v", a number from 2 up, an optional letter. Not a tile range's bounds
# (0 and 1), a model name (after "-", or capitalized), nor the letter inside a word.
VERSION = re.compile(r"(?<![-\w.])v([2-9]|[1-9]\d)[a-z]?\b")
CITATION = re.compile(r"\.\./shared|/work/shared|DESIGN\.md|kernel-design\.md")
# inline code holds the code's own names (a sequence layout ``k1 v1 k2 v2``), not versions
INLINE_CODE = re.compile(r"``.*?``|`[^`]*`")


def offending(text: str) -> list[str]:
    """The labels and stale citations in one comment or docstring line."""
    prose = INLINE_CODE.sub("", text)
    return [m.group(0) for pat, t in ((SESSION, text), (VERSION, prose), (CITATION, text))
            for m in pat.finditer(t)]


def python_comments(source: str):
    """(line number, text) of every comment and every docstring line of a module."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                doc = body[0].value
                for i, line in enumerate(doc.value.splitlines()):
                    yield doc.lineno + i, line


def shell_comments(source: str):
    for no, line in enumerate(source.splitlines(), 1):
        if "#" in line and not line.startswith("#!"):
            yield no, line[line.index("#"):]


def labelled_lines(path: pathlib.Path) -> list[str]:
    source = path.read_text(encoding="utf-8")
    lines = python_comments(source) if path.suffix == ".py" else shell_comments(source)
    return [f"{path.relative_to(ROOT)}:{no}: {', '.join(found)}: {text.strip()}"
            for no, text in sorted(set(lines)) if (found := offending(text))]


def checked_files() -> list[pathlib.Path]:
    files = [f for d in DIRS for f in (ROOT / d).rglob("*.py")]
    files += (ROOT / "benchmarks").glob("*.sh")
    return sorted(f for f in files if f.relative_to(ROOT).as_posix() not in _PENDING)


def test_checker_finds_labels_in_comments_and_docstrings():
    source = "\n".join([
        '"""Module doc, as measured in session 16."""',  # 1: session label in a docstring
        "x = 1  # v23b's A/B",                            # 2: version label in a comment
        "def f(v0, v1):",
        '    """Scores the tile range [v0, v1) (InfLLM-v2, DeepSeek-V3.2)."""',  # fine
        '    return "v7 session 3"  # see ../shared/DESIGN.md',  # 5: the citation only
        "# Sessions 7-9 tried it (v30)",                  # 6: both labels
        "# the key axis is shared by both operands, cu130 on sm_90",  # fine
        "class C:",
        '    """one line, ``k1 v1 k2 v2`` (inline code)',  # fine
        '    since session 2',                            # 10: second docstring line
        '    """',
    ])
    found = {no: offending(text) for no, text in python_comments(source) if offending(text)}
    assert found == {1: ["session 16"], 2: ["v23b"], 5: ["../shared", "DESIGN.md"],
                     6: ["Sessions 7", "v30"], 10: ["session 2"]}
    assert dict(shell_comments('echo "v7"  # v23b: A/B\n')) == {1: '# v23b: A/B'}


def test_comments_have_no_session_or_version_labels():
    files = checked_files()
    assert len(files) > 40 and ROOT / "tests" / "test_comments.py" in files
    bad = [line for f in files for line in labelled_lines(f)]
    assert not bad, ("session/version labels or ../shared citations in comments (say why "
                     "without the label; cite docs/contract.md):\n" + "\n".join(bad))


def test_pending_files_still_exist():
    missing = sorted(p for p in _PENDING if not (ROOT / p).is_file())
    assert not missing, f"remove from _PENDING (file gone): {missing}"
