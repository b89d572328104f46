"""The backends behind the routes: one interface, served by our engine in this process or by a vLLM child
process, so that a route, a limit or an auth check is written once for both."""
