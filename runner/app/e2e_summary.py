"""The e2e job summary (GITHUB_STEP_SUMMARY): one markdown table row per file with its text and the checks asked
for, then what failed or why the run stopped."""

from __future__ import annotations

from dataclasses import dataclass, field

# The checks' columns, in the table's order: key (what a check names as its column) -> heading
COLUMNS = {"golden": "golden tokens", "expected": "expected text", "wer": "WER", "reference": "eager reference"}
NUMERIC = frozenset({"wer"})  # right-aligned
NOT_ASKED = "–"
MAX_FAILURES = 10  # failures listed one by one; the rest counted


@dataclass
class FileRow:
    """One file's line in the e2e job summary: its text and one cell per check asked for (NOT_ASKED elsewhere)."""

    file: str
    text: str
    cells: dict[str, str] = field(default_factory=dict)  # COLUMNS key -> cell (our own markup, numbers)
    error: str | None = None  # why the file failed: shown in place of its text

    def markdown(self) -> str:
        cells = " | ".join(self.cells.get(key, NOT_ASKED) for key in COLUMNS)
        text = f"**error**: {md_text(self.error)}" if self.error is not None else md_text(cut_text(self.text))
        return f"| {md_text(self.file)} | {text or '(empty)'} | {cells} |"


@dataclass
class E2ESummary:
    title: str
    settings: str
    files: int  # how many were asked for
    rows: list[FileRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def markdown(self, failures: list[str], stopped: BaseException | None = None) -> str:
        lines = [f"### {md_text(self.title)}", "", md_text(self.settings), ""]
        lines.append("| file | text | " + " | ".join(COLUMNS.values()) + " |")
        lines.append("|---|---|" + "".join("---:|" if key in NUMERIC else "---|" for key in COLUMNS))
        lines += [r.markdown() for r in self.rows]
        lines.append("")
        lines += self.notes
        if stopped is not None:
            why = " ".join(f"{type(stopped).__name__}: {stopped}".split())[:300]
            lines.append(f"**stopped after {len(self.rows)} of {self.files} file(s)**: {md_text(why)}")
        elif failures:
            lines.append(f"**{len(failures)} failure(s)**:")
            lines += [f"- {md_text(f)}" for f in failures[:MAX_FAILURES]]
            if len(failures) > MAX_FAILURES:
                lines.append(f"- and {len(failures) - MAX_FAILURES} more")
        else:
            lines.append(f"all {len(self.rows)} file(s) pass")
        return "\n".join(lines) + "\n\n"


TEXT_CELL = 60  # characters of each transcript in the summary


def cut_text(text: str, n: int = TEXT_CELL) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


# translate() maps each character once, so an escape is never escaped again. `<`, `>`, `&` as entities: no raw
# HTML, and GitHub's table splitter ignores them; `|` as `\|`, which GFM honours in a cell.
_ESCAPES = str.maketrans(
    {
        "\\": "\\\\",
        "`": "\\`",
        "|": "\\|",
        "*": "\\*",
        "[": "\\[",
        "]": "\\]",
        "#": "\\#",
        "<": "&lt;",
        ">": "&gt;",
        "&": "&amp;",
    }
)


def md_text(text: object) -> str:
    """Plain text as markdown that stays one table cell or one heading: every whitespace run (line breaks, CR) a
    single space, pipes, backticks, emphasis and link brackets backslash-escaped, HTML's `<`, `>`, `&` as entities.
    The one escaping function of the job summaries (the e2e summary, bench's table, ci_scripts/job_summary.py)."""
    return " ".join(str(text).split()).translate(_ESCAPES)
