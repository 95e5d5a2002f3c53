"""An OpenAI-compatible HTTP server over one ``LLM``: ``monokernel serve``.

protocol.py reads requests and writes responses (OpenAI's JSON, chunks and errors) and needs no
web framework; worker.py runs every generation on one engine thread, FIFO; app.py is the FastAPI
app; cli.py the command. FastAPI and uvicorn are the ``serve`` extra, imported only when a server
is built, so this package imports without them.
"""
