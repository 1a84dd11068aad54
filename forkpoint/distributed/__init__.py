"""Routing requests among engine replicas to the replica that holds their checkpoint.

    routing_keys.py  a request's checkpoint keys, hashed as the engine hashes them
    router.py        the checkpoint-affine policy and its Ray Serve request router (+ round-robin)

The replicas themselves (Ray Serve deployments of the engine behind the OpenAI endpoint) compose
the server, so they live above it, in `forkpoint.server.replicas`. Ray is an optional dependency
(`pip install forkpoint[serve]`); router.py imports it. docs/replicas.md has the design.
"""
