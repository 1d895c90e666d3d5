"""The vLLM engine: vLLM's AsyncLLM in this process, serving the latest LoRA from memory."""
