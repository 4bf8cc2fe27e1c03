"""Logging: one line per event in either format; secrets never reach the output."""

from __future__ import annotations

import io
import json

from llmgw import log
from llmgw.config import Secret
from testlib.proc import run_llmgw

TOKEN = "tok-7c1f0e5a9b2d44e8a1"


def emit(fmt: str, **fields) -> str:
    out = io.StringIO()
    log.setup(level="debug", fmt=fmt, stream=out)
    log.get_logger("llmgw.test").info("thing_happened", **fields)
    return out.getvalue()


def test_kv_line_quotes_only_what_needs_it() -> None:
    line = emit("kv", node="node-1", detail="two words", n=3)
    assert line.count("\n") == 1
    assert " event=thing_happened " in line
    assert 'node=node-1 detail="two words" n=3' in line


def test_json_line_is_one_object() -> None:
    obj = json.loads(emit("json", node="node-1", n=3))
    assert obj["event"] == "thing_happened" and obj["node"] == "node-1" and obj["n"] == 3
    assert obj["level"] == "info"


def test_secret_values_and_secret_named_fields_are_redacted() -> None:
    for fmt in log.FORMATS:
        text = emit(fmt, token=TOKEN, api_key=TOKEN, wrapped=Secret(TOKEN), nested={"password": TOKEN, "ok": 1})
        assert TOKEN not in text
        assert text.count(log.REDACTED) == 4


def test_a_token_in_config_never_appears_in_any_output(tmp_path) -> None:
    cfg = tmp_path / "server.toml"
    cfg.write_text(f'[[models]]\nname = "m"\nengine = "llamacpp"\nsource = {{ path = "/m.gguf", token = "{TOKEN}" }}\n')
    for fmt in log.FORMATS:
        done = run_llmgw("config", "check", str(cfg), "--json", "--log-level", "debug", "--log-format", fmt)
        assert done.returncode == 0, done.stderr
        assert "config_loaded" in done.stderr  # the debug event that carries the whole config ran
        assert TOKEN not in done.stdout + done.stderr
