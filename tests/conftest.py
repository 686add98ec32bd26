"""Shared fixtures: bundles are exported once per session; compiled `.so` files come from the compile cache
(~/.cache/voxtral-runner or $VOXTRAL_RUNNER_CACHE), so a warm run re-exports in seconds."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from runner.app.options import Environment
from runner.bundle import MANIFEST_NAME, read_manifest, weight_files
from runner.export.checkpoint import TINY_SEED, load_checkpoint, random_model, write_tiny_checkpoint
from runner.export.options import ExportOptions
from runner.export.voxtral import export_voxtral
from runner.families import family_for
from runner.runtime.engine import ProgramEngine
from runner.runtime.generate import MultimodalRunner

# The tests must not depend on where they run. A terminal's or a CI runner's variables change what rich draws
# (FORCE_COLOR), where job summaries go (GITHUB_STEP_SUMMARY) and what bench records (GITHUB_SHA): every test,
# and every CLI it starts, begins without them; a test about one of them sets it itself.
CI_AND_TERMINAL_VARIABLES = (
    "FORCE_COLOR", "NO_COLOR", "CLICOLOR_FORCE", "COLUMNS", "CI", "GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY",
    "GITHUB_OUTPUT", "GITHUB_ENV", "GITHUB_SHA", "GITHUB_TOKEN", "GH_TOKEN", "GITHUB_API_URL", "VOXTRAL_RUNNER_API_KEY",
)  # fmt: skip
for _name in CI_AND_TERMINAL_VARIABLES:
    os.environ.pop(_name, None)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
AUDIO = FIXTURES / "audio"
# The compile cache the CLI would use ($VOXTRAL_RUNNER_CACHE, else ~/.cache/voxtral-runner): a warm run
# re-exports in seconds, and the tests' bundles and the e2e job's share compiled .so files.
CACHE = Environment.read().cache_dir

# A config no preset uses (other widths, head counts, KV heads, layers, rope theta, one audio chunk): a
# bundle from it proves nothing is hard-coded to the presets.
OTHER_HF_CONFIG = {
    "audio_config": {"hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4},
    "text_config": {
        "vocab_size": 1024,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 8,
        "rope_theta": 5e5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
    },
    "audio_token_id": 24,
}


class Doubled(torch.nn.Module):
    """An eager reference the compiled method cannot match: its module's logits, doubled."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args) * 2


def export_cached(checkpoint: Path, out: Path, **opts) -> Path:
    model, source, tekken = load_checkpoint(checkpoint)
    export_voxtral(model, source, tekken, out, ExportOptions(**{"cache_dir": CACHE, **opts}))
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    return write_tiny_checkpoint(CACHE / "checkpoints" / "voxtral-tiny")


@pytest.fixture(scope="session")
def tiny_bundle(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny model with a small capacity (1 min of audio, a 1024-token context), so tests that run to the end
    of the context stay quick; `default_tiny_bundle` has the export's defaults."""
    return export_cached(
        tiny_checkpoint, tmp_path_factory.mktemp("bundles") / "tiny", max_audio_chunks=2, max_seq_len=1024
    )


@pytest.fixture(scope="session")
def tiny_batch_bundle(tiny_checkpoint, tmp_path_factory) -> Path:
    """`tiny_bundle` exported with --max-batch 4: its five methods (the same compiles) and text_decoder_batch."""
    return export_cached(
        tiny_checkpoint, tmp_path_factory.mktemp("bundles") / "tiny-batch4", max_audio_chunks=2, max_seq_len=1024,
        max_batch=4,
    )  # fmt: skip


@pytest.fixture(scope="session")
def default_tiny_bundle(tiny_checkpoint, tmp_path_factory) -> Path:
    """The tiny model exported with the defaults (as `python -m runner export` and the e2e job build it)."""
    return export_cached(tiny_checkpoint, tmp_path_factory.mktemp("bundles") / "tiny-default")


def save_hf_checkpoint(dest: Path, hf_config: dict, seed: int = 0) -> Path:
    """A tiny checkpoint exactly as transformers writes it (save_pretrained), plus the fixture tokenizer."""
    from transformers import VoxtralConfig, VoxtralForConditionalGeneration

    torch.manual_seed(seed)
    model = VoxtralForConditionalGeneration(VoxtralConfig(**json.loads(json.dumps(hf_config))))
    model.save_pretrained(dest)
    (dest / "tekken.json").write_bytes((FIXTURES / "tekken.json").read_bytes())
    return dest


@pytest.fixture(scope="session")
def other_checkpoint(tmp_path_factory) -> Path:
    return save_hf_checkpoint(tmp_path_factory.mktemp("ckpt") / "other", OTHER_HF_CONFIG, seed=7)


@pytest.fixture(scope="session")
def other_bundle(other_checkpoint, tmp_path_factory) -> Path:
    return export_cached(
        other_checkpoint, tmp_path_factory.mktemp("bundles") / "other", max_audio_chunks=1, max_seq_len=512
    )


def runner_for(program, options=None) -> MultimodalRunner:
    """The runner `run` builds for a loaded program: its family's tokenizer and audio id over a ProgramEngine."""
    family = family_for(program.bundle_dir, program.manifest.model)
    engine = ProgramEngine(program, options, cross_attention=family.cross_attention)
    return MultimodalRunner(engine, family.tokenizer, family.audio_id)


def prompt_for(runner: MultimodalRunner, path, prompt=None, language=None) -> list:
    """The one prompt `run` builds for a Voxtral audio file (a family's first window)."""
    program = runner.engine.program
    family = family_for(program.bundle_dir, program.manifest.model)
    return family.prompts(path, prompt, language, runner.engine.max_audio_chunks)[0]


def as_random_init(bundle: Path, dest: Path, **source) -> Path:
    """A copy of `bundle` whose manifest says its weights are the tiny preset drawn with TINY_SEED, without them."""
    shutil.copytree(bundle, dest)
    data = json.loads((dest / MANIFEST_NAME).read_text())
    data["model"]["source"] = random_model("tiny", TINY_SEED)[1].to_dict() | source
    (dest / MANIFEST_NAME).write_text(json.dumps(data, indent=2))
    for name in weight_files(read_manifest(dest)):
        (dest / name).unlink()
    return dest


def export_realtime(out: Path, **opts) -> Path:
    """tiny-realtime exported (its compiles from the cache)."""
    from runner.export.registry import LoadRequest
    from runner.export.voxtral_realtime import export_voxtral_realtime
    from runner.export.voxtral_realtime import load as load_checkpoint

    loaded = load_checkpoint(LoadRequest("tiny-realtime", None))
    export_voxtral_realtime(loaded.model, loaded.source, loaded.tokenizer, out, ExportOptions(cache_dir=CACHE, **opts))
    return out


@pytest.fixture(scope="session")
def realtime_bundle(tmp_path_factory) -> Path:
    """tiny-realtime exported once for the session, with the export's default stream slots (8 on the CPU)."""
    return export_realtime(tmp_path_factory.mktemp("rt") / "tiny-realtime")


@pytest.fixture(scope="session")
def realtime_slots_bundle(tmp_path_factory) -> Path:
    """tiny-realtime with 4 stream slots (--max-streams 4): few enough that a test fills every one."""
    return export_realtime(tmp_path_factory.mktemp("rt") / "tiny-realtime-4", max_streams=4)


def eager_checked_records(bundle: Path, names=("speech.wav", "short.wav"), new: int = 24) -> list[dict]:
    """`run --json --reference eager` on fixture files, `new` tokens each: each file's record (the run passed)."""
    import subprocess
    import sys

    audio = [x for n in names for x in ("--audio", str(AUDIO / n))]
    out = subprocess.run(
        [sys.executable, "-m", "runner", "run", "--bundle", str(bundle), "--json", "--reference", "eager",
         "--max-new-tokens", str(new), "--min-new-tokens", str(new), *audio],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(records) == len(names) and all(len(r["tokens"]) == new for r in records)
    return records


def error_line(capsys) -> str:
    """The one `error:` line a command printed on stderr (and no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def parse_error(argv: list[str], capsys) -> str:
    """The one line argparse refuses `argv` with (exit 2, no traceback)."""
    from runner.app.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]
