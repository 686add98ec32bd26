"""Word error rate: normalisation, edit distance, corpus totals, and the run verb's --wer/--max-wer table."""

from __future__ import annotations

import json

import pytest

from runner.app import wer
from runner.errors import RunnerError


def test_normalize_drops_case_and_punctuation_and_writes_numbers_as_digits():
    assert wer.normalize("Good morning, World!") == ["good", "morning", "world"]
    assert wer.normalize("more than thirty seconds") == wer.normalize("more than 30 seconds")
    assert wer.normalize("thirty-five, twenty one") == ["35", "21"]
    assert wer.normalize("It's the model's") == ["it's", "the", "model's"]
    assert wer.normalize("") == []


@pytest.mark.parametrize(
    "ref, hyp, distance",
    [
        ("a b c", "a b c", 0),
        ("a b c", "a x c", 1),  # substitution
        ("a b c", "a c", 1),  # deletion
        ("a b c", "a b c d", 1),  # insertion
        ("a b c", "", 3),
        ("", "a b", 2),
        ("the weather this morning", "but whether this morning", 2),
    ],
)
def test_edit_distance_counts_substitutions_deletions_insertions(ref, hyp, distance):
    assert wer.edit_distance(ref.split(), hyp.split()) == distance


def test_corpus_wer_sums_edits_and_reference_words_and_charges_hallucination_on_silence():
    files = [wer.score("a.wav", "hello world", "hello word"), wer.score("silence.wav", "", "you")]
    assert [f.errors for f in files] == [1, 1]
    assert files[0].wer == 0.5 and files[1].wer is None
    assert wer.corpus_wer(files) == 1.0  # 2 edits over 2 reference words
    lines = wer.table(files)
    assert lines[-1].split()[:3] == ["total", "2", "2"]


def test_read_references_refuses_what_is_not_a_name_to_text_object(tmp_path):
    good = tmp_path / "t.json"
    good.write_text(json.dumps({"a.wav": "hi"}))
    assert wer.read_references(good) == {"a.wav": "hi"}
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(RunnerError, match="file name -> transcript"):
        wer.read_references(bad)
    with pytest.raises(RunnerError, match="not a transcript file"):
        wer.read_references(tmp_path / "missing.json")
