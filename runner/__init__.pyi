# What type checkers see of `runner` (py.typed): the names __init__.py imports lazily, with their types.
from runner.app.api import Delta as Delta
from runner.app.api import Model as Model
from runner.app.api import Stream as Stream
from runner.app.api import StreamSlots as StreamSlots
from runner.app.api import Transcription as Transcription
from runner.app.api import load as load

__version__: str
__all__: list[str]
