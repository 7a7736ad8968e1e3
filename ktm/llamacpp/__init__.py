"""Merged prompts on llama.cpp: the GGUF export, the runtime the decode loop calls, and attaching
it to a model. llama-cpp-python (the ``[llamacpp]`` extra) is imported only when a runtime or an
export is made."""
