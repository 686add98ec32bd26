"""The eager Voxtral Realtime as Steps (the stream session's three methods run eagerly), over a model or over
exactly a bundle's weights."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from runner.bundle import Manifest
from runner.dtypes import torch_dtype
from runner.families.voxtral_realtime.session import Steps
from runner.models.state import load_state
from runner.models.voxtral_realtime import DecoderStep, EncoderStep, StreamingLogMel, VoxtralRealtime
from runner.models.voxtral_realtime_config import RealtimeConfig


class EagerSteps(Steps):
    def __init__(self, model: VoxtralRealtime, device: str = "cpu"):
        self.model, self.device = model, device
        self.preprocessor = StreamingLogMel(model.config.audio.n_mels).to(device)
        self.encoder_step, self.decoder_step = EncoderStep(model), DecoderStep(model)

    @property
    def streams(self) -> int:
        return self.model.streams

    @torch.inference_mode()
    def preprocess(self, wave):
        return self.preprocessor(wave)

    @torch.inference_mode()
    def encode(self, mel, pos):
        return self.encoder_step(mel, pos)

    @torch.inference_mode()
    def decode(self, token, audio, pos, delay):
        return self.decoder_step(token, audio, pos, delay)

    def reset(self, rows: list[int] | None = None):
        self.model.reset_caches(rows)


def model_from_bundle(bundle_dir: Path, manifest: Manifest, device: str = "cpu", streams: int = 1) -> VoxtralRealtime:
    """The step methods' weight files are keyed by the model's own names: load them back into one model (with
    `streams` stream slots)."""
    config = RealtimeConfig.from_dict(manifest.model["config"])
    state = {}
    for method in ("encoder_step", "decoder_step"):
        state.update(load_file(str(Path(bundle_dir) / manifest.methods[method].weights), device=device))
    model = VoxtralRealtime(config)
    load_state(model, state, source=str(bundle_dir))
    model = model.to(device=device, dtype=torch_dtype(manifest.dtype)).eval()
    model.setup_caches(streams=streams)
    return model


def eager_steps(bundle_dir: Path, manifest: Manifest, device: str | None = None, streams: int = 1) -> EagerSteps:
    device = device or manifest.device
    return EagerSteps(model_from_bundle(Path(bundle_dir), manifest, device, streams), device)
