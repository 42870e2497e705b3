"""voltllm: an OpenAI-compatible LLM inference server for NVIDIA Volta and newer GPUs."""
