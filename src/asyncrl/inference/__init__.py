"""The inference server: `engine` holds the policy and samples tokens, `server` speaks HTTP."""
