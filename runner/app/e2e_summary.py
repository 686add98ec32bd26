"""The e2e job summary (GITHUB_STEP_SUMMARY): one markdown table row per file with its text and the checks asked
for, then what failed or why the run stopped."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FileRow:
    """One file's line in the e2e job summary: "–" where a check was not asked for."""

    file: str
    text: str
    golden: str = "–"
    expected: str = "–"
    wer: str = "–"
    reference: str = "–"


@dataclass
class E2ESummary:
    title: str
    settings: str
    files: int  # how many were asked for
    rows: list[FileRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def markdown(self, failures: list[str], stopped: BaseException | None = None) -> str:
        lines = [f"### {self.title}", "", self.settings, ""]
        lines += [
            "| file | text | golden tokens | expected text | WER | eager reference |",
            "|---|---|---|---|---:|---|",
        ]
        lines += [
            f"| `{r.file}` | {md_text(cut_text(r.text))} | {r.golden} | {r.expected} | {r.wer} | {r.reference} |"
            for r in self.rows
        ]
        lines.append("")
        lines += [f"{n}" for n in self.notes]
        if stopped is not None:
            why = " ".join(f"{type(stopped).__name__}: {stopped}".split())[:300]
            lines.append(f"**stopped after {len(self.rows)} of {self.files} file(s)**: {md_text(why)}")
        elif failures:
            lines.append(f"**{len(failures)} failure(s)**:")
            lines += [f"- {md_text(f)}" for f in failures[:10]]
            if len(failures) > 10:
                lines.append(f"- and {len(failures) - 10} more")
        else:
            lines.append(f"all {len(self.rows)} file(s) pass")
        return "\n".join(lines) + "\n\n"


TEXT_CELL = 60  # characters of each transcript in the summary


def cut_text(text: str, n: int = TEXT_CELL) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def md_text(text: str) -> str:
    """Plain text in a markdown table cell: markdown's punctuation escaped, no line breaks."""
    text = " ".join(text.split())
    for ch in "\\`*_[]<>|#":
        text = text.replace(ch, "\\" + ch)
    return text or "(empty)"
