"""The native engine: its decoding thread, scheduler, KV cache, model runner and sampler, which own the policy's
weights and the KV cache's memory, so that no HTTP concern reaches a forward pass."""
