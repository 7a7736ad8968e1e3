"""Merged prompts on vLLM: the export, a small client, the runtime the decode loop calls, attaching
it to a model, and the install check. vLLM itself (installed with ``--no-deps``, see
``ktm.vllm.install``) is imported only when a runtime is made."""
