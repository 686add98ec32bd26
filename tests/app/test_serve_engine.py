"""`serve`'s engine (runner/app/serve_engine.py) over a stand-in model that records each batch it runs: requests
join a batch in arrival order while they ask its options; one that asks otherwise starts the next batch once the
running one drains, and none behind it overtakes it; a client gone is never taken; stop answers what waits."""

from __future__ import annotations

import asyncio
import queue
from types import SimpleNamespace

import pytest

from runner.app.serve_engine import Engine, Submission
from runner.app.serve_metrics import Metrics
from runner.app.serve_openai import Options
from runner.errors import GenerationError

EN, FR = Options(language="en"), Options(language="fr")


class Recorder:
    """transcribe_feed as the Model's: takes what the feed gives (waiting only when idle: here always, one at a
    time) and answers each with its audio as text; every batch recorded as (language, [audio])."""

    def __init__(self):
        self.batches = []

    def transcribe_feed(self, feed, batch, **options):
        taken = []
        self.batches.append((options["language"], taken))

        def results():
            while (item := feed.take(wait=True)) is not None:
                taken.append(item[1])
                yield item[0], SimpleNamespace(text=item[1].decode(), tokens=())

        return results()


def served(requests: list[tuple[bytes, Options]], cancel=frozenset(), model=None) -> tuple[list, list]:
    """The requests queued, then the engine started and stopped (it answers what waits): (its batches, answers)."""
    model, loop = model or Recorder(), asyncio.new_event_loop()
    try:
        engine = Engine(model, 4, 16, None, Metrics())
        futures = []
        for audio, options in requests:
            futures.append(loop.create_future())
            engine.submit(Submission(audio, options, loop, futures[-1]))
            if audio in cancel:
                futures[-1].cancel()
        engine.start()
        engine.stop()
        answers = loop.run_until_complete(asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 60))
    finally:
        loop.close()
    return model.batches, [a if isinstance(a, BaseException) else a.text for a in answers]


def test_requests_that_ask_the_same_share_a_batch_in_arrival_order():
    batches, answers = served([(b"a", EN), (b"b", EN), (b"c", FR), (b"d", FR)])
    assert batches == [("en", [b"a", b"b"]), ("fr", [b"c", b"d"])]
    assert answers == ["a", "b", "c", "d"]


def test_a_request_asking_other_options_is_not_overtaken_by_later_ones():
    """c (fr) waits for a's batch to drain; d (en) came after c, so it waits for c's batch, not joining a's."""
    batches, answers = served([(b"a", EN), (b"c", FR), (b"d", EN)])
    assert batches == [("en", [b"a"]), ("fr", [b"c"]), ("en", [b"d"])]
    assert answers == ["a", "c", "d"]


def test_a_client_gone_is_never_taken():
    batches, answers = served([(b"a", EN), (b"gone", EN), (b"b", EN)], cancel={b"gone"})
    assert batches == [("en", [b"a", b"b"])]
    assert answers[0] == "a" and answers[2] == "b" and isinstance(answers[1], asyncio.CancelledError)


def test_a_batch_that_fails_answers_its_requests_with_the_error_and_the_next_batch_runs():
    class Failing(Recorder):
        def transcribe_feed(self, feed, batch, **options):
            if options["language"] == "fr":  # as the Model refuses before it takes any (a realtime bundle)
                raise GenerationError("this bundle transcribes streams")
            results = super().transcribe_feed(feed, batch, **options)
            yield next(results)
            feed.take(wait=False)
            raise RuntimeError("the device failed")  # mid-batch, with one request taken and not answered

    batches, answers = served([(b"a", EN), (b"b", EN), (b"c", FR), (b"d", EN)], model=Failing())
    assert [b[0] for b in batches] == ["en", "en"]
    assert answers[0] == "a" and isinstance(answers[1], RuntimeError)
    assert isinstance(answers[2], GenerationError) and answers[3] == "d"


def test_a_full_queue_refuses_at_once():
    engine = Engine(Recorder(), 4, 1, None, Metrics())
    loop = asyncio.new_event_loop()
    try:
        engine.submit(Submission(b"a", EN, loop, loop.create_future()))
        with pytest.raises(queue.Full):
            engine.submit(Submission(b"b", EN, loop, loop.create_future()))
        assert engine.depth() == 1
    finally:
        loop.close()
