"""``ktm serve``: an OpenAI-compatible HTTP server for a ktm model.

    config.py    ServeConfig (the CLI flags) and loading the served model
    protocol.py  request shapes, the ``ktm`` extension field, OpenAI's error shape
    prompts.py   requests -> token-id segments (chat template split around the contents)
    engine.py    continuous batching on the model's runtime (torch, llama.cpp or vLLM)
    logprobs.py  logprobs of generated tokens, held until their text is released; OpenAI's shapes
    app.py       FastAPI routes, SSE streaming, uvicorn
"""

from ktm.serving.config import ServeConfig

__all__ = ["ServeConfig"]
