"""How much memory a model replica needs, computed from the model's own files (standard library
only: the control plane ships as a zipapp). `gguf` reads a GGUF header from a prefix of the
file; `model` turns headers or a config.json into a model's shape; `estimate` turns a shape, a
context and an engine's settings into bytes (docs/engines.md, "How much memory a replica needs")."""
