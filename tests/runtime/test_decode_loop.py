"""The decode loop's contract, on a scripted engine whose next token is a known function of (token, position):
the same tokens and stop reasons as a plain one-step-at-a-time loop, while keeping one step queued ahead; no
step at or past the end of the context; recorded logits that are the ones each token was chosen from even when
the engine overwrites one logits buffer every step (as a CUDA-graph replay does)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner.errors import GenerationError
from runner.families.voxtral.tokenizer import Tekken
from runner.runtime.engine import Engine
from runner.runtime.generate import GenerationOptions, MultimodalRunner
from runner.runtime.prompt import TextSegment

TEKKEN = Path(__file__).resolve().parents[2] / "fixtures" / "tekken.json"
V, EOS = 64, 2


def next_token(token: int, pos: int) -> int:
    """The scripted model: token 2 (EOS) comes out whenever (3 * token + pos) % 17 == 0."""
    return 2 if (3 * token + pos) % 17 == 0 else 10 + (5 * token + pos) % (V - 10)


class ScriptedEngine(Engine):
    device, max_audio_chunks, encoder_dtype = "cpu", 1, torch.float32
    scores = True

    def __init__(self, max_seq_len: int = 512):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.logits = torch.zeros(1, V)  # one buffer, overwritten by every call
        self.steps: list[tuple[int, int]] = []  # (token, position) of every decode step

    def _emit(self, token: int) -> torch.Tensor:
        self.logits.zero_()
        self.logits[0, token] = 1.0
        return self.logits

    def embed(self, ids):
        return ids.float().unsqueeze(-1)  # [1, S, 1]: the ids themselves, for decode to read

    def decode(self, embeds, pos):
        return self._emit(next_token(int(embeds[0, -1, 0]), int(pos[-1])))

    def score(self, embeds, pos):
        logits = torch.zeros(embeds.shape[1], V)
        for i, (x, p) in enumerate(zip(embeds[0, :, 0].tolist(), pos.tolist())):
            logits[i, next_token(int(x), p)] = 1.0
        return logits

    def decode_token(self, token, pos):
        self.steps.append((int(token), pos))
        return self._emit(next_token(int(token), pos))

    def reset(self):
        pass


class LastLogitsOnly(ScriptedEngine):
    """A decoder that gives the last position's logits only, as a compiled text_decoder does."""

    scores = False


def reference(prompt: list[int], opts: GenerationOptions, max_seq_len: int) -> tuple[list[int], str]:
    """The loop as written before the lookahead: choose, read, stop checks, then the next step."""
    token, pos, tokens = next_token(prompt[-1], len(prompt) - 1), len(prompt), []
    while True:
        tokens.append(token)
        if token == EOS and len(tokens) > opts.min_new_tokens:
            return tokens, "eos"
        if len(tokens) == opts.max_new_tokens:
            return tokens, "max_new_tokens"
        if pos >= max_seq_len:
            return tokens, "context"
        token, pos = next_token(token, pos), pos + 1


def generate(prompt, opts, max_seq_len=512, **kw):
    engine = ScriptedEngine(max_seq_len)
    runner = MultimodalRunner(engine, Tekken.from_file(TEKKEN), None)
    return engine, runner.generate([TextSegment(tuple(prompt))], opts, **kw)


@pytest.mark.parametrize("first", [1, 4, 7, 11, 30, 45])
@pytest.mark.parametrize("max_new, min_new", [(1, 0), (5, 0), (40, 0), (40, 40), (200, 0)])
def test_tokens_and_stop_reason_match_the_one_step_loop(first, max_new, min_new):
    prompt = [1, first]
    opts = GenerationOptions(max_new_tokens=max_new, min_new_tokens=min_new)
    engine, result = generate(prompt, opts)
    want, reason = reference(prompt, opts, engine.max_seq_len)
    assert (result.tokens, result.stop_reason) == (want, reason)
    # every step fed the token before it, at consecutive positions
    fed = [t for t, _ in engine.steps]
    assert fed[: len(want) - 1] == want[:-1]
    assert [p for _, p in engine.steps] == list(range(len(prompt), len(prompt) + len(engine.steps)))
    # one step queued past the last token read at most, and none past the token limit
    assert len(want) - 1 <= len(engine.steps) <= min(len(want), max_new - 1)


@pytest.mark.parametrize("max_seq_len", [3, 5, 9])
def test_context_end_stops_without_a_step_past_it(max_seq_len):
    prompt = [1, 4]
    opts = GenerationOptions(max_new_tokens=100, min_new_tokens=100)
    engine, result = generate(prompt, opts, max_seq_len=max_seq_len)
    want, reason = reference(prompt, opts, max_seq_len)
    assert (result.tokens, result.stop_reason) == (want, "context") and reason == "context"
    assert max(p for _, p in engine.steps) == max_seq_len - 1


def test_recorded_logits_are_each_tokens_own_despite_one_shared_buffer():
    opts = GenerationOptions(max_new_tokens=30, min_new_tokens=30, record_logits=True)
    _, result = generate([1, 4], opts)
    assert len(result.logits) == len(result.tokens) == 30
    assert [int(x.argmax()) for x in result.logits] == result.tokens


def test_an_answer_is_scored_at_each_of_its_tokens_in_one_call_per_window():
    """Teacher forcing: row j holds the logits token j was chosen from, the prompt and the answer before it fed
    (EOS inside an answer included); the answer's last token is not fed; a window without an answer adds none."""
    runner = MultimodalRunner(ScriptedEngine(), Tekken.from_file(TEKKEN), None)
    windows = [[TextSegment((1, 4))], [TextSegment((7,))], [TextSegment((3, 5, 6))]]
    answers = [[20, 2, 23, 24], [], [30]]
    rows = runner.score_windows(windows, answers)
    fed = [([1, 4, 20, 2, 23], [4, 20, 2, 23]), ([3, 5, 6], [6])]  # (a window's input, the inputs scored)
    want = [next_token(x, p) for ids, last in fed for p, x in enumerate(ids) if p >= len(ids) - len(last)]
    assert [int(r.argmax()) for r in rows] == want and all(r.shape == (1, V) for r in rows)
    with pytest.raises(GenerationError, match="2 answers for 3 prompt windows"):
        runner.score_windows(windows, answers[:2])
    compiled = MultimodalRunner(LastLogitsOnly(), Tekken.from_file(TEKKEN), None)
    with pytest.raises(GenerationError, match="LastLogitsOnly cannot score an answer"):
        compiled.score_windows(windows, answers)


def test_text_streams_only_read_tokens():
    seen = []
    _, result = generate([1, 4], GenerationOptions(max_new_tokens=12), on_text=seen.append)
    tok = Tekken.from_file(TEKKEN)
    assert "".join(seen) == tok.decode([t for t in result.tokens if t != EOS])


def test_empty_prompt_is_an_error():
    runner = MultimodalRunner(ScriptedEngine(), Tekken.from_file(TEKKEN), None)
    with pytest.raises(GenerationError, match="empty prompt"):
        runner.generate([], GenerationOptions())


def test_one_call_prefill_gives_the_logits_and_cache_of_position_by_position(tiny_bundle):
    """The runner prefills the whole prompt in one decoder call into an empty cache (text_decoder attends to the
    prompt only); the seed prefilled each segment in turn. Here every position goes through the step method, which
    attends to the cache: same last logits, and the same next step (so the same KV cache), on the tiny bundle."""
    import numpy as np

    from runner.audio import SAMPLE_RATE
    from runner.families.voxtral import transcription_prompt
    from runner.runtime.engine import ProgramEngine, to_encoder_dtype
    from runner.runtime.program import Program
    from runner.runtime.prompt import inputs_on_device

    with Program.load(tiny_bundle) as program:
        engine = ProgramEngine(program)
        tok = Tekken.from_file(tiny_bundle / "tekken.json")
        runner = MultimodalRunner(engine, tok, tok.special_id("[AUDIO]"))
        wave = np.random.default_rng(0).standard_normal(3 * SAMPLE_RATE).astype(np.float32) * 0.1
        segments = transcription_prompt(tok, wave, "en")

        engine.reset()
        whole, ids = runner.prefill(segments)
        whole_next = engine.decode_token(torch.tensor([[5]]), len(ids)).clone()
        whole = whole.clone()

        engine.reset()
        pos, step = 0, program.methods["text_decoder_step"]
        for seg, x in zip(segments, inputs_on_device(segments, "cpu", engine.max_audio_chunks)):
            embeds = (
                engine.embed(x)
                if isinstance(seg, TextSegment)
                else engine.encode(to_encoder_dtype(engine.preprocess(x), engine.encoder_dtype))
            )
            for i in range(embeds.shape[1]):
                piecewise = step(embeds[:, i : i + 1], torch.tensor([pos]))[0]
                pos += 1
        assert pos == len(ids)
        torch.testing.assert_close(whole, piecewise, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(whole_next, engine.decode_token(torch.tensor([[5]]), pos), rtol=1e-4, atol=1e-5)


def test_the_default_cap_is_128_tokens_or_four_a_second_of_the_prompts_audio():
    from runner.runtime.generate import answer_room

    # text only (no audio): 128; EOS ignored so the cap is what stops it
    _, result = generate([1, 4], GenerationOptions(max_new_tokens=None, min_new_tokens=1000), max_seq_len=4096)
    assert (len(result.tokens), result.stop_reason) == (128, "max_new_tokens")
    assert [answer_room(s) for s in (0, 4.4, 32, 600, 1800)] == [128, 128, 128, 2400, 7200]
    with pytest.raises(GenerationError):
        GenerationOptions(max_new_tokens=0)


def test_the_waveform_goes_up_padded_to_whole_chunks_as_the_host_padding_was():
    """wave_on_device pads on the device (only the samples cross): the same tensor pad_to_chunks gives, float64
    samples as float32, and the same refusal of audio past the bundle's chunks."""
    import numpy as np

    from runner.audio import N_SAMPLES
    from runner.audio_chunks import pad_to_chunks
    from runner.errors import AudioError
    from runner.runtime.waveform import wave_on_device

    rng = np.random.default_rng(0)
    for n in (0, 1, N_SAMPLES - 1, N_SAMPLES, N_SAMPLES + 7):
        wave = rng.standard_normal(n).astype(np.float32)
        got = wave_on_device(wave, 3, "cpu")
        assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(pad_to_chunks(wave, 3)))
    wide = rng.standard_normal(1000)  # float64, as a caller's array may be
    assert torch.equal(wave_on_device(wide, 1, "cpu")[:1000], torch.from_numpy(wide.astype(np.float32)))
    with pytest.raises(AudioError, match="at most 1 chunks"):
        wave_on_device(np.zeros(N_SAMPLES + 1, np.float32), 1, "cpu")
