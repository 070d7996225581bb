"""The HTTP front end: an OpenAI-compatible server over an engine client (needs the 'serve' extra),
which also speaks Anthropic's Messages API.

`app.create_app` registers the routes onto handler objects (`completions`, `chat`, `messages`,
`tokenize`, `models`, sharing `base.Handler`); `client.EngineClient` is all they know of the engine
(`AsyncEngineClient` adapts `dcp_jax.serving.async_engine.AsyncEngine`); `intake` turns HTTP
bodies into `Request`s, `protocol` is the wire format (`anthropic` Anthropic's, converted to an
OpenAI chat request), `metrics` the Prometheus side. This package
sits above `dcp_jax.serving`: it imports the engine side, never the reverse.
"""
