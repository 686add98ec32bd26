"""The OpenAI shapes of `serve`'s transcription route: its errors, the form's fields as one options value, the upload
read within its bound, and the answer in each response_format (runner/app/serve.py routes them)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from starlette.datastructures import FormData, UploadFile
from starlette.responses import JSONResponse, PlainTextResponse, Response

from runner.app import writers
from runner.runtime.results import compression_ratio

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
GRANULARITIES = ("segment", "word")


class ApiError(Exception):
    """An answer other than 200: OpenAI's error object `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.kind, self.headers = status, param, code, kind, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class TooLarge(Exception):
    pass


@dataclass(frozen=True)
class Options:
    """What a request asks of the model; requests that ask the same decode in one batch."""

    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    word_timestamps: bool = False


def limited_receive(receive: Callable, limit: int) -> Callable:
    """The ASGI receive, raising _TooLarge once the body passes `limit` bytes."""
    seen = 0

    async def limited() -> dict:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise TooLarge()
        return message

    return limited


def text_field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"{name}: a text field, not a file", param=name)
    return value or None


def temperature_field(form: FormData) -> float:
    text = text_field(form, "temperature")
    if text is None:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ApiError(400, f"temperature {text!r}: a finite number, 0 or more (0: greedy)", param="temperature")
    return value


async def read_upload(form: FormData) -> bytes:
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise ApiError(400, "file: required (the audio file, as multipart form-data)", param="file")
    data = await upload.read()
    if not data:
        raise ApiError(400, f"file {upload.filename or ''!r}: empty", param="file", code="invalid_audio")
    return data


def render(t, fmt: str, options: Options) -> Response:
    if fmt == "json":
        return JSONResponse({"text": t.text, "usage": usage(t)})
    if fmt == "text":
        return PlainTextResponse(t.text)
    if fmt == "verbose_json":
        return JSONResponse(verbose(t, options))
    document = writers.transcript(t.text, [s.to_dict() for s in t.segments], t.language)
    return PlainTextResponse(writers.RENDER[fmt](document), media_type="text/vtt" if fmt == "vtt" else None)


def usage(t) -> dict:
    """OpenAI's token usage of a json transcription: the prompt (audio and text) in, the generated tokens out. The
    count a client can sum, where the text alone does not say it (tokens outside the vocabulary, empty answers)."""
    prompt, out = t.stats.get("prompt_tokens", 0), len(t.tokens)
    return {"type": "tokens", "input_tokens": prompt, "output_tokens": out, "total_tokens": prompt + out}


def verbose(t, options: Options) -> dict:
    """OpenAI's verbose_json (openai-whisper's transcribe result): times in seconds, `seek` in 10 ms frames."""
    segments = [
        {
            "id": i,
            "seek": round(s.start * 100),
            "start": s.start,
            "end": s.end,
            "text": s.text,
            "tokens": list(s.tokens),
            "temperature": options.temperature if s.temperature is None else s.temperature,
            "avg_logprob": s.avg_logprob,
            "compression_ratio": compression_ratio(s.text),
            "no_speech_prob": s.no_speech_prob,
        }
        for i, s in enumerate(t.segments)
    ]
    body = {
        "task": "transcribe",
        "language": t.language,
        "duration": t.stats.get("audio_seconds"),
        "text": t.text,
        "segments": segments,
    }
    if options.word_timestamps:
        body["words"] = [{"word": w.word, "start": w.start, "end": w.end} for s in t.segments for w in s.words or ()]
    return body
