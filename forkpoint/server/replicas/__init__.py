"""Many engine replicas on Ray Serve behind one OpenAI-compatible endpoint
(`forkpoint serve --data-parallel-size N`), each request routed to the replica that holds its
checkpoint.

    deployment.py  EngineReplica (one LLM + the server's engine thread per Serve replica),
                   ReplicaBoard (their published metrics), deploy_replicas
    cluster.py     ClusterWorker: the engine worker's surface over the replicas (retries, faults)
    ingress.py     the OpenAI app over a ClusterWorker, with per-replica metrics
    launch.py      ReplicaCluster (Ray, Serve, board, replicas) and the `serve` entry point
    routing_keys.py  a request's checkpoint keys, hashed as the engine hashes them
    router.py      the checkpoint-affine policy and its Ray Serve request router (+ round-robin)

Needs Ray Serve (`pip install forkpoint[serve]`). docs/replicas.md has the design and numbers.
"""
