"""The library (runner/app/api.py, `import runner`): each result checked against an independent reference, the
CLI's own record of the same audio (`run --json`, `stream --json`), and bad inputs refused with one sentence."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import AUDIO

import runner
from runner.app.cli import main
from runner.audio import load_audio
from runner.bundle_name import bundle_name
from runner.errors import AudioError, GenerationError, RunnerError

FILES = ["speech.wav", "long_35s.flac", "short.wav", "speech_48k_stereo.wav"]
NEW = 24  # tokens per file: enough to tell files apart, quick on the tiny model
ROOT = Path(__file__).resolve().parents[2]


def cli_records(verb: str, bundle: Path, *args: str, stdin: bytes | None = None) -> list[dict]:
    """The CLI's --json records, in a process of its own."""
    cmd = [sys.executable, "-m", "runner", verb, "--bundle", str(bundle), "--json", *args]
    p = subprocess.run(cmd, input=stdin, capture_output=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    return [json.loads(line) for line in p.stdout.decode().splitlines()]


def cli_error(capsys, *argv: str) -> str:
    """The one `error:` line the CLI gives for these arguments."""
    assert main(list(argv)) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0].removeprefix("error: ")


def one_sentence(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert text and "\n" not in text and "Traceback" not in text
    return text


@pytest.fixture(scope="module")
def tiny(tiny_bundle):
    with runner.load(tiny_bundle) as model:
        yield model


@pytest.fixture(scope="module")
def realtime(realtime_bundle):
    with runner.load(realtime_bundle) as model:
        yield model


# ---------------------------------------------------------------- importing is cheap


def test_importing_runner_and_its_help_load_no_torch_or_numpy():
    code = (
        "import runpy, sys\n"
        "import runner\n"
        "assert runner.__version__ and 'load' in dir(runner)\n"
        "sys.argv = ['runner', '--help']\n"
        "try:\n"
        "    runpy.run_module('runner', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0\n"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "[]"


def test_the_library_names_load_on_first_use_and_others_do_not_exist():
    from runner.app import api

    assert runner.load is api.load and runner.Model is api.Model
    assert runner.Transcription is api.Transcription and runner.Delta is api.Delta
    with pytest.raises(AttributeError):
        runner.no_such_name  # noqa: B018


def test_the_package_ships_its_types():
    assert (ROOT / "runner" / "py.typed").is_file()
    text = (ROOT / "pyproject.toml").read_text()
    assert 'runner = ["py.typed", "__init__.pyi"]' in text


def test_the_readme_example_runs_as_written(tiny_bundle):
    """README's Library example, on the tiny bundle in place of the one `nox -s e2e` builds there (named after the
    torch it runs under: the README names the one the project pins)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Library") :]
    code = section[section.index("```python\n") + 10 : section.index("```\n", 10)]
    e2e_bundle = f'"artifacts/{bundle_name("tiny", "cpu", "fp32", torch.__version__)}"'
    assert len(code.splitlines()) == 5 and e2e_bundle in code
    code = code.replace(e2e_bundle, repr(str(tiny_bundle)))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() and "Traceback" not in p.stderr


# ---------------------------------------------------------------- whole files: the CLI's records


def test_transcribe_a_path_equals_run_json_for_every_fixture(tiny, tiny_bundle):
    records = cli_records("run", tiny_bundle, *[a for n in FILES for a in ("--audio", str(AUDIO / n))],
                          "--max-new-tokens", str(NEW))  # fmt: skip
    assert [Path(r["audio"]).name for r in records] == FILES
    for name, record in zip(FILES, records):
        t = tiny.transcribe(AUDIO / name, max_new_tokens=NEW)
        assert list(t.tokens) == record["tokens"], name
        assert t.text == record["text"], name
        assert t.to_dict()["segments"] == record["segments"], name
        assert t.source == str(AUDIO / name) and t.index == 0
    assert tiny.name == tiny_bundle.name and tiny.family == "voxtral" and tiny.max_batch == 1
    assert not tiny.capabilities.streaming


def test_on_text_streams_the_same_text(tiny):
    pieces: list[str] = []
    t = tiny.transcribe(str(AUDIO / "speech.wav"), max_new_tokens=NEW, on_text=pieces.append)
    assert "".join(pieces) == t.text


def test_bytes_and_arrays_give_the_tokens_of_their_file(tiny):
    for name in ("speech.wav", "speech_48k_stereo.wav"):
        path = AUDIO / name
        want = tiny.transcribe(path, max_new_tokens=NEW).tokens
        assert tiny.transcribe(path.read_bytes(), max_new_tokens=NEW).tokens == want, name
        data, rate = sf.read(path, dtype="float32", always_2d=True)  # 48 kHz stereo: averaged, resampled
        t = tiny.transcribe(data if data.shape[1] > 1 else data[:, 0], sample_rate=rate, max_new_tokens=NEW)
        assert t.tokens == want and t.source is None, name


def test_bytes_leave_no_temporary_file(tiny, tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tiny.transcribe((AUDIO / "short.wav").read_bytes(), max_new_tokens=4)
    with pytest.raises(AudioError):
        tiny.transcribe(b"not audio at all", max_new_tokens=4)
    assert list(tmp_path.iterdir()) == []


def test_transcribe_many_in_a_batch_equals_one_by_one(tiny_batch_bundle):
    names = ["speech.wav", "short.wav", "long_35s.flac"]
    with runner.load(tiny_batch_bundle) as model:
        assert model.max_batch == 4
        alone = [model.transcribe(AUDIO / n, max_new_tokens=NEW) for n in names]
        inputs = [AUDIO / names[0], (AUDIO / names[1]).read_bytes(), str(AUDIO / names[2])]
        together = sorted(model.transcribe_many(inputs, batch=2, max_new_tokens=NEW), key=lambda t: t.index)
    assert [t.index for t in together] == [0, 1, 2]
    assert [t.source for t in together] == [str(AUDIO / names[0]), None, str(AUDIO / names[2])]
    for a, b in zip(alone, together):
        assert (a.tokens, a.text, a.segments) == (b.tokens, b.text, b.segments)


def test_transcribe_feed_answers_each_input_as_transcribe_does_and_a_bad_one_alone(tiny_batch_bundle):
    """Inputs from a feed (as a server's requests arrive) through one batch: each (index, Transcription) equals
    `transcribe`'s; bad bytes are (index, the error transcribe raises) and the inputs after them go on."""
    inputs = [(AUDIO / "short.wav").read_bytes(), b"garbage bytes", AUDIO / "speech.wav"]

    class Listed:
        def __init__(self):
            self.left = list(enumerate(inputs))

        def take(self, wait: bool):
            return self.left.pop(0) if self.left else None

    with runner.load(tiny_batch_bundle) as model:
        alone = {i: model.transcribe(inputs[i], max_new_tokens=NEW) for i in (0, 2)}
        with pytest.raises(AudioError) as bad:
            model.transcribe(inputs[1], max_new_tokens=NEW)
        got = dict(model.transcribe_feed(Listed(), max_new_tokens=NEW))
    assert sorted(got) == [0, 1, 2]
    assert isinstance(got[1], AudioError) and str(got[1]) == str(bad.value)
    for i, t in alone.items():
        assert (got[i].index, got[i].tokens, got[i].text, got[i].segments) == (i, t.tokens, t.text, t.segments)


# ---------------------------------------------------------------- bad inputs: our errors, one sentence


def test_a_missing_file_is_an_audio_error_naming_it(tiny, tmp_path):
    missing = tmp_path / "nope.wav"
    with pytest.raises(AudioError) as e:
        tiny.transcribe(missing)
    assert str(missing) in one_sentence(e)


def test_a_missing_bundle_is_our_error_naming_it(tmp_path, capsys):
    missing = tmp_path / "no-bundle"
    with pytest.raises(RunnerError) as e:
        runner.load(missing)
    assert str(missing) in one_sentence(e)
    assert one_sentence(e) == cli_error(capsys, "run", "--bundle", str(missing), "--audio", str(AUDIO / "short.wav"))


def test_a_bad_input_in_many_raises_naming_it(tiny):
    inputs = [AUDIO / "short.wav", b"garbage bytes"]
    with pytest.raises(AudioError) as e:
        list(tiny.transcribe_many(inputs, max_new_tokens=4))
    assert "<bytes 1>" in one_sentence(e)


@pytest.mark.parametrize(
    "audio, rate, words",
    [
        (np.array([0.0, np.nan, 0.1], dtype=np.float32), 16000, "NaN or Inf"),
        (np.zeros(1600, dtype=np.float32), None, "sample_rate"),
        (np.zeros(1600, dtype=np.int16), 16000, "floats"),
        (np.zeros((2, 16000), dtype=np.float32), 16000, "channels last"),
        (np.zeros(0, dtype=np.float32), 16000, "no samples"),
        (np.zeros(1600, dtype=np.float32), 5, "sample rate"),
    ],
)
def test_bad_arrays_are_refused(tiny, audio, rate, words):
    with pytest.raises(AudioError) as e:
        tiny.transcribe(audio, sample_rate=rate)
    assert words in one_sentence(e) and "<array>" in str(e.value)


def test_sample_rate_with_a_file_is_refused(tiny):
    with pytest.raises(AudioError) as e:
        tiny.transcribe(AUDIO / "short.wav", sample_rate=16000)
    assert "sample_rate" in one_sentence(e)


def test_bad_options_raise_the_cli_sentence(tiny, tiny_bundle, capsys):
    audio = str(AUDIO / "short.wav")
    for kwargs, flags in (
        ({"temperature": float("nan")}, ["--temperature", "nan"]),
        ({"max_new_tokens": 0}, ["--max-new-tokens", "0"]),
        ({"word_timestamps": True}, ["--word-timestamps"]),
    ):
        with pytest.raises(RunnerError) as e:
            tiny.transcribe(audio, **kwargs)
        assert one_sentence(e) == cli_error(capsys, "run", "--bundle", str(tiny_bundle), "--audio", audio, *flags)


def test_file_results_are_the_files_transcripts_and_an_unreadable_file_is_its_error(tiny, tiny_bundle, tmp_path):
    """`run --ray`'s workers' call: each file's result keyed by its path, a file that cannot be read its error."""
    from runner.runtime.generate import GenerationOptions

    missing = tmp_path / "nope.wav"
    paths = [AUDIO / "speech.wav", missing, AUDIO / "short.wav"]
    done = {r.job.key: r for r in tiny.file_results(paths, GenerationOptions(max_new_tokens=NEW))}
    assert sorted(map(str, done)) == sorted(map(str, paths))
    for path in (AUDIO / "speech.wav", AUDIO / "short.wav"):
        assert done[path].error is None
        assert tuple(done[path].result.tokens) == tiny.transcribe(path, max_new_tokens=NEW).tokens, path.name
    assert done[missing].result is None and isinstance(done[missing].error, AudioError)
    assert str(missing) in str(done[missing].error)
    assert tiny.bundle_dir == tiny_bundle


def test_check_word_timestamps_raises_the_line_run_gives(tiny, tiny_bundle, capsys):
    with pytest.raises(RunnerError) as e:
        tiny.check_word_timestamps()
    audio = str(AUDIO / "short.wav")
    assert one_sentence(e) == cli_error(
        capsys, "run", "--bundle", str(tiny_bundle), "--audio", audio, "--word-timestamps"
    )


def test_stream_on_a_whole_file_bundle_is_refused(tiny):
    with pytest.raises(GenerationError) as e:
        tiny.stream()
    assert "transcribe()" in one_sentence(e)


def test_a_closed_model_refuses_every_call(tiny_bundle):
    with runner.load(tiny_bundle) as model:
        assert model.transcribe(AUDIO / "short.wav", max_new_tokens=2).tokens
    for call in (lambda: model.transcribe(AUDIO / "short.wav"), lambda: model.transcribe_many([]), model.stream):
        with pytest.raises(GenerationError) as e:
            call()
        assert "closed" in one_sentence(e)
    model.close()  # twice: nothing more to do


# ---------------------------------------------------------------- streams: `stream --json`'s records


def test_stream_equals_stream_json_and_its_deltas_make_the_text(realtime, realtime_bundle):
    path = AUDIO / "speech.wav"
    (record,) = cli_records("stream", realtime_bundle, "--audio", str(path))
    samples = load_audio(path)
    seen: list = []
    with realtime.stream(on_delta=seen.append) as s:
        pushed = []
        for i in range(0, len(samples), 777):  # blocks that never line up with a position
            pushed += s.push(samples[i : i + 777])
        t = s.finish()
    assert list(t.tokens) == record["tokens"] and t.text == record["text"]
    assert t.to_dict()["segments"] == record["segments"]
    assert seen == s.deltas and pushed == s.deltas[: len(pushed)]
    assert "".join(d.text for d in s.deltas) == t.text and t.text
    starts = [d.start for d in s.deltas]
    assert starts == sorted(starts) and all(d.end >= d.start for d in s.deltas)
    assert realtime.capabilities.streaming and realtime.family == "voxtral-realtime"


def test_stream_of_s16le_bytes_equals_stream_from_stdin(realtime, realtime_bundle):
    samples = load_audio(AUDIO / "short.wav")
    pcm = (np.clip(samples, -1, 1 - 2**-15) * 32768).astype("<i2").tobytes()
    (record,) = cli_records("stream", realtime_bundle, "--audio", "-", stdin=pcm)
    s = realtime.stream()
    for i in range(0, len(pcm), 1001):  # odd sizes: a sample split across pushes
        s.push(pcm[i : i + 1001])
    t = s.finish()
    assert list(t.tokens) == record["tokens"] and t.text == record["text"]


def test_stream_misuse_is_refused(realtime):
    s = realtime.stream()
    with pytest.raises(GenerationError) as e:
        realtime.stream()
    assert "already open" in one_sentence(e)
    with pytest.raises(AudioError) as e:
        s.push(np.array([np.inf], dtype=np.float32))
    one_sentence(e)
    s.finish()
    with pytest.raises(GenerationError) as e:
        s.push(np.zeros(160, dtype=np.float32))
    assert "finished" in one_sentence(e)
    with pytest.raises(GenerationError) as e:
        realtime.transcribe(AUDIO / "short.wav")
    assert "stream()" in one_sentence(e)


def test_stream_slots_step_streams_together_each_as_it_is_alone(realtime, realtime_bundle):
    """Three streams in the slots, fed in blocks of their own sizes; the first gets nothing while the others go to
    the end (its row steps with them, held): each one's tokens, text and deltas are those of `stream --json` on its
    file alone."""
    names = ("speech.wav", "short.wav", "speech_48k_stereo.wav")
    records = [cli_records("stream", realtime_bundle, "--audio", str(AUDIO / n))[0] for n in names]
    files = [load_audio(AUDIO / n) for n in names]
    sizes = (777, 3 * 1280, 2000)
    assert realtime.max_streams == 8 and realtime.max_batch == 1
    with realtime.stream_slots() as slots:
        assert (slots.size, slots.free) == (8, 8)
        seen: list[list] = [[] for _ in names]
        streams = [slots.open(on_delta=seen[i].append) for i in range(len(names))]
        assert slots.free == 5
        sent = [0, 0, 0]
        ends = [len(files[0]) // 2, len(files[1]), len(files[2])]
        while any(s < e for s, e in zip(sent, ends)):
            for i, s in enumerate(streams):
                if sent[i] < ends[i]:
                    s.push(files[i][sent[i] : sent[i] + sizes[i]])  # steps every stream whose audio is here
                    sent[i] += sizes[i]
        results = {i: streams[i].finish() for i in (1, 2)}
        assert streams[0].deltas and not streams[0].done
        streams[0].feed(files[0][sent[0] :])  # fed, then stepped by the slots' loop
        streams[0].end()
        assert streams[0].pending and slots.run() > 0 and streams[0].done
        results[0] = streams[0].result()
        assert slots.free == 8
    for i, record in enumerate(records):
        t = results[i]
        assert list(t.tokens) == record["tokens"] and t.text == record["text"] and t.text
        assert t.to_dict()["segments"] == record["segments"]
        assert seen[i] == streams[i].deltas and "".join(d.text for d in seen[i]) == t.text


def test_stream_slots_misuse_is_refused(realtime, tiny):
    with realtime.stream_slots() as slots:
        with pytest.raises(GenerationError) as e:
            realtime.stream()
        assert "already open" in one_sentence(e)
        streams = [slots.open() for _ in range(slots.size)]
        with pytest.raises(GenerationError) as e:
            slots.open()
        assert "all 8 stream slots are taken" in one_sentence(e)
        streams[3].close()
        s = slots.open()  # the closed one's slot
        with pytest.raises(GenerationError) as e:
            s.result()
        assert "not done" in one_sentence(e)
        s.end()
        with pytest.raises(GenerationError) as e:
            s.feed(np.zeros(160, dtype=np.float32))
        assert "ended" in one_sentence(e)
    with pytest.raises(GenerationError) as e:
        slots.open()
    assert "closed" in one_sentence(e)
    realtime.stream().close()  # the slots gave the model back
    with pytest.raises(GenerationError) as e:
        tiny.stream_slots()
    assert "whole inputs" in one_sentence(e) and tiny.max_streams == 0
