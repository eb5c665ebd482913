"""An engine replica's Serve log survives its engine's start (vLLM and NIXL apply dictConfig)."""

import logging
import logging.config
from logging.handlers import MemoryHandler

from deployments import engine_replica


def test_the_replica_log_is_written_again_after_a_dict_config_closed_it(tmp_path, monkeypatch):
    path = tmp_path / "replica.log"
    buffer = MemoryHandler(capacity=1, target=logging.FileHandler(path), flushLevel=logging.ERROR)
    logger = logging.getLogger("test.replica")
    logger.addHandler(buffer)
    logger.setLevel(logging.INFO)
    monkeypatch.setattr(engine_replica, "logger", logger)
    targets = engine_replica._serve_log_targets()
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})  # what an engine's start does
    assert buffer.target is None, "dictConfig closed Serve's handler"
    logger.info("after the engine started")
    engine_replica._reattach(targets)
    logger.info("and after that")
    logger.removeHandler(buffer)
    assert path.read_text().splitlines() == ["after the engine started", "and after that"]
