"""The engine's Triton GPU kernels (decoding attention, decoding heads, sampling), in a room of their own because
each is optional: where Triton is absent or cannot build them, the engine uses torch's operations instead."""
