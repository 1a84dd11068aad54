"""Many engine replicas behind one endpoint, routed to the replica holding a request's checkpoint.

    routing_keys.py  a request's checkpoint keys, hashed as the engine hashes them
    router.py        the checkpoint-affine policy and its Ray Serve request router (+ round-robin)
    replicas.py      the engine replica deployment, the metrics board, deploy_replicas
    cluster.py       ClusterWorker: the server's worker surface over the replicas (retries, faults)
    ingress.py       the OpenAI-compatible app over a ClusterWorker
    launch.py        ReplicaCluster (Ray, Serve, replicas) and `forkpoint serve --data-parallel-size`

Ray is an optional dependency (`pip install forkpoint[serve]`); importing this package does not
import it, the modules above do. docs/replicas.md has the design and the measurements.
"""
