"""Batched streams (runner/families/voxtral_realtime/session.py) on the eager model, fp32 CPU: several streams in
one step loop, each in its own state row at its own position, give exactly the tokens each gives alone; streams
beyond the slots wait for a free row, which is cleared for them; rows past the live ones (a graphed step's padding)
change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runner.errors import GenerationError
from runner.families.voxtral_realtime import Stream, StreamBatch, StreamSpec, run_together, run_whole
from runner.models.voxtral_realtime import VoxtralRealtime
from runner.models.voxtral_realtime_config import RealtimeAudioConfig, RealtimeConfig, RealtimeTextConfig
from runner.reference.voxtral_realtime import EagerSteps

# Windows short enough that the rings wrap within a few seconds; wide init: tokens follow the audio.
CONFIG = RealtimeConfig(
    audio=RealtimeAudioConfig(dim=32, n_layers=2, n_heads=2, head_dim=16, ffn_dim=64, sliding_window=20),
    text=RealtimeTextConfig(
        vocab_size=200, dim=32, ffn_dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, sliding_window=12
    ),
    num_delay_tokens=3,
    initializer_range=0.3,
)
SPEC = StreamSpec(8, n_left_pad_tokens=2, n_right_pad_tokens=3 + 1 + 2, num_delay_tokens=3, bos_id=1, eos_id=2,
                  pad_id=32)  # fmt: skip


def _audio(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16000)) / 16000
    tone = sum(np.sin(2 * np.pi * f * t + rng.uniform(0, 6)) for f in rng.uniform(100, 3000, 4))
    return (0.1 * tone * (1 + np.sin(2 * np.pi * 0.9 * t)) + 0.02 * rng.standard_normal(t.shape)).astype(np.float32)


def _model(streams: int) -> VoxtralRealtime:
    model = VoxtralRealtime(CONFIG).init_weights(3).eval()
    model.setup_caches(streams=streams)
    return model


class Recorded(EagerSteps):
    """Records each step's batch: (rows, positions)."""

    def __init__(self, model, batch_for=None):
        super().__init__(model)
        self.calls: list[list[int]] = []
        if batch_for is not None:
            self.batch_for = batch_for

    def encode(self, mel, pos):
        self.calls.append(pos.tolist())
        return super().encode(mel, pos)


FILES = [_audio(s, seed) for s, seed in ((1.0, 1), (2.2, 2), (0.4, 3), (1.7, 4), (2.6, 5))]


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    steps = EagerSteps(_model(1))
    return [run_whole(steps, SPEC, f) for f in FILES]


def test_streams_in_one_batch_give_each_stream_alone_s_tokens(alone):
    steps = Recorded(_model(3))
    got = run_together(steps, SPEC, FILES, block=500)
    assert got == alone
    assert len({tuple(t) for t in alone}) == len(FILES) and min(len(set(t)) for t in alone) > 3  # tell streams apart
    # three rows at once; five streams, so two waited for a row and ran beside streams at other positions
    assert max(len(c) for c in steps.calls) == 3
    assert any(len(set(c)) == len(c) == 3 for c in steps.calls)
    assert max(p for c in steps.calls for p in c) > CONFIG.text.sliding_window  # the rings wrapped


def test_padding_rows_beyond_the_live_ones_change_nothing(alone):
    """A graphed step runs a captured batch size: the rows past the live ones are free rows fed zeros."""
    steps = Recorded(_model(4), batch_for=lambda rows: 4)
    assert run_together(steps, SPEC, FILES[:3], block=1280) == alone[:3]
    assert {len(c) for c in steps.calls} == {4}


def test_a_row_is_cleared_for_the_stream_that_takes_it(alone):
    """The second stream takes the row the first left mid-way through the others: its conv tails and rings are
    its own from position 0."""
    steps = EagerSteps(_model(1))
    batch = StreamBatch(steps, SPEC)
    first, second = Stream(SPEC), Stream(SPEC)
    batch.add(first)
    first.feed(FILES[1])
    batch.run()
    assert first.position > 10 and not first.done
    with pytest.raises(GenerationError, match="stream slots"):
        batch.add(second)
    batch.rows[0] = None  # the first stream leaves (a client hangs up)
    batch.add(second)
    second.feed(FILES[0])
    second.finish()
    batch.run()
    assert second.tokens == alone[0]


def test_streams_stop_at_eos_unless_told_not_to():
    steps = EagerSteps(_model(1))
    spec = StreamSpec(8, 2, 6, 3, bos_id=1, eos_id=alone_token(steps), pad_id=32)
    batch = StreamBatch(steps, spec)
    stopping, running = Stream(spec), Stream(spec, stop_at_eos=False)
    for s in (stopping, running):
        steps.reset()
        batch.add(s)
        s.feed(FILES[1])
        s.finish()
        batch.run()
    assert stopping.tokens[-1] == spec.eos_id and len(stopping.tokens) < len(running.tokens)
    assert running.tokens[: len(stopping.tokens)] == stopping.tokens


def alone_token(steps) -> int:
    """A token the model picks a few positions in on FILES[1] (used as </s>)."""
    return run_whole(steps, SPEC, FILES[1])[4]


def test_batched_logits_match_alone_closely():
    """fp32: a row's logits in a batch equal its logits alone (to float rounding: other matmul shapes)."""
    m1, m3 = _model(1), _model(3)
    s1, s3 = EagerSteps(m1), EagerSteps(m3)
    g = torch.Generator().manual_seed(0)
    wave = torch.randn(3, SPEC.window, generator=g) * 0.1
    mel = s3.preprocess(wave)
    pos = torch.tensor([0, 0, 0])
    audio = s3.encode(mel, pos)
    logits = s3.decode(torch.tensor([[1], [1], [1]]), audio, pos, torch.full((3,), 3.0))
    for r in range(3):
        s1.reset()
        one = s1.decode(torch.tensor([[1]]), s1.encode(s1.preprocess(wave[r : r + 1]), pos[:1]), pos[:1],
                        torch.full((1,), 3.0))  # fmt: skip
        torch.testing.assert_close(one, logits[r : r + 1], atol=1e-5, rtol=1e-5)
