"""The simulated engine behind `llmgw engine sim`: deterministic text over the OpenAI API, timed
per token, and a real TCP rendezvous among the members of a multi-node replica.

Pure parts: `text` (what is said), `api` (OpenAI requests and responses), `structured` (tool
calls and `response_format`, decided), `schema` (values made up for JSON schemas; `schemaplans` reads the schemas), `logprobs`,
`fields` (reading a request's fields), `protocol` (the rendezvous wire). Trio parts: `app` (the HTTP handler), `rendezvous` (rank 0 and workers),
`main` (the process). Specs that build its command line live in `llmgw.engines`, which never
imports this package.
"""
