"""Jobs that arrive while others decode (runner/runtime/batch.py's JobFeed): a job offered mid-run joins a free slot
while the others decode, with the tokens of a serial run; "none now" from the feed does not end the run; an idle
batcher waits on the feed (one blocking take), never spins on it; a job that failed before it had prompts is
answered before the batcher waits again."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from conftest import AUDIO, runner_for

from runner.errors import AudioError
from runner.runtime.batch import Job, generate_many
from runner.runtime.generate import GenerationOptions
from runner.runtime.program import Program
from tests.runtime.test_batch import jobs_for

NEW = 40  # no EOS from the tiny model before it: each sequence decodes all of them
OPTS = GenerationOptions(max_new_tokens=NEW)
K = 8  # decode steps before the second job is offered


@pytest.fixture(scope="module")
def program(tiny_batch_bundle):
    with Program.load(tiny_batch_bundle) as p:
        yield p


class Steps:
    """Counts the batched decode steps; records the step at which each sequence took a slot."""

    def __init__(self, engine):
        self.n, self.admitted = 0, []
        decode, admit = engine.decode_batch, engine.admit
        engine.decode_batch = lambda *a: (setattr(self, "n", self.n + 1), decode(*a))[1]
        engine.admit = lambda slot, length: (self.admitted.append((slot, self.n)), admit(slot, length))[1]


class Feed:
    """`jobs` offered in turn, each once `ready(i)` says so; every take recorded as (wait, step)."""

    def __init__(self, jobs, ready, steps: Steps):
        self.jobs, self.ready, self.steps, self.calls, self.given = list(jobs), ready, steps, [], 0

    def take(self, wait: bool):
        self.calls.append((wait, self.steps.n))
        if self.given < len(self.jobs) and self.ready(self.given, wait):
            self.given += 1
            return self.jobs[self.given - 1]
        return None


def serial_tokens(runner, jobs) -> dict:
    return {r.job.key: r.result.tokens for r in generate_many(runner, jobs, OPTS, batch=1)}


def test_a_job_offered_mid_run_joins_while_the_first_decodes_with_serial_tokens(program):
    runner = runner_for(program)
    a, b = jobs_for(runner, [AUDIO / "speech.wav", AUDIO / "short.wav"])
    want = serial_tokens(runner, [a, b])
    steps = Steps(runner.engine)
    feed = Feed([a, b], lambda i, wait: i == 0 or steps.n >= K, steps)
    finished = {}
    for r in generate_many(runner, feed, OPTS, batch=4):
        assert r.error is None, r.error
        finished[r.job.key] = steps.n
        assert r.result.tokens == want[r.job.key]
    # A took slot 0 before any step; B took slot 1 after K steps, while A still had NEW - K to go
    assert steps.admitted == [(0, 0), (1, K)]
    assert finished == {a.key: NEW - 1, b.key: K + NEW - 1}  # the first token comes from the prefill
    # "none now" while A decoded did not end the run: the batcher waited only to start and to end (idle), and
    # looked once a step while busy (twice at step K: the look that found B went on to the next job)
    assert [(w, n) for w, n in feed.calls if w] == [(True, 0), (True, steps.n)]
    looks = Counter(n for w, n in feed.calls if not w)
    assert set(looks) == set(range(steps.n)) and looks[K] == 2 and sum(looks.values()) == steps.n + 1


@pytest.mark.parametrize("batch", [2, 1])
def test_an_idle_batcher_waits_on_the_feed_once_and_takes_what_comes(program, batch):
    """After A finishes, B becomes ready only 0.2 s later (from another thread): the batcher, with nothing to
    decode, waits in one blocking take, then decodes B. A batcher that spun on take(wait=False) would take
    hundreds of times in that while."""
    runner = runner_for(program)
    a, b = jobs_for(runner, [AUDIO / "speech.wav", AUDIO / "short.wav"])
    want = serial_tokens(runner, [a, b])
    steps = Steps(runner.engine)
    b_ready = threading.Event()

    def ready(i, wait):
        if i == 1 and wait:
            assert b_ready.wait(30)
        return i == 0 or b_ready.is_set()

    feed = Feed([a, b], ready, steps)
    got = {}
    for r in generate_many(runner, feed, OPTS, batch=batch):
        got[r.job.key] = r.result.tokens
        if r.job.key == a.key:
            threading.Timer(0.2, b_ready.set).start()
    assert got == want
    waits = [w for w, _ in feed.calls]
    assert waits.count(True) == 3  # A; B, waited for while idle; the end
    assert waits.count(False) <= steps.n  # at most one look a step while busy


def test_a_job_that_failed_before_its_prompts_is_answered_before_the_batcher_waits_again(program):
    runner = runner_for(program)
    (good,) = jobs_for(runner, [AUDIO / "short.wav"])
    bad = Job("bad", [], error=AudioError("bad.wav: not audio"))
    out = []

    class Waits:
        """bad, then good, then closed; a blocking take only once every job taken has been answered."""

        def __init__(self):
            self.left, self.given = [bad, good], 0

        def take(self, wait):
            if wait:
                assert len(out) == self.given, "the batcher waited with a result in hand"
            if not self.left:
                return None
            self.given += 1
            return self.left.pop(0)

    for batch in (2, 1):
        out.clear()
        for r in generate_many(runner, Waits(), OPTS, batch=batch):
            out.append(r)
        assert [r.job.key for r in out] == ["bad", good.key]
        assert out[0].error is bad.error and out[0].result is None
        assert out[1].result.tokens == serial_tokens(runner, [good])[good.key]
