"""A turn, router side: the plan (pull, recompute or run on decode; which engines), its engine calls and
streams, and the ledger of what it holds until it ends."""
