"""kvredis: a shared KV-cache block index for LLM routers."""
