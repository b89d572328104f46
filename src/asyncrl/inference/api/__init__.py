"""The HTTP API: routes, request bodies, errors, limits and auth, kept to translating between OpenAI's (and our
token routes') shapes and a backend's token-level requests, so that nothing here ever touches a tensor."""
