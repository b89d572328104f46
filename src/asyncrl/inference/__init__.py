"""The inference server, in four rooms as vLLM draws them: `api` speaks HTTP and translates, `backends` are what
the routes talk to (our engine or a vLLM child process), `engine` holds the policy and samples tokens, and
`kernels` are its Triton GPU kernels."""
