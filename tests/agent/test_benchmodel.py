"""The bench's made model (agent.benchmodel): a GGUF that the reference reader (the `gguf`
package, test-only) and llmgw's own header parser read as written, the same bytes every time,
a few MB. That llama-server loads it and answers is tests/agent/test_bench.py's."""

from __future__ import annotations

from pathlib import Path

import gguf

from agent import benchmodel as m
from llmgw.sizing.gguf import parse_header


def test_the_made_model_reads_as_written_and_is_the_same_bytes_each_time(tmp_path: Path) -> None:
    path = m.ensure(tmp_path)
    assert path.name == m.FILE_NAME and path.read_bytes() == m.model_bytes()
    assert 4 << 20 < path.stat().st_size < 8 << 20
    reader = gguf.GGUFReader(path)
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == "llama"
    assert reader.fields["llama.block_count"].parts[-1][0] == m.N_LAYER
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == m.N_VOCAB
    got = {t.name: (tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in reader.tensors}
    assert got == {name: (dims, kind) for name, dims, kind in m.tensors()}
    q = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    assert q.tensor_type == gguf.GGMLQuantizationType.Q8_0
    values = gguf.dequantize(q.data, q.tensor_type)
    assert 0.01 < float(values.std()) < 0.03  # the spread of 0.02 the scale is for
    header = parse_header(path.read_bytes()[: 1 << 20])
    assert header.metadata["general.architecture"] == "llama" and len(header.tensors) == len(m.tensors())
    assert header.data_offset + header.tensor_bytes == path.stat().st_size
    # Written once: a second call finds it.
    before = path.stat().st_mtime_ns
    assert m.ensure(tmp_path) == path and path.stat().st_mtime_ns == before
