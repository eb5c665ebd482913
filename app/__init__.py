"""Multi-turn KV reuse on Ray Serve: `serve run app:graph`. See app/graph.py for the data flow."""

from app.graph import graph

__all__ = ["graph"]
