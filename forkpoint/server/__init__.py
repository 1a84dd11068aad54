"""OpenAI-compatible HTTP server and the `forkpoint` command line (docs/server.md).

`app.build_app(llm, config.ServerConfig(...))` builds the FastAPI app; `cli.main` is the console
script (`forkpoint serve | generate | bench`). Nothing is imported here, so that `forkpoint --help`
does not load the web stack.
"""
