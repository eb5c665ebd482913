"""KV state outside the engines: block hashes as vLLM computes them, the index of what is cached where, the
engines' KV events that feed it, and how long an idle block survives."""
