"""The engine side: the adapter from the app's config to vLLM and NIXL settings, and the plugins vLLM loads
inside its engine processes. Nothing here imports Ray Serve or the graph."""
