"""What every endpoint shares: the server's configuration and state (the engine loop, metrics,
the tokenize pool, draining and fatal-error status)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from serving.engine_loop import EngineLoop, describe
from serving.metrics import ServerMetrics
from serving.params import Limits
from serving.replicas import ReplicaRouter

log = logging.getLogger("serving")

TOKENIZE_WORKERS = 2  # chat rendering + tokenization, off the event loop and off the engine thread


@dataclasses.dataclass
class ServerConfig:
    model_name: str = "default"
    model_path: str | None = None
    draft_model_path: str | None = None
    speculative_algorithm: str = "NONE"
    verify_mode: str | None = None
    block_size: int | None = None
    shutdown_timeout: float = 30.0  # SIGTERM: how long in-flight requests may run before abort
    max_body_bytes: int = 4 << 20  # larger request bodies get a 413
    default_chat_max_tokens: int = 1024  # chat without max_tokens: this, capped by the context left
    max_stop_strings: int = 16  # per request
    max_stop_chars: int = 256  # per stop string
    max_choices: int = 128  # engine requests per HTTP request: prompts x n
    extra: dict = dataclasses.field(default_factory=dict)  # more fields for /server_info


class ServerState:
    """Everything the endpoints share.  `on_fatal(error)`, if set, is called once from the engine
    thread after a fatal engine error, once every request in flight has been answered; by then
    `fatal_error` holds the error and `fatal_event` is set."""

    def __init__(self, engine, cfg: ServerConfig, on_fatal: Callable[[BaseException], None] | None = None):
        engines = list(engine) if isinstance(engine, (list, tuple)) else [engine]  # data-parallel replicas
        self.engine = engines[0]  # every replica has the same model and limits
        self.cfg = cfg
        self.metrics = ServerMetrics(cfg.model_name, speculative=cfg.speculative_algorithm != "NONE")
        self.on_fatal = on_fatal
        self.fatal_error: BaseException | None = None
        self.fatal_event = threading.Event()
        self.loop = (EngineLoop(engines[0], self.metrics, on_fatal=self._fatal) if len(engines) == 1 else
                     ReplicaRouter(engines, self.metrics, on_fatal=self._fatal))
        self.tokenize_pool = ThreadPoolExecutor(TOKENIZE_WORKERS, thread_name_prefix="dspark-tokenize")
        self.draining = False
        self.started = time.time()
        self._drain_timer: threading.Timer | None = None

    def _fatal(self, err: BaseException) -> None:
        self.fatal_error = err
        self.fatal_event.set()
        log.critical("engine failed (%s): the server cannot serve any more requests", describe(err))
        if self.on_fatal is not None:
            self.on_fatal(err)

    def begin_drain(self, timeout: float | None = None) -> None:
        """Stop taking new requests; abort whatever still runs after `timeout` seconds."""
        if self.draining:
            return
        self.draining = True
        t = self.cfg.shutdown_timeout if timeout is None else timeout
        log.info("draining: no new requests; in-flight ones get %.1f s before they are aborted", t)
        self._drain_timer = threading.Timer(t, self.loop.abort_all)
        self._drain_timer.daemon = True
        self._drain_timer.start()

    def close(self) -> None:
        """The app is shutting down: abort everything, end the engine thread and the pool."""
        self.draining = True
        self.loop.stop()
        if self._drain_timer:
            self._drain_timer.cancel()
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def limits(self) -> Limits:
        c = self.cfg
        return Limits(max_model_len=self.engine.max_model_len, vocab_size=self.engine.config.vocab_size,
                      max_stop_strings=c.max_stop_strings, max_stop_chars=c.max_stop_chars, max_choices=c.max_choices,
                      logit_processors=getattr(self.engine, "processors", True) is not None)
