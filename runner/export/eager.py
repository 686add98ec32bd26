"""The eager PyTorch model behind the same Engine interface as the exported program (`--reference eager`,
benchmarks). Built from the bundle's own weight files, so it works for fetched bundles too."""

from __future__ import annotations

from pathlib import Path

import torch

from runner.bundle import Manifest
from runner.export.checkpoint import model_from_bundle
from runner.export.mel import LogMelSpectrogram
from runner.multimodal import decode_token


class EagerEngine:
    def __init__(self, bundle_dir: Path, manifest: Manifest, device: str | None = None):
        self.device = device or manifest.device
        self.model = model_from_bundle(bundle_dir, manifest, device=self.device)
        self.decoder = self.model.decoder()
        self.mel = LogMelSpectrogram(self.model.config.audio.n_mels).to(self.device)
        self.max_seq_len = manifest.model["max_seq_len"]
        self.max_audio_chunks = manifest.model["max_audio_chunks"]
        self.encoder_dtype = getattr(torch, manifest.dtype)

    @torch.inference_mode()
    def preprocess(self, wave):
        return self.mel(wave)

    @torch.inference_mode()
    def encode(self, mel):
        return self.model.encode_audio(mel)

    @torch.inference_mode()
    def embed(self, ids):
        return self.model.embed(ids)

    @torch.inference_mode()
    def decode(self, embeds, pos):
        return self.decoder(embeds, pos)

    def reset(self):
        self.model.reset_caches()

    def decode_token(self, token, pos):
        return decode_token(self, token, pos)

    def run_prefill(self, compute, inputs):
        return compute(*inputs)
