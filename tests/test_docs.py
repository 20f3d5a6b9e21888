"""The docs a reader opens describe today: no session or version-label talk.

README.md and docs/*.md must not mention a development session (numbered or not) or an
experiment's version label (the checker's own test shows both). The
experiment history lives in git and, as a list of rejected decisions, in docs/history.md,
the one doc exempt here. Inline code and code blocks are not checked: they hold the code's own
names (a tile range `[v0, v1)`), not version labels; session talk is looked for everywhere
(a comment in a code sample counts).
"""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXEMPT = {"history.md"}

# any mention of the development sessions, numbered or not
SESSION = re.compile(r"\b[Ss]essions?\b")
# version labels of the kernel's experiments ("v", digits, an optional letter). Not
# "InfLLM-v2" or "DeepSeek-V3.2" (a model name: after "-", or capitalized), not "cu130" or
# "sm_90" (inside a word).
VERSION = re.compile(r"(?<![-\w.])v\d+[a-z]?\b")
FENCE = re.compile(r"^\s*```")
INLINE_CODE = re.compile(r"`[^`]*`")


def doc_files():
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    return [f for f in files if f.name not in EXEMPT]


def offending_lines(text: str):
    """(line number, line) for each prose line that talks about sessions or versions."""
    out = []
    in_fence = False
    for no, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        prose = "" if in_fence else INLINE_CODE.sub("", line)
        if SESSION.search(line) or VERSION.search(prose):
            out.append((no, line.strip()))
    return out


def test_checker_finds_session_and_version_talk():
    text = "\n".join([
        "measured in session 19 (v32)",       # both
        "an earlier session's output",        # session talk without a number
        "v23b outcome",                       # a version label alone
        "InfLLM-v2 and DeepSeek-V3.2 forms",  # model names: fine
        "torch 2.11.0+cu130 on sm_90",        # inside words: fine
        "tiles `[v0, v1)` are scored",        # inline code: fine
        "```", "v9 = 1  # code", "```",       # a code block: fine
        "```", "# this session's output", "```",  # session talk in a code sample
    ])
    assert [no for no, _ in offending_lines(text)] == [1, 2, 3, 11]


def test_docs_have_no_session_or_version_talk():
    files = doc_files()
    assert any(f.name == "README.md" for f in files) and len(files) > 1
    bad = [f"{f.relative_to(ROOT)}:{no}: {line}" for f in files
           for no, line in offending_lines(f.read_text(encoding="utf-8"))]
    assert not bad, "session or version-label talk outside docs/history.md:\n" + "\n".join(bad)
